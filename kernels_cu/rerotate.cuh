// Re-rotation of keys already in a paged cache, in place: the rows of the named slots are rotated
// by the angle of a per-slot position delta. Rotations compose exactly, R(p) R(d) = R(p + d), so
// a key stored at position p comes out as the key at position p + d (sliding-window eviction,
// attention sinks) after one rounding to the cache's format.
//
// Work is split as in the rope kernels (rope.cu): x lanes over the chunks of pairs of a head, y
// heads, z slots (blocks stride over slots by gridDim.x). cos/sin of a lane's chunk come from the
// angle source of the launch (angles.cuh: a cos_sin_cache row indexed by the delta, or the delta
// times inv_freq computed exactly) once per slot and serve every head the thread visits. Each
// chunk is loaded, decoded to float32 (fp8: times the scale), rotated (rotation.cuh), and stored
// back in the cache's format (fused.cuh's store_values: fp8 of value * (1 / scale), saturated;
// the same bytes by software on GPUs without fp8 conversions).
// Dims past rotary_dim are never touched.
#pragma once

#include "angles.cuh"
#include "fused.cuh"
#include "numeric.cuh"
#include "rope_params.cuh"
#include "rotation.cuh"
#include "thread_index.cuh"
#include "token_offsets.cuh"
#include "vector_io.cuh"

namespace cupyrope {

// The second argument of rerotate_cache_kernel (the first is a RopeParams holding the angle
// source: tables, inv_freq, attention factor, rotary_dim). Every field is 8 bytes wide
// (RERO_PARAMS_DTYPE in cupyrope/core/rerotate.py mirrors this layout).
struct RerotateParams {
  void* cache;              // the paged k cache, written in place
  const void* slots;        // [num_slots] int32 / int64; negative: nothing done
  const void* delta;        // [num_slots] int32 / int64, or null: every slot moves by delta_value
  const float* scale;       // fp8 caches: the scale as a device scalar, or null (scale_value)

  long long num_slots;      // entries of slots (and of delta)
  long long slots_are_int64, slot_stride;
  long long delta_is_int64, delta_stride;
  long long delta_value;
  long long cache_slots;    // num_blocks * block_size: slots at or past it are skipped
  long long block_size;
  // Element strides of the cache between blocks, between the rows of a block and between heads
  // (NHD [blocks, block_size, heads, D] and HND [blocks, heads, block_size, D] alike).
  long long block_stride, row_stride, head_stride;
  long long num_heads;
  // The staged kernel's stages (rerotate_staged.cuh; the host lays them out and zeroes these for
  // rerotate_cache_kernel): entries of `slots` a stage, heads a consumer item, a stage's bytes,
  // where its rows and its table rows start.
  long long stage_slots, heads_per_item, stage_bytes, rows_at, angles_at;

  double scale_value;
};

// The value type store_values takes for a cache of FORMAT whose elements are T: T itself for the
// 16- and 32-bit formats; fp8 stores never reach the input-dtype branch (FORMAT is a constant
// there), which only needs some float type to compile.
template <typename T, int FORMAT> struct StoredAs { using type = T; };
template <typename T> struct StoredAs<T, kStoreE4M3> { using type = float; };
template <typename T> struct StoredAs<T, kStoreE5M2> { using type = float; };

// fp8 conversions. From compute capability 8.9 the hardware converts (as fused.cuh's stores do);
// below it, or in a build that defines CUPYROPE_FP8_SOFTWARE (tests compare the two on one GPU),
// integer and float32 arithmetic gives the same values: round to nearest even, saturated to the
// largest finite value, NaN to NaN.
#if __CUDA_ARCH__ >= 890 && !defined(CUPYROPE_FP8_SOFTWARE)
#define CUPYROPE_FP8_HARDWARE 1
#else
#define CUPYROPE_FP8_HARDWARE 0
#endif

template <int FORMAT> struct Fp8Format;
template <> struct Fp8Format<kStoreE4M3> {  // float8_e4m3fn: no infinity, 0x7f / 0xff NaN
  static constexpr int mantissa = 3, min_exponent = -6;
  static constexpr float max = 448.0f;
};
template <> struct Fp8Format<kStoreE5M2> {  // float8_e5m2: the upper byte of a float16
  static constexpr int mantissa = 2, min_exponent = -14;
  static constexpr float max = 57344.0f;
};

// 2^e as a float32 (e within the normal range).
__device__ __forceinline__ float power_of_two(int e) {
  return __uint_as_float(static_cast<unsigned>(e + 127) << 23);
}

// One fp8 value as float32, exactly. float8_e5m2 is a float16 with the low byte cut off.
template <int FORMAT>
__device__ __forceinline__ float fp8_to_float(unsigned char b) {
  if constexpr (FORMAT == kStoreE5M2) {
    return to_float(half_t{static_cast<unsigned short>(b << 8)});
  } else {
    const unsigned exponent = (b >> 3) & 0xfu, mantissa = b & 0x7u;
    float magnitude;
    if ((b & 0x7fu) == 0x7fu) {
      magnitude = quiet_nan<float>();
    } else if (exponent == 0) {
      magnitude = static_cast<float>(mantissa) * power_of_two(-9);  // subnormal: m * 2^-9
    } else {
      magnitude = __uint_as_float(((exponent + 120u) << 23) | (mantissa << 20));
    }
    return (b & 0x80u) ? -magnitude : magnitude;
  }
}

// One float32 value as fp8 (round to nearest even, saturated, NaN to 0x7f), without the hardware
// conversion: the value is clamped to the largest finite one, rounded to a multiple of its
// binade's quantum (exact scalings by powers of two around rintf), then encoded.
template <int FORMAT>
__device__ __forceinline__ unsigned char float_to_fp8(float x) {
  using F = Fp8Format<FORMAT>;
  constexpr int M = F::mantissa;
  const unsigned sign = (__float_as_uint(x) >> 24) & 0x80u;
  if (x != x) return 0x7fu;
  const float a = fminf(fabsf(x), F::max);
  int exponent = static_cast<int>((__float_as_uint(a) >> 23) & 0xffu) - 127;
  if (exponent < F::min_exponent) exponent = F::min_exponent;
  const float rounded = rintf(a * power_of_two(M - exponent)) * power_of_two(exponent - M);
  const int binade = static_cast<int>((__float_as_uint(rounded) >> 23) & 0xffu) - 127;
  unsigned code;
  if (binade < F::min_exponent) {  // subnormal (or zero): multiples of 2^(min_exponent - M)
    code = static_cast<unsigned>(rounded * power_of_two(M - F::min_exponent));
  } else {
    const unsigned mantissa = (__float_as_uint(rounded) >> (23 - M)) & ((1u << M) - 1u);
    code = (static_cast<unsigned>(binade - F::min_exponent + 1) << M) | mantissa;
  }
  return static_cast<unsigned char>(sign | code);
}

// Two fp8 values (the low byte first) as float32, exactly.
template <int FORMAT>
__device__ __forceinline__ void from_fp8x2(unsigned char low, unsigned char high, float& lo,
                                           float& hi) {
#if CUPYROPE_FP8_HARDWARE
  if constexpr (FORMAT == kStoreE4M3) {
    const unsigned short two = static_cast<unsigned short>(low | (high << 8));
    unsigned int halves;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(two));
    lo = to_float(half_t{static_cast<unsigned short>(halves & 0xffffu)});
    hi = to_float(half_t{static_cast<unsigned short>(halves >> 16)});
    return;
  }
#endif
  lo = fp8_to_float<FORMAT>(low);
  hi = fp8_to_float<FORMAT>(high);
}

// N float32 values stored at element `offset` of `base` in the cache's format: fused.cuh's
// store_values (fp8: value * (1 / scale) by the hardware conversion), or the same fp8 bytes from
// float_to_fp8 where there is no such conversion.
template <typename T, bool VECTOR, int FORMAT, int N>
__device__ __forceinline__ void store_cache_values(void* base, long long offset,
                                                   const float (&v)[N], float inv_scale) {
  using Stored = typename StoredAs<T, FORMAT>::type;
#if CUPYROPE_FP8_HARDWARE
  store_values<Stored, VECTOR>(base, offset, v, FORMAT, inv_scale);
#else
  if constexpr (FORMAT == kStoreInput) {
    store_values<Stored, VECTOR>(base, offset, v, FORMAT, inv_scale);
  } else {
    unsigned char out[N];
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = float_to_fp8<FORMAT>(v[i] * inv_scale);
    store_elements<VECTOR>(static_cast<unsigned char*>(base) + offset, out);
  }
#endif
}

// N stored elements as float32: converted (16- and 32-bit formats) or decoded and multiplied by
// the scale (fp8: stored = value / scale).
template <int FORMAT, typename T, int N>
__device__ __forceinline__ void decode_values(const T (&raw)[N], float scale, float (&v)[N]) {
  if constexpr (FORMAT == kStoreInput) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = to_float(raw[i]);
  } else {
#pragma unroll
    for (int i = 0; i + 1 < N; i += 2) from_fp8x2<FORMAT>(raw[i], raw[i + 1], v[i], v[i + 1]);
    if constexpr (N % 2 == 1) {
      float unused;
      from_fp8x2<FORMAT>(raw[N - 1], 0, v[N - 1], unused);
    }
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] *= scale;
  }
}

// The cache offset of the row of the n-th slot named, or -1 for a slot to skip (negative: nothing to do;
// past the cache: never written out of bounds, validate=True raises on the host instead).
__device__ __forceinline__ long long cache_row_of(const RerotateParams& r, long long n) {
  const long long at = n * r.slot_stride;
  const long long slot = r.slots_are_int64 ? static_cast<const long long*>(r.slots)[at]
                                           : static_cast<const int*>(r.slots)[at];
  if (slot < 0 || slot >= r.cache_slots) return -1;
  const long long block = slot / r.block_size, row = slot - block * r.block_size;
  return block * r.block_stride + row * r.row_stride;
}

__device__ __forceinline__ long long delta_of(const RerotateParams& r, long long n) {
  if (r.delta == nullptr) return r.delta_value;
  const long long at = n * r.delta_stride;
  return r.delta_is_int64 ? static_cast<const long long*>(r.delta)[at]
                          : static_cast<const int*>(r.delta)[at];
}

// A table row holds cos and sin of the angle times the schedule's attention factor (mscale),
// and the cached keys already carry that factor once: each pair's entries are divided by the
// factor, which row 0 (position 0: cos = the factor, sin = 0) holds, so that the re-rotation is
// the rotation by the angle alone (exactly the rows as given where the factor is 1). Computed
// angles leave the factor out (the host passes an attention factor of 1). A row never read (delta
// outside the table) stays NaN.
template <int P, typename TableT, typename Index>
__device__ __forceinline__ void without_attention_factor(const TableT* __restrict__ cos_table,
                                                         Index pair0, Index cos_col_stride,
                                                         bool table_vector_ok, float (&cos_v)[P],
                                                         float (&sin_v)[P]) {
  float factor[P];
  load_table(factor, cos_table + pair0 * cos_col_stride, cos_col_stride, table_vector_ok);
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const float inverse = 1.0f / factor[i];
    cos_v[i] *= inverse;
    sin_v[i] *= inverse;
  }
}

// Rotate one head's chunk of pairs [pair0, pair0 + P) in place.
template <typename T, int P, bool VECTOR, bool INTERLEAVED, int FORMAT>
__device__ __forceinline__ void rerotate_chunk(T* row, long long pair0, long long half,
                                               const float (&cos_v)[P], const float (&sin_v)[P],
                                               float scale, float inv_scale) {
  HeadChunk<T, P, VECTOR, INTERLEAVED> chunk;
  chunk.load(row, pair0, half);
  if constexpr (INTERLEAVED) {
    float x[2 * P];
    decode_values<FORMAT>(chunk.first, scale, x);
#pragma unroll
    for (int i = 0; i < P; ++i) {
      rotate_pair(x[2 * i], x[2 * i + 1], cos_v[i], sin_v[i], 1.0f, x[2 * i], x[2 * i + 1]);
    }
    store_cache_values<T, VECTOR, FORMAT>(row, 2 * pair0, x, inv_scale);
  } else {
    float x1[P], x2[P];
    decode_values<FORMAT>(chunk.first, scale, x1);
    decode_values<FORMAT>(chunk.second, scale, x2);
#pragma unroll
    for (int i = 0; i < P; ++i) rotate_pair(x1[i], x2[i], cos_v[i], sin_v[i], 1.0f, x1[i], x2[i]);
    store_cache_values<T, VECTOR, FORMAT>(row, pair0, x1, inv_scale);
    store_cache_values<T, VECTOR, FORMAT>(row, half + pair0, x2, inv_scale);
  }
}

// The kernel's body: every slot this thread's block strides over; per slot its cache row and
// delta, then per lane chunk cos/sin of the delta's angle once and every head the thread visits
// rotated with them. 64-bit offsets throughout: a paged cache is often past 2^31 elements.
template <typename T, typename TableT, bool VECTOR, bool INTERLEAVED, int SOURCE, int FORMAT>
__device__ __forceinline__ void rerotate_slots(const RopeParams& p, const RerotateParams& r) {
  using L = Layout<T, VECTOR, INTERLEAVED>;
  constexpr int P = L::pairs;
  static_assert(SOURCE != kTokenTables, "a re-rotation takes its angle from the delta");

  const TableT* __restrict__ cos_table = static_cast<const TableT*>(p.cos);
  const TableT* __restrict__ sin_table = static_cast<const TableT*>(p.sin);
  const long long cos_col_stride = p.cos_col_stride, sin_col_stride = p.sin_col_stride;
  const bool table_vector_ok = p.table_vector_ok != 0;
  const long long half = p.rotary_dim / 2;
  const long long num_chunks = half / P;
  const long long num_heads = r.num_heads, head_stride = r.head_stride;
  const long long first_head = static_cast<long long>(blockIdx.y) * ntid_y() + tid_y();
  const long long head_step = static_cast<long long>(gridDim.y) * ntid_y();
  const long long slot_step = static_cast<long long>(gridDim.x) * ntid_z();
  float scale = 1.0f, inv_scale = 1.0f;
  if constexpr (FORMAT != kStoreInput) {
    inv_scale = inverse_scale_of(r.scale, r.scale_value);
    scale = r.scale != nullptr ? *r.scale : static_cast<float>(r.scale_value);
  }
  const TokenOffsets<long long> o = {0, 0, 0, 0, 0, 0, 0};  // tables are indexed by the delta
  T* const cache = static_cast<T*>(r.cache);

  for (long long n = static_cast<long long>(blockIdx.x) * ntid_z() + tid_z(); n < r.num_slots;
       n += slot_step) {
    const long long base = cache_row_of(r, n);
    if (base < 0) continue;
    const long long delta = delta_of(r, n);
    for (long long lane = tid_x(); lane < num_chunks; lane += ntid_x()) {
      const long long pair0 = lane * P;
      float cos_v[P], sin_v[P];
      chunk_angles<SOURCE, false>(p, o, delta, pair0, cos_table, sin_table, cos_col_stride,
                                  sin_col_stride, table_vector_ok, 1.0f, cos_v, sin_v);
      if constexpr (SOURCE == kCacheTable) {
        without_attention_factor(cos_table, pair0, cos_col_stride, table_vector_ok, cos_v, sin_v);
      }
      for (long long head = first_head; head < num_heads; head += head_step) {
        rerotate_chunk<T, P, VECTOR, INTERLEAVED, FORMAT>(cache + base + head * head_stride,
                                                          pair0, half, cos_v, sin_v, scale,
                                                          inv_scale);
      }
    }
  }
}

}  // namespace cupyrope
