// Float-float ("double-float") range reduction of in-kernel angles, for GPUs whose FP64 is slow.
//
// angles.cuh computes cos/sin of position * inv_freq. Built with -DCUPYROPE_ANGLES_FLOAT_FLOAT=1
// (cupyrope.cuda.compiler.angle_arithmetic picks it per device), the float32 kernels form and reduce that
// angle here with float32 operations and integer bit operations only: no FP64 instruction at all.
//
// Every value is carried as a sum of float32 terms that is exact, so the only rounding that
// reaches the result is the last one, of the reduced angle to float32 (as in the float64 path):
//   1. inv_freq (float64) = fh + fm + fl exactly (split_double: 24 + 24 + 5 significand bits, by
//      integer operations on its bits); position (int64) = ph + pl exactly for |pos| <= 2^48
//      (split_position; pl = 0 for |pos| <= 2^24);
//   2. the angle = ph*fh + ph*fm + pl*fh (each an exact two-product: fmaf gives the rounding error)
//      + ph*fl + pl*fm (below 2^-46 |angle|, rounded; pl*fl, below 2^-70 |angle|, dropped);
//   3. k0 = rint(th * 2/pi) (th = fl(ph * fh)), and the angle minus k0 * pi/2 with pi/2 in three
//      floats (kPiOver2Hi + Mid + Lo, 1.1e-23 short of pi/2): k0 * Hi and k0 * Mid are exact
//      two-products; th - fl(k0 * Hi) is exact (the two are within a factor 2: Sterbenz; for
//      k0 = +-1 both lie on the 2^-24 grid and differ by less than 1); the terms of up to
//      ~2^-24 |angle| are added with error-free two-sums into s, and what the sums drop plus the
//      terms below 2^-46 |angle| add up, rounded, in t;
//   4. k0 comes from th alone, so s + t can be up to ~ulp(th) * pi/4 from 0: a second step takes
//      k1 = rint((s + t) * 2/pi) and r = (s - k1 * Hi) + (t - k1 * Mid - k1 * Lo), the first
//      difference exact (below 2 in magnitude, on the 2^-23 grid, or 2^-24 when |s| < 1); the
//      quadrant is (k0 + k1) mod 4.
//
// Bound (analysed, and measured by tests/test_float_float_angles.py through the bit-exact NumPy
// replay tests/float_float.py, over every inv_freq of the theta 1e4 / 5e5, llama3 and yarn
// schedules at rotary_dim 128; tests/test_gpu_angles.py checks that the kernel is that replay bit
// for bit): for |position * inv_freq| <= 2^31 rad and |position| <= 2^48, the float reduced angle
// is the exact reduced angle of position * inv_freq (the float64 inv_freq, the product unrounded)
// rounded once to float32, give or take 2^-36 rad (the sum of t's roundings, ~2^-40 measured):
// |error| <= 2^-25 + 2^-36 rad (3.0e-8) as |r| <= pi/4 + 2^-22 (2^-16 past 2^24 rad, where k1
// can be up to 65). That is the float64 path's bound without its float64 product's 2^-53 |angle|.
// Beyond 2^31 rad the extra error grows like 2^-69 |angle| (measured 1.3e-9 rad at 2^40, 1.7e-7
// at 2^46; tests assert <= 2^-68 |angle|); from |angle| ~2^47 the float32 k0 is so coarse that the
// second step can miss by a quadrant: wrong results (positions that large are not RoPE's).
//
// tests/float_float.py replays these functions operation by operation in NumPy: change both
// together (same constants, same order).
#pragma once

namespace cupyrope {
namespace float_float {

// float32 nearest 2/pi, and the float32 nearest the remainder.
constexpr float kTwoOverPiHi = 0x1.45f306p-1f;     // 0.636619746685028
constexpr float kTwoOverPiLo = 0x1.b93910p-26f;    // 2.5682553e-08
// pi/2 = HI + MID + LO + 1.06e-23: each the float32 nearest what the previous ones leave.
constexpr float kPiOver2Hi = 0x1.921fb6p+0f;       // 1.57079637050629
constexpr float kPiOver2Mid = -0x1.777a5cp-25f;    // -4.3711388e-08
constexpr float kPiOver2Lo = -0x1.ee59dap-50f;     // -1.7151245e-15

// a + b = s + *e exactly, s = fl(a + b) (Knuth's two-sum: any magnitudes). The _rn intrinsics keep
// the compiler from contracting or reordering what must round exactly as written.
__device__ __forceinline__ float two_sum(float a, float b, float* e) {
  const float s = __fadd_rn(a, b);
  const float bb = __fsub_rn(s, a);
  *e = __fadd_rn(__fsub_rn(a, __fsub_rn(s, bb)), __fsub_rn(b, bb));
  return s;
}

// a * b = p + *e exactly, p = fl(a * b) (fmaf rounds a * b - p once, and it is representable).
__device__ __forceinline__ float two_prod(float a, float b, float* e) {
  const float p = __fmul_rn(a, b);
  *e = fmaf(a, b, -p);
  return p;
}

// 2^(biased - 127) with the sign bit `sign`, as a float bit pattern: 0 below the normal range,
// infinity above.
__device__ __forceinline__ float power_of_two(unsigned int sign, int biased) {
  const unsigned int field = static_cast<unsigned int>(min(max(biased, 0), 255)) << 23;
  return __int_as_float(static_cast<int>(sign | field));
}

// x = *hi + *mid + *lo exactly for 2^-74 <= |x| < 2^128 (below, the parts under float32's normal
// range are dropped: an absolute error under 2^-98, so under 2^-50 rad in an angle of a position
// up to 2^48): *hi the leading 24 bits of the significand rounded to nearest even (the float32
// nearest x), *mid a multiple of 16 units in the last place of x (at most 24 bits), *lo the
// remaining [-8, 8) units. Integer and bit operations, three exact int -> float conversions and
// power-of-two products: no FP64 instruction. Zero, subnormal and infinite x give 0 or
// infinities (a NaN or infinite inv_freq then gives NaN cos/sin, as in the float64 path).
__device__ __forceinline__ void split_double(double x, float* hi, float* mid, float* lo) {
  const unsigned long long bits = static_cast<unsigned long long>(__double_as_longlong(x));
  const int exponent = static_cast<int>((bits >> 52) & 0x7FF) - 1023;
  const unsigned int sign = static_cast<unsigned int>(bits >> 32) & 0x80000000u;
  const long long significand =
      static_cast<long long>((bits & 0xFFFFFFFFFFFFFull) | 0x10000000000000ull);  // 53 bits
  const long long odd = (significand >> 29) & 1;
  const long long top = (significand + (1ll << 28) - 1 + odd) >> 29;  // [2^23, 2^24]
  const int rest = static_cast<int>(significand - (top << 29));        // [-2^28, 2^28]
  const int rest_hi = (rest + 8) & ~15;
  const int rest_lo = rest - rest_hi;                                   // [-8, 8)
  *hi = __fmul_rn(__int2float_rn(static_cast<int>(top)), power_of_two(sign, exponent + 104));
  const float rest_scale = power_of_two(sign, exponent + 75);          // 2^(exponent - 52)
  *mid = __fmul_rn(__int2float_rn(rest_hi), rest_scale);
  *lo = __fmul_rn(__int2float_rn(rest_lo), rest_scale);
}

// An integer position as *hi + *lo: exact for |pos| <= 2^48 (|pos - hi| <= 2^23 fits a float);
// beyond, *lo is rounded (hi + lo within 2^-48 |pos|).
__device__ __forceinline__ void split_position(long long pos, float* hi, float* lo) {
  *hi = __ll2float_rn(pos);
  *lo = __ll2float_rn(pos - __float2ll_rn(*hi));
}

// The same pair from a float64 position (the lean kernel's), without FP64 arithmetic: for every
// integer |pos| <= 2^53 (all a float64 holds exactly) it equals the int64 overload's.
__device__ __forceinline__ void split_position(double pos, float* hi, float* lo) {
  float mid, rest;
  split_double(pos, hi, &mid, &rest);
  *lo = __fadd_rn(mid, rest);
}

// (ph + pl) * (fh + fm + fl) - k * pi/2 for an integer k, as one float (rounded once from a
// float-float exact to ~2^-36 rad), |r| <= pi/4 + 2^-22; *quadrant = k mod 4. See the header.
__device__ __forceinline__ float reduce_angle(float ph, float pl, float fh, float fm, float fl,
                                              int* quadrant) {
  // The angle as exact terms: th + te + mh + me + nh + ne + ph*fl + pl*fm.
  float te, me, ne;
  const float th = two_prod(ph, fh, &te);
  const float mh = two_prod(ph, fm, &me);
  const float nh = two_prod(pl, fh, &ne);
  // k0 * pi/2 near th; th - p1 is exact.
  const float k0 = rintf(fmaf(th, kTwoOverPiHi, __fmul_rn(th, kTwoOverPiLo)));
  float e1, e2;
  const float p1 = two_prod(k0, kPiOver2Hi, &e1);
  const float p2 = two_prod(k0, kPiOver2Mid, &e2);
  const float d0 = __fsub_rn(th, p1);
  // The terms of up to ~2^-24 |angle|, without error: s + (a + b + c + d + e).
  float a, b, c, d, e;
  float s = two_sum(d0, te, &a);
  s = two_sum(s, mh, &b);
  s = two_sum(s, nh, &c);
  s = two_sum(s, -e1, &d);
  s = two_sum(s, -p2, &e);
  // The small terms, rounded.
  float t = __fadd_rn(me, ne);
  t = fmaf(pl, fm, t);
  t = fmaf(ph, fl, t);
  t = __fsub_rn(t, e2);
  t = fmaf(-k0, kPiOver2Lo, t);
  t = __fadd_rn(t, __fadd_rn(__fadd_rn(a, b), __fadd_rn(__fadd_rn(c, d), e)));
  // Second step: s + t - k1 * pi/2, the first subtraction exact.
  const float k1 = rintf(__fmul_rn(__fadd_rn(s, t), kTwoOverPiHi));
  const float rh = fmaf(-k1, kPiOver2Hi, s);
  float rl = fmaf(-k1, kPiOver2Mid, t);
  rl = fmaf(-k1, kPiOver2Lo, rl);
  // k0 mod 4 in float (exact for any integer-valued k0), plus k1 (exact: both small integers).
  const float k0_mod4 = fmaf(-4.0f, floorf(__fmul_rn(k0, 0.25f)), k0);
  *quadrant = __float2int_rn(__fadd_rn(k0_mod4, k1)) & 3;
  return __fadd_rn(rh, rl);
}

}  // namespace float_float
}  // namespace cupyrope
