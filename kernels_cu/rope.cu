// RoPE entry points: the templated __global__ kernels that cupyrope/kernels.py instantiates.
//
// One launch rotates q and k together. Work is split three ways:
//   threadIdx.x  a lane: a chunk of `pairs` rotary pairs (one 16-byte access per half, or one
//                scalar pair), then, out of place, a share of the pass-through dims to copy;
//   y            heads of q followed by heads of k: blockIdx.y * blockDim.y + threadIdx.y, strided
//                by gridDim.y * blockDim.y (the host splits heads over blocks when tokens are few);
//   threadIdx.z  a token, with blocks striding over tokens.
// cos/sin for a chunk are loaded (or computed) once per token and reused for every head; the lean
// computed-angle kernel computes each pair's angle once per token, shared through shared memory.
#include "numeric.cuh"
#include "vector_io.cuh"
#include "angles.cuh"
#include "rope_params.cuh"

namespace cupyrope {

enum AngleSource : int { kCacheTable = 0, kTokenTables = 1, kComputedAngles = 2 };

// Offsets are computed in 32 bits when the host has checked that every offset of the launch fits
// (fewer registers and instructions: 5 resident blocks instead of 4), else in 64 bits, so that
// tensors past 2^31 elements index correctly.
template <bool WIDE> struct IndexOf { using type = long long; };
template <> struct IndexOf<false> { using type = int; };

// The host launches at most kMaxThreadsPerBlock threads a block (THREADS_PER_BLOCK in launch.py).
// Asking for several resident blocks caps registers so that more warps, and so more loads, are in
// flight: the kernel is bound by memory latency, not arithmetic (measured: 4 -> 5 blocks, 91 -> 93%
// of an SM copy at the reference shape on an H200; 6 blocks spill and lose). Resident warps matter
// more than loads in flight per thread: rotating two heads per load batch at 3 blocks (no spill)
// fell from 94 to 80%, and issuing the first head's loads before cos/sin lost 4-6 points at 4-5
// blocks, even at T = 4096 where it was meant to hide the position -> cos/sin latency.
constexpr int kMaxThreadsPerBlock = 256;
// 5 blocks (48 registers) with 32-bit offsets, 4 (64 registers) with 64-bit ones. One block less
// where that would spill: float64 arrays or float64 tables (twice the registers per element; with
// 64-bit offsets and per-token tables NVRTC 13.0 spilled), and general per-token tables (two more
// offsets) with 32-bit offsets; lean per-token tables fit 5 blocks (T = 65536: 93.9 -> 95.4%).
// tests/test_kernel_compile.py checks that no specialisation spills.
template <typename T, typename TableT, int SOURCE, bool WIDE, bool LEAN>
struct MinBlocksPerSM {
  static constexpr bool heavy = sizeof(T) == 8 || sizeof(TableT) == 8 ||
                                (!WIDE && !LEAN && SOURCE == kTokenTables);
  static constexpr int value = (WIDE ? 4 : 5) - (heavy ? 1 : 0);
};

template <typename T, bool VECTOR, bool INTERLEAVED>
struct Layout {
  // Elements per access: 16 bytes on the vector path, one element on the scalar path.
  static constexpr int access = VECTOR ? 16 / static_cast<int>(sizeof(T)) : 1;
  // Pairs per thread and head: NeoX reads one access from each half (access pairs); interleaved
  // reads pairs side by side, so one 16-byte access holds access / 2 of them.
  static constexpr int pairs = INTERLEAVED ? (access >= 2 ? access / 2 : 1) : access;
};

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
  if (p.mrope_mode == 1) return pair < s0 ? 0 : (pair < s0 + s1 ? 1 : 2);
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

  // sin_sign (+1, or -1 to rotate backwards) of table-read angles is applied here, per head, not
  // once to sin_v after the load: a multiply there waits for the cos/sin load before the first
  // head's loads are issued, where now the two loads overlap. H200, reference shape, % of an SM
  // copy: T = 4096 cache 87.9 -> 91.2, in place 88.1 -> 90.9, tables 91.7 -> 93.3; T = 65536 cache
  // 94.5 -> 95.3; decode T = 1 from a cache 2.08 -> 1.94 us. Computed angles fold the sign in when
  // they are computed (no load to wait for) and pass +1.
  template <typename C, typename Index>
  __device__ __forceinline__ void rotate_store(T* out, Index pair0, Index half,
                                               const C (&cos_v)[P], const C (&sin_v)[P],
                                               C sin_sign) {
#pragma unroll
    for (int i = 0; i < P; ++i) {
      T& e1 = INTERLEAVED ? first[2 * i] : first[i];
      T& e2 = INTERLEAVED ? first[2 * i + 1] : second[i];
      const C x1 = Convert<C>::from(e1);
      const C x2 = Convert<C>::from(e2);
      e1 = Store<T>::from(x1 * cos_v[i] - sin_sign * (x2 * sin_v[i]));
      e2 = Store<T>::from(x2 * cos_v[i] + sin_sign * (x1 * sin_v[i]));
    }
    if constexpr (INTERLEAVED) {
      store_elements<VECTOR>(out + 2 * pair0, first);
    } else {
      store_elements<VECTOR>(out + pair0, first);
      store_elements<VECTOR>(out + half + pair0, second);
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
    chunk.load(rows.in, pair0, half);
    chunk.rotate_store(rows.out, pair0, half, cos_v, sin_v, sin_sign);
  }
}

// Copy this lane's share of the dims past rotary_dim (out of place only). No cos/sin are live
// here, so the loop is unrolled to keep several heads' loads in flight.
template <typename T, int ACCESS, bool VECTOR, typename Index>
__device__ __forceinline__ void copy_pass_through(const RopeParams& p, const TokenOffsets<Index>& o,
                                                  Index first_head, Index head_step,
                                                  Index num_heads, Index rotary_dim,
                                                  Index pass_chunks) {
  for (Index c = threadIdx.x; c < pass_chunks; c += blockDim.x) {
    const Index col = rotary_dim + c * ACCESS;
#pragma unroll 4
    for (Index head = first_head; head < num_heads; head += head_step) {
      const HeadRows<T> rows = head_rows<T, Index>(p, o, head);
      T v[ACCESS];
      load_elements<VECTOR>(v, rows.in + col);
      store_elements<VECTOR>(rows.out + col, v);
    }
  }
}

// LEAN: the common case, decided on the host. The token dims merge into one, no M-RoPE, and
// cos/sin rows (if read) are contiguous and aligned for vector loads. Only the vector path with
// 32-bit offsets has lean kernels. Without the general token walk, the M-RoPE branches and the
// strided table loads, the kernel needs fewer registers and half the instructions (bf16 from a
// cache: 496 against 1208 SASS instructions). Measured on an H200 at the reference shape: a decode
// step (T = 1) 2.24 -> 2.04 us, T = 4096 85.6 -> 87.9% of an SM copy, T = 65536 94.1 -> 94.6%.
template <typename T, typename TableT, bool VECTOR, bool INTERLEAVED, int SOURCE, bool WIDE_INDEX,
          bool LEAN>
__global__ __launch_bounds__(kMaxThreadsPerBlock,
                             MinBlocksPerSM<T, TableT, SOURCE, WIDE_INDEX, LEAN>::value)
void rope_kernel(const RopeParams p) {
  using Index = typename IndexOf<WIDE_INDEX>::type;
  using C = typename ComputeOf<T>::type;
  using L = Layout<T, VECTOR, INTERLEAVED>;
  constexpr int P = L::pairs;

  const TableT* __restrict__ cos_table = static_cast<const TableT*>(p.cos);
  const TableT* __restrict__ sin_table = static_cast<const TableT*>(p.sin);

  const Index rotary_dim = static_cast<Index>(p.rotary_dim);
  const Index half = rotary_dim / 2;
  const Index num_chunks = half / P;
  const Index pass_chunks =
      p.copy_pass_through ? (static_cast<Index>(p.head_dim) - rotary_dim) / L::access : 0;
  const Index num_heads = static_cast<Index>(p.num_q_heads + p.num_k_heads);
  const Index num_tokens = static_cast<Index>(p.num_tokens);
  const Index cos_col_stride = static_cast<Index>(p.cos_col_stride);
  const Index sin_col_stride = static_cast<Index>(p.sin_col_stride);
  const Index first_head = static_cast<Index>(blockIdx.y) * blockDim.y + threadIdx.y;
  const Index head_step = static_cast<Index>(gridDim.y) * blockDim.y;
  const C sin_sign = static_cast<C>(p.sin_sign);
  const bool table_vector_ok = p.table_vector_ok != 0;

  const Index token_step = static_cast<Index>(gridDim.x) * blockDim.z;

  if constexpr (LEAN && SOURCE == kComputedAngles) {
    // The threads of a token compute its angles together, each pair once, into shared memory
    // (the host sizes it: blockDim.z tokens x cos and sin of `half` pairs), rather than every
    // head lane computing the angles of its own chunk: one float64 reduction per pair instead of
    // one per pair and head lane, and a far shorter wait before the first loads.
    extern __shared__ __align__(16) unsigned char shared_angles[];
    C* const token_cos = reinterpret_cast<C*>(shared_angles) + threadIdx.z * 2 * half;
    C* const token_sin = token_cos + half;
    const Index rank = static_cast<Index>(threadIdx.y) * blockDim.x + threadIdx.x;
    const Index threads_per_token = static_cast<Index>(blockDim.y) * blockDim.x;
    const C factor = static_cast<C>(p.attention_factor);
    // The loop runs the same number of times in every thread of the block: __syncthreads inside.
    for (Index base = static_cast<Index>(blockIdx.x) * blockDim.z; base < num_tokens;
         base += token_step) {
      const Index token = base + threadIdx.z;
      const bool active = token < num_tokens;
      const TokenOffsets<Index> o = lean_token_offsets(p, active ? token : Index(0));
      if (active) {
        const double position = static_cast<double>(load_position(p, o.positions));
        for (Index j = rank; j < half; j += threads_per_token) {
          C s, c;
          accurate_sincos(position * p.inv_freq[j], &s, &c);
          token_cos[j] = c * factor;
          token_sin[j] = s * factor * sin_sign;
        }
      }
      __syncthreads();
      if (active) {
        for (Index lane = threadIdx.x; lane < num_chunks; lane += blockDim.x) {
          const Index pair0 = lane * P;
          C cos_v[P], sin_v[P];
          load_elements<true>(cos_v, token_cos + pair0);
          load_elements<true>(sin_v, token_sin + pair0);
          rotate_heads<T, P, VECTOR, INTERLEAVED>(p, o, first_head, head_step, num_heads, pair0,
                                                  half, cos_v, sin_v, C(1));
        }
        copy_pass_through<T, L::access, VECTOR>(p, o, first_head, head_step, num_heads,
                                               rotary_dim, pass_chunks);
      }
      __syncthreads();  // the next tokens' angles overwrite these
    }
    return;
  }

  for (Index token = static_cast<Index>(blockIdx.x) * blockDim.z + threadIdx.z;
       token < num_tokens; token += token_step) {
    const TokenOffsets<Index> o = LEAN ? lean_token_offsets(p, token) : token_offsets(p, token);
    // The position (M-RoPE: its temporal component; pair_position reads the others).
    long long position = 0;
    if constexpr (SOURCE != kTokenTables) position = load_position(p, o.positions);

    // Each lane rotates one chunk of pairs of every head it visits. All lanes take the same path
    // (no lane only copies while its neighbours rotate: that divergence halved partial-rotary
    // throughput).
    for (Index lane = threadIdx.x; lane < num_chunks; lane += blockDim.x) {
      const Index pair0 = lane * P;
      // (Loading the first head before cos/sin, to overlap the position -> cache-row latency,
      // spills under the register caps above: measured worse, so cos/sin come first.)
      C cos_v[P], sin_v[P];
      if constexpr (SOURCE == kComputedAngles) {
        const C factor = static_cast<C>(p.attention_factor);
#pragma unroll
        for (int i = 0; i < P; ++i) {
          const long long pos =
              LEAN ? position : pair_position(p, o.positions, position, pair0 + i);
          C s, c;
          accurate_sincos(static_cast<double>(pos) * p.inv_freq[pair0 + i], &s, &c);
          cos_v[i] = c * factor;
          sin_v[i] = s * factor * sin_sign;
        }
      } else {
        Index cos_row = o.cos, sin_row = o.sin;
        bool row_valid = true;
        if constexpr (SOURCE == kCacheTable) {
          // Rows outside the cache are never read: they come out as NaN.
          row_valid = position >= 0 && position < p.max_position;
          cos_row = sin_row =
              row_valid ? static_cast<Index>(position) * static_cast<Index>(p.table_row_stride) : 0;
        }
        if (SOURCE == kCacheTable && !LEAN && p.mrope_mode) {
          // M-RoPE from a cache: each pair reads the row of its own position component.
#pragma unroll
          for (int i = 0; i < P; ++i) {
            const long long pos = pair_position(p, o.positions, position, pair0 + i);
            if (pos >= 0 && pos < p.max_position) {
              const Index row = static_cast<Index>(pos) * static_cast<Index>(p.table_row_stride);
              cos_v[i] = Convert<C>::from(cos_table[row + (pair0 + i) * cos_col_stride]);
              sin_v[i] = Convert<C>::from(sin_table[row + (pair0 + i) * sin_col_stride]);
            } else {
              cos_v[i] = sin_v[i] = quiet_nan<C>();
            }
          }
        } else if (row_valid) {
          load_table(cos_v, cos_table + cos_row + pair0 * cos_col_stride, cos_col_stride,
                     LEAN || table_vector_ok);
          load_table(sin_v, sin_table + sin_row + pair0 * sin_col_stride, sin_col_stride,
                     LEAN || table_vector_ok);
        } else {
#pragma unroll
          for (int i = 0; i < P; ++i) cos_v[i] = sin_v[i] = quiet_nan<C>();
        }
      }

      rotate_heads<T, P, VECTOR, INTERLEAVED>(p, o, first_head, head_step, num_heads, pair0, half,
                                              cos_v, sin_v,
                                              SOURCE == kComputedAngles ? C(1) : sin_sign);
    }
    // Then every lane copies its share of the dims past rotary_dim.
    copy_pass_through<T, L::access, VECTOR>(p, o, first_head, head_step, num_heads, rotary_dim,
                                           pass_chunks);
  }
}

}  // namespace cupyrope
