// What the kernels share with Python: the one by-value argument of every rope kernel and the
// numbers both sides must agree on. cupyrope/core/abi.py mirrors every name here, and
// tests/test_abi.py checks the two against each other with NVRTC static_asserts.
//
// Every field of RopeParams is 8 bytes wide so that the layout has no padding (PARAMS_DTYPE in
// abi.py is the same layout as a NumPy structured dtype). Offsets and strides are in elements,
// 64-bit, so tensors past 2^31 elements index correctly.
#pragma once

namespace cupyrope {

constexpr int kMaxTokenDims = 4;

// The host launches at most this many threads a block (THREADS_PER_BLOCK in abi.py).
constexpr int kMaxThreadsPerBlock = 256;

// Where a kernel gets cos/sin from (the SOURCE template argument; AngleSource in abi.py).
enum AngleSource : int { kCacheTable = 0, kTokenTables = 1, kComputedAngles = 2 };

// M-RoPE layouts (RopeParams::mrope_mode; MRopeMode in abi.py).
enum MRopeMode : int { kMRopeNone = 0, kMRopeSectioned = 1, kMRopeInterleaved = 2 };

struct RopeParams {
  // Pointers. k / k_out are null when there is no k; positions is null for the implicit arange
  // (then the "position offset" below is itself the position); cos / sin point at the two halves
  // of a vLLM cache or at per-token tables; inv_freq is float64[rotary_dim / 2].
  const void* q;
  const void* k;
  void* q_out;
  void* k_out;
  const void* positions;
  const void* cos;
  const void* sin;
  const double* inv_freq;

  long long num_tokens;
  long long token_ndim;               // <= kMaxTokenDims after merging contiguous dims
  long long token_shape[kMaxTokenDims];

  long long q_token_stride[kMaxTokenDims];
  long long k_token_stride[kMaxTokenDims];
  long long q_out_token_stride[kMaxTokenDims];
  long long k_out_token_stride[kMaxTokenDims];
  long long positions_token_stride[kMaxTokenDims];
  long long cos_token_stride[kMaxTokenDims];   // per-token tables; 0 for the cache source
  long long sin_token_stride[kMaxTokenDims];

  long long q_head_stride, k_head_stride, q_out_head_stride, k_out_head_stride;
  long long num_q_heads, num_k_heads;
  long long head_dim, rotary_dim;

  long long table_row_stride;    // cache source: elements between the rows of two positions
  long long cos_col_stride;      // elements between the cos entries of two consecutive pairs
  long long sin_col_stride;
  long long max_position;        // cache source: rows in the cache
  long long positions_are_int64; // else int32
  long long table_vector_ok;     // rows contiguous and aligned for vector loads
  long long copy_pass_through;   // out of place with rotary_dim < head_dim
  // M-RoPE: 0 off; 1 sectioned (Qwen2-VL: pairs [0, s0) temporal, then s1 height, s2 width);
  // 2 interleaved (Qwen3-VL: pair j height if j % 3 == 1 and j < 3 s1, width if j % 3 == 2 and
  // j < 3 s2, else temporal). positions then hold 3 components, this many elements apart.
  long long mrope_mode;
  long long mrope_section[3];
  long long positions_component_stride;

  double sin_sign;               // -1 rotates backwards (inverse / gradient)
  double attention_factor;       // multiplies cos and sin of in-kernel angles

  // Elements between two consecutive dims of a head (the last dim's stride): 1 for dense heads,
  // which every 16-byte path needs; any other value takes the scalar path of rope_kernel (the
  // fused kernels take dense heads only). Last, so the fields before keep their offsets.
  long long q_dim_stride, k_dim_stride, q_out_dim_stride, k_out_dim_stride;
};

// Storage formats of the fused kernel's outputs (FusionParams::out_format / cache_format;
// StoreFormat in abi.py): the input dtype itself, or fp8 (value / scale, saturated), or (caches
// only) NVFP4: e2m1 pairs packed in bytes with an e4m3 scale per 16 values (quantize.cuh).
enum StoreFormat : int { kStoreInput = 0, kStoreE4M3 = 1, kStoreE5M2 = 2, kStoreNVFP4 = 3 };

// dtypes of the RMSNorm weights (FusionParams::weight_dtype; WeightDtype in abi.py).
enum WeightDtype : int { kWeightFloat32 = 0, kWeightFloat16 = 1, kWeightBFloat16 = 2 };

// The second argument of rope_fused_kernel: what the fused ops add to a rotation. Every field is
// 8 bytes wide (FUSION_PARAMS_DTYPE in abi.py).
struct FusionParams {
  // RMSNorm of each head before the rotation: x * rsqrt(mean(x^2) + eps) * (weight_offset + w).
  const void* q_weight;          // [head_dim] ([num_heads * head_dim]: the norm over all heads),
                                 // weight_dtype; null without norm
  const void* k_weight;
  // fp8 scales as device scalars (float32), or null: then the *_scale_value fields hold them.
  const float* q_scale;
  const float* k_scale;
  const float* v_scale;
  // The KV-cache write: v [tokens, num_v_heads, head_dim] and the paged caches; null without.
  const void* v;
  void* k_cache;
  void* v_cache;
  const void* slot_mapping;      // one slot per token; negative: padding, nothing written

  long long norm;
  long long weight_dtype;
  long long q_weight_stride, k_weight_stride;
  long long out_format;          // q_out / k_out
  long long cache_format;        // k_cache / v_cache
  long long write_pass_through;  // dims past rotary_dim go to the outputs (copied or normalised)
  long long num_v_heads;
  long long v_token_stride, v_head_stride;
  long long slot_stride, slots_are_int64, num_slots, block_size;
  // Element strides of a cache: between blocks, between the slots of a block, between heads
  // (NHD [blocks, block_size, heads, D] and HND [blocks, heads, block_size, D] alike).
  long long k_cache_block_stride, k_cache_slot_stride, k_cache_head_stride;
  long long v_cache_block_stride, v_cache_slot_stride, v_cache_head_stride;
  // 1: the pipelined loop keeps heads in flight in a shared-memory ring (the host sized the
  // block's shared memory for it; see fused.cuh).
  long long ring;

  double eps, weight_offset;
  double q_scale_value, k_scale_value, v_scale_value;

  // Stores quantised per row (fused.cuh: finish_row). Null where a store takes the per-tensor
  // scale above. fp8 outputs or an fp8 cache with a scale per (token, head) row: the row's amax /
  // the format's largest value (at least the smallest normal float32), written as float32 to
  // q_out_scales [tokens, num_q_heads], k_out_scales [tokens, num_k_heads] or the cache's scales
  // ([blocks, block_size, heads] or HND [blocks, heads, block_size]). An NVFP4 cache
  // (cache_format kStoreNVFP4): its e4m3 block scales, one byte per 16 values of a row
  // ([blocks, block_size, heads, head_dim / 16] or HND), k_scale / v_scale its global scales.
  float* q_out_scales;
  float* k_out_scales;
  void* k_cache_scales;
  void* v_cache_scales;
  long long q_out_scales_token_stride, q_out_scales_head_stride;
  long long k_out_scales_token_stride, k_out_scales_head_stride;
  // Element strides of the cache scales, as the caches' (between blocks, slots of a block, heads).
  long long k_cache_scales_block_stride, k_cache_scales_slot_stride, k_cache_scales_head_stride;
  long long v_cache_scales_block_stride, v_cache_scales_slot_stride, v_cache_scales_head_stride;
  // 1: some store is quantised per row; the host then sized a row buffer per head lane group in
  // shared memory (after the ring and the norm weights) and made blockDim.x a power of two.
  long long row_scaled;
};

// The one by-value argument of rope_decode_kernel (decode.cuh): what a decode launch reads, in
// two 64-byte lines of the constant bank. A kernel's first read of each line of its parameters
// misses the constant cache (hundreds of cycles, serialised in the warp), which at a few tokens
// costs more than the memory traffic itself: RopeParams spreads what the kernels read over 16
// lines. The seven data pointers lead in RopeParams' order (the repeat-call path fills both
// alike); offsets are 32-bit (the decode kernel runs only launches whose offsets all fit).
// DECODE_PARAMS_DTYPE in abi.py mirrors this layout.
struct DecodeParams {
  const void* q;
  const void* k;
  void* q_out;
  void* k_out;
  const void* positions;  // null: the implicit arange
  const void* cos;
  const void* sin;
  const double* inv_freq;  // computed angles

  int q_token_stride, k_token_stride, q_out_token_stride, k_out_token_stride;
  int q_head_stride, k_head_stride, q_out_head_stride, k_out_head_stride;
  int positions_token_stride;
  // Per-token tables: elements between two tokens' rows of cos, of sin. A cache: between the
  // rows of two positions (both).
  int cos_row_stride, sin_row_stride;
  int num_q_heads, num_heads;  // num_heads: q's and k's
  int max_position;            // rows of a cache
  int positions_are_int64;
  float sin_sign;              // -1 rotates backwards

  double attention_factor;     // computed angles: multiplies cos and sin
};

// The second by-value argument of rope_fused_decode_kernel (fused_decode.cuh): the FusionParams
// fields a fused decode launch reads, in three 64-byte lines of the constant bank (FusionParams
// spreads them over six; see DecodeParams for why lines count). The nine data pointers lead in
// FusionParams' order (the repeat-call path fills both alike), the other fields keep its names
// (the lean fused kernel's helpers take either struct). Offsets of q, k and v are 32-bit, as in
// DecodeParams; cache offsets 64-bit. FUSED_DECODE_PARAMS_DTYPE in abi.py mirrors this layout.
struct FusedDecodeParams {
  const void* q_weight;
  const void* k_weight;
  const float* q_scale;
  const float* k_scale;
  const float* v_scale;
  const void* v;
  void* k_cache;
  void* v_cache;
  const void* slot_mapping;

  long long num_slots;
  long long k_cache_block_stride, k_cache_slot_stride, k_cache_head_stride;
  long long v_cache_block_stride, v_cache_slot_stride, v_cache_head_stride;

  int weight_dtype, out_format, cache_format;
  int num_v_heads, v_token_stride, v_head_stride;
  int slot_stride, slots_are_int64, block_size;
  float eps, weight_offset;
  float q_scale_value, k_scale_value, v_scale_value;
};

}  // namespace cupyrope
