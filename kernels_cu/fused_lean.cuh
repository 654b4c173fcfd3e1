// The lean fused kernel: the fused ops in their common layout, with the fusions a launch runs
// fixed at compile time (NORM: RMSNorm before the rotation; CACHE: the k and v cache write; fp8
// stores stay a run-time choice of format). The general fused kernel (fused.cuh) tests every
// fusion at run time and handles every layout, so its registers are those of its largest case
// (~120 a thread naturally, capped at 128: 2 resident blocks) and its code does not fit the
// instruction cache at T = 1. Here only what the launch needs is compiled, so a thread fits in
// 64 registers (4 resident blocks) and each head is one load, one reduction and one store.
//
// The common layout (launch.py: fused_lean_applies): 16-byte accesses, 32-bit offsets, one token
// dim, cos/sin rows that take vector loads, every dim rotated (rotary_dim == head_dim), at most 32
// lanes a head; a partial rotation (PARTIAL) in kernels of their own, with lanes for the dims
// past rotary_dim. M-RoPE in kernels of its own (MROPE): a lane's angles are found once a token,
// before the head loop, so reading each pair's position component there costs the heads nothing.
// Each lane owns one chunk of pairs of every head it visits, as in the rope kernels, so cos/sin
// are loaded once per token and the lane's norm weights once per head (from L1: no shared
// memory, no barrier).
//
// With a norm the kernel is bound by instruction issue on fast memory (H200), so a head's work is
// kept to what the arithmetic needs: chunks held as 32-bit words, the weights' dtype known at
// compile time (the q dtype, the common case), sin's sign applied once a token, rms as
// rsqrtf(mean + eps) and each element's multiplier rms * (weight_offset + w) as one fma,
// fma(w, rms, rms * weight_offset). Its float32 results differ from the general kernel's
// (1 / sqrtf, a sum of squares in one chain, offset added first) by a few float32 roundings.
#pragma once

#include "dependent_launch.cuh"
#include "fused.cuh"

namespace cupyrope {

// Heads ahead of the one being rotated whose chunks a thread prefetches into L2. With one chunk
// in registers at a time, a thread keeps few bytes in flight; the H200 needs about twice the
// H100's at the same latency. H200, bf16 32 q / 8 kv heads of 128, % of an SM copy at T = 16384 /
// 65536 (docs/perf_log.md), 0 / 1 / 2 / 3 heads ahead: rms_norm_rope 85.2 / 86.1, 91.5 / 93.3,
// 91.6 / 93.9, 91.1 / 93.9; rope_and_cache 89.4 / 90.3, 87.3 / 88.4, 92.3 / 94.0, 92.3 / 94.1;
// norm + cache 76.2 / 77.0, 82.0 / 83.1, 82.2 / 83.2, 82.1 / 83.2. H100, 0 / 2: rms_norm_rope
// 94.7 / 96.2, 96.8 / 98.6; rope_and_cache 95.1 / 96.3, 96.1 / 97.0; norm + cache 87.3 / 87.9,
// 93.8 / 95.6. The norm alone prefetches one head ahead: with two its bfloat16 NeoX kernel spills
// 8 bytes on sm_90. Blackwell builds, unmeasured, take none: their tighter register caps spill
// 4-8 bytes with it. Set at compile time to measure others.
#ifndef CUPYROPE_LEAN_PREFETCH_HEADS
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
#define CUPYROPE_LEAN_PREFETCH_HEADS 0
#else
#define CUPYROPE_LEAN_PREFETCH_HEADS 2
#endif
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
constexpr bool kLeanWaitFirst = true;  // see rope_fused_lean_tokens
#else
constexpr bool kLeanWaitFirst = false;
#endif

template <bool NORM, bool CACHE>
struct LeanPrefetchHeads {
  static constexpr int value =
      NORM && !CACHE && CUPYROPE_LEAN_PREFETCH_HEADS > 1 ? 1 : CUPYROPE_LEAN_PREFETCH_HEADS;
};

template <typename A, typename B> struct IsSame { static constexpr bool value = false; };
template <typename A> struct IsSame<A, A> { static constexpr bool value = true; };

// The norm weights' dtype as a template argument: the q dtype when the kernel was entered for
// weights of that dtype (no dtype switch per load, the conversion known at compile time), else
// RuntimeWeights (f.weight_dtype picks the conversion at each load).
struct RuntimeWeights {};

template <typename T> struct WeightDtypeOf { static constexpr long long value = -1; };
template <> struct WeightDtypeOf<float> { static constexpr long long value = kWeightFloat32; };
template <> struct WeightDtypeOf<half_t> { static constexpr long long value = kWeightFloat16; };
template <> struct WeightDtypeOf<bfloat16_t> { static constexpr long long value = kWeightBFloat16; };

// Elements of 16 bytes.
template <typename T>
struct Words {
  static constexpr int count = 16 / static_cast<int>(sizeof(T));
};

// The elements of 16 bytes held as four 32-bit words, as float32. Held as words, a chunk takes
// four registers per access (as an array of 16-bit elements the compiler gave each element one of
// its own). bfloat16: the low element shifted up, the high one masked in place (one instruction
// each; extracted element by element, the high one takes two).
template <typename T>
__device__ __forceinline__ void words_to_floats(const uint4& w, float (&out)[Words<T>::count]) {
  const unsigned word[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (IsSame<T, bfloat16_t>::value) {
      out[2 * j] = __uint_as_float(word[j] << 16);
      out[2 * j + 1] = __uint_as_float(word[j] & 0xffff0000u);
    } else if constexpr (IsSame<T, half_t>::value) {
      out[2 * j] = to_float(half_t{static_cast<unsigned short>(word[j] & 0xffffu)});
      out[2 * j + 1] = to_float(half_t{static_cast<unsigned short>(word[j] >> 16)});
    } else {
      out[j] = __uint_as_float(word[j]);
    }
  }
}

// One head's chunk of a lane, as words: one 16-byte access of side-by-side pairs (interleaved) or
// one from each half (NeoX).
template <typename T, bool INTERLEAVED>
struct LeanChunk {
  uint4 first, second;  // second: NeoX only

  __device__ __forceinline__ void load(const T* in, int pair0, int half) {
    if constexpr (INTERLEAVED) {
      first = *reinterpret_cast<const uint4*>(in + 2 * pair0);
    } else {
      first = *reinterpret_cast<const uint4*>(in + pair0);
      second = *reinterpret_cast<const uint4*>(in + half + pair0);
    }
  }

  // A hint to bring the chunk into L2 (no registers, no wait): the head it is for loads later.
  __device__ __forceinline__ void prefetch(const T* in, int pair0, int half) const {
    if constexpr (INTERLEAVED) {
      prefetch_l2(in + 2 * pair0);
    } else {
      prefetch_l2(in + pair0);
      prefetch_l2(in + half + pair0);
    }
  }

  // x1 / x2: the first / second element of each pair, as float32.
  template <int P>
  __device__ __forceinline__ void pairs(float (&x1)[P], float (&x2)[P]) const {
    if constexpr (INTERLEAVED) {
      float x[2 * P];
      words_to_floats<T>(first, x);
#pragma unroll
      for (int i = 0; i < P; ++i) {
        x1[i] = x[2 * i];
        x2[i] = x[2 * i + 1];
      }
    } else {
      words_to_floats<T>(first, x1);
      words_to_floats<T>(second, x2);
    }
  }

  template <int P>
  __device__ __forceinline__ float sum_of_squares() const;
};

// The sum of squares of a chunk's pairs, as two sums (first and second elements of the pairs)
// added at the end: two dependency chains of P fmas instead of one of 2 P.
template <int P>
__device__ __forceinline__ float pairs_sum_of_squares(const float (&x1)[P], const float (&x2)[P]) {
  float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    s1 = fmaf(x1[i], x1[i], s1);
    s2 = fmaf(x2[i], x2[i], s2);
  }
  return s1 + s2;
}

template <typename T, bool INTERLEAVED>
template <int P>
__device__ __forceinline__ float LeanChunk<T, INTERLEAVED>::sum_of_squares() const {
  float x1[P], x2[P];
  pairs(x1, x2);
  return pairs_sum_of_squares(x1, x2);
}

// w of dims [dim, dim + N) of one norm weight, straight from global memory in 16-byte loads (or
// one smaller): every head of a kind reads the same few bytes, so after the first head they come
// from L1. No shared copy, so no barrier before the first head (a decode step's latency). The host
// sends weights here only with unit stride and 16-byte alignment; dim is a multiple of N.
template <typename W, int N>
__device__ __forceinline__ void load_weights_as(const void* w, int dim, float (&out)[N]) {
  if constexpr (N == Words<W>::count) {
    words_to_floats<W>(*reinterpret_cast<const uint4*>(static_cast<const W*>(w) + dim), out);
  } else {
    W raw[N];
    load_elements<true>(raw, static_cast<const W*>(w) + dim);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(raw[i]);
  }
}

template <typename W, int N, typename F>
__device__ __forceinline__ void load_lane_weights(const F& f, const void* w, int dim,
                                                  float (&out)[N]) {
  if constexpr (!IsSame<W, RuntimeWeights>::value) {
    load_weights_as<W>(w, dim, out);
  } else if (static_cast<int>(f.weight_dtype) == kWeightBFloat16) {
    load_weights_as<bfloat16_t>(w, dim, out);
  } else if (static_cast<int>(f.weight_dtype) == kWeightFloat16) {
    load_weights_as<half_t>(w, dim, out);
  } else {
    load_weights_as<float>(w, dim, out);
  }
}

// Values of one head to its output row or k cache row: as the input dtype, or as fp8 with the
// reciprocal of q's or k's scale computed on that path only. (Computed once at the start, the
// reciprocals spilled; picked per head before the store, the compiler computed the reciprocal of
// the picked scale for every head, fp8 or not.) F: FusionParams, or the decode kernel's
// FusedDecodeParams (fused_decode.cuh), which names its fields alike.
template <typename T, int N, typename Index, typename F>
__device__ __forceinline__ void lean_store(const F& f, void* base, Index offset,
                                           const float (&v)[N], long long format, bool is_k) {
  if (format == kStoreInput) {
    store_values<T, true>(base, offset, v, kStoreInput, 1.0f);
  } else {
    const float inv_scale = is_k ? inverse_scale_of(f.k_scale, f.k_scale_value)
                                 : inverse_scale_of(f.q_scale, f.q_scale_value);
    store_values<T, true>(base, offset, v, format, inv_scale);
  }
}

// The norm weights of a lane's chunk as float32, loaded ahead of the head's reduction (the fused
// decode kernel: one head a thread, so nothing else hides their load): w1 / w2 those of the
// pairs' first / second elements.
template <int P>
struct LaneWeights {
  float w1[P], w2[P];
};

template <typename W, int P, bool INTERLEAVED, typename F>
__device__ __forceinline__ void load_chunk_weights(const F& f, const void* w, int pair0, int half,
                                                   LaneWeights<P>& out) {
  if constexpr (INTERLEAVED) {
    float all[2 * P];
    load_lane_weights<W>(f, w, 2 * pair0, all);
#pragma unroll
    for (int i = 0; i < P; ++i) {
      out.w1[i] = all[2 * i];
      out.w2[i] = all[2 * i + 1];
    }
  } else {
    load_lane_weights<W>(f, w, pair0, out.w1);
    load_lane_weights<W>(f, w, half + pair0, out.w2);
  }
}

// One head's chunk, its pairs as float32 (x1 / x2, changed here): normalised (NORM: x *
// (rms_scale * (weight_offset + w)), the product as one fma), rotated (sin carries the sign
// already) and stored to the output row and, for a k head with a cache slot, to its k cache row.
// `head_weights`: the head's norm weights, loaded here (a pointer: the lean kernel, whose
// registers do not hold them through the reduction) or already (LaneWeights<P>). `rotate` false:
// a lane of the dims past rotary_dim (x1 / x2 its two runs of P elements, see
// rope_fused_lean_tokens), not rotated. INPUT_STORES: the outputs take the input dtype whatever
// f.out_format says (the staged kernel, whose host admits no fp8 output: no fp8 code then). The
// staged kernel holds the pairs from the sum of squares to here; the lean kernels hold the
// chunk's words and convert them again (lean_rotate_store below): fewer registers.
template <typename T, int P, bool INTERLEAVED, bool NORM, bool CACHE, typename W, typename F,
          typename Weights, bool INPUT_STORES = false>
__device__ __forceinline__ void lean_rotate_store_pairs(const F& f, float (&x1)[P], float (&x2)[P],
                                                        int pair0, int half,
                                                        const Weights& head_weights,
                                                        float weight_offset, float rms_scale,
                                                        const float (&cos_v)[P],
                                                        const float (&sin_v)[P], bool is_k,
                                                        void* out, int out_offset,
                                                        long long cache_offset,
                                                        bool rotate = true) {
  constexpr int E = INTERLEAVED ? 2 * P : P;  // elements of one 16-byte access
  if constexpr (NORM && IsSame<Weights, LaneWeights<P>>::value) {
    const float scaled_offset = rms_scale * weight_offset;
#pragma unroll
    for (int i = 0; i < P; ++i) {
      x1[i] *= fmaf(head_weights.w1[i], rms_scale, scaled_offset);
      x2[i] *= fmaf(head_weights.w2[i], rms_scale, scaled_offset);
    }
  } else if constexpr (NORM) {
    const float scaled_offset = rms_scale * weight_offset;
    if constexpr (INTERLEAVED) {
      float w[E];
      load_lane_weights<W>(f, head_weights, 2 * pair0, w);
#pragma unroll
      for (int i = 0; i < P; ++i) {
        x1[i] *= fmaf(w[2 * i], rms_scale, scaled_offset);
        x2[i] *= fmaf(w[2 * i + 1], rms_scale, scaled_offset);
      }
    } else {
      float w[P];
      load_lane_weights<W>(f, head_weights, pair0, w);
#pragma unroll
      for (int i = 0; i < P; ++i) x1[i] *= fmaf(w[i], rms_scale, scaled_offset);
      load_lane_weights<W>(f, head_weights, half + pair0, w);
#pragma unroll
      for (int i = 0; i < P; ++i) x2[i] *= fmaf(w[i], rms_scale, scaled_offset);
    }
  }
  float y1[P], y2[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    rotate_pair(x1[i], x2[i], cos_v[i], sin_v[i], 1.0f, y1[i], y2[i]);
    // A lane of dims past rotary_dim: stored as they are (normalised), exactly: the rotation's
    // result is dropped (a rotation by cos 1, sin 0 would turn an infinity's partner into NaN).
    y1[i] = rotate ? y1[i] : x1[i];
    y2[i] = rotate ? y2[i] : x2[i];
  }
  if constexpr (INTERLEAVED) {
    float y[E];
#pragma unroll
    for (int i = 0; i < P; ++i) {
      y[2 * i] = y1[i];
      y[2 * i + 1] = y2[i];
    }
    lean_store<T>(f, out, out_offset + 2 * pair0, y,
                  INPUT_STORES ? static_cast<long long>(kStoreInput) : f.out_format, is_k);
    if constexpr (CACHE) {
      if (cache_offset >= 0) {
        lean_store<T>(f, f.k_cache, cache_offset + 2 * pair0, y, f.cache_format, true);
      }
    }
  } else {
    lean_store<T>(f, out, out_offset + pair0, y1,
                  INPUT_STORES ? static_cast<long long>(kStoreInput) : f.out_format, is_k);
    lean_store<T>(f, out, out_offset + half + pair0, y2,
                  INPUT_STORES ? static_cast<long long>(kStoreInput) : f.out_format, is_k);
    if constexpr (CACHE) {
      if (cache_offset >= 0) {
        lean_store<T>(f, f.k_cache, cache_offset + pair0, y1, f.cache_format, true);
        lean_store<T>(f, f.k_cache, cache_offset + half + pair0, y2, f.cache_format, true);
      }
    }
  }
}

// lean_rotate_store_pairs from a chunk's words.
template <typename T, int P, bool INTERLEAVED, bool NORM, bool CACHE, typename W, typename F,
          typename Weights>
__device__ __forceinline__ void lean_rotate_store(const F& f,
                                                  const LeanChunk<T, INTERLEAVED>& chunk,
                                                  int pair0, int half, const Weights& head_weights,
                                                  float weight_offset, float rms_scale,
                                                  const float (&cos_v)[P], const float (&sin_v)[P],
                                                  bool is_k, void* out, int out_offset,
                                                  long long cache_offset, bool rotate = true) {
  float x1[P], x2[P];
  chunk.pairs(x1, x2);
  lean_rotate_store_pairs<T, P, INTERLEAVED, NORM, CACHE, W>(
      f, x1, x2, pair0, half, head_weights, weight_offset, rms_scale, cos_v, sin_v, is_k, out,
      out_offset, cache_offset, rotate);
}

// v head `vh` of the token into the v cache, as store_v_head, with a lane's chunks loaded two at a
// time before either is stored (a bfloat16 head of 128 dims over 8 lanes: both of a lane's chunks
// in flight at once), copied as they are when the cache takes the input dtype.
template <typename T, typename F>
__device__ __forceinline__ void lean_store_v_head(const F& f, int token, int vh,
                                                  long long v_base, int head_chunks) {
  constexpr int A = Words<T>::count;
  const T* v_row = static_cast<const T*>(f.v) + token * static_cast<int>(f.v_token_stride) +
                   vh * static_cast<int>(f.v_head_stride);
  const long long row = v_base + static_cast<long long>(vh) * f.v_cache_head_stride;
  const int lanes = static_cast<int>(ntid_x());
  for (int c = static_cast<int>(tid_x()); c < head_chunks; c += 2 * lanes) {
    const int c2 = c + lanes;
    const bool second = c2 < head_chunks;
    const uint4 a = *reinterpret_cast<const uint4*>(v_row + c * A);
    uint4 b;
    if (second) b = *reinterpret_cast<const uint4*>(v_row + c2 * A);
    if (v_base < 0) continue;
    if (f.cache_format == kStoreInput) {
      T* const cache = static_cast<T*>(f.v_cache) + row;
      *reinterpret_cast<uint4*>(cache + c * A) = a;
      if (second) *reinterpret_cast<uint4*>(cache + c2 * A) = b;
    } else {
      const float inv_scale = inverse_scale_of(f.v_scale, f.v_scale_value);
      float v[A];
      words_to_floats<T>(a, v);
      store_values<T, true>(f.v_cache, row + static_cast<long long>(c) * A, v, f.cache_format,
                            inv_scale);
      if (second) {
        words_to_floats<T>(b, v);
        store_values<T, true>(f.v_cache, row + static_cast<long long>(c2) * A, v,
                              f.cache_format, inv_scale);
      }
    }
  }
}

// What a lean fused kernel reads of a token before its heads: the position (lanes with angles
// from a position), and the rows of its cache slot (CACHE).
struct LeanToken {
  long long position;
  SlotRows slot;
};

template <int SOURCE, bool CACHE>
__device__ __forceinline__ LeanToken lean_token(const RopeParams& p, const FusionParams& f,
                                                const TokenOffsets<int>& o, int token,
                                                bool with_angles) {
  LeanToken t{0, SlotRows{-1, -1}};
  if (with_angles) {
    if constexpr (SOURCE != kTokenTables) t.position = load_position(p, o.positions);
  }
  if constexpr (CACHE) t.slot = slot_rows(f, static_cast<long long>(token));
  return t;
}

template <typename T, typename TableT, bool INTERLEAVED, int SOURCE, bool NORM, bool CACHE,
          typename W, bool MROPE, bool PARTIAL>
__device__ __forceinline__ void rope_fused_lean_tokens(const RopeParams& p, const FusionParams& f) {
  using Index = int;  // lean kernels use 32-bit offsets (cache rows stay 64-bit)
  using L = Layout<T, true, INTERLEAVED>;
  using Chunk = LeanChunk<T, INTERLEAVED>;
  constexpr int P = L::pairs;
  constexpr int A = L::access;

  if (kLeanWaitFirst) wait_for_previous_grid();
  const TableT* __restrict__ cos_table = static_cast<const TableT*>(p.cos);
  const TableT* __restrict__ sin_table = static_cast<const TableT*>(p.sin);
  const float sin_sign = static_cast<float>(p.sin_sign);

  const Index head_dim = static_cast<Index>(p.head_dim);
  const Index half = static_cast<Index>(p.rotary_dim) / 2;
  const Index num_chunks = half / P, head_chunks = head_dim / A;
  const Index num_q_heads = static_cast<Index>(p.num_q_heads);
  const Index num_rotated = num_q_heads + static_cast<Index>(p.num_k_heads);
  const Index num_heads = num_rotated + (CACHE ? static_cast<Index>(f.num_v_heads) : 0);
  const Index num_tokens = static_cast<Index>(p.num_tokens);
  const Index first_head = static_cast<Index>(blockIdx.y) * ntid_y() + tid_y();
  const Index head_step = static_cast<Index>(gridDim.y) * ntid_y();
  const Index token_step = static_cast<Index>(gridDim.x) * ntid_z();
  // PARTIAL (rotary_dim < head_dim, kernels of their own): lanes past the rotated chunks hold
  // the dims past rotary_dim when the launch reads and writes them (p.copy_pass_through: out of
  // place, normalised, fp8 or copied into the k cache): loaded, normalised and stored as the
  // rotated chunks are, but not rotated. An interleaved lane's 2 P elements follow the last
  // rotated chunk's; NeoX lanes keep the rotated chunks' two runs of P, rotary_dim / 2 apart, so
  // their dims past rotary_dim come in blocks of rotary_dim (launch.fused_lean_applies: head_dim
  // a multiple of rotary_dim), lane l's runs at l P + (l / num_chunks) rotary_dim / 2 and half
  // further.
  const Index lane = static_cast<Index>(tid_x());
  const Index head_lanes = PARTIAL && p.copy_pass_through ? head_dim / (2 * P) : num_chunks;
  const Index pair0 = PARTIAL && !INTERLEAVED ? lane * P + (lane / num_chunks) * half : lane * P;
  // Lanes past the head's chunks (the norm rounds lanes up to a power of two) load and store
  // nothing but take part in the reduction.
  const bool active = lane < head_lanes;
  const bool rotating = PARTIAL ? lane < num_chunks : active;  // the lanes with angles

  // The norm's constants (the fp8 stores compute their scales' reciprocals where they store).
  const float inv_dim = 1.0f / static_cast<float>(head_dim), eps = static_cast<float>(f.eps);
  const float weight_offset = static_cast<float>(f.weight_offset);
  const Index first_token = static_cast<Index>(blockIdx.x) * ntid_z() + tid_z();
  // Everything up to here reads parameters only: with a programmatic dependent launch it overlaps
  // the previous kernel's tail (a decode step's latency), as in the decode kernel. Blackwell
  // builds wait first: held across the wait, these values spilled 4 bytes of the float16 NeoX
  // kernel with computed angles on sm_120.
  if (!kLeanWaitFirst) wait_for_previous_grid();
  for (Index token = first_token; token < num_tokens; token += token_step) {
    const TokenOffsets<Index> o = lean_token_offsets(p, token);
    const LeanToken t = lean_token<SOURCE, CACHE>(p, f, o, token, rotating);
    const long long position = t.position;
    const SlotRows slot = t.slot;
    // The first head's chunk is loaded before table-read cos/sin: its load overlaps the
    // position's (and the slot's), and the sign folded into sin below waits for the table, not
    // the chunk. With computed angles it comes after them (before, it held 8 registers through
    // their float64 arithmetic, which spilled).
    Index head = first_head;
    Chunk chunk;
    const bool load_first = active && head < num_rotated;
    if (SOURCE != kComputedAngles && load_first) {
      chunk.load(head_rows<T, Index>(p, o, head).in, pair0, half);
    }
    float cos_v[P], sin_v[P];
    if (rotating) {
      chunk_angles<SOURCE, true, P, MROPE>(p, o, position, pair0, cos_table, sin_table,
                                 static_cast<Index>(p.cos_col_stride),
                                 static_cast<Index>(p.sin_col_stride), true, sin_sign, cos_v,
                                 sin_v);
    }
    if (SOURCE == kComputedAngles && load_first) {
      chunk.load(head_rows<T, Index>(p, o, head).in, pair0, half);
    }
    // The chunks of the thread's next kLeanPrefetchHeads heads go on their way to L2 while this
    // one is reduced and stored: bytes in flight that cost no registers. With the norm and the
    // cache write they go before the v heads' copy, which then overlaps them (H100, T = 65536:
    // norm+rope+cache 94.3 -> 95.6 % of copy); without the norm that order costs rope_and_cache
    // 97.0 -> 95.5.
    constexpr bool prefetch_before_v = NORM && CACHE;
    constexpr int kLeanPrefetchHeads = LeanPrefetchHeads<NORM, CACHE>::value;
    if (prefetch_before_v && active) {
#pragma unroll
      for (int ahead = 1; ahead < kLeanPrefetchHeads; ++ahead) {
        const Index h = head + ahead * head_step;
        if (h < num_rotated) chunk.prefetch(head_rows<T, Index>(p, o, h).in, pair0, half);
      }
    }
    if constexpr (CACHE) {
      // The v heads of this thread (after its q and k heads on its stride), to the v cache
      // unchanged but for fp8: here, so that their rows load while cos/sin and the first chunk
      // do, and the slot's v row is dead in the head loop.
      for (Index vhead = first_v_head_of(first_head, head_step, num_rotated); vhead < num_heads;
           vhead += head_step) {
        lean_store_v_head<T>(f, token, vhead - num_rotated, slot.v_base, head_chunks);
      }
    }
    // Table-read angles take the sign here, once a token (computed ones have it): one multiply per
    // pair and token instead of two per pair and head.
    if constexpr (SOURCE != kComputedAngles) {
      if (rotating) {
#pragma unroll
        for (int i = 0; i < P; ++i) sin_v[i] *= sin_sign;
      }
    }

    if (!prefetch_before_v && active) {
#pragma unroll
      for (int ahead = 1; ahead < kLeanPrefetchHeads; ++ahead) {
        const Index h = head + ahead * head_step;
        if (h < num_rotated) chunk.prefetch(head_rows<T, Index>(p, o, h).in, pair0, half);
      }
    }
    while (head < num_rotated) {
      if (kLeanPrefetchHeads > 0 && active) {
        const Index h = head + kLeanPrefetchHeads * head_step;
        if (h < num_rotated) chunk.prefetch(head_rows<T, Index>(p, o, h).in, pair0, half);
      }
      const bool is_k = head >= num_q_heads;
      const Index kh = head - num_q_heads;
      float rms_scale = 1.0f;
      if constexpr (NORM) {
        // Every lane of the head shuffles, the inactive ones with a zero sum.
        const float sum = lanes_sum(active ? chunk.template sum_of_squares<P>() : 0.0f);
        rms_scale = rsqrtf(fmaf(sum, inv_dim, eps));
      }
      if (active) {
        long long cache_offset = -1;
        if constexpr (CACHE) {
          if (is_k && slot.k_base >= 0) {
            cache_offset = slot.k_base + static_cast<long long>(kh) * f.k_cache_head_stride;
          }
        }
        lean_rotate_store<T, P, INTERLEAVED, NORM, CACHE, W>(
            f, chunk, pair0, half, is_k ? f.k_weight : f.q_weight, weight_offset, rms_scale,
            cos_v, sin_v, is_k, is_k ? p.k_out : p.q_out,
            is_k ? o.k_out + kh * static_cast<Index>(p.k_out_head_stride)
                 : o.q_out + head * static_cast<Index>(p.q_out_head_stride),
            cache_offset, !PARTIAL || rotating);
      }
      head += head_step;
      // After this head's stores: in place, they may be the rows a later load reads.
      if (active && head < num_rotated) chunk.load(head_rows<T, Index>(p, o, head).in, pair0, half);
    }
  }
}

// The kernel body for the weights' dtype: compiled for the q dtype and for any other dtype;
// without a norm, once.
template <typename T, typename TableT, bool INTERLEAVED, int SOURCE, bool NORM, bool CACHE,
          bool MROPE, bool PARTIAL = false>
__device__ __forceinline__ void rope_fused_lean_body(const RopeParams& p, const FusionParams& f) {
  if constexpr (NORM) {
    if (f.weight_dtype == WeightDtypeOf<T>::value) {
      rope_fused_lean_tokens<T, TableT, INTERLEAVED, SOURCE, NORM, CACHE, T, MROPE, PARTIAL>(p, f);
      return;
    }
  }
  rope_fused_lean_tokens<T, TableT, INTERLEAVED, SOURCE, NORM, CACHE, RuntimeWeights, MROPE,
                         PARTIAL>(p, f);
}

// ------------------------------------------------------------------------------------------------
// The norm over all heads of a token (norm_over="all_heads": OLMo 2, FlashInfer's
// fused_qk_rmsnorm_rope) in the lean layout with every dim rotated
// (launch.fused_lean_all_heads_applies): one token a block, heads on thread rows (blockDim.y rows:
// enough for every q and k head, HELD a row, where they fit the block), each lane one
// chunk of pairs. A thread loads its heads' chunks and cos/sin, adds the chunks' squares to the
// token's q or k sum (block_sums), then normalises (weights from global memory: L1 after the first
// token), rotates and stores the chunks it still holds, so that the token is read from DRAM once
// and no shared copy of the weights is made (the general all-heads kernel filled every head's
// weights into shared memory and read each head twice: 53-57 % of an SM copy on an H100). A row
// holds up to HELD heads, their loads in flight together (one held head a row, the rows
// past the block's read one after another: 65 % of the copy for 32 + 8 heads on an H100); heads
// past those are read again for their stores (from L1: the block read them for the sums).
// 3 resident blocks (80 registers) for interleaved heads without the cache write; otherwise 2
// (128): the held chunks with the next token's prefetch spilled 8-80 bytes of NeoX and of the
// 16-bit interleaved cache write at 80 on sm_80 / sm_90 (nvcc 13.0).
template <typename T, bool INTERLEAVED, bool CACHE>
struct LeanAllHeadsMinBlocksPerSM {
  static constexpr int value = INTERLEAVED && !CACHE ? 3 : 2;
};

// Head `head` (of q's heads, or of k's) of an all-heads norm weight: `head * head_dim` elements
// in, the weights' dtype known (W) or read from f.weight_dtype (RuntimeWeights).
template <typename W, typename F>
__device__ __forceinline__ const void* head_norm_weights(const F& f, bool is_k, int head,
                                                         int head_dim) {
  int bytes;
  if constexpr (!IsSame<W, RuntimeWeights>::value) {
    bytes = static_cast<int>(sizeof(W));
  } else {
    bytes = static_cast<int>(f.weight_dtype) == kWeightFloat32 ? 4 : 2;
  }
  return static_cast<const char*>(is_k ? f.k_weight : f.q_weight) +
         static_cast<long long>(head) * head_dim * bytes;
}

// HELD: the heads a thread row holds in registers through the block's sums: heads row, row +
// rows, ... (launch.lean_all_heads_geometry gives a block rows enough for every head where they
// fit). Two NeoX chunks or four interleaved ones hold 16 registers of q and k; four NeoX ones
// (32), on GPUs of fast memory (launch.lean_all_heads_held), hold twice the bytes in flight:
// H200, 32 + 8 heads, 6 points more of an SM copy at T >= 16384, where they cost an H100 8-10
// (docs/perf_log.md).

// Loads the chunks of a row's held heads, all issued before any is used.
template <typename T, typename Index, int H, bool INTERLEAVED>
__device__ __forceinline__ void load_held_heads(const RopeParams& p, const TokenOffsets<Index>& o,
                                                LeanChunk<T, INTERLEAVED> (&held)[H], Index row,
                                                Index rows, Index num_rotated, bool active,
                                                int pair0, int half) {
#pragma unroll
  for (int h = 0; h < H; ++h) {
    const Index head = row + h * rows;
    if (active && head < num_rotated) held[h].load(head_rows<T, Index>(p, o, head).in, pair0, half);
  }
}

// One head's chunk normalised by its kind's rms, rotated and stored (and its k rows to the
// cache), the weights those of the head within its projection.
template <typename T, int P, bool INTERLEAVED, bool CACHE, typename W, typename Index>
__device__ __forceinline__ void lean_all_heads_store(const RopeParams& p, const FusionParams& f,
                                                     const TokenOffsets<Index>& o,
                                                     const SlotRows& slot,
                                                     const LeanChunk<T, INTERLEAVED>& chunk,
                                                     Index head, int pair0, int half, float q_rms,
                                                     float k_rms, const float (&cos_v)[P],
                                                     const float (&sin_v)[P]) {
  const bool is_k = head >= static_cast<Index>(p.num_q_heads);
  const Index kh = head - static_cast<Index>(p.num_q_heads);
  long long cache_offset = -1;
  if constexpr (CACHE) {
    if (is_k && slot.k_base >= 0) {
      cache_offset = slot.k_base + static_cast<long long>(kh) * f.k_cache_head_stride;
    }
  }
  const int head_dim = static_cast<int>(p.head_dim);
  lean_rotate_store<T, P, INTERLEAVED, true, CACHE, W>(
      f, chunk, pair0, half, head_norm_weights<W>(f, is_k, is_k ? kh : head, head_dim),
      static_cast<float>(f.weight_offset), is_k ? k_rms : q_rms, cos_v, sin_v, is_k,
      is_k ? p.k_out : p.q_out,
      is_k ? o.k_out + kh * static_cast<Index>(p.k_out_head_stride)
           : o.q_out + head * static_cast<Index>(p.q_out_head_stride),
      cache_offset);
}

template <typename T, typename TableT, bool INTERLEAVED, int SOURCE, bool CACHE, int HELD,
          typename W>
__device__ __forceinline__ void rope_fused_lean_all_heads_tokens(const RopeParams& p,
                                                                 const FusionParams& f) {
  using Index = int;  // lean kernels use 32-bit offsets (cache rows stay 64-bit)
  using L = Layout<T, true, INTERLEAVED>;
  using Chunk = LeanChunk<T, INTERLEAVED>;
  constexpr int P = L::pairs;
  constexpr int H = HELD;
  static_assert(HELD >= 1, "a thread row holds at least one head");
  __shared__ float scratch[kAllHeadsScratch];  // block_sums: a q and a k sum per warp

  wait_for_previous_grid();
  const TableT* __restrict__ cos_table = static_cast<const TableT*>(p.cos);
  const TableT* __restrict__ sin_table = static_cast<const TableT*>(p.sin);
  const float sin_sign = static_cast<float>(p.sin_sign);

  const Index head_dim = static_cast<Index>(p.head_dim);
  const Index half = head_dim / 2;  // every dim rotated
  const Index num_chunks = half / P, head_chunks = head_dim / L::access;
  const Index num_q_heads = static_cast<Index>(p.num_q_heads);
  const Index num_k_heads = static_cast<Index>(p.num_k_heads);
  const Index num_rotated = num_q_heads + num_k_heads;
  const Index num_v_heads = CACHE ? static_cast<Index>(f.num_v_heads) : 0;
  const Index num_tokens = static_cast<Index>(p.num_tokens);
  const Index lane = static_cast<Index>(tid_x()), row = static_cast<Index>(tid_y());
  const Index rows = static_cast<Index>(ntid_y());
  const Index pair0 = lane * P;
  // Lanes past the head's chunks (lanes are a power of two) and rows past the heads load and
  // store nothing but take part in the block's sums.
  const bool active = lane < num_chunks;
  const float eps = static_cast<float>(f.eps);
  const float q_inv_count = 1.0f / static_cast<float>(num_q_heads * head_dim);
  const float k_inv_count = 1.0f / static_cast<float>(num_k_heads * head_dim);

  for (Index token = static_cast<Index>(blockIdx.x); token < num_tokens;
       token += static_cast<Index>(gridDim.x)) {
    const TokenOffsets<Index> o = lean_token_offsets(p, token);
    const LeanToken t = lean_token<SOURCE, CACHE>(p, f, o, token, active);
    const long long position = t.position;
    const SlotRows slot = t.slot;
    // The held chunks load beside the position and the angles (computed angles: after them, as
    // in the lean kernel, so that the chunks are not held through their arithmetic): every load
    // of the row's held heads in flight at once, none waiting on another's sum.
    Chunk held[H];
    if (SOURCE != kComputedAngles) load_held_heads<T, Index>(p, o, held, row, rows, num_rotated,
                                                             active, pair0, half);
    // The next token of this block (a persistent grid at large T) into L2 while this one's
    // loads are in flight: its loads then wait on L2, not DRAM, and the block's barrier and
    // stores no longer leave the SM without bytes in flight. H100, 32 + 8 heads of 128, T =
    // 65536: 78 -> 89 % of an SM copy (docs/perf_log.md).
    {
      const Index next = token + static_cast<Index>(gridDim.x);
      if (next < num_tokens) {
        const TokenOffsets<Index> upcoming = lean_token_offsets(p, next);
#pragma unroll
        for (int h = 0; h < H; ++h) {
          const Index head = row + h * rows;
          if (active && head < num_rotated) {
            held[h].prefetch(head_rows<T, Index>(p, upcoming, head).in, pair0, half);
          }
        }
      }
    }
    float cos_v[P], sin_v[P];
    if (active) {
      chunk_angles<SOURCE, true, P, false>(p, o, position, pair0, cos_table, sin_table,
                                           static_cast<Index>(p.cos_col_stride),
                                           static_cast<Index>(p.sin_col_stride), true, sin_sign,
                                           cos_v, sin_v);
    }
    if (SOURCE == kComputedAngles) load_held_heads<T, Index>(p, o, held, row, rows, num_rotated,
                                                             active, pair0, half);
    // The token's sums of squares: the held chunks, then any heads past them (read twice).
    float2 share = make_float2(0.0f, 0.0f);
#pragma unroll
    for (int h = 0; h < H; ++h) {
      const Index head = row + h * rows;
      if (active && head < num_rotated) {
        const float sum = held[h].template sum_of_squares<P>();
        if (head >= num_q_heads) {
          share.y += sum;
        } else {
          share.x += sum;
        }
      }
    }
    if (active) {
      for (Index head = row + H * rows; head < num_rotated; head += rows) {
        Chunk other;
        other.load(head_rows<T, Index>(p, o, head).in, pair0, half);
        const float sum = other.template sum_of_squares<P>();
        if (head >= num_q_heads) {
          share.y += sum;
        } else {
          share.x += sum;
        }
      }
    }
    // Table-read angles take the sign here, once a token (computed ones have it).
    if constexpr (SOURCE != kComputedAngles) {
      if (active) {
#pragma unroll
        for (int i = 0; i < P; ++i) sin_v[i] *= sin_sign;
      }
    }
    const float2 sums = block_sums(share, scratch);
    const float q_rms = rsqrtf(fmaf(sums.x, q_inv_count, eps));
    const float k_rms = rsqrtf(fmaf(sums.y, k_inv_count, eps));
    // The stores: the held chunks, then each head past them read again, after the block's sums:
    // in place, no row is written before every thread read it.
    if (active) {
#pragma unroll
      for (int h = 0; h < H; ++h) {
        const Index head = row + h * rows;
        if (head < num_rotated) {
          lean_all_heads_store<T, P, INTERLEAVED, CACHE, W>(p, f, o, slot, held[h], head, pair0,
                                                            half, q_rms, k_rms, cos_v, sin_v);
        }
      }
      for (Index head = row + H * rows; head < num_rotated; head += rows) {
        Chunk other;
        other.load(head_rows<T, Index>(p, o, head).in, pair0, half);
        lean_all_heads_store<T, P, INTERLEAVED, CACHE, W>(p, f, o, slot, other, head, pair0, half,
                                                          q_rms, k_rms, cos_v, sin_v);
      }
    }
    if constexpr (CACHE) {
      // The v heads, a row each, to the v cache unchanged but for fp8: last, when the chunk and
      // the angles no longer hold registers (copied beside the chunks' loads, they spilled 8-48
      // bytes of the 16-bit NeoX kernels at 80 registers).
      for (Index vhead = row; vhead < num_v_heads; vhead += rows) {
        lean_store_v_head<T>(f, token, vhead, slot.v_base, head_chunks);
      }
    }
  }
}

// The kernel body for the weights' dtype: compiled for the q dtype and for any other dtype.
template <typename T, typename TableT, bool INTERLEAVED, int SOURCE, bool CACHE, int HELD>
__device__ __forceinline__ void rope_fused_lean_all_heads_body(const RopeParams& p,
                                                               const FusionParams& f) {
  if (f.weight_dtype == WeightDtypeOf<T>::value) {
    rope_fused_lean_all_heads_tokens<T, TableT, INTERLEAVED, SOURCE, CACHE, HELD, T>(p, f);
  } else {
    rope_fused_lean_all_heads_tokens<T, TableT, INTERLEAVED, SOURCE, CACHE, HELD,
                                     RuntimeWeights>(p, f);
  }
}

}  // namespace cupyrope
