// The fused ops at few tokens (a serving step): the decode kernel's shape (decode.cuh: one thread
// per token, head and chunk of pairs, no loops, compact parameters) with the lean fused kernel's
// work on a head (fused_lean.cuh: the chunk held as words, RMSNorm summed over the head's lanes,
// fp8 stores, the k and v cache rows). The lean fused kernel walks a thread's heads in a loop
// and reads its parameters from RopeParams and FusionParams, about twenty lines of the constant
// bank, each a constant-cache miss at a kernel's first read: at T = 1 it took 1.9-2.5x the
// plain decode kernel.
//
// Launch (launch.fused_decode_applies, launch.decode_geometry with the v heads): blockDim.x = the
// chunks of a head (a power of two of at most 32: the norm's lanes_sum shuffles over them),
// blockDim.y = the heads of q, k, then (CACHE) v, split over gridDim.y; blockIdx.x = the token.
// The lean fused kernel's layout (launch.fused_lean_applies) without M-RoPE: every dim rotated,
// 16-byte accesses, 32-bit offsets.
//
// A v head's lanes copy its chunks into the v cache; q and k heads load their chunk first, then
// (with the cache write) the position and the slot (k only), the norm weights, (else) the
// position, and cos / sin, so the loads overlap; with
// computed angles every lane of a warp, v or without a head, takes its share of its warp's
// angles (decode.cuh).
#pragma once

#include "decode.cuh"
#include "fused_lean.cuh"

namespace cupyrope {

template <typename T, typename TableT, bool INTERLEAVED, int SOURCE, bool NORM, bool CACHE,
          typename W>
__device__ __forceinline__ void rope_fused_decode_thread(const DecodeParams& p,
                                                         const FusedDecodeParams& f) {
  constexpr int P = Layout<T, true, INTERLEAVED>::pairs;
  constexpr bool kComputed = SOURCE == kComputedAngles;

  const int head = static_cast<int>(blockIdx.y * ntid_y() + tid_y());
  const int num_rotated = p.num_heads;
  // Whether the thread rotates a head is known from DecodeParams: its chunk and its token's
  // position load before anything of FusedDecodeParams is read (a line of the constant bank
  // that a kernel's first read misses: read first, the v heads' count delayed every load).
  // With computed angles the count of heads with v is read here (later, the changed register
  // allocation spilled 4-8 bytes on sm_120); these launches wait on the angles anyway.
  bool has_head = head < num_rotated;
  if constexpr (CACHE && kComputed) has_head = head < num_rotated + f.num_v_heads;
  const bool rotated = has_head && head < num_rotated;
  if (!kComputed && !CACHE && !rotated) return;
  const int token = static_cast<int>(blockIdx.x);
  const int half = static_cast<int>(ntid_x()) * P;
  const int pair0 = static_cast<int>(tid_x()) * P;

  const DecodeHead d = decode_head(p, token, head);  // past k's heads: a v head, d unused
  const bool is_q = d.is_q;
  const T* in = static_cast<const T*>(is_q ? p.q : p.k) + d.in_offset;
  const float inv_dim = 1.0f / static_cast<float>(2 * half);
  // Everything above reads parameters only: with a programmatic dependent launch it overlaps the
  // previous kernel's tail.
  wait_for_previous_grid();
  LeanChunk<T, INTERLEAVED> chunk;
  if (rotated) chunk.load(in, pair0, half);
  // With the cache write and a table the position loads next, before the slot and the v head's
  // copy; without the cache write after the norm weights (H100, T = 1: rope_and_cache 1.31 ->
  // 1.25 us; rms_norm_rope 1.49 -> 1.57 us if early). Computed angles take it late: held
  // through the v heads' fp8 stores (a call for the scale's reciprocal), it spilled on sm_120.
  constexpr bool kPositionFirst = CACHE && !kComputed;
  long long position = 0;
  if constexpr (kPositionFirst) {
    if (rotated) position = decode_position<SOURCE>(p, token);
  }
  SlotRows slot{-1, -1};
  if constexpr (CACHE) {
    // An uneven split of the heads over blocks leaves threads without a head (as in decode.cuh).
    if constexpr (!kComputed) has_head = head < num_rotated + f.num_v_heads;
    if (!kComputed && !has_head) return;
    if (has_head && !is_q) slot = slot_rows(f, static_cast<long long>(token));
    if (has_head && !rotated) {  // a v head: its row into the v cache, nothing else
      const int head_chunks = 2 * half / Words<T>::count;
      lean_store_v_head<T>(f, token, head - num_rotated, slot.v_base, head_chunks);
      if constexpr (!kComputed) return;
    }
  }
  if (!kComputed && !rotated) return;
  // The norm weights now, after the chunk: their load then overlaps the position's and the
  // table's (the lean kernel loads them after the head's reduction). Not with computed angles,
  // nor before compute capability 8.9: there the angles' slow range reduction or the fp8
  // stores are calls, across which held weights spilled 8-32 bytes; nor on sm_120, where they
  // spilled 4 bytes across the fp8 scale's reciprocal (a call) in four specialisations.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && __CUDA_ARCH__ < 1200
  constexpr bool kWeightsFirst = NORM && !kComputed;
#else
  constexpr bool kWeightsFirst = false;
#endif
  const void* head_weights = is_q ? f.q_weight : f.k_weight;
  LaneWeights<P> weights;
  if constexpr (kWeightsFirst) {
    if (rotated) load_chunk_weights<W, P, INTERLEAVED>(f, head_weights, pair0, half, weights);
  }

  if constexpr (!kPositionFirst) position = decode_position<SOURCE>(p, token);
  float cos_v[P], sin_v[P];
  decode_angles<float, TableT, SOURCE, P>(p, token, position, pair0, half, cos_v, sin_v);
  if (!rotated) return;
  if constexpr (!kComputed) {
#pragma unroll
    for (int i = 0; i < P; ++i) sin_v[i] *= p.sin_sign;
  }
  float rms_scale = 1.0f;
  if constexpr (NORM) {
    // A head's lanes are rotated or not together, so the reduction's lanes all take part.
    rms_scale = rsqrtf(fmaf(lanes_sum(chunk.template sum_of_squares<P>()), inv_dim, f.eps));
  }
  long long cache_offset = -1;
  if constexpr (CACHE) {
    if (!is_q && slot.k_base >= 0) {
      cache_offset = slot.k_base + static_cast<long long>(d.h) * f.k_cache_head_stride;
    }
  }
  void* const out = is_q ? p.q_out : p.k_out;
  if constexpr (kWeightsFirst) {
    lean_rotate_store<T, P, INTERLEAVED, NORM, CACHE, W>(f, chunk, pair0, half, weights,
                                                         f.weight_offset, rms_scale, cos_v, sin_v,
                                                         !is_q, out, d.out_offset, cache_offset);
  } else {
    lean_rotate_store<T, P, INTERLEAVED, NORM, CACHE, W>(f, chunk, pair0, half, head_weights,
                                                         f.weight_offset, rms_scale, cos_v, sin_v,
                                                         !is_q, out, d.out_offset, cache_offset);
  }
}

// The body: norm weights of q's dtype (launch.fused_decode_applies leaves other weight dtypes
// to the lean fused kernel). A run-time check of the weights' dtype, as rope_fused_lean_body
// makes, read a line of FusedDecodeParams before any load; reading the dtype where the weights
// load instead (RuntimeWeights) cost 0.4 us at T = 1.
template <typename T, typename TableT, bool INTERLEAVED, int SOURCE, bool NORM, bool CACHE>
__device__ __forceinline__ void rope_fused_decode_body(const DecodeParams& p,
                                                       const FusedDecodeParams& f) {
  rope_fused_decode_thread<T, TableT, INTERLEAVED, SOURCE, NORM, CACHE, T>(p, f);
}

}  // namespace cupyrope
