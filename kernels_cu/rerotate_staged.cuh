// The staged re-rotation: rerotate_cache with the slots' cache rows (and their deltas'
// cos_sin_cache rows) moved by bulk copies (bulk_copy.cuh) through a ring of shared-memory
// stages, as the staged fused kernel moves a token's (fused_staged.cuh). Hopper GPUs of fast
// memory (the H200) run it for launches of many slots whose heads lie side by side in whole
// 16-byte units (launch.rerotate_staged_layout); rerotate_cache_kernel (rerotate.cuh) runs every
// other launch.
//
// Why: rerotate_cache_kernel holds one head's 16-byte chunk a thread in registers, and the fp8
// NeoX chunk's 16 pairs (their values, cos and sin) leave 768 threads an SM: too few bytes in
// flight for the H200's memory (63-74 % of an SM copy at 4096-65536 slots, docs/perf_log.md).
// Here the producer warp copies a stage's slots in (a slot's heads as one copy) ahead of the
// consumers, who rotate the rows in place in shared memory with rerotate.cuh's own chunk
// (rerotate_chunk: decode, rotate, store in the cache's format), and copies the rows back.
//
// A block: kReroStagedConsumers consumer threads and one producer warp. A stage holds
// `stage_slots` consecutive entries of `slots`, one producer lane each: the lane loads its entry's
// slot and delta a stage ahead of their use, writes the entry (its row's offset, -1 where the slot
// is skipped, and the delta) at the stage's start, and issues its row's copies. The host lays the
// stage out (RerotateParams' stage fields: cupyrope/cuda/launch.py, rerotate_stage_layout); the
// kernel follows it. Barriers as in the staged fused kernel: `full` (every producer lane's
// arrival and the bytes of its copies), `done` (every consumer's arrival after its stores, behind
// a proxy fence so that the copy engine reads them).
//
// A consumer item is one chunk (StagedPairs pairs: of each NeoX half, or side by side) of
// `heads_per_item` heads of one slot: its cos / sin once (from the stage's table row, or computed
// from the delta), its heads rotated one after another with them.
#pragma once

#include "bulk_copy.cuh"
#include "fused_staged.cuh"
#include "rerotate.cuh"

namespace cupyrope {

// Consumers a block (four warps) and the producer warp, whose 32 lanes bound a stage's entries
// (launch.RERO_STAGED_MAX_SLOTS). launch.RERO_STAGED_* sizes the launch alike.
constexpr int kReroStagedConsumers = 128;
constexpr int kReroStagedThreads = kReroStagedConsumers + 32;
constexpr int kReroStagedMinBlocksPerSM = 4;

// A stage's entry of one slot, written by its producer lane: the element offset of the slot's
// row in the cache (-1: skipped, nothing copied) and its position delta.
struct StagedSlot {
  long long row;
  long long delta;
};

// What a producer lane knows of its next entry before the stage is free: the slot and delta as
// loaded (converted where they are used: a conversion next to the load would stall the lane
// there), or none past the stage's share of `slots`.
struct StagedEntry {
  LoadedIndex slot, delta;
  bool present;
};

__device__ __forceinline__ StagedEntry rero_staged_entry(const RerotateParams& r,
                                                         long long group, int lane) {
  StagedEntry e{{-1, 0, true}, {0, 0, true}, false};
  const long long n = group * r.stage_slots + lane;
  if (lane < r.stage_slots && n < r.num_slots) {
    e.present = true;
    e.slot = load_index(r.slots, n * r.slot_stride, r.slots_are_int64 != 0);
    e.delta = r.delta == nullptr
                  ? LoadedIndex{r.delta_value, 0, true}
                  : load_index(r.delta, n * r.delta_stride, r.delta_is_int64 != 0);
  }
  return e;
}

// The bytes of one slot's row in a stage: its heads side by side.
template <typename T>
__device__ __forceinline__ unsigned rero_head_bytes(const RopeParams& p) {
  return static_cast<unsigned>(p.head_dim) * static_cast<unsigned>(sizeof(T));
}

// Pairs a consumer item: those of a 16-byte access (rotation.cuh's Layout), but for fp8 NeoX
// heads 8 (8 bytes of each half): the 16-byte access's 16 pairs, their values, cos and sin live
// at once and took 96 registers, leaving 4 blocks an SM (launch.rerotate_stage_layout alike).
template <typename T, bool INTERLEAVED>
struct StagedPairs {
  static constexpr int value =
      sizeof(T) == 1 && !INTERLEAVED ? 8 : Layout<T, true, INTERLEAVED>::pairs;
};

// Whether a table row holds the delta's angles (computed angles: always).
template <int SOURCE>
__device__ __forceinline__ bool rero_angles_in_table(const RopeParams& p, long long delta) {
  return SOURCE != kCacheTable || (delta >= 0 && delta < p.max_position);
}

// A producer lane: its entry of stage `stage` written and its slot's row (and, from a table, the
// delta's cos / sin row) copied in; every lane arrives on `full`, expecting its own bytes.
template <typename T, typename TableT, int SOURCE>
__device__ __forceinline__ void rero_staged_fill(const RopeParams& p, const RerotateParams& r,
                                                 unsigned char* stage, unsigned long long* full,
                                                 const StagedEntry& e, int lane) {
  const unsigned row_bytes = static_cast<unsigned>(r.num_heads) * rero_head_bytes<T>(p);
  const unsigned angle_bytes =
      SOURCE == kCacheTable ? static_cast<unsigned>(p.rotary_dim) * sizeof(TableT) : 0u;
  long long row = -1, delta = 0;
  if (e.present) {
    const long long slot = e.slot.value();
    delta = e.delta.value();
    if (slot >= 0 && slot < r.cache_slots) {
      const long long block = slot / r.block_size;
      row = block * r.block_stride + (slot - block * r.block_size) * r.row_stride;
    }
  }
  if (lane < r.stage_slots) {
    // Read by the consumers after the arrival below, which releases it.
    reinterpret_cast<StagedSlot*>(stage)[lane] = StagedSlot{row, delta};
  }
  const bool table_row =
      SOURCE == kCacheTable && row >= 0 && rero_angles_in_table<SOURCE>(p, delta);
  barrier_arrive_expecting(full, (row >= 0 ? row_bytes : 0u) + (table_row ? angle_bytes : 0u));
  if (row < 0) return;
  bulk_load(stage + r.rows_at + static_cast<unsigned>(lane) * row_bytes,
            static_cast<const T*>(r.cache) + row, row_bytes, full);
  if (table_row) {
    bulk_load(stage + r.angles_at + static_cast<unsigned>(lane) * angle_bytes,
              static_cast<const TableT*>(p.cos) + delta * p.table_row_stride, angle_bytes, full);
  }
}

// A producer lane: its slot's rotated row of stage `stage` copied back into the cache (its own
// bulk group).
template <typename T>
__device__ __forceinline__ void rero_staged_drain(const RopeParams& p, const RerotateParams& r,
                                                  const unsigned char* stage, int lane) {
  if (lane >= r.stage_slots) return;
  const long long row = reinterpret_cast<const StagedSlot*>(stage)[lane].row;
  if (row < 0) return;
  const unsigned row_bytes = static_cast<unsigned>(r.num_heads) * rero_head_bytes<T>(p);
  bulk_store(static_cast<T*>(r.cache) + row,
             stage + r.rows_at + static_cast<unsigned>(lane) * row_bytes, row_bytes);
  bulk_commit();
}

// The producer warp: the first stages filled, then for each stage of the block its rows copied
// back once the consumers are done with them, and the stage refilled with the group
// kStagedStages later. Each lane's next entry loads a stage ahead of its use.
template <typename T, typename TableT, int SOURCE>
__device__ __forceinline__ void rero_staged_produce(const RopeParams& p, const RerotateParams& r,
                                                    unsigned char* stages,
                                                    unsigned long long* full,
                                                    unsigned long long* done, long long first,
                                                    long long step, int count, int lane) {
  const unsigned stage_bytes = static_cast<unsigned>(r.stage_bytes);
#pragma unroll
  for (int i = 0; i < kStagedStages; ++i) {
    if (i < count) {
      rero_staged_fill<T, TableT, SOURCE>(p, r, stages + i * stage_bytes, full + i,
                                          rero_staged_entry(r, first + i * step, lane), lane);
    }
  }
  StagedEntry next{};
  if (kStagedStages < count) next = rero_staged_entry(r, first + kStagedStages * step, lane);
  for (int j = 0; j < count; ++j) {
    const int i = j % kStagedStages;
    unsigned char* stage = stages + i * stage_bytes;
    barrier_wait(done + i, (j / kStagedStages) & 1);
    rero_staged_drain<T>(p, r, stage, lane);
    if (j + kStagedStages < count) {
      bulk_wait<false>();  // this lane's stores have read its row of the stage
      rero_staged_fill<T, TableT, SOURCE>(p, r, stage, full + i, next, lane);
      if (j + kStagedStages + 1 < count) {
        next = rero_staged_entry(r, first + (j + kStagedStages + 1) * step, lane);
      }
    }
  }
  bulk_wait<true>();  // the block's shared memory must outlive the copies out of it
}

// The kernel's body. Shared memory: kStagedStages stages of r.stage_bytes, their 2 x
// kStagedStages barriers, then (a table) the inverses of row 0's cos entries (see
// without_attention_factor: a table row holds the angle's cos / sin times the attention factor,
// which the cached keys already carry).
template <typename T, typename TableT, bool INTERLEAVED, int SOURCE, int FORMAT>
__device__ __forceinline__ void rerotate_staged_slots(const RopeParams& p,
                                                      const RerotateParams& r) {
  constexpr int P = StagedPairs<T, INTERLEAVED>::value;
  static_assert(SOURCE == kCacheTable || SOURCE == kComputedAngles,
                "a re-rotation takes its angle from the delta");
  extern __shared__ __align__(16) unsigned char rero_shared[];

  const unsigned stage_bytes = static_cast<unsigned>(r.stage_bytes);
  unsigned long long* full =
      reinterpret_cast<unsigned long long*>(rero_shared + kStagedStages * stage_bytes);
  unsigned long long* done = full + kStagedStages;
  float* inverse_factor = reinterpret_cast<float*>(done + kStagedStages);
  const int tid = static_cast<int>(threadIdx.x);
  const int half = static_cast<int>(p.rotary_dim / 2);
  const long long first = blockIdx.x, step = gridDim.x;
  const long long groups = (r.num_slots + r.stage_slots - 1) / r.stage_slots;
  const int count = first < groups ? static_cast<int>((groups - first + step - 1) / step) : 0;
  if (tid == 0) staged_barriers_init(full, done, 32, kReroStagedConsumers);
  if constexpr (SOURCE == kCacheTable) {
    const TableT* row0 = static_cast<const TableT*>(p.cos);
    for (int j = tid; j < half; j += kReroStagedThreads) {
      inverse_factor[j] = 1.0f / Convert<float>::from(row0[j]);
    }
  }
  __syncthreads();
  if (tid >= kReroStagedConsumers) {
    rero_staged_produce<T, TableT, SOURCE>(p, r, rero_shared, full, done, first, step, count,
                                           tid - kReroStagedConsumers);
    return;
  }

  float scale = 1.0f, inv_scale = 1.0f;
  if constexpr (FORMAT != kStoreInput) {
    inv_scale = inverse_scale_of(r.scale, r.scale_value);
    scale = r.scale != nullptr ? *r.scale : static_cast<float>(r.scale_value);
  }
  const int num_heads = static_cast<int>(r.num_heads);
  const int heads_per_item = static_cast<int>(r.heads_per_item);
  const int chunks = half / P;
  const int head_groups = (num_heads + heads_per_item - 1) / heads_per_item;
  const int per_slot = head_groups * chunks;
  const int items = static_cast<int>(r.stage_slots) * per_slot;
  const int head_dim = static_cast<int>(p.head_dim);
  const unsigned row_bytes = static_cast<unsigned>(num_heads) * rero_head_bytes<T>(p);
  const unsigned angle_bytes = static_cast<unsigned>(p.rotary_dim) * sizeof(TableT);
  const TokenOffsets<int> o = {0, 0, 0, 0, 0, 0, 0};  // computed angles: from the delta alone
  for (int j = 0; j < count; ++j) {
    const int i = j % kStagedStages;
    unsigned char* stage = rero_shared + i * stage_bytes;
    barrier_wait(full + i, (j / kStagedStages) & 1);
    for (int item = tid; item < items; item += kReroStagedConsumers) {
      const int g = item / per_slot;
      const int rest = item - g * per_slot;
      const int head_group = rest / chunks;
      const int pair0 = (rest - head_group * chunks) * P;
      const StagedSlot entry = reinterpret_cast<const StagedSlot*>(stage)[g];
      if (entry.row < 0) continue;
      float cos_v[P], sin_v[P];
      if constexpr (SOURCE == kCacheTable) {
        if (rero_angles_in_table<SOURCE>(p, entry.delta)) {
          const TableT* angles =
              reinterpret_cast<const TableT*>(stage + r.angles_at + g * angle_bytes);
          load_table(cos_v, angles + pair0, 1, true);
          load_table(sin_v, angles + half + pair0, 1, true);
#pragma unroll
          for (int k = 0; k < P; ++k) {
            cos_v[k] *= inverse_factor[pair0 + k];
            sin_v[k] *= inverse_factor[pair0 + k];
          }
        } else {
#pragma unroll
          for (int k = 0; k < P; ++k) cos_v[k] = sin_v[k] = quiet_nan<float>();
        }
      } else {
        chunk_angles<SOURCE, false, P, false>(p, o, entry.delta, pair0,
                                       static_cast<const TableT*>(nullptr),
                                       static_cast<const TableT*>(nullptr), 0, 0, false, 1.0f,
                                       cos_v, sin_v);
      }
      T* row = reinterpret_cast<T*>(stage + r.rows_at + g * row_bytes);
      const int head_end = min(num_heads, (head_group + 1) * heads_per_item);
      for (int h = head_group * heads_per_item; h < head_end; ++h) {
        rerotate_chunk<T, P, true, INTERLEAVED, FORMAT>(row + h * head_dim, pair0, half, cos_v,
                                                        sin_v, scale, inv_scale);
      }
    }
    fence_for_bulk_copies();  // this thread's stores, before the producer's copies read them
    barrier_arrive(done + i);
  }
}

}  // namespace cupyrope
