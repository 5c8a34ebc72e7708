// CPU kernels of the blockwise INT8 quantization in quant.cuh, bound into overlap._C.
//
// Buffers come from Python as addresses (tensor.data_ptr()) plus sizes, so the build needs no
// torch headers. Layout (the same for the CUDA and Triton kernels and the torch reference):
// a quantized buffer is `rows` rows of `row_len` codes (row_len a multiple of `block`); row r
// keeps its int8 codes at q + r * q_stride and its row_len / block fp32 scales at
// s + r * s_stride, so a collective quantizes straight into its wire buffer, where each
// destination's row holds [codes | scales] back to back. Row r stands for the slice
// flat[r * flat_row, (r + 1) * flat_row) of a flat tensor of `numel` elements (flat_row <=
// row_len); what lies past flat_row or numel is zero padding.
//
// fp contraction is switched off for this file: an FMA in `acc + q * scale` would round once
// instead of twice and break bit-equality with the other implementations.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "quant.cuh"

namespace py = pybind11;
using namespace overlap::quant;

namespace {

constexpr int64_t kMaxBlock = 4096;
// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelMin = 1 << 15;

void check_geometry(const char* op, int64_t rows, int64_t row_len, int64_t block) {
  if (block < 1 || block > kMaxBlock || (block & (block - 1)) != 0) {
    throw std::invalid_argument(std::string(op) + ": block must be a power of two in [1, 4096], got " +
                                std::to_string(block));
  }
  if (rows < 0 || row_len < 0 || row_len % block != 0) {
    throw std::invalid_argument(std::string(op) + ": row_len " + std::to_string(row_len) +
                                " must be a non-negative multiple of block " + std::to_string(block));
  }
}

void check_flat(const char* op, int64_t numel, int64_t flat_row, int64_t rows, int64_t row_len) {
  if (flat_row < 0 || flat_row > row_len || numel < 0 || numel > rows * flat_row) {
    throw std::invalid_argument(std::string(op) + ": need 0 <= flat_row <= row_len and numel <= " +
                                "rows * flat_row, got numel " + std::to_string(numel) +
                                ", flat_row " + std::to_string(flat_row) + ", rows " +
                                std::to_string(rows) + ", row_len " + std::to_string(row_len));
  }
}

int threads_for(int64_t elements, int num_threads) {
  return elements >= kParallelMin ? std::max(1, num_threads) : 1;
}

// Elements of block b of row r that hold data (the rest is padding).
int64_t valid_in_block(int64_t numel, int64_t flat_row, int64_t r, int64_t b, int64_t block) {
  const int64_t row_valid = std::min(flat_row, numel - r * flat_row);
  return std::clamp<int64_t>(row_valid - b * block, 0, block);
}

// Quantize one block of `valid` fp32 values (the rest of the block is padding).
void quantize_block(const float* x, int64_t valid, int64_t block, int8_t* q, float* scale_out,
                    bool stochastic, uint32_t key, int64_t index0) {
  int32_t absmax_bits = 0;
  for (int64_t t = 0; t < valid; ++t) {
    const int32_t b = finite_abs_bits(x[t]);
    absmax_bits = b > absmax_bits ? b : absmax_bits;
  }
  const float scale = scale_from_absmax(bits_to_float(static_cast<uint32_t>(absmax_bits)));
  *scale_out = scale;
  if (stochastic) {
    for (int64_t t = 0; t < valid; ++t) {
      q[t] = quantize_value(x[t], scale, true, noise_u01(key, index0 + t));
    }
  } else {
    for (int64_t t = 0; t < valid; ++t) q[t] = quantize_value(x[t], scale, false, 0.0f);
  }
  for (int64_t t = valid; t < block; ++t) q[t] = 0;  // zero quantizes to 0 under any rounding
}

template <int kDType>
void quantize_impl(const void* x, int64_t numel, int64_t flat_row, int64_t rows, int64_t row_len,
                   int64_t block, int8_t* q, int64_t q_stride, float* s, int64_t s_stride,
                   bool stochastic, uint32_t key, int64_t index_base, int nt) {
  const int64_t blocks_per_row = row_len / block;
  const int64_t total = rows * blocks_per_row;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t gb = 0; gb < total; ++gb) {
    const int64_t r = gb / blocks_per_row, b = gb % blocks_per_row;
    const int64_t e0 = r * flat_row + b * block;
    const int64_t valid = valid_in_block(numel, flat_row, r, b, block);
    const float* xb = static_cast<const float*>(x) + e0;
    float widened[kMaxBlock];
    if (kDType != kF32) {  // widen first so the arithmetic loops run on fp32 and vectorise
      for (int64_t t = 0; t < valid; ++t) widened[t] = load_as_float(x, kDType, e0 + t);
      xb = widened;
    }
    quantize_block(xb, valid, block, q + r * q_stride + b * block, s + r * s_stride + b,
                   stochastic, key, index_base + e0);
  }
}

void quantize_blocks(uintptr_t x, int dtype, int64_t numel, int64_t flat_row, int64_t rows,
                     int64_t row_len, int64_t block, uintptr_t q, int64_t q_stride, uintptr_t s,
                     int64_t s_stride, bool stochastic, uint32_t key, int64_t index_base,
                     int num_threads) {
  check_geometry("quantize_blocks", rows, row_len, block);
  check_flat("quantize_blocks", numel, flat_row, rows, row_len);
  if (dtype != kF32 && dtype != kBF16 && dtype != kF16) {
    throw std::invalid_argument("quantize_blocks: dtype code must be 0 (f32), 1 (bf16) or 2 (f16)");
  }
  auto* qp = reinterpret_cast<int8_t*>(q);
  auto* sp = reinterpret_cast<float*>(s);
  const int nt = threads_for(rows * row_len, num_threads);
  py::gil_scoped_release nogil;
  const void* xp = reinterpret_cast<const void*>(x);
  if (dtype == kF32) {
    quantize_impl<kF32>(xp, numel, flat_row, rows, row_len, block, qp, q_stride, sp, s_stride,
                        stochastic, key, index_base, nt);
  } else if (dtype == kBF16) {
    quantize_impl<kBF16>(xp, numel, flat_row, rows, row_len, block, qp, q_stride, sp, s_stride,
                         stochastic, key, index_base, nt);
  } else {
    quantize_impl<kF16>(xp, numel, flat_row, rows, row_len, block, qp, q_stride, sp, s_stride,
                        stochastic, key, index_base, nt);
  }
}

// The inverse layout: row r of (q, s) dequantizes into out[r * flat_row + j] for the j that
// hold data (j < flat_row and r * flat_row + j < numel); out is a flat fp32 buffer.
void dequantize_blocks(uintptr_t q, int64_t q_stride, uintptr_t s, int64_t s_stride, int64_t rows,
                       int64_t row_len, int64_t block, uintptr_t out, int64_t numel,
                       int64_t flat_row, int num_threads) {
  check_geometry("dequantize_blocks", rows, row_len, block);
  check_flat("dequantize_blocks", numel, flat_row, rows, row_len);
  const auto* qp = reinterpret_cast<const int8_t*>(q);
  const auto* sp = reinterpret_cast<const float*>(s);
  auto* op = reinterpret_cast<float*>(out);
  const int64_t blocks_per_row = (flat_row + block - 1) / block;
  const int64_t total = rows * blocks_per_row;
  const int nt = threads_for(numel, num_threads);
  py::gil_scoped_release nogil;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t gb = 0; gb < total; ++gb) {
    const int64_t r = gb / blocks_per_row, b = gb % blocks_per_row;
    const float scale = sp[r * s_stride + b];
    const int8_t* qb = qp + r * q_stride + b * block;
    float* ob = op + r * flat_row + b * block;
    const int64_t n = valid_in_block(numel, flat_row, r, b, block);
    for (int64_t t = 0; t < n; ++t) ob[t] = dequantize_value(qb[t], scale);
  }
}

// Reduce phase: num_src quantized rows of the same shard -> their fp32 sum (in source order),
// divided by `divisor` unless it is 1, then either stored as fp32 (out != 0) or requantized
// into (q_out, s_out) for the all-gather phase.
void dequant_reduce_blocks(uintptr_t q, int64_t q_stride, uintptr_t s, int64_t s_stride,
                           int64_t num_src, int64_t row_len, int64_t block, float divisor,
                           uintptr_t out, uintptr_t q_out, uintptr_t s_out, bool stochastic,
                           uint32_t key, int64_t index_base, int num_threads) {
  check_geometry("dequant_reduce_blocks", num_src, row_len, block);
  if (num_src < 1) throw std::invalid_argument("dequant_reduce_blocks: num_src must be >= 1");
  if ((out == 0) == (q_out == 0 || s_out == 0)) {
    throw std::invalid_argument("dequant_reduce_blocks: give either out or (q_out, s_out)");
  }
  const auto* qp = reinterpret_cast<const int8_t*>(q);
  const auto* sp = reinterpret_cast<const float*>(s);
  auto* op = reinterpret_cast<float*>(out);
  auto* qo = reinterpret_cast<int8_t*>(q_out);
  auto* so = reinterpret_cast<float*>(s_out);
  const int64_t nblocks = row_len / block;
  const int nt = threads_for(num_src * row_len, num_threads);
  py::gil_scoped_release nogil;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t b = 0; b < nblocks; ++b) {
    float acc[kMaxBlock];
    const int64_t e0 = b * block;
    for (int64_t t = 0; t < block; ++t) acc[t] = dequantize_value(qp[e0 + t], sp[b]);
    for (int64_t r = 1; r < num_src; ++r) {
      const float scale = sp[r * s_stride + b];
      const int8_t* qb = qp + r * q_stride + e0;
      for (int64_t t = 0; t < block; ++t) acc[t] = acc_add(acc[t], dequantize_value(qb[t], scale));
    }
    if (divisor != 1.0f) {
      for (int64_t t = 0; t < block; ++t) acc[t] = acc_div(acc[t], divisor);
    }
    if (op != nullptr) {
      for (int64_t t = 0; t < block; ++t) op[e0 + t] = acc[t];
      continue;
    }
    quantize_block(acc, block, block, qo + e0, so + b, stochastic, key, index_base + e0);
  }
}

}  // namespace

void register_quant(py::module_& m) {
  m.def("quantize_blocks", &quantize_blocks, py::arg("x"), py::arg("dtype"), py::arg("numel"),
        py::arg("flat_row"), py::arg("rows"), py::arg("row_len"), py::arg("block"), py::arg("q"), py::arg("q_stride"),
        py::arg("s"), py::arg("s_stride"), py::arg("stochastic"), py::arg("key"),
        py::arg("index_base"), py::arg("num_threads"),
        "Blockwise INT8 quantization of flat x (row r = x[r*flat_row : (r+1)*flat_row], "
        "zero-padded to row_len) into q (int8 codes) and s (fp32 scales); see csrc/quant.cuh.");
  m.def("dequantize_blocks", &dequantize_blocks, py::arg("q"), py::arg("q_stride"), py::arg("s"),
        py::arg("s_stride"), py::arg("rows"), py::arg("row_len"), py::arg("block"), py::arg("out"),
        py::arg("numel"), py::arg("flat_row"), py::arg("num_threads"),
        "fp32 out[r*flat_row + j] = dequant(q, s)[r, j] for j < flat_row, r*flat_row + j < numel.");
  m.def("dequant_reduce_blocks", &dequant_reduce_blocks, py::arg("q"), py::arg("q_stride"),
        py::arg("s"), py::arg("s_stride"), py::arg("num_src"), py::arg("row_len"),
        py::arg("block"), py::arg("divisor"), py::arg("out"), py::arg("q_out"), py::arg("s_out"),
        py::arg("stochastic"), py::arg("key"), py::arg("index_base"), py::arg("num_threads"),
        "Sum num_src quantized rows in fp32 (source order), divide by divisor, then store fp32 "
        "(out) or requantize (q_out, s_out).");
}
