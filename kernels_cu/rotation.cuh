// The rotation itself: a thread's chunk of pairs of one head loaded, rotated by cos/sin held in
// registers and stored, for every head of q then k that the thread visits; and the copy of the
// dims past rotary_dim out of place. Kernels that rotate (rope, and fused ops built on it) include
// this and supply cos/sin however they get them.
#pragma once

#include "numeric.cuh"
#include "rope_params.cuh"
#include "thread_index.cuh"
#include "token_offsets.cuh"
#include "vector_io.cuh"

namespace cupyrope {

template <typename T, bool VECTOR, bool INTERLEAVED>
struct Layout {
  // Elements per access: 16 bytes on the vector path, one element on the scalar path.
  static constexpr int access = VECTOR ? 16 / static_cast<int>(sizeof(T)) : 1;
  // Pairs per thread and head: NeoX reads one access from each half (access pairs); interleaved
  // reads pairs side by side, so one 16-byte access holds access / 2 of them.
  static constexpr int pairs = INTERLEAVED ? (access >= 2 ? access / 2 : 1) : access;
};

// The rotation of one pair (x1, x2) by the angle whose cos and sin are given; sin_sign -1 rotates
// backwards. Every kernel that rotates comes down to this.
template <typename C>
__device__ __forceinline__ void rotate_pair(C x1, C x2, C cos_a, C sin_a, C sin_sign, C& y1,
                                            C& y2) {
  y1 = x1 * cos_a - sin_sign * (x2 * sin_a);
  y2 = x2 * cos_a + sin_sign * (x1 * sin_a);
}

// The elements of one head that one thread rotates: P pairs, as one access per half (NeoX) or
// one access of side-by-side pairs (interleaved).
template <typename T, int P, bool VECTOR, bool INTERLEAVED>
struct HeadChunk {
  T first[INTERLEAVED ? 2 * P : P];
  T second[INTERLEAVED ? 1 : P];

  template <typename Index>
  __device__ __forceinline__ void load(const T* in, Index pair0, Index half) {
    if constexpr (INTERLEAVED) {
      load_elements<VECTOR>(first, in + 2 * pair0);
    } else {
      load_elements<VECTOR>(first, in + pair0);
      load_elements<VECTOR>(second, in + half + pair0);
    }
  }

  // The scalar path's load from a head whose elements lie `stride` apart (any stride: the host
  // takes this path whenever a head's last dim is not dense).
  template <typename Index>
  __device__ __forceinline__ void load(const T* in, Index pair0, Index half, Index stride) {
    static_assert(!VECTOR && sizeof(Index) > 0, "strided heads take the scalar path");
    if constexpr (INTERLEAVED) {
#pragma unroll
      for (int i = 0; i < 2 * P; ++i) first[i] = in[(2 * pair0 + i) * stride];
    } else {
#pragma unroll
      for (int i = 0; i < P; ++i) {
        first[i] = in[(pair0 + i) * stride];
        second[i] = in[(half + pair0 + i) * stride];
      }
    }
  }

  // sin_sign (+1, or -1 to rotate backwards) of table-read angles is applied here, per head, not
  // once to sin_v after the load: a multiply there would make the first head's loads wait for the
  // cos/sin load, where now the two loads overlap (docs/perf_log.md has the numbers). Computed
  // angles fold the sign in when they are computed (no load to wait for) and pass +1.
  template <typename C, typename Index>
  __device__ __forceinline__ void rotate_store(T* out, Index pair0, Index half,
                                               const C (&cos_v)[P], const C (&sin_v)[P],
                                               C sin_sign) {
    rotate(cos_v, sin_v, sin_sign);
    if constexpr (INTERLEAVED) {
      store_elements<VECTOR>(out + 2 * pair0, first);
    } else {
      store_elements<VECTOR>(out + pair0, first);
      store_elements<VECTOR>(out + half + pair0, second);
    }
  }

  // rotate_store into a head whose elements lie `stride` apart (the scalar path).
  template <typename C, typename Index>
  __device__ __forceinline__ void rotate_store(T* out, Index pair0, Index half,
                                               const C (&cos_v)[P], const C (&sin_v)[P],
                                               C sin_sign, Index stride) {
    static_assert(!VECTOR && sizeof(Index) > 0, "strided heads take the scalar path");
    rotate(cos_v, sin_v, sin_sign);
    if constexpr (INTERLEAVED) {
#pragma unroll
      for (int i = 0; i < 2 * P; ++i) out[(2 * pair0 + i) * stride] = first[i];
    } else {
#pragma unroll
      for (int i = 0; i < P; ++i) {
        out[(pair0 + i) * stride] = first[i];
        out[(half + pair0 + i) * stride] = second[i];
      }
    }
  }

  // The chunk's pairs rotated in place, each rounded once to T.
  template <typename C>
  __device__ __forceinline__ void rotate(const C (&cos_v)[P], const C (&sin_v)[P], C sin_sign) {
#pragma unroll
    for (int i = 0; i < P; ++i) {
      T& e1 = INTERLEAVED ? first[2 * i] : first[i];
      T& e2 = INTERLEAVED ? first[2 * i + 1] : second[i];
      C y1, y2;
      rotate_pair(Convert<C>::from(e1), Convert<C>::from(e2), cos_v[i], sin_v[i], sin_sign, y1,
                  y2);
      e1 = Store<T>::from(y1);
      e2 = Store<T>::from(y2);
    }
  }
};

// Input and output rows of head `head` of the current token: q's heads, then k's. No
// __restrict__ anywhere on these: in place they are the same memory.
template <typename T>
struct HeadRows {
  const T* in;
  T* out;
};

// Elements between two dims of a head, of the input (q or k) and of its output: 1 for dense heads
// (the 16-byte path needs that), anything on the scalar path.
template <typename Index>
struct DimStrides {
  Index in, out;
};

template <typename Index>
__device__ __forceinline__ DimStrides<Index> dim_strides(const RopeParams& p, Index head) {
  if (head < static_cast<Index>(p.num_q_heads)) {
    return {static_cast<Index>(p.q_dim_stride), static_cast<Index>(p.q_out_dim_stride)};
  }
  return {static_cast<Index>(p.k_dim_stride), static_cast<Index>(p.k_out_dim_stride)};
}

template <typename T, typename Index>
__device__ __forceinline__ HeadRows<T> head_rows(const RopeParams& p, const TokenOffsets<Index>& o,
                                                 Index head) {
  const Index num_q_heads = static_cast<Index>(p.num_q_heads);
  if (head < num_q_heads) {
    return {static_cast<const T*>(p.q) + o.q + head * static_cast<Index>(p.q_head_stride),
            static_cast<T*>(p.q_out) + o.q_out + head * static_cast<Index>(p.q_out_head_stride)};
  }
  const Index kh = head - num_q_heads;
  return {static_cast<const T*>(p.k) + o.k + kh * static_cast<Index>(p.k_head_stride),
          static_cast<T*>(p.k_out) + o.k_out + kh * static_cast<Index>(p.k_out_head_stride)};
}

// Rotate the chunk of pairs starting at pair0 of every head this thread visits, with cos/sin
// already in registers.
template <typename T, int P, bool VECTOR, bool INTERLEAVED, typename C, typename Index>
__device__ __forceinline__ void rotate_heads(const RopeParams& p, const TokenOffsets<Index>& o,
                                             Index first_head, Index head_step, Index num_heads,
                                             Index pair0, Index half, const C (&cos_v)[P],
                                             const C (&sin_v)[P], C sin_sign) {
  for (Index head = first_head; head < num_heads; head += head_step) {
    const HeadRows<T> rows = head_rows<T, Index>(p, o, head);
    HeadChunk<T, P, VECTOR, INTERLEAVED> chunk;
    if constexpr (VECTOR) {
      chunk.load(rows.in, pair0, half);
      chunk.rotate_store(rows.out, pair0, half, cos_v, sin_v, sin_sign);
    } else {
      const DimStrides<Index> strides = dim_strides(p, head);
      chunk.load(rows.in, pair0, half, strides.in);
      chunk.rotate_store(rows.out, pair0, half, cos_v, sin_v, sin_sign, strides.out);
    }
  }
}

// Bring this lane's chunks of every head it visits into L2 (a hint: no registers, no wait).
template <typename T, int P, bool INTERLEAVED, typename Index>
__device__ __forceinline__ void prefetch_heads(const RopeParams& p, const TokenOffsets<Index>& o,
                                               Index first_head, Index head_step,
                                               Index num_heads, Index num_chunks, Index half) {
  for (Index lane = tid_x(); lane < num_chunks; lane += ntid_x()) {
    const Index pair0 = lane * P;
    for (Index head = first_head; head < num_heads; head += head_step) {
      const T* in = head_rows<T, Index>(p, o, head).in;
      if constexpr (INTERLEAVED) {
        prefetch_l2(in + 2 * pair0);
      } else {
        prefetch_l2(in + pair0);
        prefetch_l2(in + half + pair0);
      }
    }
  }
}

// Copy this lane's share of the dims past rotary_dim (out of place only). No cos/sin are live
// here, so the loop is unrolled to keep several heads' loads in flight.
template <typename T, int ACCESS, bool VECTOR, typename Index>
__device__ __forceinline__ void copy_pass_through(const RopeParams& p, const TokenOffsets<Index>& o,
                                                  Index first_head, Index head_step,
                                                  Index num_heads, Index rotary_dim,
                                                  Index pass_chunks) {
  for (Index c = tid_x(); c < pass_chunks; c += ntid_x()) {
    const Index col = rotary_dim + c * ACCESS;
#pragma unroll 4
    for (Index head = first_head; head < num_heads; head += head_step) {
      const HeadRows<T> rows = head_rows<T, Index>(p, o, head);
      if constexpr (VECTOR) {
        T v[ACCESS];
        load_elements<VECTOR>(v, rows.in + col);
        store_elements<VECTOR>(rows.out + col, v);
      } else {
        static_assert(ACCESS == 1, "the scalar path copies one element at a time");
        const DimStrides<Index> strides = dim_strides(p, head);
        rows.out[col * strides.out] = rows.in[col * strides.in];
      }
    }
  }
}

}  // namespace cupyrope
