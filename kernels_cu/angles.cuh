// Accurate cos/sin of position * inv_freq, computed in the kernel.
//
// A float32 angle `pos * inv_freq` is already ~2e-3 rad off at position 131072, and the fast
// intrinsics (__sincosf) lose accuracy further on unreduced arguments. So the angle is formed and
// reduced modulo pi/2 exactly (to far below float32 rounding), and only then rounded to float32
// for the polynomials on |r| <= pi/4 (sin_kernel / cos_kernel, about one float32 ulp), with the
// quadrant picking signs. Two arithmetics do the exact part; the build picks one
// (CUPYROPE_ANGLES_FLOAT_FLOAT, set per device by cupyrope.cuda.compiler.angle_arithmetic):
//
// - float64 (default; GPUs with full-rate FP64: sm_60, 70, 80, 90, 100): the product in float64
//   (2^-53 relative) and the reduction in float64 with a two-part pi/2 (FMA keeps k * pi/2
//   exact): r within 2^-53 |angle| + 2^-25 rad of the exact reduced angle, at any position the
//   int64 range allows (float64 holds positions exactly to 2^53);
// - float-float (CUPYROPE_ANGLES_FLOAT_FLOAT=1; GPUs whose FP64 runs at 1/32 or 1/64 of FP32):
//   float_float.cuh splits inv_freq and the position into exact float32 terms, forms the product
//   with exact two-products and reduces it with a three-part pi/2 and error-free sums: float32
//   and integer instructions only (no FP64 instruction; ~145 instructions a pair against the
//   float64 scheme's ~51, 8 of them FP64). r is within 2^-25 + 2^-36 rad of the exact reduced
//   angle (its float32 rounding, as above, without the 2^-53 |angle| term) for
//   |position * inv_freq| <= 2^31 rad and |position| <= 2^48: every int32 position at
//   inv_freq <= 1, the accuracy contract's 2^24 with room to spare. Beyond 2^31 rad the error grows
//   by ~2^-69 |angle| (1.7e-7 rad at 2^46), and from ~2^47 rad results are wrong (float_float.cuh
//   has the analysis).
//
// Either way cos and sin are within 1.75 * 2^-24 of the exact values at every |position| <= 2^24
// (tests/test_float_float_angles.py on the CPU replay, tests/test_gpu_angles.py on the GPU).
// float64 q/k take CUDA's float64 sincos either way (it reduces large arguments exactly).
#pragma once

#include "float_float.cuh"
#include "numeric.cuh"
#include "rope_params.cuh"
#include "token_offsets.cuh"
#include "vector_io.cuh"

#ifndef CUPYROPE_ANGLES_FLOAT_FLOAT
#define CUPYROPE_ANGLES_FLOAT_FLOAT 0  // float64 angles unless the build asks for float-float
#endif

namespace cupyrope {

// sin and cos on [-pi/4, pi/4]: minimax polynomials (Cephes sinf/cosf coefficients).
__device__ __forceinline__ float sin_kernel(float x) {
  const float z = x * x;
  float p = -1.9515295891e-4f;
  p = fmaf(p, z, 8.3321608736e-3f);
  p = fmaf(p, z, -1.6666654611e-1f);
  return fmaf(p * z, x, x);
}

__device__ __forceinline__ float cos_kernel(float x) {
  const float z = x * x;
  float p = 2.443315711809948e-5f;
  p = fmaf(p, z, -1.388731625493765e-3f);
  p = fmaf(p, z, 4.166664568298827e-2f);
  return fmaf(p * z, z, fmaf(-0.5f, z, 1.0f));
}

// sin and cos of r + quadrant * pi/2, |r| <= pi/4.
__device__ __forceinline__ void sincos_of_reduced(float r, int quadrant, float* s, float* c) {
  const float sr = sin_kernel(r);
  const float cr = cos_kernel(r);
  switch (quadrant) {
    case 0: *s = sr; *c = cr; break;
    case 1: *s = cr; *c = -sr; break;
    case 2: *s = -sr; *c = -cr; break;
    default: *s = -cr; *c = sr; break;
  }
}

// The float64 scheme (see the header).
__device__ __forceinline__ void accurate_sincos(double angle, float* s, float* c) {
  constexpr double kTwoOverPi = 0.63661977236758134308;
  constexpr double kPiOver2Hi = 1.5707963267948966192;     // double nearest pi/2
  constexpr double kPiOver2Lo = 6.1232339957367658e-17;    // pi/2 - kPiOver2Hi
  const double k = rint(angle * kTwoOverPi);
  double r = fma(-k, kPiOver2Hi, angle);
  r = fma(-k, kPiOver2Lo, r);
  // The quadrant is k mod 4; k is exact in float64 for any angle below 2^53.
  sincos_of_reduced(static_cast<float>(r), static_cast<int>(static_cast<long long>(k) & 3), s, c);
}

// The float-float scheme (see the header and float_float.cuh): no FP64 instruction. Position is
// an int64, or the float64 the lean kernel holds it in (split without FP64 arithmetic).
template <typename Position>
__device__ __forceinline__ void float_float_sincos(Position position, double inv_freq, float* s,
                                                   float* c) {
  float ph, pl, fh, fm, fl;
  float_float::split_position(position, &ph, &pl);
  float_float::split_double(inv_freq, &fh, &fm, &fl);
  int quadrant;
  const float r = float_float::reduce_angle(ph, pl, fh, fm, fl, &quadrant);
  sincos_of_reduced(r, quadrant, s, c);
}

// float64 arrays get float64 cos/sin: CUDA's sincos reduces large arguments exactly.
__device__ __forceinline__ void accurate_sincos(double angle, double* s, double* c) {
  sincos(angle, s, c);
}

// cos/sin of position * inv_freq in the compute type C, by the scheme this build uses.
template <typename Position>
__device__ __forceinline__ void angle_sincos(Position position, double inv_freq, double* s,
                                             double* c) {
  accurate_sincos(static_cast<double>(position) * inv_freq, s, c);
}

template <typename Position>
__device__ __forceinline__ void angle_sincos(Position position, double inv_freq, float* s,
                                             float* c) {
#if CUPYROPE_ANGLES_FLOAT_FLOAT
  float_float_sincos(position, inv_freq, s, c);
#else
  accurate_sincos(static_cast<double>(position) * inv_freq, s, c);
#endif
}

// cos/sin of the pairs [pair0, pair0 + P) of one token, from the launch's angle source (SOURCE).
// Table-read angles come without the sign of sin (rotate_store applies it per head, so that the
// first head's loads overlap this load); computed angles have it folded in. A cache row outside
// the cache is never read: its pairs get NaN.
// LEAN: cos/sin rows known to take vector loads. MROPE: M-RoPE possible (p.mrope_mode checked at
// run time: each pair's position component); the lean rope kernels never see M-RoPE, the lean
// fused kernel does.
template <int SOURCE, bool LEAN, int P, bool MROPE = !LEAN, typename C, typename TableT,
          typename Index>
__device__ __forceinline__ void chunk_angles(const RopeParams& p, const TokenOffsets<Index>& o,
                                             long long position, Index pair0,
                                             const TableT* __restrict__ cos_table,
                                             const TableT* __restrict__ sin_table,
                                             Index cos_col_stride, Index sin_col_stride,
                                             bool table_vector_ok, C sin_sign, C (&cos_v)[P],
                                             C (&sin_v)[P]) {
  if constexpr (SOURCE == kComputedAngles) {
    const C factor = static_cast<C>(p.attention_factor);
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const long long pos = MROPE ? pair_position(p, o.positions, position, pair0 + i) : position;
      // c before s: in this order NVRTC compiles the quadrant switch of accurate_sincos as tightly
      // as in the single-file kernel (declared s, c it costs up to 9 more instructions).
      C c, s;
      angle_sincos(pos, p.inv_freq[pair0 + i], &s, &c);
      cos_v[i] = c * factor;
      sin_v[i] = s * factor * sin_sign;
    }
  } else {
    Index cos_row = o.cos, sin_row = o.sin;
    bool row_valid = true;
    if constexpr (SOURCE == kCacheTable) {
      row_valid = position >= 0 && position < p.max_position;
      cos_row = sin_row =
          row_valid ? static_cast<Index>(position) * static_cast<Index>(p.table_row_stride) : 0;
    }
    if (SOURCE == kCacheTable && MROPE && LEAN && p.mrope_mode == kMRopeSectioned &&
        mrope_component(p, pair0) == mrope_component(p, pair0 + (P - 1))) {
      // Sectioned M-RoPE whose chunk lies in one section (Qwen2-VL's 16 / 24 / 24 pairs, 4 or 8 a
      // chunk): one position component for the chunk, so its rows load as vectors.
      const long long pos = pair_position(p, o.positions, position, pair0);
      if (pos >= 0 && pos < p.max_position) {
        const Index row = static_cast<Index>(pos) * static_cast<Index>(p.table_row_stride);
        load_table(cos_v, cos_table + row + pair0 * cos_col_stride, cos_col_stride, true);
        load_table(sin_v, sin_table + row + pair0 * sin_col_stride, sin_col_stride, true);
      } else {
#pragma unroll
        for (int i = 0; i < P; ++i) cos_v[i] = sin_v[i] = quiet_nan<C>();
      }
    } else if (SOURCE == kCacheTable && MROPE && p.mrope_mode) {
      // M-RoPE from a cache: each pair reads the row of its own position component.
#pragma unroll
      for (int i = 0; i < P; ++i) {
        const long long pos = pair_position(p, o.positions, position, pair0 + i);
        if (pos >= 0 && pos < p.max_position) {
          const Index row = static_cast<Index>(pos) * static_cast<Index>(p.table_row_stride);
          cos_v[i] = Convert<C>::from(cos_table[row + (pair0 + i) * cos_col_stride]);
          sin_v[i] = Convert<C>::from(sin_table[row + (pair0 + i) * sin_col_stride]);
        } else {
          cos_v[i] = sin_v[i] = quiet_nan<C>();
        }
      }
    } else if (row_valid) {
      load_table(cos_v, cos_table + cos_row + pair0 * cos_col_stride, cos_col_stride,
                 LEAN || table_vector_ok);
      load_table(sin_v, sin_table + sin_row + pair0 * sin_col_stride, sin_col_stride,
                 LEAN || table_vector_ok);
    } else {
#pragma unroll
      for (int i = 0; i < P; ++i) cos_v[i] = sin_v[i] = quiet_nan<C>();
    }
  }
}

// The lean computed-angle kernel's prologue for one token: the threads of the token (`rank` of
// `threads_per_token`) compute each of its `half` pairs' cos and sin (times the attention factor,
// sin times sin_sign) once, into shared memory, where every head lane of the token reads them.
// The position comes as a float64 (converted once per token) or as the int64 itself: the
// float-float build splits either into floats without FP64 arithmetic (an int64 also saves that
// one conversion).
template <typename C, typename Index, typename Position>
__device__ __forceinline__ void token_angles_to_shared(const RopeParams& p, Position position,
                                                       Index half, Index rank,
                                                       Index threads_per_token, C factor,
                                                       C sin_sign, C* token_cos, C* token_sin) {
  for (Index j = rank; j < half; j += threads_per_token) {
    C c, s;  // c before s: see chunk_angles
    angle_sincos(position, p.inv_freq[j], &s, &c);
    token_cos[j] = c * factor;
    token_sin[j] = s * factor * sin_sign;
  }
}

}  // namespace cupyrope
