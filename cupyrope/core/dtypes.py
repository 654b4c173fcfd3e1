"""The dtypes cupyrope accepts, and the one table that maps them to C++ type names."""

from __future__ import annotations

import numpy as np

try:  # bfloat16 for NumPy: a base dependency, so only a broken install lacks it
    import ml_dtypes
except ImportError as error:
    raise ImportError(
        "bfloat16 arrays need the ml_dtypes package, a dependency of cupyrope that is "
        "missing here: pip install ml_dtypes (or reinstall cupyrope)"
    ) from error

# C++ names used in the kernel instantiations (kernels_cu/numeric.cuh defines the 16-bit ones).
CUDA_TYPE_NAMES = {
    "float16": "cupyrope::half_t",
    "bfloat16": "cupyrope::bfloat16_t",
    "float32": "float",
    "float64": "double",
}
FLOAT_DTYPES = tuple(CUDA_TYPE_NAMES)  # for q / k and for cos/sin tables alike
POSITION_DTYPES = ("int32", "int64")
# Outputs of the fused ops may be fp8 (ml_dtypes / torch / JAX names); CuPy, which has no fp8
# dtype, gets their bits as uint8.
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8,
            "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1}


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype for a dtype name (bfloat16 comes from ml_dtypes)."""
    if name in ("bfloat16", *FP8_DTYPES):
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def dtype_name(dtype) -> str:
    """Canonical name ('bfloat16', 'float32', ...) of a NumPy, CuPy or ml_dtypes dtype."""
    return np.dtype(dtype).name


def dtype_name_of(value) -> str | None:
    """The canonical name of a dtype given as a string or as a NumPy, CuPy, ml_dtypes, JAX or torch
    dtype object (``"float32"``, ``np.float32``, ``torch.bfloat16`` ...); None when it is none."""
    if isinstance(value, str):
        return value
    if type(value).__module__.split(".", 1)[0] == "torch":  # torch.dtype prints as "torch.float32"
        text = str(value)
        return text[len("torch."):] if text.startswith("torch.") else None
    try:
        return np.dtype(value).name
    except TypeError:
        return None


def refused_dtype_error(value) -> type[Exception]:
    """The exception for a dtype argument that is refused: ValueError for a string or a dtype
    object that names a dtype the argument does not take (``"bf16"``, ``"int8"``, ``np.int32``),
    TypeError for anything else (a number, a list, an array)."""
    return ValueError if dtype_name_of(value) is not None else TypeError


def compute_dtype(name: str) -> np.dtype:
    """Arithmetic happens in float32, or float64 for float64 arrays (as in the kernels)."""
    return np.dtype(np.float64 if name == "float64" else np.float32)


def round_once(values: np.ndarray, name: str) -> np.ndarray:
    """float64 values correctly rounded (nearest even) to dtype ``name``.

    NumPy/ml_dtypes cast float64 to bfloat16 and float16 through float32, rounding twice, which is
    one ulp off for a few values. Rounding to float32 *to odd* first (truncate, then set the last
    bit when inexact) keeps the sticky information, so the final round-to-nearest-even is exact.
    """
    values = np.asarray(values, dtype=np.float64)
    target = numpy_dtype(name)
    if target.itemsize >= 4:
        return values.astype(target)
    narrow = values.astype(np.float32)
    too_far = np.abs(narrow.astype(np.float64)) > np.abs(values)
    narrow = np.where(too_far, np.nextafter(narrow, np.float32(0)), narrow)  # truncate toward 0
    inexact = narrow.astype(np.float64) != values
    bits = narrow.view(np.uint32) | inexact.astype(np.uint32)
    return bits.view(np.float32).astype(target)
