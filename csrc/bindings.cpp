// overlap._C: the C++ CPU extension. Each csrc/*.cpp contributes one register_* function.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void register_signal(py::module_& m);
void register_quant(py::module_& m);

PYBIND11_MODULE(_C, m) {
  m.doc() = "overlap CPU kernels: shared-memory signal atomics and quantization";
  register_signal(m);
  register_quant(m);
}
