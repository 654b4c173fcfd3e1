"""What the kernels share with Python."""

from __future__ import annotations

import enum

import numpy as np


class AngleSource(enum.IntEnum):
    """Where a kernel gets cos/sin from (the SOURCE template argument of rope_kernel)."""

    CACHE_TABLE = 0  # vLLM layout [max_position, rotary_dim], row positions[t]
    TOKEN_TABLES = 1  # cos / sin broadcastable to the token dims
    COMPUTED = 2  # positions * inv_freq, reduced in float64 in the kernel


MAX_TOKEN_DIMS = 4  # kMaxTokenDims in kernels_cu/rope_params.cuh

_TOKEN_STRIDE_FIELDS = ("q_token_stride", "k_token_stride", "q_out_token_stride",
                        "k_out_token_stride", "positions_token_stride", "cos_token_stride",
                        "sin_token_stride")

# Field for field the layout of cupyrope::RopeParams (kernels_cu/rope_params.cuh).
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
)
