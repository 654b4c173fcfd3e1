// RoPE entry points: the templated __global__ kernels that cupyrope/cuda/compiler.py instantiates. The
// device code they share lives in the headers: token offsets and positions (token_offsets.cuh),
// cos/sin of a chunk of pairs (angles.cuh), the rotation of every head (rotation.cuh).
//
// One launch rotates q and k together. Work is split three ways:
//   threadIdx.x  a lane: a chunk of `pairs` rotary pairs (one 16-byte access per half, or one
//                scalar pair), then, out of place, a share of the pass-through dims to copy;
//   y            heads of q followed by heads of k: blockIdx.y * blockDim.y + threadIdx.y, strided
//                by gridDim.y * blockDim.y (the host splits heads over blocks when tokens are few);
//   threadIdx.z  a token, with blocks striding over tokens by gridDim.x.
// cos/sin for a chunk are loaded (or computed) once per token and reused for every head.
//
// Kernels: rope_decode_kernel for few tokens (decode.cuh: one thread per token, head and chunk),
// rope_lean_kernel for the common case (one token dim after merging, no M-RoPE,
// 16-byte accesses, 32-bit offsets, vector cos/sin rows: fewer registers and about half the
// instructions), rope_kernel for every layout, rope_fused_kernel for the fused ops (fused.cuh)
// (rope_fused_rows_kernel where stores are quantised per row, rope_fused_all_heads_kernel with
// the norm over all heads), rope_fused_lean_kernel (rope_fused_lean_all_heads_kernel) for
// their common layout (fused_lean.cuh), rope_fused_decode_kernel for that layout at few tokens
// (fused_decode.cuh) and rope_fused_staged_kernel for the norm past them on Hopper GPUs of fast
// memory (fused_staged.cuh: rows by bulk copies through shared memory). The DeepSeek MLA kernels
// are mla_rope_kernel (mla.cuh) and, for many tokens of contiguous rows on those GPUs,
// mla_staged_kernel (mla_staged.cuh).
#include "angles.cuh"
#include "decode.cuh"
#include "dependent_launch.cuh"
#include "fused.cuh"
#include "fused_decode.cuh"
#include "fused_lean.cuh"
#include "fused_staged.cuh"
#include "mla.cuh"
#include "mla_staged.cuh"
#include "numeric.cuh"
#include "rerotate.cuh"
#include "rerotate_staged.cuh"
#include "rope_params.cuh"
#include "rotation.cuh"
#include "thread_index.cuh"
#include "token_offsets.cuh"
#include "vector_io.cuh"

namespace cupyrope {

// Asking for several resident blocks caps registers so that more warps, and so more loads, are in
// flight: the kernel is bound by memory latency, not arithmetic. Resident warps matter more than
// loads in flight per thread (docs/perf_log.md has the measurements). 5 blocks (48 registers)
// with 32-bit offsets, 4 (64 registers) with 64-bit ones; one block less where that would spill:
// float64 arrays or tables (twice the registers per element) and general per-token tables (two
// more offsets) with 32-bit offsets. Blackwell's assembler keeps more values live for the same code
// (the lean kernel's natural demand: 96 registers against Hopper's 64) and spills 4-88 bytes under
// those caps: there one block less with 32-bit offsets and 2 blocks (128 registers) with 64-bit
// ones. tests/test_kernel_compile.py checks that nothing spills.
template <typename T, typename TableT, int SOURCE, bool WIDE, bool LEAN>
struct MinBlocksPerSM {
  static constexpr bool heavy = sizeof(T) == 8 || sizeof(TableT) == 8 ||
                                (!WIDE && !LEAN && SOURCE == kTokenTables);
#if __CUDA_ARCH__ >= 1000
  static constexpr int value = WIDE ? 2 : 4 - (heavy ? 1 : 0);
#else
  static constexpr int value = (WIDE ? 4 : 5) - (heavy ? 1 : 0);
#endif
};

// A launch's extent as one thread sees it: the rotary pairs and their chunks, the pass-through
// chunks (out of place), the heads and tokens, and this thread's first head and strides.
template <typename Index>
struct Work {
  Index rotary_dim, half, num_chunks, pass_chunks, num_heads, num_tokens;
  Index first_head, head_step, token_step;
};

template <typename Index, int P, int ACCESS>
__device__ __forceinline__ Work<Index> work_of(const RopeParams& p) {
  Work<Index> w;
  w.rotary_dim = static_cast<Index>(p.rotary_dim);
  w.half = w.rotary_dim / 2;
  w.num_chunks = w.half / P;
  w.pass_chunks =
      p.copy_pass_through ? (static_cast<Index>(p.head_dim) - w.rotary_dim) / ACCESS : 0;
  w.num_heads = static_cast<Index>(p.num_q_heads + p.num_k_heads);
  w.num_tokens = static_cast<Index>(p.num_tokens);
  w.first_head = static_cast<Index>(blockIdx.y) * ntid_y() + tid_y();
  w.head_step = static_cast<Index>(gridDim.y) * ntid_y();
  w.token_step = static_cast<Index>(gridDim.x) * ntid_z();
  return w;
}

// Every token this thread's block strides over: cos/sin of each lane's chunk (angles.cuh), then
// every head this thread visits rotated with them, then the pass-through copy.
template <typename T, typename TableT, bool VECTOR, bool INTERLEAVED, int SOURCE, bool WIDE_INDEX,
          bool LEAN>
__device__ __forceinline__ void rope_tokens(const RopeParams& p) {
  using Index = typename IndexOf<WIDE_INDEX>::type;
  using C = typename ComputeOf<T>::type;
  using L = Layout<T, VECTOR, INTERLEAVED>;
  constexpr int P = L::pairs;

  const TableT* __restrict__ cos_table = static_cast<const TableT*>(p.cos);
  const TableT* __restrict__ sin_table = static_cast<const TableT*>(p.sin);
  const Work<Index> w = work_of<Index, P, L::access>(p);
  const Index rotary_dim = w.rotary_dim, half = w.half, num_chunks = w.num_chunks;
  const Index pass_chunks = w.pass_chunks, num_heads = w.num_heads, num_tokens = w.num_tokens;
  const Index first_head = w.first_head, head_step = w.head_step, token_step = w.token_step;
  const Index cos_col_stride = static_cast<Index>(p.cos_col_stride);
  const Index sin_col_stride = static_cast<Index>(p.sin_col_stride);
  const C sin_sign = static_cast<C>(p.sin_sign);
  const bool table_vector_ok = p.table_vector_ok != 0;

  for (Index token = static_cast<Index>(blockIdx.x) * ntid_z() + tid_z();
       token < num_tokens; token += token_step) {
    const TokenOffsets<Index> o = LEAN ? lean_token_offsets(p, token) : token_offsets(p, token);
    // The position (M-RoPE: its temporal component; pair_position reads the others).
    long long position = 0;
    if constexpr (SOURCE != kTokenTables) position = load_position(p, o.positions);

    // Each lane rotates one chunk of pairs of every head it visits. All lanes take the same path
    // (no lane only copies while its neighbours rotate: that divergence halved partial-rotary
    // throughput). cos/sin come first: loading the first head before them, to overlap the
    // position -> cache-row latency, spills under the register caps above.
    for (Index lane = tid_x(); lane < num_chunks; lane += ntid_x()) {
      const Index pair0 = lane * P;
      C cos_v[P], sin_v[P];
      chunk_angles<SOURCE, LEAN>(p, o, position, pair0, cos_table, sin_table, cos_col_stride,
                                 sin_col_stride, table_vector_ok, sin_sign, cos_v, sin_v);
      rotate_heads<T, P, VECTOR, INTERLEAVED>(p, o, first_head, head_step, num_heads, pair0, half,
                                              cos_v, sin_v,
                                              SOURCE == kComputedAngles ? C(1) : sin_sign);
    }
    // Then every lane copies its share of the dims past rotary_dim.
    copy_pass_through<T, L::access, VECTOR>(p, o, first_head, head_step, num_heads, rotary_dim,
                                           pass_chunks);
  }
}

// The lean computed-angle kernel: the threads of a token compute its angles together, each pair
// once, into shared memory (the host sizes it: blockDim.z tokens x cos and sin of `half` pairs),
// rather than every head lane computing the angles of its own chunk: one float64 reduction per
// pair instead of one per pair and head lane, and a far shorter wait before the first loads.
template <typename T, bool VECTOR, bool INTERLEAVED>
__device__ __forceinline__ void rope_tokens_shared_angles(const RopeParams& p) {
  using Index = int;  // lean kernels use 32-bit offsets
  using C = typename ComputeOf<T>::type;
  using L = Layout<T, VECTOR, INTERLEAVED>;
  constexpr int P = L::pairs;

  const Work<Index> w = work_of<Index, P, L::access>(p);
  const Index rotary_dim = w.rotary_dim, half = w.half, num_chunks = w.num_chunks;
  const Index pass_chunks = w.pass_chunks, num_heads = w.num_heads, num_tokens = w.num_tokens;
  const Index first_head = w.first_head, head_step = w.head_step, token_step = w.token_step;
  const C sin_sign = static_cast<C>(p.sin_sign);

  extern __shared__ __align__(16) unsigned char shared_angles[];
  C* const token_cos = reinterpret_cast<C*>(shared_angles) + tid_z() * 2 * half;
  C* const token_sin = token_cos + half;
  const Index rank = static_cast<Index>(tid_y()) * ntid_x() + tid_x();
  const Index threads_per_token = static_cast<Index>(ntid_y()) * ntid_x();
  const C factor = static_cast<C>(p.attention_factor);
  // NeoX in place: a thread's chunks of the token go to L2 while the token's angles are computed
  // (the loads after the barrier then hit L2). H200, bf16 q [T, 32, 128] k [T, 8, 128], % of an
  // SM copy at T = 4096 / 16384 / 65536, in place 87.8 / 92.2 / 95.5 -> 90.3 / 93.3 / 97.1. Out
  // of place the hint measured slower (86.1 / 92.9 / 96.2 -> 85.9 / 90.2 / 92.6); with GPT-J
  // pairs the code of the in-place branch alone slowed out of place (82.7 / 88.8 / 92.2 -> 79.6 /
  // 84.1 / 87.3, in place 81.9 / 87.8 / 91.3 -> 89.1 / 92.3 / 96.7): NeoX only.
  // measured: docs/perf_log.md#computed-angles-in-place-heads-into-l2-while-the-angles-are-computed
  const bool prefetch = !INTERLEAVED && p.q_out == p.q;
  // The loop runs the same number of times in every thread of the block: __syncthreads inside.
  for (Index base = static_cast<Index>(blockIdx.x) * ntid_z(); base < num_tokens;
       base += token_step) {
    const Index token = base + tid_z();
    const bool active = token < num_tokens;
    const TokenOffsets<Index> o = lean_token_offsets(p, active ? token : Index(0));
    if (active) {
      if (prefetch) {
        prefetch_heads<T, P, INTERLEAVED>(p, o, first_head, head_step, num_heads, num_chunks, half);
      }
      const long long position = load_position(p, o.positions);
      token_angles_to_shared(p, position, half, rank, threads_per_token, factor, sin_sign,
                             token_cos, token_sin);
    }
    __syncthreads();
    if (active) {
      for (Index lane = tid_x(); lane < num_chunks; lane += ntid_x()) {
        const Index pair0 = lane * P;
        C cos_v[P], sin_v[P];
        load_elements<true>(cos_v, token_cos + pair0);
        load_elements<true>(sin_v, token_sin + pair0);
        rotate_heads<T, P, VECTOR, INTERLEAVED>(p, o, first_head, head_step, num_heads, pair0,
                                                half, cos_v, sin_v, C(1));
      }
      copy_pass_through<T, L::access, VECTOR>(p, o, first_head, head_step, num_heads, rotary_dim,
                                             pass_chunks);
    }
    __syncthreads();  // the next tokens' angles overwrite these
  }
}

// Every layout: any token dims (up to kMaxTokenDims after merging), M-RoPE, strided tables,
// scalar or 16-byte accesses, 32- or 64-bit offsets.
template <typename T, typename TableT, bool VECTOR, bool INTERLEAVED, int SOURCE, bool WIDE_INDEX>
__global__ __launch_bounds__(kMaxThreadsPerBlock,
                             MinBlocksPerSM<T, TableT, SOURCE, WIDE_INDEX, false>::value)
void rope_kernel(const RopeParams p) {
  rope_tokens<T, TableT, VECTOR, INTERLEAVED, SOURCE, WIDE_INDEX, false>(p);
}

// The common case, decided on the host (launch.lean_kernel_applies): one token dim after merging,
// no M-RoPE, cos/sin rows (if read) contiguous and aligned for vector loads, 16-byte accesses and
// 32-bit offsets (VECTOR is true and WIDE_INDEX false in every instantiation).
template <typename T, typename TableT, bool VECTOR, bool INTERLEAVED, int SOURCE, bool WIDE_INDEX>
__device__ __forceinline__ void rope_lean(const RopeParams& p) {
  static_assert(VECTOR && !WIDE_INDEX, "lean kernels take 16-byte accesses and 32-bit offsets");
  wait_for_previous_grid();  // a no-op unless the host made this a programmatic dependent launch
  if constexpr (SOURCE == kComputedAngles) {
    rope_tokens_shared_angles<T, VECTOR, INTERLEAVED>(p);
  } else {
    rope_tokens<T, TableT, VECTOR, INTERLEAVED, SOURCE, WIDE_INDEX, true>(p);
  }
}

template <typename T, typename TableT, bool VECTOR, bool INTERLEAVED, int SOURCE, bool WIDE_INDEX>
__global__ __launch_bounds__(kMaxThreadsPerBlock,
                             MinBlocksPerSM<T, TableT, SOURCE, WIDE_INDEX, true>::value)
void rope_lean_kernel(const RopeParams p) {
  rope_lean<T, TableT, VECTOR, INTERLEAVED, SOURCE, WIDE_INDEX>(p);
}

// Few tokens (decided on the host: launch.decode_kernel_applies): the lean kernel's layouts, one
// thread per (token, head, chunk), nothing copied past rotary_dim. VECTOR and WIDE_INDEX keep the
// other kernels' template signature (true and false in every instantiation).
template <typename T, typename TableT, bool VECTOR, bool INTERLEAVED, int SOURCE, bool WIDE_INDEX>
__global__ __launch_bounds__(kMaxThreadsPerBlock) void rope_decode_kernel(const DecodeParams p) {
  static_assert(VECTOR && !WIDE_INDEX, "the decode kernel takes 16-byte accesses, 32-bit offsets");
  rope_decode_thread<T, TableT, INTERLEAVED, SOURCE>(p);
}

// The fused ops (fused.cuh): RMSNorm before the rotation, fp8 outputs, the KV-cache write. 3
// resident blocks (80 registers) where that does not spill, else 2 (128): the 16-byte NeoX path
// (the next head's chunk loaded ahead: rotated values, cos/sin and two chunks live at once; float32
// with a table spills 8 bytes at 80 registers on sm_80); 64-bit offsets take what they need (they
// spill even at 128, and only tensors past 2^31 elements run them).
// tests/test_kernel_compile.py checks that nothing spills.
template <bool VECTOR, bool INTERLEAVED, bool WIDE_INDEX>
struct FusedMinBlocksPerSM {
  static constexpr int value =
      WIDE_INDEX ? 1
                 : (VECTOR && !INTERLEAVED) ? 2
                                            : 3;
};

template <typename T, typename TableT, bool VECTOR, bool INTERLEAVED, int SOURCE, bool WIDE_INDEX>
__global__ __launch_bounds__(
    kMaxThreadsPerBlock, FusedMinBlocksPerSM<VECTOR, INTERLEAVED, WIDE_INDEX>::value)
void rope_fused_kernel(const RopeParams p, const FusionParams f) {
  rope_fused_tokens<T, TableT, VECTOR, INTERLEAVED, SOURCE, WIDE_INDEX>(p, f);
}

// The fused kernel for launches that quantise stores per row (per-(token, head) fp8 scales,
// NVFP4 caches: quantize.cuh), with the row buffer's code that the kernel above leaves out: 2
// resident blocks (128 registers), 1 with 64-bit offsets.
template <typename T, typename TableT, bool VECTOR, bool INTERLEAVED, int SOURCE, bool WIDE_INDEX>
__global__ __launch_bounds__(kMaxThreadsPerBlock, WIDE_INDEX ? 1 : 2)
void rope_fused_rows_kernel(const RopeParams p, const FusionParams f) {
  rope_fused_tokens<T, TableT, VECTOR, INTERLEAVED, SOURCE, WIDE_INDEX, true>(p, f);
}

// The fused ops with the norm over all heads of a token (fused.cuh: ALL_HEADS), stores quantised
// per row or not (the row code is compiled in, as in the kernel above): 2 resident blocks (128
// registers), 1 with 64-bit offsets. A kernel of its own, so that the block reduction leaves the
// per-head kernels' registers as they were (it spilled 24-48 bytes in six of their 80-register
// specialisations on sm_80).
template <typename T, typename TableT, bool VECTOR, bool INTERLEAVED, int SOURCE, bool WIDE_INDEX>
__global__ __launch_bounds__(kMaxThreadsPerBlock, WIDE_INDEX ? 1 : 2)
void rope_fused_all_heads_kernel(const RopeParams p, const FusionParams f) {
  rope_fused_tokens<T, TableT, VECTOR, INTERLEAVED, SOURCE, WIDE_INDEX, true, true>(p, f);
}

// The norm over all heads in the lean layout with every dim rotated (fused_lean.cuh): every q and
// k head of a token in one block, HELD of them a thread row held in registers (heads past those
// read again, from L1). Resident blocks: fused_lean.cuh, LeanAllHeadsMinBlocksPerSM. CACHE: the k
// and v cache write.
template <typename T, typename TableT, bool VECTOR, bool INTERLEAVED, int SOURCE, bool WIDE_INDEX,
          bool CACHE, int HELD>
__global__ __launch_bounds__(kMaxThreadsPerBlock,
                             LeanAllHeadsMinBlocksPerSM<T, INTERLEAVED, CACHE>::value)
void rope_fused_lean_all_heads_kernel(const RopeParams p, const FusionParams f) {
  static_assert(VECTOR && !WIDE_INDEX, "lean kernels take 16-byte accesses and 32-bit offsets");
  rope_fused_lean_all_heads_body<T, TableT, INTERLEAVED, SOURCE, CACHE, HELD>(p, f);
}

// The fused ops in the lean layout, one kernel per set of fusions (NORM, CACHE): 4 resident blocks
// (64 registers), 3 (80) where 64 spill: the norm with the cache write, and the norm of float16
// NeoX heads. One block fewer where those caps spill: on Blackwell the cache write of 16-bit NeoX
// heads (float16: 4 bytes under NVRTC 13.0; the cache write alone, float16 or bfloat16: 32-72
// bytes once its chunks are held as words; the bfloat16 norm with the cache write keeps 3), and
// in float-float builds for sm_89 / sm_90 the computed angles of bfloat16 NeoX heads with the norm
// or the cache write alone (4-12 bytes). MROPE (launch.py sets it for plans with mrope_mode): one
// block fewer again, since the per-pair position components and table rows spilled 24-56 bytes of
// the 16-bit NeoX kernels at the common kernels' bound on sm_90 (those keep their registers).
// PARTIAL (a partial rotation: lanes for the dims past rotary_dim): one block fewer as MROPE;
// at the common bound its lane offsets spilled 4-20 bytes of the bfloat16 NeoX kernels on sm_90.
template <typename T, bool INTERLEAVED, bool NORM, bool CACHE, int SOURCE, bool MROPE = false,
          bool PARTIAL = false>
struct FusedLeanMinBlocksPerSM {
  static constexpr int hopper = NORM && (CACHE || (IsHalf<T>::value && !INTERLEAVED)) ? 3 : 4;
  static constexpr bool bfloat16 = sizeof(T) == 2 && !IsHalf<T>::value;
#if __CUDA_ARCH__ >= 1000
  static constexpr int architecture =
      hopper - (CACHE && !INTERLEAVED && (IsHalf<T>::value || (!NORM && bfloat16)) ? 1 : 0);
#elif __CUDA_ARCH__ >= 890 && CUPYROPE_ANGLES_FLOAT_FLOAT
  static constexpr int architecture =
      hopper - (SOURCE == kComputedAngles && bfloat16 && !INTERLEAVED && NORM != CACHE ? 1 : 0);
#else
  static constexpr int architecture = hopper;
#endif
  static constexpr int mrope = MROPE || PARTIAL ? 1 : 0;
  static constexpr int value = architecture - mrope;
  // XLA's native entry (frontends/jax/native.py) rebuilds the parameters from flat arguments,
  // which costs the float16 NeoX cache write 16 bytes of stack at 64 registers on sm_90: one
  // block fewer there, unless the architecture's bound already took it.
  static constexpr int flat_entry =
      architecture - mrope -
      (architecture == hopper && CACHE && !NORM && IsHalf<T>::value && !INTERLEAVED ? 1 : 0);
};

template <typename T, typename TableT, bool VECTOR, bool INTERLEAVED, int SOURCE, bool WIDE_INDEX,
          bool NORM, bool CACHE, bool MROPE = false, bool PARTIAL = false>
__device__ __forceinline__ void rope_fused_lean(const RopeParams& p, const FusionParams& f) {
  static_assert(VECTOR && !WIDE_INDEX, "lean kernels take 16-byte accesses and 32-bit offsets");
  static_assert(!(MROPE && PARTIAL), "M-RoPE kernels rotate every dim");
  rope_fused_lean_body<T, TableT, INTERLEAVED, SOURCE, NORM, CACHE, MROPE, PARTIAL>(p, f);
}

template <typename T, typename TableT, bool VECTOR, bool INTERLEAVED, int SOURCE, bool WIDE_INDEX,
          bool NORM, bool CACHE, bool MROPE = false, bool PARTIAL = false>
__global__ __launch_bounds__(kMaxThreadsPerBlock,
                             FusedLeanMinBlocksPerSM<T, INTERLEAVED, NORM, CACHE, SOURCE, MROPE,
                                                     PARTIAL>::value)
void rope_fused_lean_kernel(const RopeParams p, const FusionParams f) {
  rope_fused_lean<T, TableT, VECTOR, INTERLEAVED, SOURCE, WIDE_INDEX, NORM, CACHE, MROPE,
                  PARTIAL>(p, f);
}

// QK-RMSNorm + RoPE (CACHE: with the k / v cache write) with a token's rows moved by bulk copies
// through shared-memory stages (fused_staged.cuh), on Hopper GPUs of fast memory
// (launch.fused_staged_applies; lean layout, table angles, full rotation, stores of the input
// dtype). Built for an architecture without bulk copies it traps: no launch picks it there.
template <typename T, typename TableT, bool INTERLEAVED, bool NORM, bool CACHE, bool MROPE = false,
          bool PARTIAL = false>
__global__ __launch_bounds__(kStagedMaxThreads, kStagedMinBlocksPerSM)
void rope_fused_staged_kernel(const RopeParams p, const FusionParams f) {
#if CUPYROPE_BULK_COPY
  rope_fused_staged_tokens<T, TableT, INTERLEAVED, NORM, CACHE, MROPE, PARTIAL>(p, f);
#else
  __trap();
#endif
}

// The fused ops in the lean layout at few tokens (decided on the host:
// launch.fused_decode_applies), one thread per (token, head, chunk), one kernel per set of
// fusions as the lean fused kernel. No block bound: a thread holds one chunk, and a decode
// launch fills few blocks.
template <typename T, typename TableT, bool VECTOR, bool INTERLEAVED, int SOURCE, bool WIDE_INDEX,
          bool NORM, bool CACHE>
__global__ __launch_bounds__(kMaxThreadsPerBlock)
void rope_fused_decode_kernel(const DecodeParams p, const FusedDecodeParams f) {
  static_assert(VECTOR && !WIDE_INDEX, "the decode kernels take 16-byte accesses, 32-bit offsets");
  rope_fused_decode_body<T, TableT, INTERLEAVED, SOURCE, NORM, CACHE>(p, f);
}

// Re-rotation of cached keys in place (rerotate.cuh): FORMAT is the cache's StoreFormat, T its
// element type (unsigned char for fp8). 3 resident blocks (80 registers); the 16-byte fp8 chunks
// of NeoX heads (16 pairs a thread: their cos/sin and values live at once) took 96 registers
// at 2 (128), 512 threads an SM, and fit 80 without a spill where the GPU converts fp8 itself
// (compute capability 8.9+); on sm_80 the software conversion spilled 64-72 bytes at 80, so
// there they keep 2. tests/test_kernel_compile.py checks that nothing spills.
template <typename T, bool VECTOR, bool INTERLEAVED>
struct RerotateMinBlocksPerSM {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  static constexpr int value = VECTOR && sizeof(T) == 1 && !INTERLEAVED ? 2 : 3;
#else
  static constexpr int value = 3;
#endif
};

template <typename T, typename TableT, bool VECTOR, bool INTERLEAVED, int SOURCE, int FORMAT>
__global__ __launch_bounds__(kMaxThreadsPerBlock,
                             RerotateMinBlocksPerSM<T, VECTOR, INTERLEAVED>::value)
void rerotate_cache_kernel(const RopeParams p, const RerotateParams r) {
  rerotate_slots<T, TableT, VECTOR, INTERLEAVED, SOURCE, FORMAT>(p, r);
}

// The re-rotation with the slots' rows moved by bulk copies through shared-memory stages
// (rerotate_staged.cuh), on Hopper GPUs of fast memory (launch.rerotate_staged_layout: many
// slots, rows of whole 16-byte units). Built for an architecture without bulk copies it traps:
// no launch picks it there.
template <typename T, typename TableT, bool INTERLEAVED, int SOURCE, int FORMAT>
__global__ __launch_bounds__(kReroStagedThreads, kReroStagedMinBlocksPerSM)
void rerotate_staged_kernel(const RopeParams p, const RerotateParams r) {
#if CUPYROPE_BULK_COPY
  rerotate_staged_slots<T, TableT, INTERLEAVED, SOURCE, FORMAT>(p, r);
#else
  __trap();
#endif
}

}  // namespace cupyrope
