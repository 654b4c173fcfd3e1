"""Checks of scalar arguments, shared by every entry point; each message names the function and
the argument, what was expected and what was given."""

from __future__ import annotations

import math
import numbers

import numpy as np


def check_bool(value, name: str, op_name: str = "apply_rope") -> bool:
    """A bool (Python or NumPy); 0 / 1 and other truthy values are refused."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op_name}: {name} must be a bool, got {type(value).__name__}")
    return bool(value)


def is_integer(value) -> bool:
    """A Python or NumPy integer that is not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(value, name: str, op_name: str, *, minimum: int | None = None) -> int:
    if not is_integer(value):
        raise TypeError(f"{op_name}: {name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{op_name}: {name} must be >= {minimum}, got {value}")
    return int(value)


def check_real(value, name: str, op_name: str) -> float:
    """A real number (Python, NumPy or anything registered as ``numbers.Real``) as a float.

    Strings, bools and arrays are refused: ``float("1e4")`` would accept text.
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{op_name}: {name} must be a number, got bool")
    if not isinstance(value, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"{op_name}: {name} must be a number, got {type(value).__name__}")
    return float(value)


def check_theta(theta, op_name: str, name: str = "theta") -> float:
    """The RoPE base: a finite real number > 0."""
    value = check_real(theta, name, op_name)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{op_name}: {name} must be finite and > 0, got {theta!r}")
    return value


def check_seq_len(seq_len, op_name: str) -> int | None:
    if seq_len is None:
        return None
    if not is_integer(seq_len):
        raise TypeError(f"{op_name}: seq_len must be None or an int, got {type(seq_len).__name__}")
    if seq_len < 0:
        raise ValueError(f"{op_name}: seq_len must be >= 0, got {seq_len}")
    return int(seq_len)


def check_rotary_dim(rotary_dim, op_name: str, head_dim: int | None = None) -> int:
    """An even int >= 2 (and <= head_dim when that is given)."""
    rotary_dim = check_int(rotary_dim, "rotary_dim", op_name)
    if head_dim is None:
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(f"{op_name}: rotary_dim must be even and >= 2, got {rotary_dim}")
    elif rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"{op_name}: rotary_dim must be even with 2 <= rotary_dim <= head_dim ({head_dim}), "
            f"got {rotary_dim}"
        )
    return rotary_dim
