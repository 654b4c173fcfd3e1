// The lean fused kernel: the fused ops in their common layout, with the fusions a launch runs
// fixed at compile time (NORM: RMSNorm before the rotation; CACHE: the k and v cache write; fp8
// stores stay a run-time choice of format). The general fused kernel (fused.cuh) tests every
// fusion at run time and handles every layout, so its registers are those of its largest case
// (~120 a thread naturally, capped at 128: 2 resident blocks) and its code does not fit the
// instruction cache at T = 1. Here only what the launch needs is compiled, so a thread fits in
// 64 registers (4 resident blocks) and each head is one load, one reduction and one store.
//
// The common layout (launch.py: fused_lean_applies): 16-byte accesses, 32-bit offsets, one token
// dim, no M-RoPE, cos/sin rows that take vector loads, every dim rotated (rotary_dim == head_dim),
// at most 32 lanes a head. Each lane owns one chunk of pairs of every head it visits, as in the
// rope kernels, so cos/sin are loaded once per token and the lane's norm weights once per head
// (from L1: no shared memory, no barrier).
#pragma once

#include "fused.cuh"

namespace cupyrope {

// weight_offset + w of dims [dim, dim + N) of one norm weight, straight from global memory in
// 16-byte loads (or one smaller): every head of a kind reads the same few bytes, so after the
// first head they come from L1. No shared copy, so no barrier before the first head (a decode
// step's latency). The host sends weights here only with unit stride and 16-byte alignment; dim
// is a multiple of N.
template <typename W, int N>
__device__ __forceinline__ void load_weights_as(const void* w, int dim, float offset,
                                                float (&out)[N]) {
  W raw[N];
  load_elements<true>(raw, static_cast<const W*>(w) + dim);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = offset + to_float(raw[i]);
}

template <int N>
__device__ __forceinline__ void load_lane_weights(const FusionParams& f, const void* w, int dim,
                                                  float (&out)[N]) {
  const float offset = static_cast<float>(f.weight_offset);
  if (f.weight_dtype == kWeightBFloat16) {
    load_weights_as<bfloat16_t>(w, dim, offset, out);
  } else if (f.weight_dtype == kWeightFloat16) {
    load_weights_as<half_t>(w, dim, offset, out);
  } else {
    load_weights_as<float>(w, dim, offset, out);
  }
}

// One head's chunk: normalised (NORM: x * (rms_scale * w), as the general kernel), rotated, and
// stored to the output row and, for a k head with a cache slot, to its k cache row.
template <typename T, int P, bool INTERLEAVED, bool NORM, bool CACHE>
__device__ __forceinline__ void lean_rotate_store(const FusionParams& f,
                                                  const HeadChunk<T, P, true, INTERLEAVED>& chunk,
                                                  int pair0, int half, const void* head_weights,
                                                  float rms_scale, const float (&cos_v)[P],
                                                  const float (&sin_v)[P], float sin_sign,
                                                  void* out, int out_offset, float out_inv_scale,
                                                  long long cache_offset, float cache_inv_scale) {
  constexpr int E = INTERLEAVED ? 2 * P : P;  // elements of one 16-byte access
  float x1[P], x2[P];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    x1[i] = to_float(INTERLEAVED ? chunk.first[2 * i] : chunk.first[i]);
    x2[i] = to_float(INTERLEAVED ? chunk.first[2 * i + 1] : chunk.second[i]);
  }
  if constexpr (NORM) {
    if constexpr (INTERLEAVED) {
      float w[E];
      load_lane_weights(f, head_weights, 2 * pair0, w);
#pragma unroll
      for (int i = 0; i < P; ++i) {
        x1[i] *= rms_scale * w[2 * i];
        x2[i] *= rms_scale * w[2 * i + 1];
      }
    } else {
      float w[P];
      load_lane_weights(f, head_weights, pair0, w);
#pragma unroll
      for (int i = 0; i < P; ++i) x1[i] *= rms_scale * w[i];
      load_lane_weights(f, head_weights, half + pair0, w);
#pragma unroll
      for (int i = 0; i < P; ++i) x2[i] *= rms_scale * w[i];
    }
  }
  float y1[P], y2[P];
#pragma unroll
  for (int i = 0; i < P; ++i) rotate_pair(x1[i], x2[i], cos_v[i], sin_v[i], sin_sign, y1[i], y2[i]);
  if constexpr (INTERLEAVED) {
    float y[E];
#pragma unroll
    for (int i = 0; i < P; ++i) {
      y[2 * i] = y1[i];
      y[2 * i + 1] = y2[i];
    }
    store_values<T, true>(out, out_offset + 2 * pair0, y, f.out_format, out_inv_scale);
    if constexpr (CACHE) {
      if (cache_offset >= 0) {
        store_values<T, true>(f.k_cache, cache_offset + 2 * pair0, y, f.cache_format,
                              cache_inv_scale);
      }
    }
  } else {
    store_values<T, true>(out, out_offset + pair0, y1, f.out_format, out_inv_scale);
    store_values<T, true>(out, out_offset + half + pair0, y2, f.out_format, out_inv_scale);
    if constexpr (CACHE) {
      if (cache_offset >= 0) {
        store_values<T, true>(f.k_cache, cache_offset + pair0, y1, f.cache_format,
                              cache_inv_scale);
        store_values<T, true>(f.k_cache, cache_offset + half + pair0, y2, f.cache_format,
                              cache_inv_scale);
      }
    }
  }
}

template <typename T, typename TableT, bool INTERLEAVED, int SOURCE, bool NORM, bool CACHE>
__device__ __forceinline__ void rope_fused_lean_tokens(const RopeParams& p, const FusionParams& f) {
  using Index = int;  // lean kernels use 32-bit offsets (cache rows stay 64-bit)
  using L = Layout<T, true, INTERLEAVED>;
  using Chunk = HeadChunk<T, L::pairs, true, INTERLEAVED>;
  constexpr int P = L::pairs;
  constexpr int A = L::access;

  const TableT* __restrict__ cos_table = static_cast<const TableT*>(p.cos);
  const TableT* __restrict__ sin_table = static_cast<const TableT*>(p.sin);
  const float sin_sign = static_cast<float>(p.sin_sign);
  const float head_sign = SOURCE == kComputedAngles ? 1.0f : sin_sign;  // see HeadChunk

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
  const Index pair0 = tid_x() * P;
  // Lanes past the head's chunks (the norm rounds lanes up to a power of two) load and store
  // nothing but take part in the reduction.
  const bool active = static_cast<Index>(tid_x()) < num_chunks;

  const FusedConstants consts = fused_constants(f, head_dim);
  const Index first_token = static_cast<Index>(blockIdx.x) * ntid_z() + tid_z();
  for (Index token = first_token; token < num_tokens; token += token_step) {
    const TokenOffsets<Index> o = lean_token_offsets(p, token);
    float cos_v[P], sin_v[P];
    if (active) {
      long long position = 0;
      if constexpr (SOURCE != kTokenTables) position = load_position(p, o.positions);
      chunk_angles<SOURCE, true>(p, o, position, pair0, cos_table, sin_table,
                                 static_cast<Index>(p.cos_col_stride),
                                 static_cast<Index>(p.sin_col_stride), true, sin_sign, cos_v,
                                 sin_v);
    }
    SlotRows slot{-1, -1};
    if constexpr (CACHE) slot = slot_rows(f, static_cast<long long>(token));

    for (Index head = first_head; head < num_rotated; head += head_step) {
      const bool is_k = head >= num_q_heads;
      const Index kh = head - num_q_heads;
      const HeadRows<T> rows = head_rows<T, Index>(p, o, head);
      Chunk chunk;
      if (active) chunk.load(rows.in, pair0, half);
      float rms_scale = 1.0f;
      if constexpr (NORM) {
        // Every lane of the head shuffles, the inactive ones with a zero sum.
        const float sum = lanes_sum(active ? sum_of_squares(chunk) : 0.0f);
        rms_scale = 1.0f / sqrtf(fmaf(sum, consts.inv_dim, consts.eps));
      }
      if (!active) continue;
      long long cache_offset = -1;
      if constexpr (CACHE) {
        if (is_k && slot.k_base >= 0) {
          cache_offset = slot.k_base + static_cast<long long>(kh) * f.k_cache_head_stride;
        }
      }
      lean_rotate_store<T, P, INTERLEAVED, NORM, CACHE>(
          f, chunk, pair0, half, is_k ? f.k_weight : f.q_weight, rms_scale,
          cos_v, sin_v, head_sign, is_k ? p.k_out : p.q_out,
          is_k ? o.k_out + kh * static_cast<Index>(p.k_out_head_stride)
               : o.q_out + head * static_cast<Index>(p.q_out_head_stride),
          is_k ? consts.k_inv_scale : consts.q_inv_scale, cache_offset, consts.k_inv_scale);
    }
    if constexpr (CACHE) {
      // The v heads, after this thread's q and k heads: to the v cache, unchanged but for fp8.
      for (Index head = first_v_head_of(first_head, head_step, num_rotated); head < num_heads;
           head += head_step) {
        store_v_head<T, true, A>(f, token, head - num_rotated, slot.v_base, head_chunks,
                                 consts.v_inv_scale);
      }
    }
  }
}

}  // namespace cupyrope
