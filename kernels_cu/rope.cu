// RoPE entry points: the templated __global__ kernels that cupyrope/kernels.py instantiates.
//
// One launch rotates q and k together. Work is split three ways:
//   threadIdx.x  a chunk of `pairs` rotary pairs (one 16-byte access per half, or one scalar pair),
//   threadIdx.y  heads of q followed by heads of k, strided by blockDim.y,
//   threadIdx.z  a token, with blocks striding over tokens.
// cos/sin for a chunk are loaded (or computed) once per token and reused for every head.
#include "numeric.cuh"
#include "vector_io.cuh"
#include "angles.cuh"
#include "rope_params.cuh"

namespace cupyrope {

enum AngleSource : int { kCacheTable = 0, kTokenTables = 1, kComputedAngles = 2 };

// The host launches at most kMaxThreadsPerBlock threads a block (THREADS_PER_BLOCK in launch.py).
// Asking for CUPYROPE_MIN_BLOCKS resident blocks caps registers (64 at 256 x 4) so that more warps,
// and so more loads, are in flight: the kernel is bound by memory latency, not arithmetic.
#ifndef CUPYROPE_MIN_BLOCKS
#define CUPYROPE_MIN_BLOCKS 4
#endif
constexpr int kMaxThreadsPerBlock = 256;
// float64 arrays hold twice the registers per element: they get one block less (no spills).
template <typename T>
struct MinBlocksPerSM {
  static constexpr int value = sizeof(T) == 8 ? CUPYROPE_MIN_BLOCKS - 1 : CUPYROPE_MIN_BLOCKS;
};

template <typename T, bool VECTOR, bool INTERLEAVED>
struct Layout {
  // Elements per access: 16 bytes on the vector path, one element on the scalar path.
  static constexpr int access = VECTOR ? 16 / static_cast<int>(sizeof(T)) : 1;
  // Pairs per thread and head: NeoX reads one access from each half (access pairs); interleaved
  // reads pairs side by side, so one 16-byte access holds access / 2 of them.
  static constexpr int pairs = INTERLEAVED ? (access >= 2 ? access / 2 : 1) : access;
};

struct TokenOffsets {
  long long q, k, q_out, k_out, positions, cos, sin;
};

__device__ __forceinline__ TokenOffsets token_offsets(const RopeParams& p, long long token) {
  TokenOffsets o = {0, 0, 0, 0, 0, 0, 0};
  long long rest = token;
#pragma unroll
  for (int d = kMaxTokenDims - 1; d >= 0; --d) {
    if (d >= p.token_ndim) continue;
    const long long i = d == 0 ? rest : rest % p.token_shape[d];
    rest = d == 0 ? 0 : rest / p.token_shape[d];
    o.q += i * p.q_token_stride[d];
    o.k += i * p.k_token_stride[d];
    o.q_out += i * p.q_out_token_stride[d];
    o.k_out += i * p.k_out_token_stride[d];
    o.positions += i * p.positions_token_stride[d];
    o.cos += i * p.cos_token_stride[d];
    o.sin += i * p.sin_token_stride[d];
  }
  return o;
}

__device__ __forceinline__ long long load_position(const RopeParams& p, long long offset) {
  if (p.positions == nullptr) return offset;  // implicit arange: the offset is the index
  if (p.positions_are_int64) return static_cast<const long long*>(p.positions)[offset];
  return static_cast<const int*>(p.positions)[offset];
}

template <typename T, typename C, int P, bool VECTOR, bool INTERLEAVED>
__device__ __forceinline__ void rotate_head(const T* in, T* out,
                                            long long pair0, long long half, const C (&cos_v)[P],
                                            const C (&sin_v)[P]) {
  if constexpr (INTERLEAVED) {
    T x[2 * P];
    load_elements<VECTOR>(x, in + 2 * pair0);
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const C x1 = Convert<C>::from(x[2 * i]);
      const C x2 = Convert<C>::from(x[2 * i + 1]);
      x[2 * i] = Store<T>::from(x1 * cos_v[i] - x2 * sin_v[i]);
      x[2 * i + 1] = Store<T>::from(x2 * cos_v[i] + x1 * sin_v[i]);
    }
    store_elements<VECTOR>(out + 2 * pair0, x);
  } else {
    T a[P], b[P];
    load_elements<VECTOR>(a, in + pair0);
    load_elements<VECTOR>(b, in + half + pair0);
#pragma unroll
    for (int i = 0; i < P; ++i) {
      const C x1 = Convert<C>::from(a[i]);
      const C x2 = Convert<C>::from(b[i]);
      a[i] = Store<T>::from(x1 * cos_v[i] - x2 * sin_v[i]);
      b[i] = Store<T>::from(x2 * cos_v[i] + x1 * sin_v[i]);
    }
    store_elements<VECTOR>(out + pair0, a);
    store_elements<VECTOR>(out + half + pair0, b);
  }
}

template <typename T, typename TableT, bool VECTOR, bool INTERLEAVED, int SOURCE>
__global__ __launch_bounds__(kMaxThreadsPerBlock, MinBlocksPerSM<T>::value) void rope_kernel(const RopeParams p) {
  using C = typename ComputeOf<T>::type;
  using L = Layout<T, VECTOR, INTERLEAVED>;
  constexpr int P = L::pairs;

  // No __restrict__ on q/k and their outputs: in place they are the same memory.
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  T* q_out = static_cast<T*>(p.q_out);
  T* k_out = static_cast<T*>(p.k_out);
  const TableT* __restrict__ cos_table = static_cast<const TableT*>(p.cos);
  const TableT* __restrict__ sin_table = static_cast<const TableT*>(p.sin);

  const long long half = p.rotary_dim / 2;
  const long long num_chunks = half / P;
  const long long num_heads = p.num_q_heads + p.num_k_heads;
  const C sin_sign = static_cast<C>(p.sin_sign);
  const bool table_vector_ok = p.table_vector_ok != 0;

  const long long token_step = static_cast<long long>(gridDim.x) * blockDim.z;
  for (long long token = static_cast<long long>(blockIdx.x) * blockDim.z + threadIdx.z;
       token < p.num_tokens; token += token_step) {
    const TokenOffsets o = token_offsets(p, token);
    long long position = 0;
    if constexpr (SOURCE != kTokenTables) position = load_position(p, o.positions);

    for (long long chunk = threadIdx.x; chunk < num_chunks; chunk += blockDim.x) {
      const long long pair0 = chunk * P;
      C cos_v[P], sin_v[P];
      if constexpr (SOURCE == kComputedAngles) {
        const C factor = static_cast<C>(p.attention_factor);
#pragma unroll
        for (int i = 0; i < P; ++i) {
          C s, c;
          accurate_sincos(static_cast<double>(position) * p.inv_freq[pair0 + i], &s, &c);
          cos_v[i] = c * factor;
          sin_v[i] = s * factor * sin_sign;
        }
      } else {
        long long cos_row = o.cos, sin_row = o.sin;
        bool row_valid = true;
        if constexpr (SOURCE == kCacheTable) {
          // Rows outside the cache are never read: they come out as NaN.
          row_valid = position >= 0 && position < p.max_position;
          cos_row = sin_row = row_valid ? position * p.table_row_stride : 0;
        }
        if (row_valid) {
          load_table(cos_v, cos_table + cos_row + pair0 * p.cos_col_stride, p.cos_col_stride,
                     table_vector_ok);
          load_table(sin_v, sin_table + sin_row + pair0 * p.sin_col_stride, p.sin_col_stride,
                     table_vector_ok);
#pragma unroll
          for (int i = 0; i < P; ++i) sin_v[i] *= sin_sign;
        } else {
#pragma unroll
          for (int i = 0; i < P; ++i) cos_v[i] = sin_v[i] = quiet_nan<C>();
        }
      }

      // Not unrolled: under the register cap below, unrolling by 2 measured the same (H200).
      for (long long head = threadIdx.y; head < num_heads; head += blockDim.y) {
        if (head < p.num_q_heads) {
          rotate_head<T, C, P, VECTOR, INTERLEAVED>(q + o.q + head * p.q_head_stride,
                                                    q_out + o.q_out + head * p.q_out_head_stride,
                                                    pair0, half, cos_v, sin_v);
        } else {
          const long long kh = head - p.num_q_heads;
          rotate_head<T, C, P, VECTOR, INTERLEAVED>(k + o.k + kh * p.k_head_stride,
                                                    k_out + o.k_out + kh * p.k_out_head_stride,
                                                    pair0, half, cos_v, sin_v);
        }
      }
    }

    // Dims past rotary_dim pass through: copied when writing to new arrays, untouched in place.
    if (p.copy_pass_through) {
      constexpr int A = L::access;
      const long long pass_chunks = (p.head_dim - p.rotary_dim) / A;
      for (long long chunk = threadIdx.x; chunk < pass_chunks; chunk += blockDim.x) {
        const long long col = p.rotary_dim + chunk * A;
        for (long long head = threadIdx.y; head < num_heads; head += blockDim.y) {
          const bool is_q = head < p.num_q_heads;
          const long long kh = head - p.num_q_heads;
          const T* in = is_q ? q + o.q + head * p.q_head_stride : k + o.k + kh * p.k_head_stride;
          T* out = is_q ? q_out + o.q_out + head * p.q_out_head_stride
                        : k_out + o.k_out + kh * p.k_out_head_stride;
          T v[A];
          load_elements<VECTOR>(v, in + col);
          store_elements<VECTOR>(out + col, v);
        }
      }
    }
  }
}

}  // namespace cupyrope
