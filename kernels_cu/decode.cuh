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
// rotary_dim == head_dim). Angles come from a cache or per-token tables: computed angles run the
// lean kernel, which computes each pair's angle once per token in shared memory.
#pragma once

#include "dependent_launch.cuh"
#include "numeric.cuh"
#include "rope_params.cuh"
#include "rotation.cuh"
#include "vector_io.cuh"

namespace cupyrope {

template <typename T, typename TableT, bool INTERLEAVED, int SOURCE>
__device__ __forceinline__ void rope_decode_thread(const DecodeParams& p) {
  static_assert(SOURCE != kComputedAngles, "computed angles run the lean kernel (shared angles)");
  using C = typename ComputeOf<T>::type;
  constexpr int P = Layout<T, true, INTERLEAVED>::pairs;

  const int head = static_cast<int>(blockIdx.y * blockDim.y + threadIdx.y);
  if (head >= p.num_heads) return;  // an uneven split of the heads over blocks
  const int token = static_cast<int>(blockIdx.x);
  const int half = static_cast<int>(blockDim.x) * P;
  const int pair0 = static_cast<int>(threadIdx.x) * P;

  // The head's rows (q's heads, then k's), chosen by selects rather than branches.
  const bool is_q = head < p.num_q_heads;
  const int h = is_q ? head : head - p.num_q_heads;
  const T* in = static_cast<const T*>(is_q ? p.q : p.k) +
                token * (is_q ? p.q_token_stride : p.k_token_stride) +
                h * (is_q ? p.q_head_stride : p.k_head_stride);
  T* out = static_cast<T*>(is_q ? p.q_out : p.k_out) +
           token * (is_q ? p.q_out_token_stride : p.k_out_token_stride) +
           h * (is_q ? p.q_out_head_stride : p.k_out_head_stride);
  // Everything above reads parameters only: with a programmatic dependent launch it overlaps the
  // previous kernel's tail.
  wait_for_previous_grid();
  HeadChunk<T, P, true, INTERLEAVED> chunk;
  chunk.load(in, pair0, half);

  long long position = token;  // the implicit arange
  if (SOURCE == kCacheTable && p.positions != nullptr) {
    const int offset = token * p.positions_token_stride;
    position = p.positions_are_int64 ? static_cast<const long long*>(p.positions)[offset]
                                     : static_cast<const int*>(p.positions)[offset];
  }

  C cos_v[P], sin_v[P];
  int cos_row = token * p.cos_row_stride, sin_row = token * p.sin_row_stride;
  bool row_valid = true;
  if constexpr (SOURCE == kCacheTable) {  // a row outside the cache is never read: NaN
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
  chunk.rotate_store(out, pair0, half, cos_v, sin_v, static_cast<C>(p.sin_sign));
}

}  // namespace cupyrope
