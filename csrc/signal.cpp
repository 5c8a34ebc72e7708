// CPU side of the signal protocol in signal.cuh, over POSIX shared memory mapped by every local
// rank. Addresses come from Python (tensor.data_ptr() of a shared-memory mapping).
#include <cstring>
#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <thread>

#include "signal.cuh"

namespace py = pybind11;

namespace {

int64_t* as_flag(uintptr_t addr) {
  if (addr == 0 || addr % alignof(int64_t) != 0) {
    throw std::invalid_argument("overlap._C: signal address must be non-null and 8-byte aligned");
  }
  return reinterpret_cast<int64_t*>(addr);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Spins, then sleeps with a growing back-off: on a 2-core machine running 4 ranks a pure spin
// would starve the very producer it waits for. Returns the last value seen.
int64_t wait_ge(int64_t* flag, int64_t phase, double timeout_s, bool* reached) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration<double>(timeout_s);
  int64_t v = overlap::signal_load(flag);
  for (int spin = 0; spin < 256 && !overlap::signal_reached(v, phase); ++spin) {
    cpu_relax();
    v = overlap::signal_load(flag);
  }
  auto nap = std::chrono::microseconds(2);
  while (!overlap::signal_reached(v, phase)) {
    if (clock::now() >= deadline) {
      *reached = false;
      return v;
    }
    std::this_thread::sleep_for(nap);
    if (nap < std::chrono::microseconds(200)) nap *= 2;
    v = overlap::signal_load(flag);
  }
  *reached = true;
  return v;
}

}  // namespace

void register_signal(py::module_& m) {
  m.def(
      "signal_load", [](uintptr_t addr) { return overlap::signal_load(as_flag(addr)); },
      py::arg("addr"), "Acquire-load the int64 flag at addr.");
  m.def(
      "signal_store", [](uintptr_t addr, int64_t v) { overlap::signal_store(as_flag(addr), v); },
      py::arg("addr"), py::arg("value"), "Release-store value into the int64 flag at addr.");
  m.def(
      "signal_add", [](uintptr_t addr, int64_t v) { return overlap::signal_add(as_flag(addr), v); },
      py::arg("addr"), py::arg("value"), "Atomically add (acq_rel) and return the old value.");
  m.def(
      "signal_wait",
      [](uintptr_t addr, int64_t phase, double timeout_s) {
        int64_t* flag = as_flag(addr);
        bool reached = false;
        int64_t last;
        {
          py::gil_scoped_release nogil;
          last = wait_ge(flag, phase, timeout_s, &reached);
        }
        return py::make_tuple(reached, last);
      },
      py::arg("addr"), py::arg("phase"), py::arg("timeout_s"),
      "Wait (GIL released) until flag >= phase or timeout_s passes. Returns (reached, last_value).");
  m.def(
      "poison_if_error",
      [](uintptr_t error_addr, uintptr_t out_addr, uint64_t nbytes) {
        // The CPU twin of overlap_poison_if_error (signal.cu): same error word, same byte.
        const int64_t code = overlap::signal_load(as_flag(error_addr) + overlap::kErrCode);
        if (code == 0) return false;
        std::memset(reinterpret_cast<void*>(out_addr), overlap::kPoisonByte, nbytes);
        return true;
      },
      py::arg("error_addr"), py::arg("out_addr"), py::arg("nbytes"),
      "If the error record at error_addr is set, fill nbytes at out_addr with the poison byte "
      "(NaN in every fp32/bf16/fp16 element); returns whether it did.");
  m.attr("ERROR_WORDS") = static_cast<int>(overlap::kErrWords);
}
