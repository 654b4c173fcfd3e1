// Accurate cos/sin of position * inv_freq, computed in the kernel.
//
// A float32 angle `pos * inv_freq` is already ~2e-3 rad off at position 131072, and the fast
// intrinsics (__sincosf) lose accuracy further on unreduced arguments. Here the product is formed
// in float64 (exact to ~1e-16 relative) and reduced modulo pi/2 in float64 with a two-part pi/2
// (FMA keeps the product k * pi/2 exact), so the reduced argument is correct to ~1e-16 rad for any
// position the int64 range allows. Only the final polynomial runs in float32, on |r| <= pi/4,
// where it is accurate to about one float32 ulp.
#pragma once

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

__device__ __forceinline__ void accurate_sincos(double angle, float* s, float* c) {
  constexpr double kTwoOverPi = 0.63661977236758134308;
  constexpr double kPiOver2Hi = 1.5707963267948966192;     // double nearest pi/2
  constexpr double kPiOver2Lo = 6.1232339957367658e-17;    // pi/2 - kPiOver2Hi
  const double k = rint(angle * kTwoOverPi);
  double r = fma(-k, kPiOver2Hi, angle);
  r = fma(-k, kPiOver2Lo, r);
  const float rf = static_cast<float>(r);
  const float sr = sin_kernel(rf);
  const float cr = cos_kernel(rf);
  // The quadrant is k mod 4; k is exact in float64 for any angle below 2^53.
  const int quadrant = static_cast<int>(static_cast<long long>(k) & 3);
  switch (quadrant) {
    case 0: *s = sr; *c = cr; break;
    case 1: *s = cr; *c = -sr; break;
    case 2: *s = -sr; *c = -cr; break;
    default: *s = -cr; *c = sr; break;
  }
}

// float64 arrays get float64 cos/sin: CUDA's sincos reduces large arguments exactly.
__device__ __forceinline__ void accurate_sincos(double angle, double* s, double* c) {
  sincos(angle, s, c);
}

}  // namespace cupyrope
