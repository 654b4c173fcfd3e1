// Quantisation of whole rows, for the stores of the fused kernel (fused.cuh) that need a row's
// values before any of them can be stored:
//
// - fp8 with a scale per (token, head) row: scale = amax / the format's largest finite value (at
//   least the smallest normal float32, so that 1 / scale stays finite and an all-zero row stores
//   zeros with scale 2^-126), stored = fp8(value * (1 / scale)) as for a per-tensor scale.
// - NVFP4 (TensorRT-LLM's and FlashInfer's KV-cache format): per 16 consecutive values of a row,
//   an e4m3 block scale s = e4m3(amax / 6 * (1 / g)), g the tensor's float32 global scale, and the
//   values e2m1(x * (1 / (s * g))), two per byte (even element in the low nibble); a reader
//   dequantises e2m1 * s * g.
//
// Every step is one IEEE float32 operation (division, multiplication, reciprocal), in the same
// order as cupyrope/core/numpy_path.py, so that the bytes agree with the NumPy path. NaN makes
// its row's (or block's) scale NaN, so that the whole row (block) reads back as NaN.
#pragma once

#include "numeric.cuh"
#include "rope_params.cuh"
#include "thread_index.cuh"

namespace cupyrope {

constexpr int kNvfp4BlockValues = 16;  // values per e4m3 block scale
constexpr float kE2M1Max = 6.0f;

__device__ __forceinline__ float smallest_normal_float() { return __int_as_float(0x00800000); }

// Largest finite value of an fp8 format: a per-row scale maps the row's amax onto it.
__device__ __forceinline__ float fp8_max_of(long long format) {
  return format == kStoreE4M3 ? 448.0f : 57344.0f;
}

// max(m, x) that keeps a NaN of either (fmaxf drops it).
__device__ __forceinline__ float max_keeping_nan(float m, float x) {
  return (x > m || x != x) ? x : m;
}

// The scale of a row quantised to fp8 `format`, from its amax.
__device__ __forceinline__ float row_scale_of(float amax, long long format) {
  const float scale = amax / fp8_max_of(format);
  return scale < smallest_normal_float() ? smallest_normal_float() : scale;  // NaN stays NaN
}

// e4m3 (float8_e4m3fn) bits of a value >= 0 or NaN, rounded to nearest even, saturated at 448:
// the hardware conversion from compute capability 8.9, the same rounding by hand before it.
__device__ __forceinline__ unsigned e4m3_code(float x) {
#if __CUDA_ARCH__ >= 890
  unsigned short two;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(two) : "f"(0.0f), "f"(x));
  return two & 0xffu;
#else
  if (x != x) return 0x7fu;
  if (x < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9 (the count may round up to 2^-6)
    return static_cast<unsigned>(__float2int_rn(x * 512.0f));
  }
  unsigned u = __float_as_uint(x);
  u += 0x7ffffu + ((u >> 20) & 1u);  // round the float32 mantissa to 3 bits, ties to even
  const int exponent = static_cast<int>(u >> 23) - 120;  // float32 bias 127, e4m3 bias 7
  const unsigned mantissa = (u >> 20) & 7u;
  if (exponent > 15 || (exponent == 15 && mantissa == 7u)) return 0x7eu;  // 448
  return (static_cast<unsigned>(exponent) << 3) | mantissa;
#endif
}

// The value of e4m3 bits with a clear sign bit (NaN for 0x7f).
__device__ __forceinline__ float e4m3_value(unsigned code) {
  const unsigned exponent = (code >> 3) & 15u, mantissa = code & 7u;
  if (exponent == 15u && mantissa == 7u) return __int_as_float(0x7fc00000);
  if (exponent == 0u) return static_cast<float>(mantissa) * 0.001953125f;  // 2^-9 steps
  return __uint_as_float(((exponent + 120u) << 23) | (mantissa << 20));
}

// The e2m1 nibble of a value in [-6, 6], rounded to nearest even onto {0, 0.5, 1, 1.5, 2, 3, 4,
// 6}: each threshold passed adds one code (ties go to the even code), the sign is bit 3.
__device__ __forceinline__ unsigned e2m1_code(float y) {
  const float a = fabsf(y);
  const unsigned magnitude = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) +
                             (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return magnitude | (__float_as_uint(y) >> 31 << 3);
}

// Eight values to e2m1, value i in nibble i (bits 4i..4i+3): two per byte, even one low. The
// conversion instruction exists on Blackwell's arch- and family-specific targets (sm_100a,
// sm_100f, sm_120a ...); every other build rounds by hand (the same results).
__device__ __forceinline__ unsigned e2m1x8(const float (&y)[8]) {
#if __CUDA_ARCH__ >= 1000 && (defined(__CUDA_ARCH_SPECIFIC__) || defined(__CUDA_ARCH_FAMILY_SPECIFIC__))
  unsigned packed;
  asm("{\n"
      ".reg .b8 b0, b1, b2, b3;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b0, %2, %1;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b1, %4, %3;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b2, %6, %5;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b3, %8, %7;\n"
      "mov.b32 %0, {b0, b1, b2, b3};\n"
      "}"
      : "=r"(packed)
      : "f"(y[0]), "f"(y[1]), "f"(y[2]), "f"(y[3]), "f"(y[4]), "f"(y[5]), "f"(y[6]), "f"(y[7]));
  return packed;
#else
  unsigned packed = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) packed |= e2m1_code(y[i]) << (4 * i);
  return packed;
#endif
}

// One NVFP4 block of 16 values: their e2m1 pairs into `words` (8 bytes, in memory order) and the
// returned e4m3 block scale. `global` is the tensor's scale g, `inv_global` 1 / g. Values are
// clamped to +-6 before the conversion (the saturation the format asks for; a NaN, whose block
// scale is NaN, becomes -6 there, so that both conversions give the same bits).
__device__ __forceinline__ unsigned nvfp4_block(const float (&x)[kNvfp4BlockValues], float global,
                                                float inv_global, unsigned (&words)[2]) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kNvfp4BlockValues; ++i) amax = max_keeping_nan(amax, fabsf(x[i]));
  const unsigned scale = e4m3_code(amax / kE2M1Max * inv_global);
  const float scale_value = e4m3_value(scale);
  const float to_grid = scale_value == 0.0f ? 0.0f : 1.0f / (scale_value * global);
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    float y[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) y[i] = fminf(fmaxf(x[8 * w + i] * to_grid, -kE2M1Max), kE2M1Max);
    words[w] = e2m1x8(y);
  }
  return scale;
}

// The lanes of this thread's head: blockDim.x consecutive threads of one warp, blockDim.x a power
// of two (as lanes_sum in fused.cuh).
__device__ __forceinline__ unsigned head_lanes_mask() {
  const unsigned width = ntid_x();
  const unsigned linear = tid_x() + ntid_x() * (tid_y() + ntid_y() * tid_z());
  const unsigned first = (linear & 31u) & ~(width - 1u);
  return width >= 32u ? 0xffffffffu : ((1u << width) - 1u) << first;
}

// Largest value over the lanes of one head (a NaN of any lane wins).
__device__ __forceinline__ float lanes_max(float v) {
  const unsigned mask = head_lanes_mask();
  for (unsigned offset = ntid_x() / 2; offset > 0; offset /= 2) {
    v = max_keeping_nan(v, __shfl_xor_sync(mask, v, offset));
  }
  return v;
}

}  // namespace cupyrope
