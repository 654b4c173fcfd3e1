// DeepSeek MLA (cupyrope.mla_rope_and_cache, cupyrope.mla_rope_quantize) in one launch: every q
// head [nope | rope] stored whole with its rope part (the LAST rope_dim dims) rotated, k_pe (and
// a k nope part) likewise, and the latent cache row [kv_c | rotated k_pe] of each token's slot
// (vLLM's concat_and_cache_mla layout; or kv_c and k_pe in two caches, FlashInfer's ckv / kpe
// layout), each element rounded once to its output format (the input dtype, or fp8 value /
// scale through store_values of fused.cuh).
//
// Work: blockIdx.x strides over tokens; the threads of a block (64-128: mla_launch.mla_geometry;
// of gridDim.y blocks, a decode step's share) share out the token's items in rounds, one
// access of A elements (16 bytes when VECTOR; pass-through chunks two where the parts split
// into them) each:
//   q items    num_q_heads * (nope chunks + rope chunks), when q outputs are written;
//   k items    num_k_heads * (k nope chunks + rope chunks), when k outputs are written;
//   cache      kv_c chunks, when the token's slot is in the cache; the rotated k_pe goes to the
//              cache row from the k items (or from rope chunks of its own without k outputs).
// A rope chunk holds P pairs: GPT-J pairs (2j, 2j + 1) are A consecutive elements, NeoX pairs
// (j, j + rope_dim / 2) two runs of A. Its cos / sin come from the cos_sin_cache row of the
// token's position (NaN outside the table) or are computed (angles.cuh), as in the rope kernels.
// cupyrope/cuda/mla_launch.py holds MLA_PARAMS_DTYPE, this struct's layout, and the host checks
// that make every access of a VECTOR launch aligned.
#pragma once

#include "angles.cuh"
#include "fused.cuh"
#include "numeric.cuh"
#include "rope_params.cuh"
#include "rotation.cuh"
#include "vector_io.cuh"

namespace cupyrope {

struct MlaParams {
  const void* q_nope;  // inputs [T, heads, dim], any token / head strides, unit last stride
  const void* q_pe;
  const void* k_nope;
  const void* k_pe;
  const void* kv_c;  // [T, rank]
  void* q_nope_out;  // outputs (nullptr: not written); the q_pe / k_pe inputs when in place
  void* q_pe_out;
  void* k_nope_out;
  void* k_pe_out;
  void* kv_cache;  // [num_blocks, block_size, rank + rope_dim], or [.., rank] with kpe_cache
  void* kpe_cache;  // [num_blocks, block_size, rope_dim]; nullptr: k_pe after kv_c in kv_cache
  const void* positions;  // int32 / int64, nullptr: the token index
  const void* slot_mapping;
  const void* table;  // cos_sin_cache [max_position, rope_dim], or nullptr for computed angles
  const double* inv_freq;  // computed angles: rope_dim / 2 frequencies
  const float* q_scale;  // one-element fp8 scales read here (nullptr: the values below)
  const float* k_scale;
  const float* kv_scale;
  long long q_nope_strides[2], q_pe_strides[2], k_nope_strides[2], k_pe_strides[2];
  long long q_nope_out_strides[2], q_pe_out_strides[2], k_nope_out_strides[2], k_pe_out_strides[2];
  long long kv_c_stride, cache_block_stride, cache_row_stride, kpe_block_stride, kpe_row_stride;
  long long positions_stride, slot_stride, table_row_stride, table_col_stride;
  long long num_tokens, num_q_heads, num_k_heads, nope_dim, k_nope_dim, rope_dim, rank;
  long long num_slots, block_size, max_position;
  long long positions_int64, slots_int64, out_format, cache_format, rotate;
  float q_scale_value, k_scale_value, kv_scale_value, attention_factor;
};
static_assert(sizeof(MlaParams) == 480, "MlaParams must match MLA_PARAMS_DTYPE (mla_launch.py)");

__device__ __forceinline__ long long mla_index(const void* values, long long i, bool wide) {
  return wide ? static_cast<const long long*>(values)[i] : static_cast<const int*>(values)[i];
}

// A elements at `in`, as float32.
template <typename T, bool VECTOR, int A>
__device__ __forceinline__ void mla_load(float (&v)[A], const T* in) {
  T raw[A];
  load_elements<VECTOR>(raw, in);
#pragma unroll
  for (int i = 0; i < A; ++i) v[i] = to_float(raw[i]);
}

// cos / sin of the P pairs from `pair0` at `position` (NaN outside the table). `vector`: the
// table's rows load as vectors (unit column stride; the table, its rows and the sin half
// aligned to the P values' bytes).
template <typename TableT, int SOURCE, int P>
__device__ __forceinline__ void mla_angles(const MlaParams& p, long long position, long long pair0,
                                           bool vector, float (&c)[P], float (&s)[P]) {
  if constexpr (SOURCE == kCacheTable) {
    if (position >= 0 && position < p.max_position) {
      const TableT* row = static_cast<const TableT*>(p.table) + position * p.table_row_stride;
      const long long col = p.table_col_stride;
      load_table(c, row + pair0 * col, col, vector);
      load_table(s, row + (p.rope_dim / 2 + pair0) * col, col, vector);
    } else {
#pragma unroll
      for (int j = 0; j < P; ++j) c[j] = s[j] = quiet_nan<float>();
    }
  } else {
    // Blackwell: two pairs an iteration (fully unrolled, the range reductions of every pair of
    // a 16-byte float32 chunk kept too many values live across their slow path and spilled).
#if __CUDA_ARCH__ >= 1000
#pragma unroll 2
#else
#pragma unroll
#endif
    for (int j = 0; j < P; ++j) {
      angle_sincos(position, p.inv_freq[pair0 + j], &s[j], &c[j]);
      c[j] *= p.attention_factor;
      s[j] *= p.attention_factor;
    }
  }
}

// N values stored in `format` (fused.cuh): whole 32-bit words of a vector access as 16- / 8-byte
// stores (store_value_words), else element by element.
template <typename T, bool VECTOR, int N, typename Index>
__device__ __forceinline__ void mla_store_values(void* base, Index offset, const float (&v)[N],
                                                 long long format, float inv_scale) {
  if constexpr (VECTOR && N % 4 == 0) {
    store_value_words<T>(base, offset, v, format, inv_scale);
  } else {
    store_values<T, VECTOR>(base, offset, v, format, inv_scale);
  }
}

// One rope chunk: the P pairs from `pair0` of the head at `in`, rotated (or not, for the cache
// write alone) and stored at element `out_offset` of `out` in `format`.
// A second destination (`cache`, nullptr: none) takes the same values in its own format: the k
// head's chunk goes to the k output and to the cache row in one go, so that an in-place k
// output never overwrites values another thread still has to read.
template <typename Index>
struct MlaTarget {
  void* base;
  Index offset;
  long long format;
  float inv_scale;
};

template <typename T, bool VECTOR, int N, typename Index>
__device__ __forceinline__ void mla_store(const MlaTarget<Index>& t, Index at,
                                          const float (&v)[N]) {
  if (t.base != nullptr) {
    mla_store_values<T, VECTOR>(t.base, t.offset + at, v, t.format, t.inv_scale);
  }
}

// The pairs of a rope chunk rotated by (c, s), or passed through where `rotate` is false (the
// cache write alone): GPT-J pairs side by side in `x`, NeoX pairs (x1[j], x2[j]).
template <int P>
__device__ __forceinline__ void mla_rotate(const float (&x)[2 * P], const float (&c)[P],
                                           const float (&s)[P], bool rotate, float (&y)[2 * P]) {
#pragma unroll
  for (int j = 0; j < P; ++j) {
    if (rotate) {
      rotate_pair(x[2 * j], x[2 * j + 1], c[j], s[j], 1.0f, y[2 * j], y[2 * j + 1]);
    } else {
      y[2 * j] = x[2 * j];
      y[2 * j + 1] = x[2 * j + 1];
    }
  }
}

template <int P>
__device__ __forceinline__ void mla_rotate(const float (&x1)[P], const float (&x2)[P],
                                           const float (&c)[P], const float (&s)[P], bool rotate,
                                           float (&y1)[P], float (&y2)[P]) {
#pragma unroll
  for (int j = 0; j < P; ++j) {
    if (rotate) {
      rotate_pair(x1[j], x2[j], c[j], s[j], 1.0f, y1[j], y2[j]);
    } else {
      y1[j] = x1[j];
      y2[j] = x2[j];
    }
  }
}

template <typename T, bool VECTOR, bool INTERLEAVED, int P, int A, typename Index>
__device__ __forceinline__ void mla_rope_chunk(const T* in, const MlaTarget<Index>& out,
                                               const MlaTarget<Index>& cache, Index half,
                                               Index pair0, const float (&c)[P],
                                               const float (&s)[P], bool rotate) {
  if constexpr (INTERLEAVED) {
    float x[2 * P], y[2 * P];
    mla_load<T, VECTOR, 2 * P>(x, in + 2 * pair0);
    mla_rotate(x, c, s, rotate, y);
    mla_store<T, VECTOR>(out, 2 * pair0, y);
    mla_store<T, VECTOR>(cache, 2 * pair0, y);
  } else {
    float x1[P], x2[P], y1[P], y2[P];
    mla_load<T, VECTOR, P>(x1, in + pair0);
    mla_load<T, VECTOR, P>(x2, in + half + pair0);
    mla_rotate(x1, x2, c, s, rotate, y1, y2);
    mla_store<T, VECTOR>(out, pair0, y1);
    mla_store<T, VECTOR>(out, half + pair0, y2);
    mla_store<T, VECTOR>(cache, pair0, y1);
    mla_store<T, VECTOR>(cache, half + pair0, y2);
  }
}

// One pass-through chunk of `wide` ? 2 A : A elements: `in` stored at `out_offset` of `out` in
// `format`, both loads issued before either store (two 16-byte accesses in flight a thread, and
// an item's index and address work spent on twice the bytes).
template <typename T, bool VECTOR, int A, typename Index>
__device__ __forceinline__ void mla_copy_chunk(const T* in, void* out, Index out_offset,
                                               long long format, float inv_scale, bool wide) {
  float v[A], w[A];
  mla_load<T, VECTOR, A>(v, in);
  if (wide) mla_load<T, VECTOR, A>(w, in + A);
  mla_store_values<T, VECTOR>(out, out_offset, v, format, inv_scale);
  if (wide) mla_store_values<T, VECTOR>(out, out_offset + A, w, format, inv_scale);
}

// x / n for the item counts of a token, n > 0: a shift where n is a power of two (every DeepSeek
// shape), set once a launch; the division otherwise.
struct MlaDivisor {
  int n;
  int shift;  // -1: n is no power of two
  __device__ __forceinline__ explicit MlaDivisor(int value)
      : n(value), shift(value > 0 && (value & (value - 1)) == 0 ? __ffs(value) - 1 : -1) {}
  __device__ __forceinline__ int of(int x) const { return shift >= 0 ? x >> shift : x / n; }
};

// Item `item` of one part (q or k) of a token: first the nope chunks of every head (when
// written), then the rope chunks of every head, so that a warp's items take one path (a warp
// of 32 items that mixed a head's nope and rope chunks ran both, 19 of 32 threads active).
// `cache`: where the k head's rotated rope part also goes (base nullptr: nowhere).
template <typename T, typename TableT, bool VECTOR, bool INTERLEAVED, int SOURCE, int A, int P,
          typename Index>
__device__ __forceinline__ void mla_part_item(
    const MlaParams& p, int item, Index token, long long position, int nope_items,
    const MlaDivisor& nope_chunks, const MlaDivisor& rope_chunks, const void* nope,
    const long long (&nope_strides)[2], void* nope_out, const long long (&nope_out_strides)[2],
    const void* pe, const long long (&pe_strides)[2], void* pe_out,
    const long long (&pe_out_strides)[2], long long format, float inv_scale,
    const MlaTarget<Index>& cache, bool table_vector, bool wide) {
  if (item < nope_items) {
    const int copy_width = wide ? 2 * A : A;  // a pass-through chunk's elements
    const int head = nope_chunks.of(item);
    const int chunk = item - head * nope_chunks.n;
    const T* in = static_cast<const T*>(nope) + (token * static_cast<Index>(nope_strides[0]) +
                                                 head * static_cast<Index>(nope_strides[1]));
    mla_copy_chunk<T, VECTOR, A>(in + chunk * copy_width, nope_out,
                                 token * static_cast<Index>(nope_out_strides[0]) +
                                     head * static_cast<Index>(nope_out_strides[1]) +
                                     chunk * copy_width,
                                 format, inv_scale, wide);
  } else {
    const int rope_item = item - nope_items;
    const int head = rope_chunks.of(rope_item);
    const Index pair0 = static_cast<Index>(rope_item - head * rope_chunks.n) * P;
    float c[P], s[P];
    mla_angles<TableT, SOURCE, P>(p, position, pair0, table_vector, c, s);
    const T* in = static_cast<const T*>(pe) + (token * static_cast<Index>(pe_strides[0]) +
                                               head * static_cast<Index>(pe_strides[1]));
    const MlaTarget<Index> out{pe_out,
                               token * static_cast<Index>(pe_out_strides[0]) +
                                   head * static_cast<Index>(pe_out_strides[1]),
                               format, inv_scale};
    mla_rope_chunk<T, VECTOR, INTERLEAVED, P, A>(in, out, cache,
                                                 static_cast<Index>(p.rope_dim / 2), pair0, c,
                                                 s, p.rotate != 0);
  }
}

template <typename T, typename TableT, bool VECTOR, bool INTERLEAVED, int SOURCE, bool WIDE_INDEX>
__device__ __forceinline__ void mla_rope_tokens(const MlaParams& p) {
  // Element offsets into q, k, their outputs, kv_c and the caches: 32-bit where every array's
  // reach fits (mla_launch.plan_mla_launch), which frees the registers of 64-bit products.
  using Index = typename IndexOf<WIDE_INDEX>::type;
  // A elements an access; P pairs a rope chunk (GPT-J: A / 2 pairs are A elements).
  constexpr int A = VECTOR ? 16 / static_cast<int>(sizeof(T)) : 1;
  constexpr int P = VECTOR ? (INTERLEAVED ? A / 2 : A) : 1;
  const float q_inv = 1.0f / (p.q_scale != nullptr ? *p.q_scale : p.q_scale_value);
  const float k_inv = 1.0f / (p.k_scale != nullptr ? *p.k_scale : p.k_scale_value);
  const float kv_inv = 1.0f / (p.kv_scale != nullptr ? *p.kv_scale : p.kv_scale_value);
  const long long half = p.rope_dim / 2;
  // A token's items (the same for every token): q's nope then rope chunks, k's, then the cache
  // row's. Counted in 32 bits (plan_mla_launch refuses larger tokens).
  // Pass-through chunks of two accesses where every pass-through run splits into them (DeepSeek:
  // nope 128, rank 512), else of one: the item's index and address work then buys twice the bytes
  // (H200, DeepSeek-V3 at T = 65536: 61.3 -> 65.3 % of a copy). GPT-J pairs only: NeoX rope
  // chunks hold twice the pairs, and 16-bit ones spilled 4-58 bytes beside the wide copies.
  const bool wide = VECTOR && INTERLEAVED && p.nope_dim % (2 * A) == 0 &&
                    p.k_nope_dim % (2 * A) == 0 && p.rank % (2 * A) == 0;
  const int copy_width = wide ? 2 * A : A;
  const MlaDivisor rope_chunks(static_cast<int>(half) / P);
  const MlaDivisor q_nope_chunks(p.q_nope_out != nullptr ? static_cast<int>(p.nope_dim) / copy_width
                                                         : 0);
  const MlaDivisor k_nope_chunks(p.k_nope_out != nullptr
                                     ? static_cast<int>(p.k_nope_dim) / copy_width : 0);
  const int q_nope_items = static_cast<int>(p.num_q_heads) * q_nope_chunks.n;
  const int k_nope_items = static_cast<int>(p.num_k_heads) * k_nope_chunks.n;
  const int q_items = p.q_pe_out != nullptr
      ? q_nope_items + static_cast<int>(p.num_q_heads) * rope_chunks.n : 0;
  const int k_items = p.k_pe_out != nullptr
      ? k_nope_items + static_cast<int>(p.num_k_heads) * rope_chunks.n : 0;
  constexpr int table_bytes = VectorBytes<TableT, P>::chunk;
  const bool table_vector = SOURCE == kCacheTable && VECTOR && p.table_col_stride == 1 &&
      reinterpret_cast<unsigned long long>(p.table) % table_bytes == 0 &&
      (p.table_row_stride * static_cast<long long>(sizeof(TableT))) % table_bytes == 0 &&
      (half * static_cast<long long>(sizeof(TableT))) % table_bytes == 0;
  // The cache row's items, when the launch writes the cache (kv_cache may be empty: rank 0):
  // kv_c chunks, then, without k outputs, chunks of the rotated k_pe (with them the k items store
  // it there too: k_pe's one head). A token whose slot is padding skips them in the loop, so
  // that the count, and with it the first items' loads, never waits for the token's slot.
  const int rank_chunks = static_cast<int>(p.rank) / copy_width;
  const int cache_items = p.slot_mapping != nullptr
      ? rank_chunks + (k_items == 0 ? static_cast<int>(half) / P : 0) : 0;
  const int total = q_items + k_items + cache_items;
  const bool joint = p.kpe_cache == nullptr;
  const MlaTarget<Index> no_cache{nullptr, 0, 0, 0.0f};
  for (Index token = blockIdx.x; token < p.num_tokens; token += gridDim.x) {
    // Both read here and waited for only by the items that use them: the rope chunks (position)
    // and the k and cache items (slot), the last of a token's items.
    const long long position = p.positions != nullptr
        ? mla_index(p.positions, token * p.positions_stride, p.positions_int64 != 0)
        : token;
    long long slot = -1;
    if (p.slot_mapping != nullptr) {
      slot = mla_index(p.slot_mapping, token * p.slot_stride, p.slots_int64 != 0);
      if (slot >= p.num_slots) slot = -1;  // past the cache: skipped, as padding
    }
    // blockIdx.y: the block's share of the token's items. A few tokens (a decode step) spread
    // their items over several blocks, one item a thread, where a block of 128 threads took a
    // DeepSeek-V3 token's 296 items in three rounds, one after another: H200, T = 1 / 32 3.73 /
    // 3.94 -> 2.88 / 3.16 us (cupyrope/cuda/mla_launch.py: mla_grid).
    for (int item = static_cast<int>(threadIdx.x + blockIdx.y * blockDim.x); item < total;
         item += static_cast<int>(blockDim.x * gridDim.y)) {
      if (item < q_items) {
        mla_part_item<T, TableT, VECTOR, INTERLEAVED, SOURCE, A, P, Index>(
            p, item, token, position, q_nope_items, q_nope_chunks, rope_chunks, p.q_nope,
            p.q_nope_strides, p.q_nope_out, p.q_nope_out_strides, p.q_pe, p.q_pe_strides,
            p.q_pe_out, p.q_pe_out_strides, p.out_format, q_inv, no_cache, table_vector,
            wide);
        continue;
      }
      if (item >= q_items + k_items && slot < 0) continue;  // no cache row for padding
      // The cache row of the token's slot: k_pe's row is in a cache of its own (FlashInfer's
      // kpe_cache) or is the joint row's last rope_dim entries (the host then gives the joint
      // row's strides as kpe strides): one code path for both layouts.
      Index row = 0, pe_row = 0;
      if (slot >= 0) {
        // 32-bit division where the cache's slots fit (every cache in practice).
        const long long block = p.num_slots <= 0x7fffffffLL
            ? static_cast<long long>(static_cast<unsigned>(slot) /
                                     static_cast<unsigned>(p.block_size))
            : slot / p.block_size;
        const long long entry = slot - block * p.block_size;
        row = static_cast<Index>(block) * static_cast<Index>(p.cache_block_stride) +
              static_cast<Index>(entry) * static_cast<Index>(p.cache_row_stride);
        pe_row = static_cast<Index>(block) * static_cast<Index>(p.kpe_block_stride) +
                 static_cast<Index>(entry) * static_cast<Index>(p.kpe_row_stride);
      }
      const MlaTarget<Index> cache_pe{slot >= 0 ? (joint ? p.kv_cache : p.kpe_cache) : nullptr,
                                      pe_row + (joint ? static_cast<Index>(p.rank) : 0),
                                      p.cache_format, kv_inv};
      if (item < q_items + k_items) {
        mla_part_item<T, TableT, VECTOR, INTERLEAVED, SOURCE, A, P, Index>(
            p, item - q_items, token, position, k_nope_items, k_nope_chunks, rope_chunks,
            p.k_nope, p.k_nope_strides, p.k_nope_out, p.k_nope_out_strides, p.k_pe,
            p.k_pe_strides, p.k_pe_out, p.k_pe_out_strides, p.out_format, k_inv, cache_pe,
            table_vector, wide);
      } else {
        const int chunk = item - q_items - k_items;
        if (chunk < rank_chunks) {
          mla_copy_chunk<T, VECTOR, A>(static_cast<const T*>(p.kv_c) +
                                           (token * static_cast<Index>(p.kv_c_stride) +
                                            chunk * copy_width),
                                       p.kv_cache, row + static_cast<Index>(chunk * copy_width),
                                       p.cache_format, kv_inv, wide);
        } else {
          const Index pair0 = static_cast<Index>(chunk - rank_chunks) * P;
          float c[P], s[P];
          mla_angles<TableT, SOURCE, P>(p, position, pair0, table_vector, c, s);
          mla_rope_chunk<T, VECTOR, INTERLEAVED, P, A>(
              static_cast<const T*>(p.k_pe) + token * static_cast<Index>(p.k_pe_strides[0]),
              cache_pe, no_cache, static_cast<Index>(half), pair0, c, s, p.rotate != 0);
        }
      }
    }
  }
}

// Resident blocks of 128 threads (the launch bound; launches of many tokens take blocks of 96 or
// 64 under the same register cap: mla_launch.mla_geometry). Each thread keeps one item in
// flight, so the threads an SM holds are its bytes in flight: the kernel is bound by them, not
// by its instructions. H200, DeepSeek-V3 at T = 65536 (bf16 / fp8 cache), % of a copy, 64-bit
// offsets in blocks of 128: 8 blocks (64 registers) 59.7 / 57.5, 9 (55) 64.7 / 62.5, 10 (42)
// 68.5 / 65.7, 12 (40) 74.9 / 71.6; 14 and more (32 registers) spilled. With 32-bit offsets
// (WIDE_INDEX false) the 16-bit GPT-J kernel with a cos / sin table fits 32 registers with no
// spill: 16 blocks, 2048 threads an SM (blocks of 64 at 40 registers: 81.6 / 79.6 -> 85.9 /
// 86.1 at 32). On sm_90:
//   16  16-bit GPT-J pairs from a table, 32-bit offsets, but float16 with a float32 table
//       (16 bytes spilled at 14 and 16: ptxas caps both at 32 registers);
//   12  the other 16-bit GPT-J kernels (computed angles spilled 200-232 bytes at 16; 64-bit
//       offsets, 40 registers);
//   10  float32 GPT-J pairs (12 spilled 12-102 bytes; 46-48 registers at 10, speed not
//       measured);
//   8   NeoX chunks (twice the pairs: 22-72 bytes spilled at 10 and 12).
// sm_80 / 100 / 120: 8 (they spilled from 9, and 8 is what those GPUs were built and tested
// with: 4 blocks held 640 threads at the 92-104 registers ptxas took without a cap).
// tests/test_kernel_compile.py checks that nothing spills; cupyrope/frontends/jax/mla.py's
// native entry takes the same bound from here.
template <typename T, typename TableT, bool INTERLEAVED, int SOURCE, bool WIDE_INDEX>
struct MlaMinBlocksPerSM {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
  static constexpr bool sixteen_bit = sizeof(T) == 2;
  static constexpr int value =
      !INTERLEAVED ? 8
      : !sixteen_bit ? 10
      : WIDE_INDEX || SOURCE != kCacheTable ? 12
      : IsHalf<T>::value && sizeof(TableT) == 4 ? 12 : 16;
#else
  static constexpr int value = 8;
#endif
};

template <typename T, typename TableT, bool VECTOR, bool INTERLEAVED, int SOURCE, bool WIDE_INDEX>
__global__ __launch_bounds__(128, (MlaMinBlocksPerSM<T, TableT, INTERLEAVED, SOURCE,
                                                     WIDE_INDEX>::value)) void
mla_rope_kernel(const MlaParams p) {
  mla_rope_tokens<T, TableT, VECTOR, INTERLEAVED, SOURCE, WIDE_INDEX>(p);
}

}  // namespace cupyrope
