// The staged fused kernel: QK-RMSNorm + RoPE, with or without the k / v cache write, its rows
// moved by bulk copies (bulk_copy.cuh) through a ring of shared-memory stages. Hopper GPUs of
// fast memory (the H200) run it past the fused decode kernel's few tokens
// (launch.fused_staged_applies); the lean fused kernel (fused_lean.cuh) runs every other launch.
//
// Why: the lean kernel holds one head's chunk a thread in registers, and with the norm its
// registers leave 768-960 threads an SM: too few bytes in flight for the H200's memory (norm +
// rope + cache 83 / 87 / 89 % of an SM copy at T = 4096 / 16384 / 65536, docs/perf_log.md). Here
// one producer thread a block copies whole token rows (q's heads, k's, v's, the token's cos and
// sin row) into the stages ahead of the consumers, so a block keeps up to three tokens' rows in
// flight with no register holding them, and copies the finished rows out (q_out, k_out, the k and
// v cache rows: the v row never passes through a register).
//
// A block: the consumer warps (thread rows of `lanes` threads, one head's chunks a row, as in the
// lean kernel) and one producer warp, the last 32 threads, of which one thread works. Each stage
// has two barriers: `full` (the producer's arrival and the bytes of its copies) and `done` (every
// consumer thread's arrival after its stores, behind a proxy fence so that the copy engine reads
// them). The consumers normalise and rotate a stage's heads in place in shared memory, with the
// lean kernel's helpers (LeanChunk, lean_rotate_store_pairs); the host admits only stores of the
// input dtype (no fp8), full rotation, contiguous heads, a cos_sin_cache with 16-byte rows and
// 16-bit q / k (launch.fused_staged_applies). The block's tokens are blockIdx.x, + gridDim.x,
// ... (a persistent grid). H200, norm + rope + cache at T = 4096 / 16384: 82.7 / 86.8 -> 86.7 /
// 88.2 % of an SM copy (docs/perf_log.md).
#pragma once

#include "bulk_copy.cuh"
#include "fused_lean.cuh"

namespace cupyrope {

// Stages of the ring (launch.STAGED_STAGES sizes the block's shared memory for this many) and the
// most threads a block (launch.STAGED_MAX_THREADS: the consumers' 160 at most and the producer
// warp). Four resident blocks (what the stages' shared memory allows at the reference shape)
// leave 80 registers a thread; at three blocks of 384 (56 registers) the producer's loop spilled
// 44-60 bytes of the NeoX kernels on sm_90.
constexpr int kStagedStages = 4;
constexpr int kStagedMaxThreads = 192;
constexpr int kStagedMinBlocksPerSM = 4;

// The ring's barriers, set up by one thread of the block before a block barrier (the staged
// fused, MLA and re-rotation kernels alike): a stage's `full` phase completes on `fillers`
// arrivals and the bytes they announce, its `done` phase on `consumers` arrivals.
__device__ __forceinline__ void staged_barriers_init(unsigned long long* full,
                                                     unsigned long long* done, unsigned fillers,
                                                     unsigned consumers) {
#pragma unroll
  for (int i = 0; i < kStagedStages; ++i) {
    barrier_init(full + i, fillers);
    barrier_init(done + i, consumers);
  }
  barrier_init_fence();
}

// Where a stage keeps a token's rows, in bytes from its start: q's heads, then k's (rotated head h
// at h * head_dim elements), v's (CACHE), then the token's cos and sin rows (the halves of its
// cache row: angle_rows of them, see below; a position outside the cache reads none, the producer
// writes NaN there, as the lean kernel's angles are). Every part is a whole number of 16-byte
// units (the host checks); launch.staged_stage_bytes computes the same size.
//
// M-RoPE (MROPE, kernels of their own) gives each pair the angle of one of three position
// components. Sectioned (Qwen2-VL: runs of pairs a component), the producer copies each run from
// its component's cache row into the stage's one cos / sin row (runs of whole 16-byte units:
// launch.fused_staged_applies), so that the consumers read the row as any other. Interleaved
// (Qwen3-VL: the component changes every pair), the stage holds the three components' rows and
// each pair reads its own.
template <typename T, typename TableT, bool CACHE, bool MROPE>
struct StageLayout {
  unsigned q_bytes, k_bytes, v_bytes, angle_bytes, angle_rows;

  __device__ __forceinline__ StageLayout(const RopeParams& p, const FusionParams& f) {
    const unsigned head = static_cast<unsigned>(p.head_dim) * static_cast<unsigned>(sizeof(T));
    q_bytes = static_cast<unsigned>(p.num_q_heads) * head;
    k_bytes = static_cast<unsigned>(p.num_k_heads) * head;
    v_bytes = CACHE ? static_cast<unsigned>(f.num_v_heads) * head : 0u;
    angle_bytes = static_cast<unsigned>(p.rotary_dim / 2) * static_cast<unsigned>(sizeof(TableT));
    angle_rows = MROPE && p.mrope_mode == kMRopeInterleaved ? 3u : 1u;
  }
  __device__ __forceinline__ unsigned v_at() const { return q_bytes + k_bytes; }
  // Component `row`'s cos and sin halves (row 0 but for interleaved M-RoPE).
  __device__ __forceinline__ unsigned cos_at(unsigned row = 0) const {
    return v_at() + v_bytes + row * 2 * angle_bytes;
  }
  __device__ __forceinline__ unsigned sin_at(unsigned row = 0) const {
    return cos_at(row) + angle_bytes;
  }
  // Whole 128-byte lines, so that every stage starts on one.
  __device__ __forceinline__ unsigned bytes() const {
    return (cos_at(angle_rows) + 127) / 128 * 128;
  }
};

// A position or slot as loaded, converted where it is used: the producer loads it a token or
// more ahead, and a conversion next to the load would stall the producer there.
struct LoadedIndex {
  long long wide;
  int narrow;
  bool is_wide;

  __device__ __forceinline__ long long value() const { return is_wide ? wide : narrow; }
};

__device__ __forceinline__ LoadedIndex load_index(const void* base, long long at, bool is_wide) {
  LoadedIndex r{0, 0, is_wide};
  if (is_wide) {
    r.wide = static_cast<const long long*>(base)[at];
  } else {
    r.narrow = static_cast<const int*>(base)[at];
  }
  return r;
}

// The positions of a token: one, or M-RoPE's three components.
template <bool MROPE>
struct StagedPositions {
  static constexpr int kComponents = MROPE ? 3 : 1;
  LoadedIndex component[kComponents];
};

// The positions of `token` as load_position and pair_position read them (none: the implicit
// arange, its offset).
template <bool MROPE>
__device__ __forceinline__ StagedPositions<MROPE> load_staged_positions(const RopeParams& p,
                                                                        int token) {
  StagedPositions<MROPE> r;
  const long long at = static_cast<long long>(token) * p.positions_token_stride[0];
#pragma unroll
  for (int c = 0; c < StagedPositions<MROPE>::kComponents; ++c) {
    const long long offset = at + c * p.positions_component_stride;
    r.component[c] = p.positions == nullptr
                         ? LoadedIndex{offset, 0, true}
                         : load_index(p.positions, offset, p.positions_are_int64 != 0);
  }
  return r;
}

// One position component's share of a stage's angles: the cos and sin bytes it fills and the
// cache row (elements; -1: its position is outside the cache) they come from.
struct AnglePart {
  unsigned cos_at, sin_at, bytes;
  long long row;
};

// Component `c`'s part: sectioned M-RoPE's run of pairs [start, start + n) of the stage's one row
// (mrope_component's sections), else row `c` whole (none past the stage's angle_rows).
template <typename TableT, typename S>
__device__ __forceinline__ AnglePart staged_angle_part(const RopeParams& p, const S& s, int c,
                                                       bool sectioned, long long position) {
  const int half = static_cast<int>(p.rotary_dim / 2);
  int start = 0, n = c < static_cast<int>(s.angle_rows) ? half : 0;
  if (sectioned) {
    const int s0 = static_cast<int>(p.mrope_section[0]);
    const int s1 = static_cast<int>(p.mrope_section[1]);
    start = c == 0 ? 0 : (c == 1 ? s0 : s0 + s1);
    n = c == 0 ? s0 : (c == 1 ? s1 : half - s0 - s1);
  }
  const unsigned at = static_cast<unsigned>(start) * static_cast<unsigned>(sizeof(TableT));
  const unsigned row = sectioned ? 0u : static_cast<unsigned>(c);
  const bool valid = position >= 0 && position < p.max_position;
  return AnglePart{s.cos_at(row) + at, s.sin_at(row) + at,
                   static_cast<unsigned>(n) * static_cast<unsigned>(sizeof(TableT)),
                   valid ? position * p.table_row_stride + start : -1LL};
}

// A part's angles copied into the stage: one copy where it is both whole halves of a
// cos_sin_cache row (`half_bytes` each), else one a half.
template <typename TableT>
__device__ __forceinline__ void staged_angles(const RopeParams& p, unsigned char* stage,
                                              const AnglePart& part, unsigned half_bytes,
                                              unsigned long long* full) {
  const TableT* cos_row = static_cast<const TableT*>(p.cos) + part.row;
  if (part.bytes == half_bytes && part.sin_at == part.cos_at + half_bytes &&
      static_cast<const char*>(p.sin) - static_cast<const char*>(p.cos) == half_bytes) {
    bulk_load(stage + part.cos_at, cos_row, 2 * half_bytes, full);
  } else {
    bulk_load(stage + part.cos_at, cos_row, part.bytes, full);
    bulk_load(stage + part.sin_at, static_cast<const TableT*>(p.sin) + part.row, part.bytes,
              full);
  }
}

// The producer: stage `stage` filled with token `token`'s rows.
template <typename T, typename TableT, bool CACHE, bool MROPE>
__device__ __forceinline__ void staged_fill(const RopeParams& p, const FusionParams& f,
                                            const StageLayout<T, TableT, CACHE, MROPE>& s,
                                            unsigned char* stage, unsigned long long* full,
                                            int token, const StagedPositions<MROPE>& positions) {
  constexpr int C = StagedPositions<MROPE>::kComponents;
  const TokenOffsets<int> o = lean_token_offsets(p, token);
  const bool sectioned = MROPE && p.mrope_mode == kMRopeSectioned;
  AnglePart parts[C];
  unsigned angle_bytes = 0;
  bool outside = false;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    parts[c] = staged_angle_part<TableT>(p, s, c, sectioned, positions.component[c].value());
    if (parts[c].row >= 0) {
      angle_bytes += 2 * parts[c].bytes;
    } else {
      // A position outside the cache: NaN angles, as every kernel gives (written by this thread;
      // the arrival below releases them to the consumers, the fence orders them before later
      // bulk copies into the same bytes).
      for (unsigned at = 0; at < parts[c].bytes; at += sizeof(TableT)) {
        *reinterpret_cast<TableT*>(stage + parts[c].cos_at + at) =
            Store<TableT>::from(quiet_nan<float>());
        *reinterpret_cast<TableT*>(stage + parts[c].sin_at + at) =
            Store<TableT>::from(quiet_nan<float>());
      }
      outside = true;
    }
  }
  if (outside) fence_for_bulk_copies();
  barrier_arrive_expecting(full, s.cos_at() + angle_bytes);
  bulk_load(stage, static_cast<const T*>(p.q) + o.q, s.q_bytes, full);
  bulk_load(stage + s.q_bytes, static_cast<const T*>(p.k) + o.k, s.k_bytes, full);
  if constexpr (CACHE) {
    bulk_load(stage + s.v_at(),
              static_cast<const T*>(f.v) + static_cast<long long>(token) * f.v_token_stride,
              s.v_bytes, full);
  }
#pragma unroll
  for (int c = 0; c < C; ++c) {
    if (parts[c].row >= 0 && parts[c].bytes > 0) {
      staged_angles<TableT>(p, stage, parts[c], s.angle_bytes, full);
    }
  }
}

// `heads` rows of `head_bytes` from shared `src` to the cache rows at `base` (elements), one
// copy where the cache's heads are contiguous (NHD), else one a head (HND).
template <typename T>
__device__ __forceinline__ void staged_cache_rows(void* cache, long long base,
                                                  long long head_stride, int heads, int head_dim,
                                                  const unsigned char* src) {
  const unsigned head_bytes = static_cast<unsigned>(head_dim) * static_cast<unsigned>(sizeof(T));
  T* row = static_cast<T*>(cache) + base;
  if (head_stride == head_dim) {
    bulk_store(row, src, static_cast<unsigned>(heads) * head_bytes);
    return;
  }
  for (int h = 0; h < heads; ++h) {
    bulk_store(row + h * head_stride, src + h * head_bytes, head_bytes);
  }
}

// The producer: the finished rows of stage `stage` (token `token`) to q_out, k_out and the
// token's cache rows (`slot`), as one bulk group.
template <typename T, typename TableT, bool CACHE, bool MROPE>
__device__ __forceinline__ void staged_drain(const RopeParams& p, const FusionParams& f,
                                             const StageLayout<T, TableT, CACHE, MROPE>& s,
                                             const unsigned char* stage, int token,
                                             const SlotRows& slot) {
  const TokenOffsets<int> o = lean_token_offsets(p, token);
  bulk_store(static_cast<T*>(p.q_out) + o.q_out, stage, s.q_bytes);
  bulk_store(static_cast<T*>(p.k_out) + o.k_out, stage + s.q_bytes, s.k_bytes);
  if constexpr (CACHE) {
    const int head_dim = static_cast<int>(p.head_dim);
    if (slot.k_base >= 0) {
      staged_cache_rows<T>(f.k_cache, slot.k_base, f.k_cache_head_stride,
                           static_cast<int>(p.num_k_heads), head_dim, stage + s.q_bytes);
    }
    if (slot.v_base >= 0) {
      staged_cache_rows<T>(f.v_cache, slot.v_base, f.v_cache_head_stride,
                           static_cast<int>(f.num_v_heads), head_dim, stage + s.v_at());
    }
  }
  bulk_commit();
}

// The producer thread: the first stages filled, then for each token of the block its rows copied
// out once the consumers are done with them, and the stage refilled with the token kStagedStages
// later. Positions and slots load a token ahead of their use.
template <typename T, typename TableT, bool CACHE, bool MROPE>
__device__ __forceinline__ void staged_produce(const RopeParams& p, const FusionParams& f,
                                               const StageLayout<T, TableT, CACHE, MROPE>& s,
                                               unsigned char* stages, unsigned long long* full,
                                               unsigned long long* done, int first, int step,
                                               int count) {
  const unsigned stage_bytes = s.bytes();
  {
    // The first stages' positions loaded together (one wait for all of them), then the stages
    // filled.
    StagedPositions<MROPE> positions[kStagedStages];
#pragma unroll
    for (int i = 0; i < kStagedStages; ++i) {
      if (i < count) positions[i] = load_staged_positions<MROPE>(p, first + i * step);
    }
#pragma unroll
    for (int i = 0; i < kStagedStages; ++i) {
      if (i < count) {
        staged_fill<T, TableT, CACHE, MROPE>(p, f, s, stages + i * stage_bytes, full + i,
                                      first + i * step, positions[i]);
      }
    }
  }
  StagedPositions<MROPE> next_positions;
  if (kStagedStages < count) {
    next_positions = load_staged_positions<MROPE>(p, first + kStagedStages * step);
  }
  LoadedIndex next_slot{-1, 0, true};
  if (CACHE && count > 0) {
    next_slot = load_index(f.slot_mapping, first * f.slot_stride, f.slots_are_int64 != 0);
  }
  for (int j = 0; j < count; ++j) {
    const int i = j % kStagedStages;
    const int token = first + j * step;
    unsigned char* stage = stages + i * stage_bytes;
    const long long slot = next_slot.value();
    if (CACHE && j + 1 < count) {
      next_slot = load_index(f.slot_mapping, static_cast<long long>(token + step) * f.slot_stride,
                             f.slots_are_int64 != 0);
    }
    barrier_wait(done + i, (j / kStagedStages) & 1);
    staged_drain<T, TableT, CACHE, MROPE>(p, f, s, stage, token,
                                   CACHE ? rows_of_slot(f, slot, true) : SlotRows{-1, -1});
    if (j + kStagedStages < count) {
      bulk_wait<false>();  // the stores have read the stage
      staged_fill<T, TableT, CACHE, MROPE>(p, f, s, stage, full + i,
                                           token + kStagedStages * step, next_positions);
      if (j + kStagedStages + 1 < count) {
        next_positions = load_staged_positions<MROPE>(p, token + (kStagedStages + 1) * step);
      }
    }
  }
  bulk_wait<true>();  // the block's shared memory must outlive the copies out of it
}

// The sum of `v` over a head's `lanes` threads (a power of two), every thread of the warp taking
// part: the common 8 lanes (16-bit heads of 128) as three unrolled steps, others in a loop.
__device__ __forceinline__ float staged_lanes_sum(float v, int lanes) {
  if (lanes == 8) {
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    return v + __shfl_xor_sync(0xffffffffu, v, 1);
  }
  for (int offset = lanes / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

// The angles of a lane's pairs [pair0, pair0 + P) from a filled stage, sin with its sign.
// Interleaved M-RoPE: each pair from its component's row, `components` holding each pair's
// (mrope_component), two bits a pair.
template <typename TableT, int P, bool MROPE, typename S>
__device__ __forceinline__ void staged_angles_of(const S& s, const unsigned char* stage,
                                                 int pair0, unsigned components, float sin_sign,
                                                 float (&cos_v)[P], float (&sin_v)[P]) {
  if (MROPE && s.angle_rows > 1) {
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const unsigned c = (components >> (2 * k)) & 3u;
      cos_v[k] = Convert<float>::from(
          reinterpret_cast<const TableT*>(stage + s.cos_at(c))[pair0 + k]);
      sin_v[k] = Convert<float>::from(
          reinterpret_cast<const TableT*>(stage + s.sin_at(c))[pair0 + k]);
    }
  } else {
    load_table(cos_v, reinterpret_cast<const TableT*>(stage + s.cos_at()) + pair0, 1, true);
    load_table(sin_v, reinterpret_cast<const TableT*>(stage + s.sin_at()) + pair0, 1, true);
  }
#pragma unroll
  for (int k = 0; k < P; ++k) sin_v[k] *= sin_sign;
}

// The norm weights are of q's dtype (the host admits no other here). PARTIAL (rotary_dim <
// head_dim, kernels of their own): with the norm, lanes past the rotated chunks hold the other
// dims as the lean kernel's do (fused_lean.cuh), normalised but not rotated; without it they
// have nothing to do, the stage's rows being copied out whole.
template <typename T, typename TableT, bool INTERLEAVED, bool NORM, bool CACHE, bool MROPE,
          bool PARTIAL>
__device__ __forceinline__ void rope_fused_staged_tokens(const RopeParams& p,
                                                         const FusionParams& f) {
  using L = Layout<T, true, INTERLEAVED>;
  using Chunk = LeanChunk<T, INTERLEAVED>;
  constexpr int P = L::pairs;
  extern __shared__ __align__(16) unsigned char staged_shared[];

  const StageLayout<T, TableT, CACHE, MROPE> s(p, f);
  const unsigned stage_bytes = s.bytes();
  unsigned long long* full =
      reinterpret_cast<unsigned long long*>(staged_shared + kStagedStages * stage_bytes);
  unsigned long long* done = full + kStagedStages;
  const int lanes = static_cast<int>(ntid_x());
  const int consumer_rows = static_cast<int>(ntid_y()) - 32 / lanes;
  const int consumers = consumer_rows * lanes;
  const int lane = static_cast<int>(tid_x()), row = static_cast<int>(tid_y());
  const int num_tokens = static_cast<int>(p.num_tokens);
  const int first = static_cast<int>(blockIdx.x), step = static_cast<int>(gridDim.x);
  const int count = first < num_tokens ? (num_tokens - first + step - 1) / step : 0;

  if (lane == 0 && row == 0) staged_barriers_init(full, done, 1, static_cast<unsigned>(consumers));
  __syncthreads();
  wait_for_previous_grid();
  if (row >= consumer_rows) {
    if (lane + lanes * (row - consumer_rows) == 0) {
      staged_produce<T, TableT, CACHE, MROPE>(p, f, s, staged_shared, full, done, first, step,
                                              count);
    }
    return;
  }

  const int head_dim = static_cast<int>(p.head_dim);
  const int half = static_cast<int>(p.rotary_dim) / 2;
  const int num_chunks = half / P;
  const int head_lanes = PARTIAL && NORM ? head_dim / (2 * P) : num_chunks;
  const int pair0 = PARTIAL && !INTERLEAVED ? lane * P + (lane / num_chunks) * half : lane * P;
  const bool active = lane < head_lanes;  // lanes past the head's: the norm's zeros only
  const bool rotating = lane < num_chunks;  // the lanes with angles
  unsigned components = 0;
  if constexpr (MROPE) {
#pragma unroll
    for (int k = 0; k < P; ++k) {
      components |= static_cast<unsigned>(mrope_component(p, pair0 + k)) << (2 * k);
    }
  }
  const int num_q_heads = static_cast<int>(p.num_q_heads);
  const int num_rotated = num_q_heads + static_cast<int>(p.num_k_heads);
  const float sin_sign = static_cast<float>(p.sin_sign);
  const float inv_dim = 1.0f / static_cast<float>(head_dim), eps = static_cast<float>(f.eps);
  const float weight_offset = static_cast<float>(f.weight_offset);
  for (int j = 0; j < count; ++j) {
    const int i = j % kStagedStages;
    unsigned char* stage = staged_shared + i * stage_bytes;
    T* heads = reinterpret_cast<T*>(stage);
    barrier_wait(full + i, (j / kStagedStages) & 1);
    float cos_v[P], sin_v[P];
    if (rotating) {
      staged_angles_of<TableT, P, MROPE>(s, stage, pair0, components, sin_sign, cos_v, sin_v);
    }
    // Every thread of the block takes the same rounds of heads (a thread row past the heads
    // with none), so that a warp's shuffles always find all its threads.
    for (int first_head = 0; first_head < num_rotated; first_head += consumer_rows) {
      const int head = first_head + row;
      const bool working = active && head < num_rotated;
      const bool is_k = head >= num_q_heads;
      // The chunk's pairs converted once and held as float32 from the sum to the stores, and the
      // lane's weights loaded before the sum (their load then overlaps the shuffles): the
      // stages' shared memory, not registers, bounds this kernel's resident blocks.
      float x1[P], x2[P];
      LaneWeights<P> weights;
      if (working) {
        Chunk chunk;
        chunk.load(heads + head * head_dim, pair0, half);
        chunk.pairs(x1, x2);
        if constexpr (NORM && !MROPE) {
          load_chunk_weights<T, P, INTERLEAVED>(f, is_k ? f.k_weight : f.q_weight, pair0, half,
                                                weights);
        }
      }
      float rms_scale = 1.0f;
      if constexpr (NORM) {
        const float sum = staged_lanes_sum(working ? pairs_sum_of_squares(x1, x2) : 0.0f, lanes);
        rms_scale = rsqrtf(fmaf(sum, inv_dim, eps));
      }
      if constexpr (NORM && MROPE) {
        if (working) {
          load_chunk_weights<T, P, INTERLEAVED>(f, is_k ? f.k_weight : f.q_weight, pair0, half,
                                                weights);
        }
      }
      if (working) {
        lean_rotate_store_pairs<T, P, INTERLEAVED, NORM, false, T, FusionParams, LaneWeights<P>,
                                true>(f, x1, x2, pair0, half, weights, weight_offset, rms_scale,
                                      cos_v, sin_v, is_k, heads, head * head_dim, -1LL,
                                      !PARTIAL || rotating);
      }
    }
    fence_for_bulk_copies();  // this thread's stores, before the producer's copies read them
    barrier_arrive(done + i);
  }
}

}  // namespace cupyrope
