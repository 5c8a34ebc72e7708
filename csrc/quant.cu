// CUDA kernels of the blockwise INT8 quantization. The arithmetic is quant.cuh, shared with the
// C++ CPU extension (quant.cpp), so the CPU tests check the rounding these kernels do; the buffer
// layout (rows of row_len codes at q + r * q_stride, their scales at s + r * s_stride) is the one
// quant.cpp documents. Compile-checked in CI with nvcc -arch=sm_90a and sm_80.
//
// Row r of a quantized buffer stands for flat[r * flat_row, (r + 1) * flat_row) of a flat tensor
// of numel elements, zero-padded to row_len.
//
// One thread block per quantization block: the block maximum is a shared-memory max reduction,
// which gives the same result in any order, so the bytes match the sequential CPU loop.
#include "quant.cuh"

namespace {

constexpr int kMaxBlock = 4096;

using overlap::quant::acc_add;
using overlap::quant::acc_div;
using overlap::quant::dequantize_value;
using overlap::quant::finite_abs;
using overlap::quant::load_as_float;
using overlap::quant::noise_u01;
using overlap::quant::quantize_value;
using overlap::quant::scale_from_absmax;

// Max over the thread block of every thread's `v`; blockDim.x must be a power of two.
__device__ float block_max(float v, float* red) {
  red[threadIdx.x] = v;
  __syncthreads();
  for (unsigned step = blockDim.x / 2; step > 0; step >>= 1) {
    if (threadIdx.x < step) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + step]);
    __syncthreads();
  }
  const float m = red[0];
  __syncthreads();
  return m;
}

// Elements of block b of row r that hold data (the rest is padding).
__device__ int64_t valid_in_block(int64_t numel, int64_t flat_row, int64_t r, int64_t b,
                                  int64_t block) {
  // Ternaries, not min/max: NVRTC (which builds this file at run time) has no <algorithm>.
  const int64_t rest = numel - r * flat_row;
  const int64_t in_block = (rest < flat_row ? rest : flat_row) - b * block;
  return in_block < 0 ? 0 : (in_block < block ? in_block : block);
}

}  // namespace

// grid = rows * (row_len / block) thread blocks, blockDim a power of two <= 1024.
extern "C" __global__ void overlap_quantize_blocks(const void* x, int dtype, int64_t numel,
                                                   int64_t flat_row, int64_t row_len,
                                                   int64_t block, int8_t* q, int64_t q_stride,
                                                   float* s, int64_t s_stride, int stochastic,
                                                   uint32_t key, int64_t index_base) {
  __shared__ float red[1024];
  const int64_t blocks_per_row = row_len / block;
  const int64_t r = blockIdx.x / blocks_per_row, b = blockIdx.x % blocks_per_row;
  const int64_t e0 = r * flat_row + b * block;
  const int64_t valid = valid_in_block(numel, flat_row, r, b, block);
  float m = 0.0f;
  for (int64_t t = threadIdx.x; t < valid; t += blockDim.x) {
    m = fmaxf(m, finite_abs(load_as_float(x, dtype, e0 + t)));
  }
  const float scale = scale_from_absmax(block_max(m, red));
  if (threadIdx.x == 0) s[r * s_stride + b] = scale;
  for (int64_t t = threadIdx.x; t < block; t += blockDim.x) {
    const float v = t < valid ? load_as_float(x, dtype, e0 + t) : 0.0f;
    const float u = stochastic ? noise_u01(key, index_base + e0 + t) : 0.0f;
    q[r * q_stride + b * block + t] = quantize_value(v, scale, stochastic != 0, u);
  }
}

// Grid-stride over the numel elements of the flat fp32 output.
extern "C" __global__ void overlap_dequantize_blocks(const int8_t* q, int64_t q_stride,
                                                     const float* s, int64_t s_stride,
                                                     int64_t block, float* out, int64_t numel,
                                                     int64_t flat_row) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < numel;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / flat_row, j = i % flat_row;
    out[i] = dequantize_value(q[r * q_stride + j], s[r * s_stride + j / block]);
  }
}

// grid = row_len / block thread blocks. Sums num_src quantized rows in source order in fp32,
// divides by `divisor` unless it is 1, then writes fp32 (out != nullptr) or requantizes.
extern "C" __global__ void overlap_dequant_reduce_blocks(
    const int8_t* q, int64_t q_stride, const float* s, int64_t s_stride, int64_t num_src,
    int64_t block, float divisor, float* out, int8_t* q_out, float* s_out, int stochastic,
    uint32_t key, int64_t index_base) {
  __shared__ float red[1024];
  __shared__ float acc[kMaxBlock];
  const int64_t b = blockIdx.x, e0 = b * block;
  float m = 0.0f;
  for (int64_t t = threadIdx.x; t < block; t += blockDim.x) {
    float a = dequantize_value(q[e0 + t], s[b]);
    for (int64_t r = 1; r < num_src; ++r) {
      a = acc_add(a, dequantize_value(q[r * q_stride + e0 + t], s[r * s_stride + b]));
    }
    if (divisor != 1.0f) a = acc_div(a, divisor);
    if (out != nullptr) {
      out[e0 + t] = a;
    } else {
      acc[t] = a;
      m = fmaxf(m, finite_abs(a));
    }
  }
  if (out != nullptr) return;  // uniform across the block: no thread skips the barriers below
  const float scale = scale_from_absmax(block_max(m, red));
  if (threadIdx.x == 0) s_out[b] = scale;
  for (int64_t t = threadIdx.x; t < block; t += blockDim.x) {
    const float u = stochastic ? noise_u01(key, index_base + e0 + t) : 0.0f;
    q_out[e0 + t] = quantize_value(acc[t], scale, stochastic != 0, u);
  }
}
