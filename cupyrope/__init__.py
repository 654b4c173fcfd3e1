"""cupyrope: Rotary Position Embedding kernels for any array type.

CUDA kernels compiled at run time by NVRTC (through CuPy) rotate q and k in one launch; CPU arrays
take a vectorised NumPy path with the same semantics.

>>> import cupyrope as cr
>>> q_out, k_out = cr.apply_rope(q, k, positions, cos_sin_cache=cache)      # doctest: +SKIP
>>> q_out = cr.apply_rope(q, cos=cos, sin=sin)                               # doctest: +SKIP
"""

from .api import apply_rope
from .frequencies import cos_sin_cache, rope_frequencies
from .abi import AngleSource
from .prepare import warmup
from .positions import context_parallel_positions, te_positions, varlen_positions

__version__ = "0.1.0"


def clear_cache() -> None:
    """Forget compiled kernels and uploaded frequency tables of this process."""
    from . import execute, kernels, launch

    execute.clear()
    kernels.clear_cache()
    launch.device_constants.clear()


__all__ = [
    "AngleSource",
    "apply_rope",
    "clear_cache",
    "context_parallel_positions",
    "cos_sin_cache",
    "rope_frequencies",
    "te_positions",
    "varlen_positions",
    "warmup",
]
