// DeepSeek MLA's one launch (cupyrope.mla_rope_and_cache, cupyrope.mla_rope_quantize) with its
// rows moved by bulk copies (bulk_copy.cuh) through a ring of shared-memory stages, as the staged
// fused kernel moves the norm's (fused_staged.cuh). Hopper GPUs of fast memory (the H200) run it
// for launches of many tokens whose rows are contiguous (mla_launch.mla_staged_applies); the item
// kernel (mla.cuh) runs every other launch.
//
// Why: the item kernel keeps one 16-byte access in flight a thread, so its bytes in flight are the
// threads an SM holds (2048 at 32 registers), too few for the H200's memory (75 / 84 / 86 % of an
// SM copy at T = 4096 / 16384 / 65536, docs/perf_log.md). Here one producer thread a block copies
// a token's q row (every head's [nope | rope]), its k_pe and kv_c rows and its cos / sin row into
// a stage ahead of the consumers, and each finished row out as one copy: the q row, the k_pe row,
// the cache row [kv_c | k_pe] (or its two parts, FlashInfer's ckv / kpe caches).
//
// A block: kMlaStagedConsumers consumer threads and one producer warp, of which one thread works.
// A stage holds the token's input rows and, apart, its output rows (the fp8 or 16-bit values the
// consumers convert into): the consumers read the one and write the other, so no consumer ever
// overwrites what another still has to read. Barriers as in the staged fused kernel: `full` (the
// producer's arrival and the bytes of its copies), `done` (every consumer's arrival after its
// stores, behind a proxy fence). A token's items are those of mla.cuh (q's nope chunks, q's rope
// chunks, k_pe's rope chunks, kv_c's chunks), 16 bytes of input each, here from shared memory.
#pragma once

#include "bulk_copy.cuh"
#include "fused_staged.cuh"
#include "mla.cuh"

namespace cupyrope {

// Consumers a block (four warps) and the producer warp; four resident blocks of the reference
// shape's stages (mla_launch.MLA_STAGED_* sizes the launch alike).
constexpr int kMlaStagedConsumers = 128;
constexpr int kMlaStagedThreads = kMlaStagedConsumers + 32;
constexpr int kMlaStagedMinBlocksPerSM = 4;

// Where a stage keeps a token's rows, in bytes from its start: the inputs (q's heads
// [nope | rope] when q is written, k_pe's heads when k is written or the cache, kv_c when the
// cache is, the cos / sin row of the position), a word saying whether that row exists, then the
// outputs (q, k_pe, the cache row [kv_c | k_pe]). Every part is a whole number of 16-byte units
// (the host checks: mla_launch.mla_stage_bytes computes the same sizes).
template <typename T, typename TableT>
struct MlaStageLayout {
  unsigned q_elements, k_elements, kv_elements;
  unsigned q_in, k_in, kv_in, angles, flag, q_out, k_out, cache_out, end;

  __device__ __forceinline__ explicit MlaStageLayout(const MlaParams& p) {
    const unsigned size = static_cast<unsigned>(sizeof(T));
    const unsigned out_size = p.out_format ? 1u : size;
    const unsigned cache_size = p.cache_format ? 1u : size;
    const unsigned rope = static_cast<unsigned>(p.rope_dim);
    const bool cache = p.slot_mapping != nullptr;
    q_elements = p.q_pe_out != nullptr
        ? static_cast<unsigned>(p.num_q_heads) * (static_cast<unsigned>(p.nope_dim) + rope) : 0u;
    k_elements = p.k_pe_out != nullptr || cache ? static_cast<unsigned>(p.num_k_heads) * rope : 0u;
    kv_elements = cache ? static_cast<unsigned>(p.rank) : 0u;
    q_in = 0;
    k_in = q_in + q_elements * size;
    kv_in = k_in + k_elements * size;
    angles = kv_in + kv_elements * size;
    flag = angles + rope * static_cast<unsigned>(sizeof(TableT));
    q_out = flag + 16;
    k_out = q_out + q_elements * out_size;
    cache_out = k_out + (p.k_pe_out != nullptr ? k_elements * out_size : 0u);
    end = cache_out + (cache ? (kv_elements + rope) * cache_size : 0u);
  }
  // Whole 128-byte lines, so that every stage starts on one.
  __device__ __forceinline__ unsigned bytes() const { return (end + 127) / 128 * 128; }
};

// The producer: stage `stage` filled with token `token`'s input rows.
template <typename T, typename TableT>
__device__ __forceinline__ void mla_staged_fill(const MlaParams& p,
                                                const MlaStageLayout<T, TableT>& s,
                                                unsigned char* stage, unsigned long long* full,
                                                long long token, long long position) {
  const unsigned size = static_cast<unsigned>(sizeof(T));
  const unsigned angle_bytes =
      static_cast<unsigned>(p.rope_dim) * static_cast<unsigned>(sizeof(TableT));
  const bool angles = position >= 0 && position < p.max_position;
  // Written before the arrival below, which releases it to the consumers' wait.
  *reinterpret_cast<int*>(stage + s.flag) = angles;
  barrier_arrive_expecting(full, s.angles + (angles ? angle_bytes : 0u));
  if (s.q_elements) {
    // q's row starts at the first head's nope part (its rope part alone without one).
    const void* q = p.nope_dim ? p.q_nope : p.q_pe;
    bulk_load(stage + s.q_in, static_cast<const T*>(q) + token * p.q_pe_strides[0],
              s.q_elements * size, full);
  }
  if (s.k_elements) {
    bulk_load(stage + s.k_in, static_cast<const T*>(p.k_pe) + token * p.k_pe_strides[0],
              s.k_elements * size, full);
  }
  if (s.kv_elements) {
    bulk_load(stage + s.kv_in, static_cast<const T*>(p.kv_c) + token * p.kv_c_stride,
              s.kv_elements * size, full);
  }
  if (angles) {
    const TableT* row = static_cast<const TableT*>(p.table) + position * p.table_row_stride;
    bulk_load(stage + s.angles, row, angle_bytes, full);
  }
}

// The producer: stage `stage`'s output rows (token `token`) to q's and k's outputs and the cache
// row of `slot` (< 0: none), as one bulk group.
template <typename T, typename TableT>
__device__ __forceinline__ void mla_staged_drain(const MlaParams& p,
                                                 const MlaStageLayout<T, TableT>& s,
                                                 const unsigned char* stage, long long token,
                                                 long long slot) {
  const long long out_size = p.out_format ? 1 : static_cast<long long>(sizeof(T));
  const long long cache_size = p.cache_format ? 1 : static_cast<long long>(sizeof(T));
  if (s.q_elements) {
    void* q = p.nope_dim ? p.q_nope_out : p.q_pe_out;
    bulk_store(static_cast<char*>(q) + token * p.q_pe_out_strides[0] * out_size, stage + s.q_out,
               s.q_elements * static_cast<unsigned>(out_size));
  }
  if (p.k_pe_out != nullptr) {
    bulk_store(static_cast<char*>(p.k_pe_out) + token * p.k_pe_out_strides[0] * out_size,
               stage + s.k_out, s.k_elements * static_cast<unsigned>(out_size));
  }
  if (slot >= 0) {
    const long long block = slot / p.block_size, entry = slot - block * p.block_size;
    const unsigned rank_bytes = s.kv_elements * static_cast<unsigned>(cache_size);
    const unsigned pe_bytes = static_cast<unsigned>(p.rope_dim * cache_size);
    char* row = static_cast<char*>(p.kv_cache) +
                (block * p.cache_block_stride + entry * p.cache_row_stride) * cache_size;
    if (p.kpe_cache == nullptr) {
      bulk_store(row, stage + s.cache_out, rank_bytes + pe_bytes);  // the joint row, one copy
    } else {
      if (rank_bytes) bulk_store(row, stage + s.cache_out, rank_bytes);
      bulk_store(static_cast<char*>(p.kpe_cache) +
                     (block * p.kpe_block_stride + entry * p.kpe_row_stride) * cache_size,
                 stage + s.cache_out + rank_bytes, pe_bytes);
    }
  }
  bulk_commit();
}

__device__ __forceinline__ LoadedIndex mla_staged_position(const MlaParams& p, long long token) {
  if (p.positions == nullptr) return LoadedIndex{token, 0, true};
  return load_index(p.positions, token * p.positions_stride, p.positions_int64 != 0);
}

// The slot of `token` (-1: padding or past the cache, skipped), or -1 without a cache write.
__device__ __forceinline__ LoadedIndex mla_staged_slot(const MlaParams& p, long long token) {
  if (p.slot_mapping == nullptr) return LoadedIndex{-1, 0, true};
  return load_index(p.slot_mapping, token * p.slot_stride, p.slots_int64 != 0);
}

// The producer thread: the first stages filled, then for each token of the block its rows copied
// out once the consumers are done with them, and the stage refilled with the token kStagedStages
// later. Positions and slots load a token ahead of their use.
template <typename T, typename TableT>
__device__ __forceinline__ void mla_staged_produce(const MlaParams& p,
                                                   const MlaStageLayout<T, TableT>& s,
                                                   unsigned char* stages,
                                                   unsigned long long* full,
                                                   unsigned long long* done, long long first,
                                                   long long step, int count) {
  const unsigned stage_bytes = s.bytes();
  {
    long long positions[kStagedStages];
#pragma unroll
    for (int i = 0; i < kStagedStages; ++i) {
      positions[i] = i < count ? mla_staged_position(p, first + i * step).value() : 0;
    }
#pragma unroll
    for (int i = 0; i < kStagedStages; ++i) {
      if (i < count) {
        mla_staged_fill<T, TableT>(p, s, stages + i * stage_bytes, full + i, first + i * step,
                                   positions[i]);
      }
    }
  }
  LoadedIndex next_position{0, 0, true};
  if (kStagedStages < count) {
    next_position = mla_staged_position(p, first + kStagedStages * step);
  }
  LoadedIndex next_slot{-1, 0, true};
  if (count > 0) next_slot = mla_staged_slot(p, first);
  for (int j = 0; j < count; ++j) {
    const int i = j % kStagedStages;
    const long long token = first + j * step;
    unsigned char* stage = stages + i * stage_bytes;
    long long slot = next_slot.value();
    if (slot >= p.num_slots) slot = -1;  // past the cache: skipped, as padding
    if (j + 1 < count) next_slot = mla_staged_slot(p, token + step);
    barrier_wait(done + i, (j / kStagedStages) & 1);
    mla_staged_drain<T, TableT>(p, s, stage, token, slot);
    if (j + kStagedStages < count) {
      bulk_wait<false>();  // the stores have read the stage
      mla_staged_fill<T, TableT>(p, s, stage, full + i, token + kStagedStages * step,
                                 next_position.value());
      if (j + kStagedStages + 1 < count) {
        next_position = mla_staged_position(p, token + (kStagedStages + 1) * step);
      }
    }
  }
  bulk_wait<true>();  // the block's shared memory must outlive the copies out of it
}

// One rope chunk of a head in shared memory: P pairs from `pair0` of the head at `in` (rope part,
// `half` = rope_dim / 2), rotated by the stage's cos / sin row (NaN where `angles` is false;
// not rotated where `rotate` is false), stored at element `at` of `out` in `format` and, where
// `second` is given, at element `second_at` of it in `second_format` (k_pe's chunk: its output
// and the cache row).
template <typename T, typename TableT, bool INTERLEAVED, int P, int A>
__device__ __forceinline__ void mla_staged_rope(const T* in, const TableT* cos_row, int half,
                                                int pair0, bool angles, bool rotate, void* out,
                                                unsigned at, long long format, float inv_scale,
                                                void* second, unsigned second_at,
                                                long long second_format, float second_inv) {
  float c[P], s[P];
  if (angles) {
    load_table(c, cos_row + pair0, 1, true);
    load_table(s, cos_row + half + pair0, 1, true);
  } else {
#pragma unroll
    for (int j = 0; j < P; ++j) c[j] = s[j] = quiet_nan<float>();
  }
  if constexpr (INTERLEAVED) {
    float x[A], y[A];
    mla_load<T, true, A>(x, in + 2 * pair0);
    mla_rotate(x, c, s, rotate, y);
    store_value_words<T, A, unsigned, true>(out, at + 2 * pair0, y, format, inv_scale);
    if (second != nullptr) {
      store_value_words<T, A, unsigned, true>(second, second_at + 2 * pair0, y, second_format,
                                              second_inv);
    }
  } else {
    float x1[P], x2[P], y1[P], y2[P];
    mla_load<T, true, P>(x1, in + pair0);
    mla_load<T, true, P>(x2, in + half + pair0);
    mla_rotate(x1, x2, c, s, rotate, y1, y2);
    store_value_words<T, P, unsigned, true>(out, at + pair0, y1, format, inv_scale);
    store_value_words<T, P, unsigned, true>(out, at + half + pair0, y2, format, inv_scale);
    if (second != nullptr) {
      store_value_words<T, P, unsigned, true>(second, second_at + pair0, y1, second_format,
                                              second_inv);
      store_value_words<T, P, unsigned, true>(second, second_at + half + pair0, y2,
                                              second_format, second_inv);
    }
  }
}

// 16-bit q / k_pe / kv_c (A = 8 elements a 16-byte access), a cos_sin_cache of float32 or of
// their dtype.
template <typename T, typename TableT, bool INTERLEAVED>
__device__ __forceinline__ void mla_staged_tokens(const MlaParams& p) {
  constexpr int A = 16 / static_cast<int>(sizeof(T));
  constexpr int P = INTERLEAVED ? A / 2 : A;
  extern __shared__ __align__(16) unsigned char mla_shared[];

  const MlaStageLayout<T, TableT> s(p);
  const unsigned stage_bytes = s.bytes();
  unsigned long long* full =
      reinterpret_cast<unsigned long long*>(mla_shared + kStagedStages * stage_bytes);
  unsigned long long* done = full + kStagedStages;
  const int tid = static_cast<int>(threadIdx.x);
  const long long first = blockIdx.x, step = gridDim.x;
  const int count =
      first < p.num_tokens ? static_cast<int>((p.num_tokens - first + step - 1) / step) : 0;
  if (tid == 0) staged_barriers_init(full, done, 1, kMlaStagedConsumers);
  __syncthreads();
  if (tid >= kMlaStagedConsumers) {
    if (tid == kMlaStagedConsumers) {
      mla_staged_produce<T, TableT>(p, s, mla_shared, full, done, first, step, count);
    }
    return;
  }

  const float q_inv = 1.0f / (p.q_scale != nullptr ? *p.q_scale : p.q_scale_value);
  const float k_inv = 1.0f / (p.k_scale != nullptr ? *p.k_scale : p.k_scale_value);
  const float kv_inv = 1.0f / (p.kv_scale != nullptr ? *p.kv_scale : p.kv_scale_value);
  const int rope = static_cast<int>(p.rope_dim), half = rope / 2;
  const int nope = static_cast<int>(p.nope_dim), q_head = nope + rope;
  const bool rotate = p.rotate != 0, cache = p.slot_mapping != nullptr;
  // A token's items, every token alike: q's nope chunks, q's rope chunks, k_pe's rope chunks,
  // kv_c's chunks (the order of mla.cuh, so that a warp's items mostly take one path).
  const MlaDivisor nope_chunks(s.q_elements ? nope / A : 0);
  const MlaDivisor rope_chunks(half / P);
  const int q_heads = static_cast<int>(p.num_q_heads);
  const int q_nope_items = s.q_elements ? q_heads * nope_chunks.n : 0;
  const int q_items = s.q_elements ? q_nope_items + q_heads * rope_chunks.n : 0;
  const int k_items = s.k_elements ? static_cast<int>(p.num_k_heads) * rope_chunks.n : 0;
  const int total = q_items + k_items + static_cast<int>(s.kv_elements) / A;
  for (int j = 0; j < count; ++j) {
    const int i = j % kStagedStages;
    unsigned char* stage = mla_shared + i * stage_bytes;
    barrier_wait(full + i, (j / kStagedStages) & 1);
    const bool angles = *reinterpret_cast<const int*>(stage + s.flag) != 0;
    const TableT* cos_row = reinterpret_cast<const TableT*>(stage + s.angles);
    for (int item = tid; item < total; item += kMlaStagedConsumers) {
      if (item < q_nope_items) {
        const int head = nope_chunks.of(item);
        const int at = head * q_head + (item - head * nope_chunks.n) * A;
        float v[A];
        mla_load<T, true, A>(v, reinterpret_cast<const T*>(stage + s.q_in) + at);
        store_value_words<T, A, unsigned, true>(stage + s.q_out, at, v, p.out_format, q_inv);
      } else if (item < q_items) {
        const int r = item - q_nope_items;
        const int head = rope_chunks.of(r);
        const int at = head * q_head + nope;
        mla_staged_rope<T, TableT, INTERLEAVED, P, A>(
            reinterpret_cast<const T*>(stage + s.q_in) + at, cos_row, half,
            (r - head * rope_chunks.n) * P, angles, rotate, stage + s.q_out, at, p.out_format,
            q_inv, nullptr, 0, 0, 0.0f);
      } else if (item < q_items + k_items) {
        // k_pe's heads: to k's output where it is written, and (one head: the host checks) to
        // the cache row after kv_c.
        const int r = item - q_items;
        const int head = rope_chunks.of(r);
        const int at = head * rope;
        const bool k_out = p.k_pe_out != nullptr;
        mla_staged_rope<T, TableT, INTERLEAVED, P, A>(
            reinterpret_cast<const T*>(stage + s.k_in) + at, cos_row, half,
            (r - head * rope_chunks.n) * P, angles, rotate,
            k_out ? stage + s.k_out : stage + s.cache_out,
            k_out ? at : s.kv_elements, k_out ? p.out_format : p.cache_format,
            k_out ? k_inv : kv_inv, k_out && cache ? stage + s.cache_out : nullptr,
            s.kv_elements, p.cache_format, kv_inv);
      } else {
        const int at = (item - q_items - k_items) * A;
        float v[A];
        mla_load<T, true, A>(v, reinterpret_cast<const T*>(stage + s.kv_in) + at);
        store_value_words<T, A, unsigned, true>(stage + s.cache_out, at, v, p.cache_format,
                                                kv_inv);
      }
    }
    fence_for_bulk_copies();  // this thread's stores, before the producer's copies read them
    barrier_arrive(done + i);
  }
}

// Built for an architecture without bulk copies it traps: no launch picks it there.
template <typename T, typename TableT, bool INTERLEAVED>
__global__ __launch_bounds__(kMlaStagedThreads, kMlaStagedMinBlocksPerSM) void
mla_staged_kernel(const MlaParams p) {
#if CUPYROPE_BULK_COPY
  mla_staged_tokens<T, TableT, INTERLEAVED>(p);
#else
  __trap();
#endif
}

}  // namespace cupyrope
