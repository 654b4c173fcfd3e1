"""RoPE frequency schedules: a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict in,
``(inv_freq float64[rotary_dim // 2], attention_factor)`` out.

Every schedule of transformers' ``ROPE_INIT_FUNCTIONS`` is written again in float64, formula for
formula; the attention factor is Hugging Face's bit for bit.

Design notes: docs/architecture.md#coreschedulespy
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .mrope import mrope_layout
from .validators import check_rotary_dim, check_seq_len, check_theta

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope", "proportional")
# Legacy names: Phi-3's first configs called LongRoPE "su".
_ALIASES = {"su": "longrope"}
# The schedules that depend on the sequence length (the seq_len argument).
SEQ_LEN_SCHEDULES = ("dynamic", "longrope")
DEFAULT_THETA = 10000.0

# Keys that any dict may carry without a warning: the type, the base, the rotated fraction and the
# config lengths (a user may copy them into every dict).
_COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor",
                          "max_position_embeddings", "original_max_position_embeddings",
                          "mrope_section", "mrope_interleaved"})
# Keys each schedule reads besides the common ones.
_SCHEDULE_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "yarn": frozenset({"factor", "attention_factor", "beta_fast", "beta_slow", "mscale",
                       "mscale_all_dim", "truncate"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor"}),
    "longrope": frozenset({"factor", "attention_factor", "short_factor", "long_factor"}),
    "proportional": frozenset({"factor"}),
}


# ---------------------------------------------------------------------------------------------------
# the dict's own checks


def scaling_type(scaling: Mapping[str, Any] | None, op_name: str) -> str:
    """The rope_type of a Hugging Face rope_scaling / rope_parameters dict, checked.

    ``"type"`` is the legacy spelling of ``"rope_type"`` (both may be given if they agree); no type
    means ``"default"``. ``mrope_section`` (M-RoPE) may come with any type: see :func:`mrope_layout`.
    """
    if scaling is None:
        return "default"
    if not isinstance(scaling, Mapping):
        raise TypeError(
            f"{op_name}: scaling must be None or a Hugging Face rope_scaling dict, "
            f"got {type(scaling).__name__}"
        )
    nested = [key for key, value in scaling.items() if isinstance(value, Mapping)]
    if nested:
        raise ValueError(
            f"{op_name}: scaling holds one dict per layer type ({', '.join(map(repr, nested))}); pass "
            f"the dict of one layer type, e.g. scaling[{nested[0]!r}]"
        )
    rope_type, legacy = scaling.get("rope_type"), scaling.get("type")
    for name, value in (("rope_type", rope_type), ("type", legacy)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{op_name}: scaling[{name!r}] must be a string, got {type(value).__name__}")
    if rope_type is None:
        rope_type = "default" if legacy is None else legacy
    elif legacy is not None and _ALIASES.get(legacy, legacy) != _ALIASES.get(rope_type, rope_type):
        raise ValueError(
            f"{op_name}: scaling has 'rope_type' {rope_type!r} and 'type' {legacy!r}; 'type' is the legacy "
            "name of 'rope_type': give one, or both equal"
        )
    rope_type = _ALIASES.get(rope_type, rope_type)
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{op_name}: unknown scaling rope_type {rope_type!r}; expected one of {ROPE_TYPES}"
        )
    return rope_type


def _number_or_none(value, key: str, context: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{context}: {key!r} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{context}: {key!r} must be finite, got {value!r}")
    return value


def partial_rotary_factor(scaling: Mapping[str, Any] | None, op_name: str) -> float | None:
    """``scaling['partial_rotary_factor']`` checked to lie in (0, 1]; None when absent."""
    if not scaling:
        return None
    value = _number_or_none(scaling.get("partial_rotary_factor"), "partial_rotary_factor",
                            f"{op_name}: scaling")
    if value is not None and not 0.0 < value <= 1.0:
        raise ValueError(f"{op_name}: scaling['partial_rotary_factor'] must lie in (0, 1], got {value!r}")
    return value


def rotary_dim_for(head_dim: int, scaling, rotary_dim, op_name: str) -> int:
    """The rotary_dim of a call with computed angles, from head_dim, scaling and rotary_dim.

    Without a ``partial_rotary_factor`` in ``scaling`` (or for ``proportional``, which always spans
    head_dim): ``rotary_dim``, or head_dim when it is None. With one: ``int(head_dim * factor)``, as
    Hugging Face computes it; an explicit ``rotary_dim`` must then equal that.
    """
    rope_type = scaling_type(scaling, op_name)
    factor = None if rope_type == "proportional" else partial_rotary_factor(scaling, op_name)
    if factor is None:
        return head_dim if rotary_dim is None else rotary_dim
    dim = int(head_dim * factor)
    if rotary_dim is None:
        if dim < 2 or dim % 2:
            raise ValueError(
                f"{op_name}: scaling['partial_rotary_factor'] = {factor!r} of head_dim {head_dim} gives "
                f"rotary_dim int({head_dim} * {factor!r}) = {dim}, which is not even and >= 2"
            )
        return dim
    if rotary_dim != dim:
        raise ValueError(
            f"{op_name}: rotary_dim is {rotary_dim} but scaling['partial_rotary_factor'] = {factor!r} of "
            f"head_dim {head_dim} gives int({head_dim} * {factor!r}) = {dim}; leave rotary_dim out or "
            "make them agree"
        )
    return rotary_dim


# ---------------------------------------------------------------------------------------------------
# the schedules


class _Schedule:
    """One call's inputs, with checked readers that name the key in every error."""

    def __init__(self, rope_type: str, rotary_dim: int, theta: float, params: Mapping[str, Any],
                 seq_len: int | None, op_name: str):
        self.rope_type = rope_type
        self.dim = rotary_dim
        self.theta = theta
        self.params = params
        self.seq_len = seq_len
        self.op_name = op_name
        self.context = f"{op_name}: {rope_type!r} scaling"

    def number(self, key: str, *, positive: bool = False) -> float | None:
        """A finite number (> 0 with ``positive``), or None when absent or None."""
        value = _number_or_none(self.params.get(key), key, self.context)
        if positive and value is not None and not value > 0:
            raise ValueError(f"{self.context}: {key!r} must be > 0, got {value!r}")
        return value

    def required(self, key: str, why: str = "") -> float:
        value = self.number(key, positive=True)
        if value is None:
            raise ValueError(f"{self.context} needs the key {key!r}{why}")
        return value

    def factor(self) -> float:
        return self.required("factor", " (a number > 0)")

    def length(self, key: str, why: str) -> int | None:
        """A context length: a positive integer, or None when absent."""
        value = self.params.get(key)
        if value is None:
            return None
        if isinstance(value, (float, np.floating)) and float(value).is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{self.context}: {key!r} ({why}) must be a positive integer, got {value!r}")
        return int(value)

    def max_position_embeddings(self, needed_for: str) -> int:
        value = self.length("max_position_embeddings", "the model config's context length")
        if value is None:
            raise ValueError(
                f"{self.context} needs the key 'max_position_embeddings' (copy the model config's "
                f"value into the dict) {needed_for}"
            )
        return value

    def original_max_position_embeddings(self) -> int:
        value = self.length("original_max_position_embeddings", "the pretraining context length")
        if value is None:  # transformers' standardize_rope_params falls back on the config's length
            value = self.length("max_position_embeddings", "the model config's context length")
        if value is None:
            raise ValueError(
                f"{self.context} needs the key 'original_max_position_embeddings' (the pretraining "
                "context length; a 'max_position_embeddings' key is used in its absence, as "
                "Hugging Face does)"
            )
        return value

    def factor_list(self, key: str) -> np.ndarray:
        value = self.params.get(key)
        half = self.dim // 2
        if value is None:
            raise ValueError(f"{self.context} needs the key {key!r} (a list of rotary_dim // 2 = {half} "
                             "numbers)")
        if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
            raise TypeError(f"{self.context}: {key!r} must be a list of numbers, got "
                            f"{type(value).__name__}")
        try:
            values = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            raise TypeError(f"{self.context}: {key!r} must be a list of numbers") from None
        if values.ndim != 1 or values.shape[0] != half:
            raise ValueError(
                f"{self.context}: {key!r} must hold rotary_dim // 2 = {half} numbers (rotary_dim "
                f"{self.dim}), got shape {values.shape}"
            )
        if not (np.all(np.isfinite(values)) and np.all(values > 0)):
            raise ValueError(f"{self.context}: every entry of {key!r} must be finite and > 0")
        return values

    def exponents(self, width: int | None = None) -> np.ndarray:
        """``arange(0, dim, 2) / dim`` (Hugging Face's ``inv_freq`` exponents), float64."""
        width = self.dim if width is None else width
        return np.arange(0, width, 2, dtype=np.float64) / self.dim

    def default_inv_freq(self) -> np.ndarray:
        return 1.0 / self.theta ** self.exponents()


def _default(s: _Schedule):
    return s.default_inv_freq(), 1.0


def _linear(s: _Schedule):
    return s.default_inv_freq() / s.factor(), 1.0


def _dynamic(s: _Schedule):
    factor = s.factor()
    max_position = s.max_position_embeddings("as the length the NTK scaling is relative to")
    if s.dim == 2:
        raise ValueError(f"{s.context} needs rotary_dim > 2 (its base exponent is dim / (dim - 2))")
    seq_len = max_position if s.seq_len is None else max(s.seq_len, max_position)
    base = s.theta * ((factor * seq_len / max_position) - (factor - 1)) ** (s.dim / (s.dim - 2))
    return 1.0 / base ** s.exponents(), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn(s: _Schedule):
    original = s.original_max_position_embeddings()
    factor = s.number("factor", positive=True)
    if factor is None:  # DeepSeek-V3 style: the ratio of the context lengths
        factor = s.max_position_embeddings("to derive the absent 'factor' (max / original)") / original
    attention_factor = s.number("attention_factor", positive=True)
    mscale, mscale_all_dim = s.number("mscale"), s.number("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            denominator = _yarn_mscale(factor, mscale_all_dim)
            if denominator == 0:
                raise ValueError(f"{s.context}: 'mscale_all_dim' {mscale_all_dim!r} makes the attention "
                                 "factor's denominator 0")
            attention_factor = float(_yarn_mscale(factor, mscale) / denominator)
        else:
            attention_factor = _yarn_mscale(factor)
    # Hugging Face: `get("beta_fast") or 32`, so 0 and None both mean the default.
    beta_fast = s.number("beta_fast") or 32
    beta_slow = s.number("beta_slow") or 1
    if beta_slow <= 0 or beta_fast < beta_slow:
        raise ValueError(
            f"{s.context}: needs 0 < beta_slow <= beta_fast, got beta_fast={beta_fast!r}, "
            f"beta_slow={beta_slow!r} (defaults 32 and 1)"
        )
    truncate = s.params.get("truncate", True)
    if truncate is not None and not isinstance(truncate, (bool, np.bool_)):
        raise TypeError(f"{s.context}: 'truncate' must be a bool, got {type(truncate).__name__}")
    if s.theta == 1.0:
        raise ValueError(f"{s.context} needs a base (theta) other than 1 (it divides by log(theta))")

    dim, base = s.dim, s.theta

    def correction_dim(num_rotations):
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # Hugging Face's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation_weight = 1.0 - ramp

    pos_freqs = base ** s.exponents()
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = (inv_freq_interpolation * (1.0 - extrapolation_weight)
                + inv_freq_extrapolation * extrapolation_weight)
    return inv_freq, attention_factor


def _longrope(s: _Schedule):
    original = s.original_max_position_embeddings()
    long_factor, short_factor = s.factor_list("long_factor"), s.factor_list("short_factor")
    attention_factor = s.number("attention_factor", positive=True)
    factor = s.number("factor", positive=True)
    if attention_factor is None:
        if factor is None:  # Phi-3 style: the ratio of the context lengths
            factor = (s.max_position_embeddings("to derive the attention factor without 'factor' or "
                                                "'attention_factor'") / original)
        if factor <= 1.0:
            attention_factor = 1.0
        elif original == 1:
            raise ValueError(f"{s.context}: 'original_max_position_embeddings' must be > 1 (the "
                             "attention factor divides by its log)")
        else:
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    # Hugging Face: `if seq_len and seq_len > original_max_position_embeddings` -> long factors.
    ext_factors = long_factor if (s.seq_len and s.seq_len > original) else short_factor
    return 1.0 / (ext_factors * s.theta ** s.exponents()), attention_factor


def _llama3(s: _Schedule):
    factor = s.factor()
    low_freq_factor = s.required("low_freq_factor", " (a number > 0; 1 for Llama 3.1)")
    high_freq_factor = s.required("high_freq_factor", " (a number > low_freq_factor; 4 for Llama 3.1)")
    original = s.original_max_position_embeddings()
    if not low_freq_factor < high_freq_factor:
        raise ValueError(
            f"{s.context}: needs low_freq_factor < high_freq_factor, got {low_freq_factor!r} and "
            f"{high_freq_factor!r}"
        )
    inv_freq = s.default_inv_freq()
    low_freq_wavelen = original / low_freq_factor
    high_freq_wavelen = original / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # wavelen < high_freq_wavelen: unchanged; wavelen > low_freq_wavelen: divided by factor
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # in between: interpolated with a smooth factor
    smooth_factor = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_llama), 1.0


def _proportional(s: _Schedule):
    # rotary_dim plays Hugging Face's head_dim: the first int(prf * head_dim // 2) pairs rotate with
    # the exponents of the full head_dim, the others get frequency 0 (an identity rotation).
    factor = s.number("factor", positive=True) or 1.0
    fraction = partial_rotary_factor(s.params, s.op_name) or 1.0
    rope_angles = int(fraction * s.dim // 2)
    inv_freq = np.zeros(s.dim // 2, dtype=np.float64)
    inv_freq[:rope_angles] = 1.0 / s.theta ** s.exponents(2 * rope_angles)
    return inv_freq / factor, 1.0


_COMPUTE = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "llama3": _llama3,
    "longrope": _longrope,
    "proportional": _proportional,
}


def schedule_theta(theta, scaling, op_name: str) -> float:
    """The RoPE base: ``scaling['rope_theta']`` when present, else ``theta``.

    Both given and different raises, unless ``theta`` is at its default (10000.0), which cannot be
    told apart from "not given".
    """
    theta = check_theta(theta, op_name)
    rope_theta = None if not scaling else scaling.get("rope_theta")
    if rope_theta is None:
        return theta
    rope_theta = check_theta(rope_theta, op_name, "scaling['rope_theta']")
    if theta != DEFAULT_THETA and theta != rope_theta:
        raise ValueError(
            f"{op_name}: theta={theta!r} disagrees with scaling['rope_theta']={rope_theta!r}; give the "
            "base once (leave theta at its default when the dict has rope_theta)"
        )
    return rope_theta


def _stacklevel_outside_package() -> int:
    """The ``stacklevel`` of the first caller outside cupyrope (a warning points at user code)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # cupyrope/
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def compute_frequencies(rotary_dim, *, theta=DEFAULT_THETA, scaling=None, seq_len=None,
                        op_name: str = "rope_frequencies"):
    """``(inv_freq float64[rotary_dim // 2], attention_factor float)`` of a schedule, checked.

    See :func:`cupyrope.rope_frequencies`; ``op_name`` prefixes the error messages.
    """
    rotary_dim = check_rotary_dim(rotary_dim, op_name)
    rope_type = scaling_type(scaling, op_name)
    base = schedule_theta(theta, scaling, op_name)
    seq_len = check_seq_len(seq_len, op_name)
    params = scaling or {}
    partial_rotary_factor(params, op_name)  # checked for every type, used by proportional
    mrope_layout(params, rotary_dim, op_name)  # M-RoPE keys checked here too; plan.py uses them
    schedule = _Schedule(rope_type, rotary_dim, base, params, seq_len, op_name)
    inv_freq, attention_factor = _COMPUTE[rope_type](schedule)

    unused = sorted(str(key) for key in params
                    if key not in _COMMON_KEYS and key not in _SCHEDULE_KEYS[rope_type])
    if unused:
        warnings.warn(
            f"{op_name}: scaling keys {unused} are not used by rope_type {rope_type!r} (it reads "
            f"{sorted(_SCHEDULE_KEYS[rope_type] | {'rope_theta'})})",
            UserWarning, stacklevel=_stacklevel_outside_package(),
        )
    inv_freq = np.ascontiguousarray(inv_freq, dtype=np.float64)
    attention_factor = float(attention_factor)
    if not (np.all(np.isfinite(inv_freq)) and math.isfinite(attention_factor) and attention_factor > 0):
        raise ValueError(
            f"{op_name}: the {rope_type!r} schedule gives non-finite inverse frequencies or an attention "
            f"factor that is not > 0 ({attention_factor!r}); check the values of scaling"
        )
    return inv_freq, attention_factor
