// The fused ops, built on the rotation of rotation.cuh: RMSNorm of each head before the rotation,
// fp8 outputs, and the write of the rotated k and of v into a paged KV cache, all in the one pass
// over q and k (and v) that the rotation makes anyway.
//
// Work is split as in the rope kernels (rope.cu): x lanes over the chunks of pairs of a head, y
// heads (q, then k, then v when a cache is written), z tokens. The loop order differs: heads
// outside, chunks inside, because RMSNorm needs the sum of squares of a whole head before any of
// its elements can be rotated. The lanes of a head are blockDim.x consecutive threads of one warp
// (the host makes blockDim.x a power of two when it normalises), so the sum is a warp shuffle.
// Arithmetic is float32 throughout and each output is rounded once.
#pragma once

#include "angles.cuh"
#include "numeric.cuh"
#include "quantize.cuh"
#include "rope_params.cuh"
#include "rotation.cuh"
#include "thread_index.cuh"
#include "token_offsets.cuh"
#include "vector_io.cuh"

namespace cupyrope {

// Two float32 values to fp8, rounded to nearest even and saturated to the largest finite value
// (NaN stays NaN): what vLLM's and FlashInfer's fp8 stores do. `low` lands in the low byte. The
// hardware conversion exists from compute capability 8.9; the host refuses fp8 outputs on older
// GPUs before launching.
__device__ __forceinline__ unsigned short to_fp8x2(float low, float high, long long format) {
#if __CUDA_ARCH__ >= 890
  unsigned short two;
  if (format == kStoreE4M3) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(two) : "f"(high), "f"(low));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(two) : "f"(high), "f"(low));
  }
  return two;
#else
  __trap();  // unreachable: no fp8 launch on GPUs without the conversion
  return 0;
#endif
}

// W 32-bit words at `dst` (16-byte aligned for 4 words, 8 for 2) as 16- / 8-byte stores. In PTX:
// the compiler turned a uint4 store of converted values into four 4-byte stores. SHARED: `dst` is
// in shared memory (the staged MLA kernel's output rows), stored as uint4 / uint2.
template <int W, bool SHARED = false>
__device__ __forceinline__ void store_words(void* dst, const unsigned int (&words)[W]) {
  if constexpr (SHARED && W % 4 == 0) {
#pragma unroll
    for (int i = 0; i < W; i += 4) {
      static_cast<uint4*>(dst)[i / 4] = make_uint4(words[i], words[i + 1], words[i + 2],
                                                   words[i + 3]);
    }
  } else if constexpr (SHARED && W == 2) {
    *static_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
  } else if constexpr (W % 4 == 0) {
#pragma unroll
    for (int i = 0; i < W; i += 4) {
      asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};"
                   :: "l"(static_cast<unsigned int*>(dst) + i), "r"(words[i]), "r"(words[i + 1]),
                      "r"(words[i + 2]), "r"(words[i + 3]) : "memory");
    }
  } else if constexpr (W == 2) {
    asm volatile("st.global.v2.u32 [%0], {%1, %2};"
                 :: "l"(dst), "r"(words[0]), "r"(words[1]) : "memory");
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) reinterpret_cast<unsigned int*>(dst)[i] = words[i];
  }
}

// N values stored at element `offset` of `base`: as the input dtype T, or as fp8 bytes of
// value * (1 / scale) (vLLM's scale convention, stored = value / scale, with the reciprocal
// rounded to float32 once: a multiply per element instead of a division, which made the fp8
// stores instruction-bound; the NumPy path does the same). Two values a conversion.
template <typename T, bool VECTOR, int N, typename Index>
__device__ __forceinline__ void store_values(void* base, Index offset, const float (&v)[N],
                                             long long format, float inv_scale) {
  if (format == kStoreInput) {
    T out[N];
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = Store<T>::from(v[i]);
    store_elements<VECTOR>(static_cast<T*>(base) + offset, out);
  } else {
    unsigned char out[N];
#pragma unroll
    for (int i = 0; i + 1 < N; i += 2) {
      const unsigned short two = to_fp8x2(v[i] * inv_scale, v[i + 1] * inv_scale, format);
      out[i] = static_cast<unsigned char>(two & 0xffu);
      out[i + 1] = static_cast<unsigned char>(two >> 8);
    }
    if constexpr (N % 2 == 1) {
      out[N - 1] = static_cast<unsigned char>(to_fp8x2(v[N - 1] * inv_scale, 0.0f, format) & 0xffu);
    }
    store_elements<VECTOR>(static_cast<unsigned char*>(base) + offset, out);
  }
}

// store_values of a vector access as 32-bit words: two bf16 / fp16 values a cvt.rn.*x2, four
// fp8 values a pair of conversions, stored with st.global.v4 / v2. The MLA kernel's converted
// stores otherwise came out of NVRTC as four 4-byte stores (bf16) or byte shuffles (fp8). Not
// used by the fused kernels: there the same change spilled 20-64 bytes in 8 sm_90
// specialisations.
template <typename T, int N, typename Index, bool SHARED = false>
__device__ __forceinline__ void store_value_words(void* base, Index offset, const float (&v)[N],
                                                  long long format, float inv_scale) {
  static_assert(N % 4 == 0 && (sizeof(T) == 2 || sizeof(T) == 4), "whole 32-bit words");
  if (format == kStoreInput) {
    if constexpr (sizeof(T) == 2) {
      unsigned int words[N / 2];
#pragma unroll
      for (int i = 0; i < N / 2; ++i) words[i] = store_pair<T>(v[2 * i], v[2 * i + 1]);
      store_words<N / 2, SHARED>(static_cast<T*>(base) + offset, words);
    } else {
      unsigned int words[N];
#pragma unroll
      for (int i = 0; i < N; ++i) words[i] = __float_as_uint(Store<T>::from(v[i]));
      store_words<N, SHARED>(static_cast<T*>(base) + offset, words);
    }
  } else {
    unsigned int words[N / 4];
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const unsigned int low = to_fp8x2(v[4 * i] * inv_scale, v[4 * i + 1] * inv_scale, format);
      const unsigned int high =
          to_fp8x2(v[4 * i + 2] * inv_scale, v[4 * i + 3] * inv_scale, format);
      words[i] = low | (high << 16);
    }
    store_words<N / 4, SHARED>(static_cast<unsigned char*>(base) + offset, words);
  }
}

__device__ __forceinline__ float load_weight(const void* w, long long i, long long dtype) {
  if (dtype == kWeightBFloat16) return to_float(static_cast<const bfloat16_t*>(w)[i]);
  if (dtype == kWeightFloat16) return to_float(static_cast<const half_t*>(w)[i]);
  return static_cast<const float*>(w)[i];
}

// 1 / scale, rounded to float32 (the stores multiply by it).
__device__ __forceinline__ float inverse_scale_of(const float* device_scale, double value) {
  return 1.0f / (device_scale != nullptr ? *device_scale : static_cast<float>(value));
}

// Sum over the blockDim.x lanes of one head: consecutive threads of one warp, blockDim.x a power
// of two. Only those lanes take part (the other heads of the warp may loop differently).
__device__ __forceinline__ float lanes_sum(float v) {
  const unsigned width = ntid_x();
  const unsigned linear = tid_x() + ntid_x() * (tid_y() + ntid_y() * tid_z());
  const unsigned first = (linear & 31u) & ~(width - 1u);
  const unsigned mask = width >= 32u ? 0xffffffffu : ((1u << width) - 1u) << first;
  for (unsigned offset = width / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(mask, v, offset);
  }
  return v;
}

template <typename T, int P, bool VECTOR, bool INTERLEAVED>
__device__ __forceinline__ float sum_of_squares(const HeadChunk<T, P, VECTOR, INTERLEAVED>& c) {
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < (INTERLEAVED ? 2 * P : P); ++i) {
    const float x = to_float(c.first[i]);
    s = fmaf(x, x, s);
  }
  if constexpr (!INTERLEAVED) {
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const float x = to_float(c.second[i]);
      s = fmaf(x, x, s);
    }
  }
  return s;
}

// Where one head's results go: its output row (q_out / k_out, input dtype or fp8) and, for a k
// head whose token has a cache slot, its row in the k cache.
template <typename Index>
struct HeadTargets {
  void* out;
  Index out_offset;
  float out_inv_scale;
  long long cache_offset;  // < 0: no cache write
};

// The per-head multiplier of element `dim`: rsqrt(mean + eps) * (weight_offset + w[dim]), or 1.
// The block keeps weight_offset + w of q and of k in shared memory (fill_norm_weights).
struct HeadNorm {
  const float* weights;  // shared memory, [head_dim]; null when the op does not normalise
  float rms_scale;
  template <typename Index>
  __device__ __forceinline__ float at(Index dim) const {
    return weights == nullptr ? 1.0f : rms_scale * weights[dim];
  }
};

// The pipelined loop's ring (see rope_fused_tokens and ring_slot below): kRingDepth slots of
// kRingSlotBytes per thread.
constexpr int kRingDepth = 4;
constexpr int kRingSlotBytes = 32;  // one chunk of 16-byte accesses: two (NeoX) or one (interleaved)

// Floats of the norm weights in the block's shared memory (after the ring, when the launch has
// one): weight_offset + w of q, then of k, head_dim each; with the norm over all heads
// (ALL_HEADS) a whole projection each (num_heads * head_dim), then the scratch of block_sums.
// launch.fused_shared_bytes mirrors this.
constexpr int kAllHeadsScratch = 2 * 32;  // a q and a k partial sum per warp

template <bool ALL_HEADS>
__device__ __forceinline__ long long norm_shared_floats(const RopeParams& p,
                                                        const FusionParams& f) {
  if (!f.norm) return 0;
  if constexpr (!ALL_HEADS) return 2 * p.head_dim;
  return (p.num_q_heads + p.num_k_heads) * p.head_dim + kAllHeadsScratch;
}

// weights[i] = offset + w[i * stride] for i < count, by the block's threads: 16-byte loads where
// the weights are one aligned run, else kFillBatch loads in flight a thread before their
// conversions and stores. The norm over all heads fills the weights of every head (5120 for 32 +
// 8 heads of 128), and loads of one element after another (a conversion waiting on each) made a
// decode step's latency: H100, T = 1, 12.5 -> 8.2 us (batches of 4) -> see docs/perf_log.md.
// (Batches of 16-byte loads spilled the 80-register interleaved specialisations.)
template <typename W>
__device__ __forceinline__ void fill_weights(float* weights, const W* w, long long stride,
                                             long long count, float offset, long long rank,
                                             long long threads) {
  constexpr int V = 16 / sizeof(W);  // weights a 16-byte load
  if (stride == 1 && count % V == 0 && (reinterpret_cast<unsigned long long>(w) & 15u) == 0) {
    for (long long i = rank; i < count / V; i += threads) {
      const uint4 raw = reinterpret_cast<const uint4*>(w)[i];
      const W* values = reinterpret_cast<const W*>(&raw);
#pragma unroll
      for (int m = 0; m < V; ++m) weights[i * V + m] = offset + to_float(values[m]);
    }
    return;
  }
  constexpr int kFillBatch = 4;
  for (long long first = rank; first < count; first += kFillBatch * threads) {
    W raw[kFillBatch];
#pragma unroll
    for (int j = 0; j < kFillBatch; ++j) {
      const long long i = first + j * threads;
      if (i < count) raw[j] = w[i * stride];
    }
#pragma unroll
    for (int j = 0; j < kFillBatch; ++j) {
      const long long i = first + j * threads;
      if (i < count) weights[i] = offset + to_float(raw[j]);
    }
  }
}

__device__ __forceinline__ void fill_weights_of(float* weights, const void* w, long long stride,
                                                long long count, long long dtype, float offset,
                                                long long rank, long long threads) {
  if (w == nullptr) {
    for (long long i = rank; i < count; i += threads) weights[i] = 0.0f;
  } else if (dtype == kWeightBFloat16) {
    fill_weights(weights, static_cast<const bfloat16_t*>(w), stride, count, offset, rank, threads);
  } else if (dtype == kWeightFloat16) {
    fill_weights(weights, static_cast<const half_t*>(w), stride, count, offset, rank, threads);
  } else {
    fill_weights(weights, static_cast<const float*>(w), stride, count, offset, rank, threads);
  }
}

// weight_offset + weight of q and of k, as float32, into the block's shared memory: read once a
// block instead of once per head and element (and no dtype switch in the inner loops).
// They follow the ring when the launch has one (f.ring). Per head: head_dim each, one element a
// thread; ALL_HEADS: q's whole projection (q_count), then k's (k_count), in batches
// (fill_weights).
template <bool ALL_HEADS>
__device__ __forceinline__ float* fill_norm_weights(const FusionParams& f, long long q_count,
                                                    long long k_count) {
  extern __shared__ __align__(16) unsigned char fused_shared[];
  const long long rank = tid_x() + ntid_x() * (tid_y() + ntid_y() * tid_z());
  const long long threads = static_cast<long long>(ntid_x()) * ntid_y() * ntid_z();
  float* const weights = reinterpret_cast<float*>(
      fused_shared + (f.ring ? threads * kRingDepth * kRingSlotBytes : 0));
  const float offset = static_cast<float>(f.weight_offset);
  if constexpr (ALL_HEADS) {
    fill_weights_of(weights, f.q_weight, f.q_weight_stride, q_count, f.weight_dtype, offset,
                    rank, threads);
    fill_weights_of(weights + q_count, f.k_weight, f.k_weight_stride, k_count, f.weight_dtype,
                    offset, rank, threads);
  } else {
    for (long long i = rank; i < q_count + k_count; i += threads) {
      const bool k = i >= q_count;
      const long long d = k ? i - q_count : i;
      const void* w = k ? f.k_weight : f.q_weight;
      weights[i] = w == nullptr ? 0.0f
                                : offset + load_weight(w, d * (k ? f.k_weight_stride
                                                                 : f.q_weight_stride),
                                                       f.weight_dtype);
    }
  }
  __syncthreads();
  return weights;
}

// A thread's ring slot, at the start of the block's shared memory (the norm weights follow the
// ring). Each thread fills and
// reads only its own slots, so no barrier is needed: cp.async.wait_group orders a thread's copies
// before its own reads.

__device__ __forceinline__ unsigned char* ring_slot(int slot) {
  extern __shared__ __align__(16) unsigned char fused_shared[];
  const int rank = tid_x() + ntid_x() * (tid_y() + ntid_y() * tid_z());
  return fused_shared + (rank * kRingDepth + slot) * kRingSlotBytes;
}

// 16 bytes from global to shared memory without passing through registers (cp.async, compute
// capability 8.0+; a plain copy before it).
__device__ __forceinline__ void copy16_async(unsigned char* dst, const void* src) {
#if __CUDA_ARCH__ >= 800
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(address), "l"(src) : "memory");
#else
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#endif
}

__device__ __forceinline__ void commit_copies() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Wait until at most kRingDepth - 1 groups of this thread's copies are in flight: the oldest slot
// has landed.
__device__ __forceinline__ void wait_oldest_copy() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(kRingDepth - 1) : "memory");
#endif
}

// One head chunk (16-byte accesses) into a ring slot, and back out of it.
template <typename T, int P, bool INTERLEAVED, typename Index>
__device__ __forceinline__ void chunk_to_slot(unsigned char* slot, const T* in, Index pair0,
                                              Index half) {
  if constexpr (INTERLEAVED) {
    copy16_async(slot, in + 2 * pair0);
  } else {
    copy16_async(slot, in + pair0);
    copy16_async(slot + 16, in + half + pair0);
  }
}

template <typename T, int P, bool INTERLEAVED>
__device__ __forceinline__ void chunk_from_slot(HeadChunk<T, P, true, INTERLEAVED>& chunk,
                                                const unsigned char* slot) {
  static_assert(sizeof(chunk.first) == 16 && (INTERLEAVED || sizeof(chunk.second) == 16),
                "a ring slot holds one chunk of 16-byte accesses");
  *reinterpret_cast<uint4*>(chunk.first) = *reinterpret_cast<const uint4*>(slot);
  if constexpr (!INTERLEAVED) {
    *reinterpret_cast<uint4*>(chunk.second) = *reinterpret_cast<const uint4*>(slot + 16);
  }
}

// The rotated values of one chunk of pairs (already loaded): y1 at the first dims of the pairs,
// y2 at the second.
template <typename T, int P, bool VECTOR, bool INTERLEAVED, typename Index>
__device__ __forceinline__ void rotated_chunk(const HeadChunk<T, P, VECTOR, INTERLEAVED>& chunk,
                                              Index pair0, Index half, const float (&cos_v)[P],
                                              const float (&sin_v)[P], float sin_sign,
                                              const HeadNorm& norm, float (&y1)[P],
                                              float (&y2)[P]) {
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const Index d1 = INTERLEAVED ? 2 * (pair0 + i) : pair0 + i;
    const Index d2 = INTERLEAVED ? d1 + 1 : half + pair0 + i;
    const float x1 = to_float(INTERLEAVED ? chunk.first[2 * i] : chunk.first[i]) * norm.at(d1);
    const float x2 = to_float(INTERLEAVED ? chunk.first[2 * i + 1] : chunk.second[i]) *
                     norm.at(d2);
    rotate_pair(x1, x2, cos_v[i], sin_v[i], sin_sign, y1[i], y2[i]);
  }
}

// Store a rotated chunk to the head's output row (`to_out`) and k cache row (`to_cache`, when the
// head has one).
template <typename T, int P, bool VECTOR, bool INTERLEAVED, typename Index>
__device__ __forceinline__ void store_rotated(const FusionParams& f, const float (&y1)[P],
                                              const float (&y2)[P], Index pair0, Index half,
                                              const HeadTargets<Index>& t,
                                              float k_cache_inv_scale, bool to_out,
                                              bool to_cache) {
  if constexpr (INTERLEAVED) {
    float y[2 * P];
#pragma unroll
    for (int i = 0; i < P; ++i) {
      y[2 * i] = y1[i];
      y[2 * i + 1] = y2[i];
    }
    if (to_out) {
      store_values<T, VECTOR>(t.out, t.out_offset + 2 * pair0, y, f.out_format, t.out_inv_scale);
    }
    if (to_cache && t.cache_offset >= 0) {
      store_values<T, VECTOR>(f.k_cache, t.cache_offset + 2 * pair0, y, f.cache_format,
                              k_cache_inv_scale);
    }
  } else {
    if (to_out) {
      store_values<T, VECTOR>(t.out, t.out_offset + pair0, y1, f.out_format, t.out_inv_scale);
      store_values<T, VECTOR>(t.out, t.out_offset + half + pair0, y2, f.out_format,
                              t.out_inv_scale);
    }
    if (to_cache && t.cache_offset >= 0) {
      store_values<T, VECTOR>(f.k_cache, t.cache_offset + pair0, y1, f.cache_format,
                              k_cache_inv_scale);
      store_values<T, VECTOR>(f.k_cache, t.cache_offset + half + pair0, y2, f.cache_format,
                              k_cache_inv_scale);
    }
  }
}

// Rotate one chunk of pairs (already loaded) and store it to the head's targets.
template <typename T, int P, bool VECTOR, bool INTERLEAVED, typename Index>
__device__ __forceinline__ void rotate_chunk_to(const FusionParams& f,
                                                const HeadChunk<T, P, VECTOR, INTERLEAVED>& chunk,
                                                Index pair0, Index half, const float (&cos_v)[P],
                                                const float (&sin_v)[P], float sin_sign,
                                                const HeadNorm& norm, const HeadTargets<Index>& t,
                                                float k_cache_inv_scale) {
  float y1[P], y2[P];
  rotated_chunk(chunk, pair0, half, cos_v, sin_v, sin_sign, norm, y1, y2);
  store_rotated<T, P, VECTOR, INTERLEAVED>(f, y1, y2, pair0, half, t, k_cache_inv_scale, true,
                                           true);
}

// A token's cache slot split once into its block and its row in the block (vLLM's slot_mapping):
// the row of head h is then `base + h * head_stride` for either cache. 64-bit always: a KV cache
// is often past 2^31 elements while q and k are far from it.
struct SlotRows {
  long long k_base, v_base;  // < 0: no cache write for this token
};

// `narrow`: a 32-bit division where the slots fit (a single thread works out every token's
// rows in the staged kernel; a 64-bit division is a call of ~70 instructions).
template <typename F>  // FusionParams, or FusedDecodeParams (fused_decode.cuh)
__device__ __forceinline__ SlotRows rows_of_slot(const F& f, long long slot, bool narrow = false) {
  // Negative (padding) or past the cache: skipped (documented; validate=True raises instead).
  if (slot < 0 || slot >= f.num_slots) return {-1, -1};
  long long block, row;
  if (narrow && f.num_slots <= 0x7fffffffLL) {
    const int slot32 = static_cast<int>(slot), size = static_cast<int>(f.block_size);
    block = slot32 / size;
    row = slot32 - static_cast<int>(block) * size;
  } else {
    block = slot / f.block_size;
    row = slot - block * f.block_size;
  }
  return {block * f.k_cache_block_stride + row * f.k_cache_slot_stride,
          block * f.v_cache_block_stride + row * f.v_cache_slot_stride};
}

template <typename F>
__device__ __forceinline__ SlotRows slot_rows(const F& f, long long token) {
  if (f.k_cache == nullptr) return {-1, -1};
  const long long at = token * f.slot_stride;
  const long long slot = f.slots_are_int64 ? static_cast<const long long*>(f.slot_mapping)[at]
                                           : static_cast<const int*>(f.slot_mapping)[at];
  return rows_of_slot(f, slot);
}

// The rows of a token's slot in the caches' scale arrays (per-row fp8 scales, NVFP4 block
// scales), as slot_rows: < 0 where the token writes no cache row or the caches have no scales.
// Read again where a row is finished rather than kept in registers through the token.
__device__ __forceinline__ SlotRows slot_scale_rows(const FusionParams& f, long long token) {
  if (f.k_cache == nullptr || f.k_cache_scales == nullptr) return {-1, -1};
  const long long at = token * f.slot_stride;
  const long long slot = f.slots_are_int64 ? static_cast<const long long*>(f.slot_mapping)[at]
                                           : static_cast<const int*>(f.slot_mapping)[at];
  if (slot < 0 || slot >= f.num_slots) return {-1, -1};
  const long long block = slot / f.block_size, row = slot - block * f.block_size;
  return {block * f.k_cache_scales_block_stride + row * f.k_cache_scales_slot_stride,
          block * f.v_cache_scales_block_stride + row * f.v_cache_scales_slot_stride};
}

// The per-head state of one token shared by every head a thread visits.
template <typename Index>
struct TokenState {
  TokenOffsets<Index> o;
  SlotRows slot;
};

// ------------------------------------------------------------------------------------------------
// Stores quantised per row (quantize.cuh): the head's values are gathered in a row buffer in
// shared memory (each lane writes the dims it computes), then the lanes of the head find the
// row's amax (fp8 per row) or each block's (NVFP4) and store. The other targets of the head are
// stored directly, as without.

// One row store: fp8 `format` with a scale of its own (written to `scales`, a float), or NVFP4
// (`scales`: the row's first e4m3 block scale byte; `global`: the tensor's scale).
struct RowStore {
  void* base;          // null: this target is not quantised per row
  long long offset;    // the row's first element (fp8) or byte (NVFP4) in `base`
  long long format;
  void* scales;
  float global, inv_global;
};

struct RowStores {
  RowStore out, cache;
  __device__ __forceinline__ bool any() const { return out.base != nullptr || cache.base != nullptr; }
};

// The tensor's scale itself (NVFP4's global scale), from the device or the value.
__device__ __forceinline__ float scale_of(const float* device_scale, double value) {
  return device_scale != nullptr ? *device_scale : static_cast<float>(value);
}

// Which targets of a q or k head are quantised per row (bits kRowOut, kRowCache): its output,
// when the launch writes per-row output scales; its k cache row, when the cache has scales.
constexpr unsigned kRowOut = 1u, kRowCache = 2u;

template <typename Index>
__device__ __forceinline__ unsigned row_quantised_targets(const RopeParams& p,
                                                          const FusionParams& f,
                                                          const HeadTargets<Index>& t,
                                                          Index head) {
  const bool is_k = head >= static_cast<Index>(p.num_q_heads);
  return ((is_k ? f.k_out_scales : f.q_out_scales) != nullptr ? kRowOut : 0u) |
         (is_k && t.cache_offset >= 0 && f.k_cache_scales != nullptr ? kRowCache : 0u);
}

// The row stores of a q or k head (none unless the launch is row-scaled and this head's output or
// its k cache row is quantised per row).
template <typename Index>
__device__ __forceinline__ RowStores head_row_stores(const RopeParams& p, const FusionParams& f,
                                                     const TokenState<Index>& s,
                                                     const HeadTargets<Index>& t, Index token,
                                                     Index head, float k_inv_scale) {
  RowStores r{};
  const Index num_q_heads = static_cast<Index>(p.num_q_heads);
  const bool is_k = head >= num_q_heads;
  const long long h = is_k ? head - num_q_heads : head;
  float* const out_scales = is_k ? f.k_out_scales : f.q_out_scales;
  if (out_scales != nullptr) {
    r.out.base = t.out;
    r.out.offset = t.out_offset;
    r.out.format = f.out_format;
    r.out.scales = out_scales +
                   static_cast<long long>(token) * (is_k ? f.k_out_scales_token_stride
                                                         : f.q_out_scales_token_stride) +
                   h * (is_k ? f.k_out_scales_head_stride : f.q_out_scales_head_stride);
  }
  if (is_k && t.cache_offset >= 0 && f.k_cache_scales != nullptr) {
    const long long at =
        slot_scale_rows(f, static_cast<long long>(token)).k_base + h * f.k_cache_scales_head_stride;
    r.cache.base = f.k_cache;
    r.cache.offset = t.cache_offset;
    r.cache.format = f.cache_format;
    r.cache.scales = f.cache_format == kStoreNVFP4
                         ? static_cast<void*>(static_cast<unsigned char*>(f.k_cache_scales) + at)
                         : static_cast<void*>(static_cast<float*>(f.k_cache_scales) + at);
    r.cache.global = scale_of(f.k_scale, f.k_scale_value);
    r.cache.inv_global = k_inv_scale;
  }
  return r;
}

// This thread's head lane group's row buffer: head_dim floats, after the ring and the norm
// weights (norm_shared_floats) in the block's shared memory (the host sized it:
// launch.fused_shared_bytes).
template <bool ALL_HEADS>
__device__ __forceinline__ float* row_buffer(const RopeParams& p, const FusionParams& f,
                                            long long head_dim) {
  extern __shared__ __align__(16) unsigned char fused_shared[];
  const long long threads = static_cast<long long>(ntid_x()) * ntid_y() * ntid_z();
  const long long ring_bytes = f.ring ? threads * kRingDepth * kRingSlotBytes : 0;
  const long long weight_bytes =
      norm_shared_floats<ALL_HEADS>(p, f) * static_cast<long long>(sizeof(float));
  const long long group = tid_y() + static_cast<long long>(ntid_y()) * tid_z();
  return reinterpret_cast<float*>(fused_shared + ring_bytes + weight_bytes) + group * head_dim;
}

// One target of a gathered row, by the lanes of the head: fp8 with the row's scale from `amax`,
// or NVFP4 block by block.
template <typename T, bool VECTOR, int A>
__device__ __forceinline__ void store_row(const float* row, long long head_dim, const RowStore& s,
                                          float amax) {
  if (s.base == nullptr) return;
  const long long lane = tid_x(), lanes = ntid_x();
  if (s.format == kStoreNVFP4) {
    unsigned char* const bytes = static_cast<unsigned char*>(s.base) + s.offset;
    unsigned char* const block_scales = static_cast<unsigned char*>(s.scales);
    for (long long b = lane; b < head_dim / kNvfp4BlockValues; b += lanes) {
      float x[kNvfp4BlockValues];
#pragma unroll
      for (int i = 0; i < kNvfp4BlockValues; ++i) x[i] = row[b * kNvfp4BlockValues + i];
      unsigned words[2];
      block_scales[b] = static_cast<unsigned char>(nvfp4_block(x, s.global, s.inv_global, words));
      unsigned char* const at = bytes + b * (kNvfp4BlockValues / 2);
      if ((reinterpret_cast<unsigned long long>(at) & 7u) == 0) {
        uint2 both;
        both.x = words[0];
        both.y = words[1];
        *reinterpret_cast<uint2*>(at) = both;
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) at[i] = static_cast<unsigned char>(words[i / 4] >> (8 * (i % 4)));
      }
    }
    return;
  }
  const float scale = row_scale_of(amax, s.format);
  if (lane == 0) *static_cast<float*>(s.scales) = scale;
  const float inv_scale = 1.0f / scale;
  for (long long c = lane; c < head_dim / A; c += lanes) {
    float v[A];
#pragma unroll
    for (int i = 0; i < A; ++i) v[i] = row[c * A + i];
    store_values<T, VECTOR>(s.base, s.offset + c * A, v, s.format, inv_scale);
  }
}

// Store a gathered row to its row-quantised targets. Every lane of the head calls this (it
// synchronises them and shuffles); the row buffer is free again when it returns.
template <typename T, bool VECTOR, int A>
__device__ __forceinline__ void finish_row(const float* row, long long head_dim,
                                           const RowStores& r) {
  const unsigned mask = head_lanes_mask();
  __syncwarp(mask);  // every lane's values are in the row
  float amax = 0.0f;
  if ((r.out.base != nullptr && r.out.format != kStoreNVFP4) ||
      (r.cache.base != nullptr && r.cache.format != kStoreNVFP4)) {
    for (long long d = tid_x(); d < head_dim; d += ntid_x()) {
      amax = max_keeping_nan(amax, fabsf(row[d]));
    }
    amax = lanes_max(amax);
  }
  store_row<T, VECTOR, A>(row, head_dim, r.out, amax);
  store_row<T, VECTOR, A>(row, head_dim, r.cache, amax);
  __syncwarp(mask);  // every lane has read the row before the next head overwrites it
}

// v head `vh` of the token into a row-quantised v cache (per-row fp8 or NVFP4): gathered, then
// stored as the k rows are; nothing for a token without a slot.
template <typename T, bool VECTOR, int A, typename Index>
__device__ __forceinline__ void store_v_row(const FusionParams& f, Index token, Index vh,
                                            const TokenState<Index>& s, Index head_dim,
                                            float* row, float v_inv_scale) {
  if (s.slot.v_base < 0) return;
  const T* v_row = static_cast<const T*>(f.v) + token * static_cast<Index>(f.v_token_stride) +
                   vh * static_cast<Index>(f.v_head_stride);
  for (Index c = tid_x(); c < head_dim / A; c += ntid_x()) {
    T raw[A];
    load_elements<VECTOR>(raw, v_row + c * A);
#pragma unroll
    for (int i = 0; i < A; ++i) row[c * A + i] = to_float(raw[i]);
  }
  const long long at = slot_scale_rows(f, static_cast<long long>(token)).v_base +
                       static_cast<long long>(vh) * f.v_cache_scales_head_stride;
  RowStores r{};
  r.cache.base = f.v_cache;
  r.cache.offset = s.slot.v_base + static_cast<long long>(vh) * f.v_cache_head_stride;
  r.cache.format = f.cache_format;
  r.cache.scales = f.cache_format == kStoreNVFP4
                       ? static_cast<void*>(static_cast<unsigned char*>(f.v_cache_scales) + at)
                       : static_cast<void*>(static_cast<float*>(f.v_cache_scales) + at);
  r.cache.global = scale_of(f.v_scale, f.v_scale_value);
  r.cache.inv_global = v_inv_scale;
  finish_row<T, VECTOR, A>(row, head_dim, r);
}

// Where head `head` (a q or k head) of the token goes: its output row and its k cache row.
template <typename T, typename Index>
__device__ __forceinline__ HeadTargets<Index> head_targets(const RopeParams& p,
                                                           const FusionParams& f,
                                                           const TokenState<Index>& s, Index head,
                                                           float q_inv_scale, float k_inv_scale) {
  const Index num_q_heads = static_cast<Index>(p.num_q_heads);
  const bool is_k = head >= num_q_heads;
  const Index kh = head - num_q_heads;
  HeadTargets<Index> t;
  t.out = is_k ? p.k_out : p.q_out;
  t.out_offset = is_k ? s.o.k_out + kh * static_cast<Index>(p.k_out_head_stride)
                      : s.o.q_out + head * static_cast<Index>(p.q_out_head_stride);
  t.out_inv_scale = is_k ? k_inv_scale : q_inv_scale;
  t.cache_offset = is_k && s.slot.k_base >= 0
                       ? s.slot.k_base + static_cast<long long>(kh) * f.k_cache_head_stride
                       : -1LL;
  return t;
}

// Copy v head `vh` of the token into the v cache (fp8: value / v_scale; v's own dtype: its bits),
// lane by lane; nothing for a token without a slot (v_base < 0). v is read first either way
// (every token has its row), so that the load does not wait for the slot's.
template <typename T, bool VECTOR, int A, typename Index>
__device__ __forceinline__ void store_v_head(const FusionParams& f, Index token, Index vh,
                                             long long v_base, Index head_chunks, float v_inv_scale) {
  const T* v_row = static_cast<const T*>(f.v) + token * static_cast<Index>(f.v_token_stride) +
                   vh * static_cast<Index>(f.v_head_stride);
  const long long row = v_base + static_cast<long long>(vh) * f.v_cache_head_stride;
  for (Index c = tid_x(); c < head_chunks; c += ntid_x()) {
    T raw[A];
    float v[A];
    load_elements<VECTOR>(raw, v_row + c * A);
    if (v_base < 0) continue;
    if (f.cache_format == kStoreInput) {  // v's own dtype: the bits as read
      store_elements<VECTOR>(static_cast<T*>(f.v_cache) + row + static_cast<long long>(c) * A, raw);
      continue;
    }
#pragma unroll
    for (int i = 0; i < A; ++i) v[i] = to_float(raw[i]);
    store_values<T, VECTOR>(f.v_cache, row + static_cast<long long>(c) * A, v, f.cache_format,
                            v_inv_scale);
  }
}

// Per-launch constants of the fused ops: the fp8 stores' reciprocal scales and the norm's.
struct FusedConstants {
  float q_inv_scale, k_inv_scale, v_inv_scale, inv_dim, eps;
};

__device__ __forceinline__ FusedConstants fused_constants(const FusionParams& f,
                                                          long long head_dim) {
  return {inverse_scale_of(f.q_scale, f.q_scale_value), inverse_scale_of(f.k_scale, f.k_scale_value),
          inverse_scale_of(f.v_scale, f.v_scale_value), 1.0f / static_cast<float>(head_dim),
          static_cast<float>(f.eps)};
}

// The position of a thread's first token, loaded before the block fills the norm weights so that
// the two loads overlap across the barrier (a decode step has one token: this is its latency).
template <int SOURCE, typename Index>
__device__ __forceinline__ long long first_token_position(const RopeParams& p, Index first_token,
                                                          Index num_tokens) {
  if constexpr (SOURCE == kTokenTables) return 0;
  if (first_token >= num_tokens) return 0;
  return load_position(p, token_offsets(p, first_token).positions);
}

// The first v head a thread visits: after its q and k heads, on the same stride.
template <typename Index>
__device__ __forceinline__ Index first_v_head_of(Index first_head, Index head_step,
                                                 Index num_rotated) {
  return first_head >= num_rotated
             ? first_head
             : first_head + (num_rotated - first_head + head_step - 1) / head_step * head_step;
}

// ------------------------------------------------------------------------------------------------
// RMSNorm over all heads of a token (ALL_HEADS: OLMo 2 normalises the whole q and k
// projections): the block holds one token and every head of it, so the sums of squares of q's
// heads and of k's are block reductions, before any head is rotated. The heads are then read
// again for the rotation (from L1: the block has just read them).

// This thread's share of the sums of squares of the token's q heads and k heads: its chunks of
// the heads it visits, and its share of the dims past rotary_dim.
template <typename T, int P, bool VECTOR, bool INTERLEAVED, int A, typename Index>
__device__ __forceinline__ float2 token_shares(const RopeParams& p, const TokenOffsets<Index>& o,
                                               Index first_head, Index head_step,
                                               Index num_rotated, Index num_chunks, Index half,
                                               Index rotary_dim, Index pass_chunks) {
  const Index num_q_heads = static_cast<Index>(p.num_q_heads);
  float q_sum = 0.0f, k_sum = 0.0f;
  for (Index head = first_head; head < num_rotated; head += head_step) {
    const HeadRows<T> rows = head_rows<T, Index>(p, o, head);
    float sum = 0.0f;
    for (Index lane = tid_x(); lane < num_chunks; lane += ntid_x()) {
      HeadChunk<T, P, VECTOR, INTERLEAVED> chunk;
      chunk.load(rows.in, lane * P, half);
      sum += sum_of_squares(chunk);
    }
    for (Index c = tid_x(); c < pass_chunks; c += ntid_x()) {
      T raw[A];
      load_elements<VECTOR>(raw, rows.in + rotary_dim + c * A);
#pragma unroll
      for (int i = 0; i < A; ++i) sum = fmaf(to_float(raw[i]), to_float(raw[i]), sum);
    }
    if (head < num_q_heads) {
      q_sum += sum;
    } else {
      k_sum += sum;
    }
  }
  return make_float2(q_sum, k_sum);
}

// Ask L2 for the chunks this thread will read of another token (the next one its block takes)
// while it rotates this one: the block's next sums then wait on L2, not on DRAM.
template <typename T, int P, bool INTERLEAVED, int A, typename Index>
__device__ __forceinline__ void prefetch_token(const RopeParams& p, const TokenOffsets<Index>& o,
                                               Index first_head, Index head_step,
                                               Index num_rotated, Index num_chunks, Index half,
                                               Index rotary_dim, Index pass_chunks) {
  for (Index head = first_head; head < num_rotated; head += head_step) {
    const T* in = head_rows<T, Index>(p, o, head).in;
    for (Index lane = tid_x(); lane < num_chunks; lane += ntid_x()) {
      const Index pair0 = lane * P;
      prefetch_l2(in + (INTERLEAVED ? 2 * pair0 : pair0));
      if constexpr (!INTERLEAVED) prefetch_l2(in + half + pair0);
    }
    for (Index c = tid_x(); c < pass_chunks; c += ntid_x()) prefetch_l2(in + rotary_dim + c * A);
  }
}

// The block's sums of the threads' (q, k) shares: each warp's by shuffles, then every thread adds
// the warps' partial sums (kept in `scratch`) in one order, so every thread gets the same sums.
// Every thread of the block calls this (whole warps, one token a block: the host's geometry).
__device__ __forceinline__ float2 block_sums(float2 share, float* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) {
    share.x += __shfl_xor_sync(0xffffffffu, share.x, offset);
    share.y += __shfl_xor_sync(0xffffffffu, share.y, offset);
  }
  const unsigned rank = tid_x() + ntid_x() * (tid_y() + ntid_y() * tid_z());
  const unsigned warps = (ntid_x() * ntid_y() * ntid_z()) / 32u;
  if ((rank & 31u) == 0u) {
    scratch[2 * (rank / 32u)] = share.x;
    scratch[2 * (rank / 32u) + 1] = share.y;
  }
  __syncthreads();
  float2 sums = make_float2(0.0f, 0.0f);
  for (unsigned w = 0; w < warps; ++w) {
    sums.x += scratch[2 * w];
    sums.y += scratch[2 * w + 1];
  }
  __syncthreads();  // every thread has read the scratch before the next token's sums
  return sums;
}

// The fused kernel's body: every token this thread's block strides over; per token, its cache
// slot and cos/sin of the lane's first chunk once, then each head this thread visits: RMSNorm
// (sum of squares over the lanes), rotation of its chunks, the dims past rotary_dim, and the
// cache rows; v heads are copied to the v cache.
//
// With RMSNorm or a cache write at large T (the host sets f.ring: 16-byte accesses, every lane
// has at most one chunk of pairs, no dims past rotary_dim), a pipelined loop: each thread keeps
// the chunks of up to kRingDepth heads in flight, copied to shared memory with cp.async (no
// registers held), and reduces, rotates and stores one while the next land. The fused kernel runs
// at 2 resident blocks (its registers) and a norm makes every head wait for its load and a
// shuffle reduction; without the ring that wait was exposed (H100, T = 65536: rms_norm_rope 62% ->
// 70% of an SM copy; launch.py has the other numbers). Few tokens and fp8 outputs alone run
// faster without it.
//
// ROWS (rope_fused_rows_kernel): the launch may quantise stores per row (f.row_scaled: per-(token,
// head) fp8 scales, NVFP4 caches), gathering those rows in shared memory; compiled apart so that
// the other fused launches keep their registers.
//
// ALL_HEADS (rope_fused_all_heads_kernel): with the norm, over all heads of a token together
// (q's, and k's apart): one token a block and every head in it (the host's geometry), the
// token's sums reduced over the block before any head is rotated; compiled apart too.
template <typename T, typename TableT, bool VECTOR, bool INTERLEAVED, int SOURCE, bool WIDE_INDEX,
          bool ROWS = false, bool ALL_HEADS = false>
__device__ __forceinline__ void rope_fused_tokens(const RopeParams& p, const FusionParams& f) {
  using Index = typename IndexOf<WIDE_INDEX>::type;
  using L = Layout<T, VECTOR, INTERLEAVED>;
  using Chunk = HeadChunk<T, L::pairs, VECTOR, INTERLEAVED>;
  constexpr int P = L::pairs;
  constexpr int A = L::access;

  const TableT* __restrict__ cos_table = static_cast<const TableT*>(p.cos);
  const TableT* __restrict__ sin_table = static_cast<const TableT*>(p.sin);
  const Index cos_col_stride = static_cast<Index>(p.cos_col_stride);
  const Index sin_col_stride = static_cast<Index>(p.sin_col_stride);
  const bool table_vector_ok = p.table_vector_ok != 0;
  const float sin_sign = static_cast<float>(p.sin_sign);
  // Table-read angles take the sign per head (see HeadChunk::rotate_store); computed ones have it.
  const float head_sign = SOURCE == kComputedAngles ? 1.0f : sin_sign;

  const Index head_dim = static_cast<Index>(p.head_dim);
  const Index rotary_dim = static_cast<Index>(p.rotary_dim), half = rotary_dim / 2;
  const Index num_chunks = half / P, head_chunks = head_dim / A;
  const bool many_chunks = num_chunks > static_cast<Index>(ntid_x());
  const bool pass_through = f.norm || f.write_pass_through || f.k_cache != nullptr;
  const Index pass_chunks = pass_through ? (head_dim - rotary_dim) / A : 0;
  const bool pipelined = !ROWS && f.ring && !many_chunks && pass_chunks == 0;
  const Index num_q_heads = static_cast<Index>(p.num_q_heads);
  const Index num_rotated = num_q_heads + static_cast<Index>(p.num_k_heads);
  const Index num_heads = num_rotated + (f.k_cache != nullptr ? static_cast<Index>(f.num_v_heads) : 0);
  const Index num_tokens = static_cast<Index>(p.num_tokens);
  const Index first_head = static_cast<Index>(blockIdx.y) * ntid_y() + tid_y();
  const Index head_step = static_cast<Index>(gridDim.y) * ntid_y();
  const Index token_step = static_cast<Index>(gridDim.x) * ntid_z();
  const Index lane0 = tid_x();
  // The first v head this thread visits (after its q and k heads).
  const Index first_v_head = first_v_head_of(first_head, head_step, num_rotated);

  const FusedConstants k = fused_constants(f, head_dim);
  const float q_inv_scale = k.q_inv_scale, k_inv_scale = k.k_inv_scale;
  const float v_inv_scale = k.v_inv_scale, inv_dim = k.inv_dim, eps = k.eps;
  const Index first_token = static_cast<Index>(blockIdx.x) * ntid_z() + tid_z();
  const long long first_position =
      first_token_position<SOURCE>(p, first_token, num_tokens);
  // RMSNorm over all heads of a token: q's whole projection, then k's.
  const bool all_heads = ALL_HEADS && f.norm;
  const Index q_count = all_heads ? num_q_heads * head_dim : head_dim;
  const Index k_count = all_heads ? static_cast<Index>(p.num_k_heads) * head_dim : head_dim;
  float* const norm_weights =
      f.norm ? fill_norm_weights<ALL_HEADS>(f, q_count, k_count) : nullptr;
  float* const row = ROWS && f.row_scaled ? row_buffer<ALL_HEADS>(p, f, head_dim) : nullptr;
  float q_rms = 1.0f, k_rms = 1.0f;  // all heads: the token's q and k norms

  for (Index token = first_token; token < num_tokens; token += token_step) {
    TokenState<Index> s;
    s.o = token_offsets(p, token);
    s.slot = slot_rows(f, static_cast<long long>(token));
    long long position = first_position;
    if constexpr (SOURCE != kTokenTables) {
      if (token != first_token) position = load_position(p, s.o.positions);
    }

    // The norm of a head from its sum of squares over the lanes (every lane of the head calls
    // this: it shuffles), or (all heads) from the token's.
    auto head_norm = [&](float sum, Index head) {
      HeadNorm norm{nullptr, 1.0f};
      if (all_heads) {
        const bool is_k = head >= num_q_heads;
        norm.weights = norm_weights + head * head_dim;  // q's heads, then k's
        norm.rms_scale = is_k ? k_rms : q_rms;
      } else if (f.norm) {
        sum = lanes_sum(sum);
        norm.weights = norm_weights + (head >= num_q_heads ? head_dim : 0);
        norm.rms_scale = 1.0f / sqrtf(fmaf(sum, inv_dim, eps));
      }
      return norm;
    };

    float cos_v[P], sin_v[P];
    if constexpr (VECTOR) {
      if (pipelined) {
        const bool active = lane0 < num_chunks;
        const Index pair0 = lane0 * P;
        if (active) {
          chunk_angles<SOURCE, false>(p, s.o, position, pair0, cos_table, sin_table,
                                      cos_col_stride, sin_col_stride, table_vector_ok, sin_sign,
                                      cos_v, sin_v);
        }
        // Up to kRingDepth heads' chunks in flight, in shared memory (no registers held): the
        // ring is filled ahead and each slot refilled once its head is done. One copy group per
        // head, committed even when empty, so that wait_oldest_copy always means "this head".
        Index ahead = first_head;
        for (int r = 0; r < kRingDepth; ++r) {
          if (active && ahead < num_rotated) {
            chunk_to_slot<T, P, INTERLEAVED>(ring_slot(r), head_rows<T, Index>(p, s.o, ahead).in,
                                             pair0, half);
          }
          commit_copies();
          ahead += head_step;
        }
        int r = 0;
        for (Index head = first_head; head < num_rotated; head += head_step) {
          wait_oldest_copy();
          Chunk chunk;
          if (active) chunk_from_slot(chunk, ring_slot(r));
          const HeadNorm norm = head_norm(active ? sum_of_squares(chunk) : 0.0f, head);
          if (active) {
            rotate_chunk_to(f, chunk, pair0, half, cos_v, sin_v, head_sign, norm,
                            head_targets<T>(p, f, s, head, q_inv_scale, k_inv_scale), k_inv_scale);
            // After the rotation has consumed the slot's values: the refill cannot overtake them.
            if (ahead < num_rotated) {
              chunk_to_slot<T, P, INTERLEAVED>(ring_slot(r),
                                               head_rows<T, Index>(p, s.o, ahead).in, pair0, half);
            }
          }
          commit_copies();
          ahead += head_step;
          r = r + 1 == kRingDepth ? 0 : r + 1;
        }
      }
    }
    if (!VECTOR || !pipelined) {
      // cos/sin of the lane's chunk: once per token for every head, loaded before the first head
      // so that the two loads overlap (the norm would otherwise put its reduction between
      // them); per chunk and head when a lane has several chunks (scalar accesses of a wide
      // head).
      bool have_angles = false;
      if (!many_chunks && lane0 < num_chunks && first_head < num_rotated) {
        have_angles = true;
        chunk_angles<SOURCE, false>(p, s.o, position, lane0 * P, cos_table, sin_table,
                                    cos_col_stride, sin_col_stride, table_vector_ok, sin_sign,
                                    cos_v, sin_v);
      }
      if (all_heads) {  // the token's sums over the block, the angles' loads in flight meanwhile
        const float2 sums = block_sums(
            token_shares<T, P, VECTOR, INTERLEAVED, A>(p, s.o, first_head, head_step,
                                                       num_rotated, num_chunks, half, rotary_dim,
                                                       pass_chunks),
            norm_weights + q_count + k_count);
        q_rms = 1.0f / sqrtf(fmaf(sums.x, 1.0f / static_cast<float>(q_count), eps));
        k_rms = 1.0f / sqrtf(fmaf(sums.y, 1.0f / static_cast<float>(k_count), eps));
        if (token + token_step < num_tokens) {
          prefetch_token<T, P, INTERLEAVED, A>(p, token_offsets(p, token + token_step),
                                               first_head, head_step, num_rotated, num_chunks,
                                               half, rotary_dim, pass_chunks);
        }
      }
      for (Index head = first_head; head < num_rotated; head += head_step) {
        const HeadRows<T> rows = head_rows<T, Index>(p, s.o, head);
        const HeadTargets<Index> t = head_targets<T>(p, f, s, head, q_inv_scale, k_inv_scale);
        // Targets quantised per row wait for the whole row (gathered in `row`); the others are
        // stored as the values come.
        const unsigned gathered =
            ROWS && f.row_scaled ? row_quantised_targets(p, f, t, head) : 0u;
        const bool gather = gathered != 0u;
        const bool out_now = (gathered & kRowOut) == 0u;
        const bool cache_now = (gathered & kRowCache) == 0u;
        float sum = 0.0f;
        if (f.norm && !all_heads) {
          // The sum of squares of the whole head: this lane's chunks and its share of the dims
          // past rotary_dim (read again below, from L1).
          for (Index lane = lane0; lane < num_chunks; lane += ntid_x()) {
            Chunk chunk;
            chunk.load(rows.in, lane * P, half);
            sum += sum_of_squares(chunk);
          }
          for (Index c = lane0; c < pass_chunks; c += ntid_x()) {
            T raw[A];
            load_elements<VECTOR>(raw, rows.in + rotary_dim + c * A);
#pragma unroll
            for (int i = 0; i < A; ++i) sum = fmaf(to_float(raw[i]), to_float(raw[i]), sum);
          }
        }
        const HeadNorm norm = head_norm(sum, head);
        for (Index lane = lane0; lane < num_chunks; lane += ntid_x()) {
          if (many_chunks || !have_angles) {
            have_angles = true;
            chunk_angles<SOURCE, false>(p, s.o, position, lane * P, cos_table, sin_table,
                                        cos_col_stride, sin_col_stride, table_vector_ok, sin_sign,
                                        cos_v, sin_v);
          }
          Chunk chunk;
          chunk.load(rows.in, lane * P, half);
          if (!gather) {
            rotate_chunk_to(f, chunk, lane * P, half, cos_v, sin_v, head_sign, norm, t,
                            k_inv_scale);
            continue;
          }
          float y1[P], y2[P];
          rotated_chunk(chunk, lane * P, half, cos_v, sin_v, head_sign, norm, y1, y2);
#pragma unroll
          for (int i = 0; i < P; ++i) {
            row[INTERLEAVED ? 2 * (lane * P + i) : lane * P + i] = y1[i];
            row[INTERLEAVED ? 2 * (lane * P + i) + 1 : half + lane * P + i] = y2[i];
          }
          store_rotated<T, P, VECTOR, INTERLEAVED>(f, y1, y2, lane * P, half, t, k_inv_scale,
                                                   out_now, cache_now);
        }
        for (Index c = lane0; c < pass_chunks; c += ntid_x()) {
          const Index col = rotary_dim + c * A;
          T raw[A];
          float v[A];
          load_elements<VECTOR>(raw, rows.in + col);
#pragma unroll
          for (int i = 0; i < A; ++i) v[i] = to_float(raw[i]) * norm.at(col + i);
          if (gather) {
#pragma unroll
            for (int i = 0; i < A; ++i) row[col + i] = v[i];
          }
          if (f.write_pass_through && out_now) {
            store_values<T, VECTOR>(t.out, t.out_offset + col, v, f.out_format, t.out_inv_scale);
          }
          if (t.cache_offset >= 0 && cache_now) {
            if (f.cache_format == kStoreInput && !f.norm) {
              // Unchanged values in their own dtype: the bits as read (NaN payloads included).
              store_elements<VECTOR>(static_cast<T*>(f.k_cache) + t.cache_offset + col, raw);
            } else {
              store_values<T, VECTOR>(f.k_cache, t.cache_offset + col, v, f.cache_format,
                                      k_inv_scale);
            }
          }
        }
        if (gather) {
          finish_row<T, VECTOR, A>(row, head_dim,
                                   head_row_stores(p, f, s, t, token, head, k_inv_scale));
        }
      }
    }
    // The v heads: to the v cache, unchanged but for the fp8 store.
    for (Index head = first_v_head; head < num_heads; head += head_step) {
      if (ROWS && f.v_cache_scales != nullptr) {
        store_v_row<T, VECTOR, A>(f, token, head - num_rotated, s, head_dim, row, v_inv_scale);
      } else {
        store_v_head<T, VECTOR, A>(f, token, head - num_rotated, s.slot.v_base, head_chunks,
                                   v_inv_scale);
      }
    }
  }
}

}  // namespace cupyrope
