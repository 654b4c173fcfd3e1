"""What the kernels share with Python, mirrored from ``kernels_cu/rope_params.cuh`` and
``kernels_cu/rotation.cuh``: the parameter struct's layout, the angle sources, the M-RoPE modes, the
block size limit and the access layout. ``tests/test_abi.py`` checks every value here against the
CUDA sources with NVRTC ``static_assert`` s, so the two cannot drift apart."""

from __future__ import annotations

import enum

import numpy as np


class AngleSource(enum.IntEnum):
    """Where a kernel gets cos/sin from (the SOURCE template argument; ``AngleSource`` in
    rope_params.cuh)."""

    CACHE_TABLE = 0  # vLLM layout [max_position, rotary_dim], row positions[t]
    TOKEN_TABLES = 1  # cos / sin broadcastable to the token dims
    COMPUTED = 2  # positions * inv_freq, reduced in float64 in the kernel


class MRopeMode(enum.IntEnum):
    """M-RoPE layouts (``RopeParams::mrope_mode``; ``MRopeMode`` in rope_params.cuh)."""

    NONE = 0
    SECTIONED = 1  # Qwen2-VL: pairs [0, s0) temporal, then s1 height, s2 width
    INTERLEAVED = 2  # Qwen3-VL: pair j height if j % 3 == 1 and j < 3 s1, width if j % 3 == 2 ...


class StoreFormat(enum.IntEnum):
    """How the fused kernel stores an output (``StoreFormat`` in rope_params.cuh)."""

    INPUT = 0  # the input dtype
    E4M3 = 1  # float8_e4m3fn of value / scale, saturated
    E5M2 = 2  # float8_e5m2 of value / scale, saturated
    NVFP4 = 3  # caches only: e2m1 pairs in bytes, an e4m3 scale per 16 values (quantize.cuh)


class WeightDtype(enum.IntEnum):
    """dtype of the RMSNorm weights (``WeightDtype`` in rope_params.cuh)."""

    FLOAT32 = 0
    FLOAT16 = 1
    BFLOAT16 = 2


THREADS_PER_BLOCK = 256  # kMaxThreadsPerBlock: the kernels' __launch_bounds__


def access_layout(itemsize: int, vector: bool, interleaved: bool) -> tuple[int, int]:
    """(elements per access, pairs per thread and head): ``Layout<T, VECTOR, INTERLEAVED>``.

    16-byte accesses on the vector path, one element on the scalar path; NeoX reads one access
    from each half (``access`` pairs), interleaved reads pairs side by side (``access / 2``)."""
    access = 16 // itemsize if vector else 1
    pairs = max(access // 2, 1) if interleaved else access
    return access, pairs


MAX_TOKEN_DIMS = 4  # kMaxTokenDims

_TOKEN_STRIDE_FIELDS = ("q_token_stride", "k_token_stride", "q_out_token_stride",
                        "k_out_token_stride", "positions_token_stride", "cos_token_stride",
                        "sin_token_stride")

# Field for field the layout of cupyrope::RopeParams.
PARAMS_DTYPE = np.dtype(
    [(name, np.uint64) for name in ("q", "k", "q_out", "k_out", "positions", "cos", "sin",
                                    "inv_freq")]
    + [("num_tokens", np.int64), ("token_ndim", np.int64),
       ("token_shape", np.int64, (MAX_TOKEN_DIMS,))]
    + [(name, np.int64, (MAX_TOKEN_DIMS,)) for name in _TOKEN_STRIDE_FIELDS]
    + [(name, np.int64) for name in (
        "q_head_stride", "k_head_stride", "q_out_head_stride", "k_out_head_stride",
        "num_q_heads", "num_k_heads", "head_dim", "rotary_dim", "table_row_stride",
        "cos_col_stride", "sin_col_stride", "max_position", "positions_are_int64",
        "table_vector_ok", "copy_pass_through", "mrope_mode")]
    + [("mrope_section", np.int64, (3,)), ("positions_component_stride", np.int64)]
    + [("sin_sign", np.float64), ("attention_factor", np.float64)]
    + [(name, np.int64) for name in ("q_dim_stride", "k_dim_stride", "q_out_dim_stride",
                                     "k_out_dim_stride")]
)

# Field for field the layout of cupyrope::FusionParams.
FUSION_PARAMS_DTYPE = np.dtype(
    [(name, np.uint64) for name in ("q_weight", "k_weight", "q_scale", "k_scale", "v_scale", "v",
                                    "k_cache", "v_cache", "slot_mapping")]
    + [(name, np.int64) for name in (
        "norm", "weight_dtype", "q_weight_stride", "k_weight_stride", "out_format",
        "cache_format", "write_pass_through", "num_v_heads", "v_token_stride", "v_head_stride",
        "slot_stride", "slots_are_int64", "num_slots", "block_size", "k_cache_block_stride",
        "k_cache_slot_stride", "k_cache_head_stride", "v_cache_block_stride",
        "v_cache_slot_stride", "v_cache_head_stride", "ring")]
    + [(name, np.float64) for name in ("eps", "weight_offset", "q_scale_value", "k_scale_value",
                                       "v_scale_value")]
    # Stores quantised per row: per-(token, head) fp8 scales and NVFP4 block scales.
    + [(name, np.uint64) for name in ("q_out_scales", "k_out_scales", "k_cache_scales",
                                      "v_cache_scales")]
    + [(name, np.int64) for name in (
        "q_out_scales_token_stride", "q_out_scales_head_stride", "k_out_scales_token_stride",
        "k_out_scales_head_stride", "k_cache_scales_block_stride", "k_cache_scales_slot_stride",
        "k_cache_scales_head_stride", "v_cache_scales_block_stride", "v_cache_scales_slot_stride",
        "v_cache_scales_head_stride", "row_scaled")]
)

# Field for field the layout of cupyrope::FusedDecodeParams (the fused decode kernel's compact
# FusionParams: the nine data pointers in FUSION_PARAMS_DTYPE's order and offsets, then the cache
# strides, then 32-bit fields; 184 bytes).
FUSED_DECODE_PARAMS_DTYPE = np.dtype(
    [(name, np.uint64) for name in ("q_weight", "k_weight", "q_scale", "k_scale", "v_scale", "v",
                                    "k_cache", "v_cache", "slot_mapping")]
    + [(name, np.int64) for name in (
        "num_slots", "k_cache_block_stride", "k_cache_slot_stride", "k_cache_head_stride",
        "v_cache_block_stride", "v_cache_slot_stride", "v_cache_head_stride")]
    + [(name, np.int32) for name in (
        "weight_dtype", "out_format", "cache_format", "num_v_heads", "v_token_stride",
        "v_head_stride", "slot_stride", "slots_are_int64", "block_size")]
    + [(name, np.float32) for name in ("eps", "weight_offset", "q_scale_value", "k_scale_value",
                                       "v_scale_value")]
)

# Field for field the layout of cupyrope::DecodeParams (the decode kernel's compact parameters:
# the seven data pointers and inv_freq in PARAMS_DTYPE's order and offsets, then 32-bit fields).
DECODE_PARAMS_DTYPE = np.dtype(
    [(name, np.uint64) for name in ("q", "k", "q_out", "k_out", "positions", "cos", "sin",
                                    "inv_freq")]
    + [(name, np.int32) for name in (
        "q_token_stride", "k_token_stride", "q_out_token_stride", "k_out_token_stride",
        "q_head_stride", "k_head_stride", "q_out_head_stride", "k_out_head_stride",
        "positions_token_stride", "cos_row_stride", "sin_row_stride", "num_q_heads", "num_heads",
        "max_position", "positions_are_int64")]
    + [("sin_sign", np.float32), ("attention_factor", np.float64)]
)
