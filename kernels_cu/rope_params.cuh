// What the kernels share with Python: the one by-value argument of every rope kernel and the
// numbers both sides must agree on. cupyrope/abi.py mirrors every name here, and
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
};

}  // namespace cupyrope
