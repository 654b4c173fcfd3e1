// Storage types and float conversions for the dtypes cupyrope handles.
//
// The kernels include no CUDA headers at all (not even cuda_fp16.h / cuda_bf16.h), so NVRTC from
// pip compiles them on a machine that has only an NVIDIA driver. 16-bit floats are stored as raw
// bits and converted with the PTX cvt instructions, which round to nearest even like the
// framework kernels do.
#pragma once

namespace cupyrope {

struct half_t { unsigned short bits; };
struct bfloat16_t { unsigned short bits; };

template <typename T> struct IsHalf { static constexpr bool value = false; };
template <> struct IsHalf<half_t> { static constexpr bool value = true; };

// Arithmetic happens in float32, or in float64 when the rotated arrays are float64.
template <typename T> struct ComputeOf { using type = float; };
template <> struct ComputeOf<double> { using type = double; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(double x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(half_t x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}
__device__ __forceinline__ float to_float(bfloat16_t x) {
  return __uint_as_float(static_cast<unsigned int>(x.bits) << 16);
}

__device__ __forceinline__ double to_double(double x) { return x; }
__device__ __forceinline__ double to_double(float x) { return x; }
__device__ __forceinline__ double to_double(half_t x) { return to_float(x); }
__device__ __forceinline__ double to_double(bfloat16_t x) { return to_float(x); }

template <typename C> struct Convert;
template <> struct Convert<float> {
  template <typename S> __device__ __forceinline__ static float from(S x) { return to_float(x); }
};
template <> struct Convert<double> {
  template <typename S> __device__ __forceinline__ static double from(S x) { return to_double(x); }
};

template <typename T> struct Store;
template <> struct Store<float> {
  __device__ __forceinline__ static float from(float x) { return x; }
};
template <> struct Store<double> {
  __device__ __forceinline__ static double from(double x) { return x; }
};
template <> struct Store<half_t> {
  __device__ __forceinline__ static half_t from(float x) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
    return h;
  }
};
template <> struct Store<bfloat16_t> {
  __device__ __forceinline__ static bfloat16_t from(float x) {
    bfloat16_t b;
#if __CUDA_ARCH__ >= 800
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b.bits) : "f"(x));
#else
    // Round to nearest even by hand on chips without the bf16 cvt; NaN stays a quiet NaN.
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      b.bits = static_cast<unsigned short>((u >> 16) | 0x40u);
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      b.bits = static_cast<unsigned short>(u >> 16);
    }
#endif
    return b;
  }
};

// Two values rounded to T (half_t or bfloat16_t) in one 32-bit word, `low` in the low half: one
// conversion instruction from compute capability 8.0, rounded as Store<T>::from rounds each.
template <typename T>
__device__ __forceinline__ unsigned int store_pair(float low, float high) {
#if __CUDA_ARCH__ >= 800
  unsigned int word;
  if constexpr (IsHalf<T>::value) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(word) : "f"(high), "f"(low));
  } else {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(word) : "f"(high), "f"(low));
  }
  return word;
#else
  return static_cast<unsigned int>(Store<T>::from(low).bits) |
         (static_cast<unsigned int>(Store<T>::from(high).bits) << 16);
#endif
}

template <typename C> __device__ __forceinline__ C quiet_nan();
template <> __device__ __forceinline__ float quiet_nan<float>() { return __int_as_float(0x7fc00000); }
template <> __device__ __forceinline__ double quiet_nan<double>() {
  return __longlong_as_double(0x7ff8000000000000LL);
}

}  // namespace cupyrope
