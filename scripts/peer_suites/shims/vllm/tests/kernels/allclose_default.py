"""``tests.kernels.allclose_default``: vLLM's default comparison tolerances by dtype."""

import torch

DEFAULT_ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-3, torch.float: 1e-5}
DEFAULT_RTOL = {torch.float16: 1e-3, torch.bfloat16: 1.6e-2, torch.float: 1.3e-6}


def get_default_atol(output) -> float:
    return DEFAULT_ATOL[output.dtype]


def get_default_rtol(output) -> float:
    return DEFAULT_RTOL[output.dtype]
