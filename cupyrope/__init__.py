"""cupyrope: Rotary Position Embedding kernels for any array type.

CUDA kernels compiled at run time by NVRTC (through CuPy) rotate q and k in one launch; CPU arrays
take a vectorised NumPy path with the same semantics.

>>> import cupyrope as cr
>>> q_out, k_out = cr.apply_rope(q, k, positions, cos_sin_cache=cache)      # doctest: +SKIP
>>> q_out = cr.apply_rope(q, cos=cos, sin=sin)                               # doctest: +SKIP
"""

from .api import apply_rope, rms_norm_rope, rope_and_cache
from .api import rerotate_cache, write_cache
from .mla import mla_rope_and_cache, mla_rope_quantize
from .core.frequencies import cos_sin_cache, rope_frequencies
from .core.abi import AngleSource
from .warmup import warmup
from .positions import context_parallel_positions, te_positions, varlen_positions


def _version() -> str:
    """The installed distribution's version; from a checkout that is not installed, the one its
    pyproject.toml declares."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cupyrope")
    except PackageNotFoundError:
        import re
        from pathlib import Path

        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        found = pyproject.is_file() and re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.M)
        return found.group(1) if found else "unknown"


__version__ = _version()


def clear_cache() -> None:
    """Forget compiled kernels, uploaded frequency tables and the ``CUPYROPE_ANGLE_ARITHMETIC``
    setting read by this process (set that variable, then call this, to switch arithmetics)."""
    from . import execute
    from .cuda import compiler, launch

    execute.clear()
    compiler.clear_cache()
    launch.device_constants.clear()


__all__ = [
    "AngleSource",
    "apply_rope",
    "rms_norm_rope",
    "rope_and_cache",
    "write_cache",
    "rerotate_cache",
    "mla_rope_and_cache",
    "mla_rope_quantize",
    "clear_cache",
    "context_parallel_positions",
    "cos_sin_cache",
    "rope_frequencies",
    "te_positions",
    "varlen_positions",
    "warmup",
]
