// Blockwise symmetric INT8 quantization: the arithmetic shared by the CUDA kernels (quant.cu), the
// C++ CPU extension (quant.cpp) and, line for line, the Triton kernels and the torch reference in
// overlap/comm. All four must produce the same bytes, so every step is pinned down here:
//
//   tz(v)    = 0 if |v| < 2^-125 else v    ("tiny to zero", applied where marked below)
//   absmax_b = max |x_i| over the finite x_i of block b (0 if none)       exact in any order
//   scale_b  = tz(absmax_b / 127)                                         one IEEE fp32 division
//   q_i      = -128                       if x_i is NaN or +-Inf          (the non-finite code)
//            = 0                          if scale_b == 0                 (all-zero or tiny block)
//            = clamp(rne(tz(tz(x_i) / scale_b)), -127, 127)   round to nearest, ties to even
//            = clamp(floor(tz(tz(x_i) / scale_b) + u_i), -127, 127)   stochastic, u_i in [0, 1)
//   deq_i    = NaN                        if q_i == -128
//            = clamp(q_i * tz(scale_b), -FLT_MAX, FLT_MAX)  (127 * (FLT_MAX/127) rounds up to Inf)
//   reduce   acc = tz(acc + deq) per source, in source order; tz(acc / divisor)
//
// tz makes the bytes independent of the device's denormal mode. Compiled GPU code may run with
// flush-to-zero (cupy always compiles with -ftz=true, and libdevice's div_rn follows it): FTZ
// hardware reads a subnormal operand as 0 and writes a subnormal result as 0, where the CPU
// keeps it. With tz, no operand of any fp operation is subnormal and every result that could
// be subnormal is zeroed whatever the mode, so FTZ and IEEE devices agree bit for bit. The
// cut is 2^-125 rather than FLT_MIN = 2^-126 so that a quotient an FTZ unit flushes before
// rounding, and IEEE rounds up to exactly 2^-126, is zero on both. In the contract: a block
// whose absmax is below 127 * 2^-125 (~3e-36) is a zero block, elements below 2^-125 quantize
// to 0, and each such zeroing errs by less than 2^-125 (a zero block by less than 2^-118).
//
// Every product, sum and quotient is a separately rounded fp32 operation: no FMA contraction
// (the CUDA path uses the __f*_rn intrinsics, which nvcc never fuses; quant.cpp turns contraction
// off), no reciprocal in place of a division. rne() adds and subtracts 1.5 * 2^23, which rounds to
// nearest-even for |v| < 2^22 (here |v| <= 254) and vectorises on any x86-64, unlike rintf.
#pragma once
#include "common.cuh"

#if !defined(__CUDACC_RTC__)  // NVRTC has no standard headers; common.cuh defines the types there
#include <cmath>
#include <cstdint>
#include <cstring>
#endif

namespace overlap {
namespace quant {

constexpr int kQMax = 127;
constexpr int8_t kNonFinite = -128;
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23
constexpr float kFloatMax = 3.402823466e+38f;
constexpr float kTiny = 2.350988701644575e-38f;  // 2^-125: tz() zeroes magnitudes below it

// Input element types, as the Python side numbers them.
enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

OVERLAP_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
OVERLAP_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
OVERLAP_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
OVERLAP_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

OVERLAP_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// max / min for operands that are never NaN. fmaxf/fminf would do, but their NaN rules make
// g++ call libm instead of emitting maxss/minss, which stops the loops from vectorising.
OVERLAP_HD float max_nn(float a, float b) { return a > b ? a : b; }
OVERLAP_HD float min_nn(float a, float b) { return a < b ? a : b; }

// NaN fails every comparison, so this is false for NaN and +-Inf alike.
OVERLAP_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

OVERLAP_HD bool is_finite(float x) { return fabsf(x) <= kFloatMax; }

// bf16 and fp16 widen to fp32 exactly, so the arithmetic below never sees the input type.
OVERLAP_HD float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

OVERLAP_HD float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
  // Subnormal (or zero): mant * 2^-24 is exact in fp32.
  const float mag = mul_rn(static_cast<float>(mant), 5.9604644775390625e-08f);
  return sign ? -mag : mag;
}

OVERLAP_HD float load_as_float(const void* base, int dtype, int64_t i) {
  if (dtype == kBF16) return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  if (dtype == kF16) return f16_to_float(static_cast<const uint16_t*>(base)[i]);
  return static_cast<const float*>(base)[i];
}

// |x| for the block maximum; non-finite values are coded separately and must not set the scale.
OVERLAP_HD float finite_abs(float x) { return is_finite(x) ? fabsf(x) : 0.0f; }

// finite_abs as bits. Non-negative floats order like their bit patterns, so an integer max of
// these is the block absmax exactly, and integer max reductions vectorise without fast-math.
// Signed, because SSE2 has only signed 32-bit compares (the sign bit is clear anyway).
OVERLAP_HD int32_t finite_abs_bits(float x) {
  const int32_t b = static_cast<int32_t>(float_to_bits(x) & 0x7fffffffu);
  return b < 0x7f800000 ? b : 0;
}

// tz(v): +0 for |v| < 2^-125. A select, not arithmetic, so FTZ hardware computes it the same
// way (a flushed operand compares as 0, which is below the cut too).
OVERLAP_HD float tiny_to_zero(float v) { return fabsf(v) < kTiny ? 0.0f : v; }

OVERLAP_HD float scale_from_absmax(float absmax) {
  return tiny_to_zero(div_rn(absmax, static_cast<float>(kQMax)));
}

// The reduce phase's fp32 accumulation: tz after every add and after the division.
OVERLAP_HD float acc_add(float acc, float d) { return tiny_to_zero(add_rn(acc, d)); }
OVERLAP_HD float acc_div(float acc, float divisor) { return tiny_to_zero(div_rn(acc, divisor)); }

OVERLAP_HD float round_half_even(float v) { return sub_rn(add_rn(v, kRoundMagic), kRoundMagic); }

// Counter-based noise for stochastic rounding: a 32-bit integer mix of (index, key), so every
// implementation draws the same u_i without sharing RNG state. u = (h >> 8) * 2^-24 in [0, 1).
OVERLAP_HD uint32_t mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7feb352du;
  h ^= h >> 15;
  h *= 0x846ca68bu;
  h ^= h >> 16;
  return h;
}
OVERLAP_HD float noise_u01(uint32_t key, int64_t index) {
  const uint32_t h = mix32(static_cast<uint32_t>(index) ^ key);
  return mul_rn(static_cast<float>(h >> 8), 5.9604644775390625e-08f);
}

// Branch-free (selects only) so the CPU loops vectorise; same results as the branchy form.
OVERLAP_HD int8_t quantize_value(float x, float scale, bool stochastic, float noise) {
  const bool finite = is_finite(x);
  const float xz = tiny_to_zero(finite ? x : 0.0f);
  const float v = tiny_to_zero(div_rn(xz, scale > 0.0f ? scale : 1.0f));
  float r = stochastic ? floorf(add_rn(v, noise)) : round_half_even(v);
  r = min_nn(max_nn(r, -static_cast<float>(kQMax)), static_cast<float>(kQMax));
  r = scale > 0.0f ? r : 0.0f;
  return finite ? static_cast<int8_t>(r) : kNonFinite;
}

OVERLAP_HD float dequantize_value(int8_t q, float scale) {
  float d = mul_rn(static_cast<float>(q), tiny_to_zero(scale));  // never NaN: both finite
  d = min_nn(max_nn(d, -kFloatMax), kFloatMax);
  return q == kNonFinite ? bits_to_float(0x7fc00000u) : d;  // quiet NaN
}

}  // namespace quant
}  // namespace overlap
