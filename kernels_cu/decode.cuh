// The decode kernel: few tokens (a serving step's 1 to a few hundred), where a launch is bound by
// latency, not bandwidth. One thread per (token, head, chunk of pairs): no token or head loop, no
// shared memory, and compact parameters (DecodeParams: two lines of the constant bank, where
// RopeParams' fields would take a constant-cache miss each), so that the path from the first
// load to the stores is as short as the data dependencies allow. The head's chunk is loaded
// before the position and cos/sin, so its load overlaps the position -> cache row chain.
//
// Launch (launch.decode_geometry): blockDim.x = the chunks of a head (so rotary_dim / 2 =
// blockDim.x * pairs), blockDim.y = heads of q then k, split over gridDim.y; blockIdx.x = the
// token. The lean kernels' preconditions hold (one token dim, 16-byte accesses, 32-bit offsets,
// vector cos/sin rows, no M-RoPE) and nothing is copied past rotary_dim (in place, or
// rotary_dim == head_dim).
//
// Computed angles: every warp computes its token's angles itself, each pair once (a lane takes
// pairs lane, lane + 32, ...), into its own slice of shared memory, and its lanes read their
// chunk's cos/sin back after a __syncwarp: no block barrier, so no warp waits for another, and
// the head's load (issued first) overlaps the position -> angle chain as the table load does
// for a cache. The host sizes the shared memory: warps of a block x cos and sin of `half` pairs.
#pragma once

#include "angles.cuh"
#include "dependent_launch.cuh"
#include "numeric.cuh"
#include "rope_params.cuh"
#include "rotation.cuh"
#include "thread_index.cuh"
#include "vector_io.cuh"

namespace cupyrope {

// The cos/sin of this thread's pairs [pair0, pair0 + P), computed by its warp: see the header.
template <typename C, int P>
__device__ __forceinline__ void warp_computed_angles(const DecodeParams& p, long long position,
                                                     int pair0, int half, C (&cos_v)[P],
                                                     C (&sin_v)[P]) {
  extern __shared__ __align__(16) unsigned char shared_angles[];
  // Blocks are whole warps (launch.decode_geometry pads the heads of a block to make them so): a
  // __syncwarp with a mask known only at run time would compile to a call and a register spill.
  const int linear = static_cast<int>(tid_y() * ntid_x() + tid_x());
  const int warp = linear >> 5, lane = linear & 31;
  C* const warp_cos = reinterpret_cast<C*>(shared_angles) + warp * 2 * half;
  C* const warp_sin = warp_cos + half;
  const C factor = static_cast<C>(p.attention_factor);
  const C sin_sign = static_cast<C>(p.sin_sign);
  // Not unrolled: unrolled, ptxas spilled a register for float32 interleaved q and k (measured
  // the same speed either way, docs/perf_log.md).
#pragma unroll 1
  for (int j = lane; j < half; j += 32) {
    C c, s;  // c before s: see chunk_angles
    angle_sincos(position, p.inv_freq[j], &s, &c);
    warp_cos[j] = c * factor;
    warp_sin[j] = s * factor * sin_sign;
  }
  __syncwarp();
  load_elements<true>(cos_v, warp_cos + pair0);
  load_elements<true>(sin_v, warp_sin + pair0);
}

// The token's position: its entry of `positions`, or the implicit arange (also for per-token
// tables, which read no position).
template <int SOURCE>
__device__ __forceinline__ long long decode_position(const DecodeParams& p, int token) {
  if (SOURCE == kTokenTables || p.positions == nullptr) return token;
  const int offset = token * p.positions_token_stride;
  return p.positions_are_int64 ? static_cast<const long long*>(p.positions)[offset]
                               : static_cast<const int*>(p.positions)[offset];
}

// cos / sin of the pairs [pair0, pair0 + P) of `token`: from its table rows (sin without the
// launch's sign; NaN for a position outside a cache, whose rows are never read), or computed by
// the warp with the attention factor and the sign folded in (then every lane of the warp calls).
template <typename C, typename TableT, int SOURCE, int P>
__device__ __forceinline__ void decode_angles(const DecodeParams& p, int token, long long position,
                                              int pair0, int half, C (&cos_v)[P], C (&sin_v)[P]) {
  if constexpr (SOURCE == kComputedAngles) {
    warp_computed_angles(p, position, pair0, half, cos_v, sin_v);
  } else {
    int cos_row = token * p.cos_row_stride, sin_row = token * p.sin_row_stride;
    bool row_valid = true;
    if constexpr (SOURCE == kCacheTable) {
      row_valid = position >= 0 && position < p.max_position;
      cos_row = row_valid ? static_cast<int>(position) * p.cos_row_stride : 0;
      sin_row = row_valid ? static_cast<int>(position) * p.sin_row_stride : 0;
    }
    if (row_valid) {
      load_table(cos_v, static_cast<const TableT*>(p.cos) + cos_row + pair0, 1, true);
      load_table(sin_v, static_cast<const TableT*>(p.sin) + sin_row + pair0, 1, true);
    } else {
#pragma unroll
      for (int i = 0; i < P; ++i) cos_v[i] = sin_v[i] = quiet_nan<C>();
    }
  }
}

// Head `head` of a token (q's heads, then k's): whether it is q's, its index there, and the
// element offsets of its input and output rows, chosen by selects rather than branches.
struct DecodeHead {
  bool is_q;
  int h, in_offset, out_offset;
};

__device__ __forceinline__ DecodeHead decode_head(const DecodeParams& p, int token, int head) {
  const bool is_q = head < p.num_q_heads;
  const int h = is_q ? head : head - p.num_q_heads;
  return {is_q, h,
          token * (is_q ? p.q_token_stride : p.k_token_stride) +
              h * (is_q ? p.q_head_stride : p.k_head_stride),
          token * (is_q ? p.q_out_token_stride : p.k_out_token_stride) +
              h * (is_q ? p.q_out_head_stride : p.k_out_head_stride)};
}

template <typename T, typename TableT, bool INTERLEAVED, int SOURCE>
__device__ __forceinline__ void rope_decode_thread(const DecodeParams& p) {
  using C = typename ComputeOf<T>::type;
  constexpr int P = Layout<T, true, INTERLEAVED>::pairs;
  constexpr bool kComputed = SOURCE == kComputedAngles;

  const int head = static_cast<int>(blockIdx.y * ntid_y() + tid_y());
  // An uneven split of the heads over blocks leaves threads without a head. With computed angles
  // they still compute their warp's share of the angles (and load and store nothing).
  const bool has_head = head < p.num_heads;
  if (!kComputed && !has_head) return;
  const int token = static_cast<int>(blockIdx.x);
  const int half = static_cast<int>(ntid_x()) * P;
  const int pair0 = static_cast<int>(tid_x()) * P;

  const DecodeHead d = decode_head(p, token, head);
  const T* in = static_cast<const T*>(d.is_q ? p.q : p.k) + d.in_offset;
  T* out = static_cast<T*>(d.is_q ? p.q_out : p.k_out) + d.out_offset;
  // Everything above reads parameters only: with a programmatic dependent launch it overlaps the
  // previous kernel's tail.
  wait_for_previous_grid();
  HeadChunk<T, P, true, INTERLEAVED> chunk;
  if (has_head) chunk.load(in, pair0, half);

  const long long position = decode_position<SOURCE>(p, token);
  C cos_v[P], sin_v[P];
  decode_angles<C, TableT, SOURCE, P>(p, token, position, pair0, half, cos_v, sin_v);
  if (has_head) {  // computed angles fold the sign in; a table's rows do not carry it
    chunk.rotate_store(out, pair0, half, cos_v, sin_v,
                       kComputed ? C(1) : static_cast<C>(p.sin_sign));
  }
}

}  // namespace cupyrope
