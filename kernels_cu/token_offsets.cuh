// Where a token's rows start: element offsets of q, k, their outputs, positions and per-token
// tables for one token, and the position (or, under M-RoPE, the position component) a pair of
// rotary dims takes its angle from.
#pragma once

#include "rope_params.cuh"

namespace cupyrope {

// Offsets are computed in 32 bits when the host has checked that every offset of the launch fits
// (fewer registers and instructions: 5 resident blocks instead of 4), else in 64 bits, so that
// tensors past 2^31 elements index correctly.
template <bool WIDE> struct IndexOf { using type = long long; };
template <> struct IndexOf<false> { using type = int; };

template <typename Index>
struct TokenOffsets {
  Index q, k, q_out, k_out, positions, cos, sin;
};

// The lean kernels' token offsets: one token dim (the host merged the others away).
template <typename Index>
__device__ __forceinline__ TokenOffsets<Index> lean_token_offsets(const RopeParams& p, Index token) {
  return {token * static_cast<Index>(p.q_token_stride[0]),
          token * static_cast<Index>(p.k_token_stride[0]),
          token * static_cast<Index>(p.q_out_token_stride[0]),
          token * static_cast<Index>(p.k_out_token_stride[0]),
          token * static_cast<Index>(p.positions_token_stride[0]),
          token * static_cast<Index>(p.cos_token_stride[0]),
          token * static_cast<Index>(p.sin_token_stride[0])};
}

template <typename Index>
__device__ __forceinline__ TokenOffsets<Index> token_offsets(const RopeParams& p, Index token) {
  TokenOffsets<Index> o = {0, 0, 0, 0, 0, 0, 0};
  Index rest = token;
#pragma unroll
  for (int d = kMaxTokenDims - 1; d >= 0; --d) {
    if (d >= p.token_ndim) continue;
    const Index size = static_cast<Index>(p.token_shape[d]);
    const Index i = d == 0 ? rest : rest % size;
    rest = d == 0 ? 0 : rest / size;
    o.q += i * static_cast<Index>(p.q_token_stride[d]);
    o.k += i * static_cast<Index>(p.k_token_stride[d]);
    o.q_out += i * static_cast<Index>(p.q_out_token_stride[d]);
    o.k_out += i * static_cast<Index>(p.k_out_token_stride[d]);
    o.positions += i * static_cast<Index>(p.positions_token_stride[d]);
    o.cos += i * static_cast<Index>(p.cos_token_stride[d]);
    o.sin += i * static_cast<Index>(p.sin_token_stride[d]);
  }
  return o;
}

// M-RoPE: the position component (0 temporal, 1 height, 2 width) a pair takes its angle from.
template <typename Index>
__device__ __forceinline__ int mrope_component(const RopeParams& p, Index pair) {
  const Index s0 = static_cast<Index>(p.mrope_section[0]);
  const Index s1 = static_cast<Index>(p.mrope_section[1]);
  if (p.mrope_mode == kMRopeSectioned) return pair < s0 ? 0 : (pair < s0 + s1 ? 1 : 2);
  const Index s2 = static_cast<Index>(p.mrope_section[2]);
  const Index r = pair % 3;
  if (r == 1 && pair < 3 * s1) return 1;
  if (r == 2 && pair < 3 * s2) return 2;
  return 0;
}

template <typename Index>
__device__ __forceinline__ long long load_position(const RopeParams& p, Index offset) {
  if (p.positions == nullptr) return offset;  // implicit arange: the offset is the index
  if (p.positions_are_int64) return static_cast<const long long*>(p.positions)[offset];
  return static_cast<const int*>(p.positions)[offset];
}

// The position pair `pair` takes its angle from: `position` itself, or under M-RoPE its height or
// width component, re-read (from L1) rather than kept in registers through the whole token.
template <typename Index>
__device__ __forceinline__ long long pair_position(const RopeParams& p, Index offset,
                                                   long long position, Index pair) {
  if (!p.mrope_mode) return position;
  const int component = mrope_component(p, pair);
  if (component == 0) return position;
  return load_position(p, offset + component * static_cast<Index>(p.positions_component_stride));
}

}  // namespace cupyrope
