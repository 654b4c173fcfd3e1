"""Every documented validation error (docs/api_decisions.md, docs/contract.md §5).

Each case asserts the exception type, that the message names the argument (and, where natural, what was
given), and that nothing was written: q, k and the tables are bit-identical after the failed call, with
inplace=False and with inplace=True.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import cupyrope as cr
from tolerances import assert_bits_equal

T, HQ, HK, D, MAX_POSITION = 6, 4, 2, 64, 128

Q = r"\bq\b"
K = r"\bk\b"


class Inputs:
    """Fresh random q, k, positions, cache and per-token tables for one case."""

    def __init__(self, randn, rng, dtype="float32"):
        self.randn = randn
        self.rng = rng
        self.q = randn((T, HQ, D), dtype)
        self.k = randn((T, HK, D), dtype)
        self.positions = rng.integers(0, MAX_POSITION, size=T).astype(np.int64)
        self.cache = cr.cos_sin_cache(MAX_POSITION, D)
        angles = rng.uniform(-3, 3, size=(T, D // 2))
        self.cos = np.cos(angles).astype(np.float32)
        self.sin = np.sin(angles).astype(np.float32)


# Each case: inputs -> (q, k, kwargs, exception, message regex, optional regex of the given value)
CASES = {
    # --- q and k -----------------------------------------------------------------------------------
    "q_list": lambda a: (a.q.tolist(), None, {}, TypeError, Q, None),
    "q_object": lambda a: (object(), None, {}, TypeError, Q, None),
    "q_int32": lambda a: (a.q.astype(np.int32), None, {}, TypeError, Q, "int32"),
    "q_complex": lambda a: (a.q.astype(np.complex64), None, {}, TypeError, Q, "complex64"),
    "q_float8": lambda a: (a.q.astype(ml_dtypes.float8_e4m3fn), None, {}, TypeError, Q, "float8"),
    "q_rank1": lambda a: (a.q[0, 0], None, {}, ValueError, Q, None),
    "k_token_dims": lambda a: (a.q, a.randn((T + 1, HK, D)), {}, ValueError, K, None),
    "k_token_rank": lambda a: (a.q, a.randn((1, T, HK, D)), {}, ValueError, K, None),
    "k_head_dim": lambda a: (a.q, a.randn((T, HK, D + 2)), {}, ValueError, K, str(D + 2)),
    "k_dtype": lambda a: (a.q, a.k.astype(np.float64), {}, TypeError, K, "float64"),
    "k_list": lambda a: (a.q, a.k.tolist(), {}, TypeError, K, None),
    "q_odd_head_dim": lambda a: (a.randn((T, HQ, 63)), None, {}, ValueError, r"rotary_dim|head_dim", "63"),
    # --- rotary_dim --------------------------------------------------------------------------------
    "rotary_dim_odd": lambda a: (a.q, a.k, {"rotary_dim": 31}, ValueError, "rotary_dim", "31"),
    "rotary_dim_too_big": lambda a: (a.q, a.k, {"rotary_dim": D + 2}, ValueError, "rotary_dim", str(D + 2)),
    "rotary_dim_zero": lambda a: (a.q, a.k, {"rotary_dim": 0}, ValueError, "rotary_dim", None),
    "rotary_dim_negative": lambda a: (a.q, a.k, {"rotary_dim": -2}, ValueError, "rotary_dim", None),
    # --- cos_sin_cache -----------------------------------------------------------------------------
    "cache_rank1": lambda a: (a.q, a.k, {"positions": a.positions, "cos_sin_cache": a.cache[0]},
                              ValueError, "cos_sin_cache", None),
    "cache_int": lambda a: (a.q, a.k, {"positions": a.positions, "cos_sin_cache": a.cache.astype(np.int32)},
                            TypeError, "cos_sin_cache", "int32"),
    "cache_list": lambda a: (a.q, a.k, {"positions": a.positions, "cos_sin_cache": a.cache.tolist()},
                             TypeError, "cos_sin_cache", None),
    "cache_width_vs_rotary_dim": lambda a: (a.q, a.k, {"positions": a.positions, "cos_sin_cache": a.cache,
                                                       "rotary_dim": D // 2},
                                            ValueError, "cos_sin_cache|rotary_dim", None),
    "cache_wider_than_head": lambda a: (a.q, a.k, {"positions": a.positions,
                                                   "cos_sin_cache": cr.cos_sin_cache(MAX_POSITION, 2 * D)},
                                        ValueError, "cos_sin_cache", "128"),  # rotary_dim was not passed
    "cache_odd_width": lambda a: (a.q, a.k, {"positions": a.positions, "cos_sin_cache": a.cache[:, :D - 1]},
                                  ValueError, "cos_sin_cache|rotary_dim", None),
    "cache_and_tables": lambda a: (a.q, a.k, {"positions": a.positions, "cos_sin_cache": a.cache,
                                              "cos": a.cos, "sin": a.sin},
                                   ValueError, "cos_sin_cache", None),
    # --- cos / sin ---------------------------------------------------------------------------------
    "cos_without_sin": lambda a: (a.q, a.k, {"cos": a.cos, "rotary_dim": D}, ValueError, r"\bsin\b", None),
    "sin_without_cos": lambda a: (a.q, a.k, {"sin": a.sin, "rotary_dim": D}, ValueError, r"\bcos\b", None),
    "tables_with_positions": lambda a: (a.q, a.k, {"cos": a.cos, "sin": a.sin, "rotary_dim": D,
                                                   "positions": a.positions},
                                        ValueError, "positions", None),
    "tables_dtype_mismatch": lambda a: (a.q, a.k, {"cos": a.cos, "sin": a.sin.astype(np.float64),
                                                   "rotary_dim": D},
                                        TypeError, r"\bcos\b|\bsin\b", None),
    "tables_int": lambda a: (a.q, a.k, {"cos": a.cos.astype(np.int32), "sin": a.sin.astype(np.int32),
                                        "rotary_dim": D},
                             TypeError, r"\bcos\b", "int32"),
    "tables_shape_mismatch": lambda a: (a.q, a.k, {"cos": a.cos, "sin": a.sin[:, : D // 4], "rotary_dim": D},
                                        ValueError, r"\bsin\b|\bcos\b", None),
    "tables_width_neither": lambda a: (a.q, a.k, {"cos": a.cos[:, :24], "sin": a.sin[:, :24], "rotary_dim": D},
                                       ValueError, r"\bcos\b", "24"),
    "tables_too_wide": lambda a: (a.q, a.k, {"cos": np.concatenate([a.cos] * 4, -1),
                                             "sin": np.concatenate([a.sin] * 4, -1)},
                                  ValueError, r"\bcos\b", "128"),  # rotary_dim was not passed
    "tables_odd_width": lambda a: (a.q, a.k, {"cos": a.cos[:, :31], "sin": a.sin[:, :31]},
                                   ValueError, r"\bcos\b", "31"),
    "tables_token_dims": lambda a: (a.q, a.k, {"cos": np.concatenate([a.cos, a.cos[:1]]),
                                               "sin": np.concatenate([a.sin, a.sin[:1]]), "rotary_dim": D},
                                    ValueError, r"\bcos\b", None),
    # --- positions ---------------------------------------------------------------------------------
    "positions_float": lambda a: (a.q, a.k, {"positions": a.positions.astype(np.float32)},
                                  TypeError, "positions", "float32"),
    "positions_int16": lambda a: (a.q, a.k, {"positions": a.positions.astype(np.int16)},
                                  TypeError, "positions", "int16"),
    "positions_uint32": lambda a: (a.q, a.k, {"positions": a.positions.astype(np.uint32)},
                                   TypeError, "positions", "uint32"),
    "positions_list": lambda a: (a.q, a.k, {"positions": a.positions.tolist()}, TypeError, "positions", None),
    "positions_not_broadcastable": lambda a: (a.q, a.k, {"positions": np.arange(T + 1)},
                                              ValueError, "positions", None),
    "positions_extra_dim": lambda a: (a.q, a.k, {"positions": np.zeros((T, 2), dtype=np.int64)},
                                      ValueError, "positions", None),
    "positions_cache_float": lambda a: (a.q, a.k, {"positions": a.positions.astype(np.float64),
                                                   "cos_sin_cache": a.cache},
                                        TypeError, "positions", None),
    # --- theta and scaling -------------------------------------------------------------------------
    "theta_zero": lambda a: (a.q, a.k, {"theta": 0.0}, ValueError, "theta", None),
    "theta_negative": lambda a: (a.q, a.k, {"theta": -10000.0}, ValueError, "theta", None),
    "theta_nan": lambda a: (a.q, a.k, {"theta": float("nan")}, ValueError, "theta", None),
    "theta_inf": lambda a: (a.q, a.k, {"theta": float("inf")}, ValueError, "theta", None),
    "scaling_unknown": lambda a: (a.q, a.k, {"scaling": {"rope_type": "banana"}},
                                  ValueError, "scaling|rope_type", "banana"),
    "scaling_linear_factor_zero": lambda a: (a.q, a.k, {"scaling": {"rope_type": "linear", "factor": 0.0}},
                                             ValueError, "factor", None),
    "scaling_linear_factor_negative": lambda a: (a.q, a.k, {"scaling": {"rope_type": "linear", "factor": -2.0}},
                                                 ValueError, "factor", None),
    "scaling_linear_no_factor": lambda a: (a.q, a.k, {"scaling": {"rope_type": "linear"}},
                                           ValueError, "factor", None),
    # Every Hugging Face schedule is computed; what is wrong in a dict is named.
    "scaling_dynamic_no_max": lambda a: (a.q, a.k, {"scaling": {"rope_type": "dynamic", "factor": 2.0}},
                                         ValueError, "max_position_embeddings", None),
    "scaling_yarn_beta": lambda a: (a.q, a.k, {"scaling": {"rope_type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings": 4096,
                                                            "beta_fast": 1, "beta_slow": 8}},
                                    ValueError, "beta", None),
    "scaling_llama3_no_low": lambda a: (a.q, a.k, {"scaling": {"rope_type": "llama3", "factor": 8.0,
                                                                "high_freq_factor": 4.0,
                                                                "original_max_position_embeddings": 8192}},
                                        ValueError, "low_freq_factor", None),
    "scaling_longrope_length": lambda a: (a.q, a.k, {"scaling": {"rope_type": "longrope", "factor": 4.0,
                                                                  "original_max_position_embeddings": 4096,
                                                                  "short_factor": [1.0] * 31,
                                                                  "long_factor": [1.0] * 32}},
                                          ValueError, "short_factor", "32"),
    "scaling_mrope_sum": lambda a: (a.q, a.k, {"scaling": {"rope_type": "default",
                                                            "mrope_section": [16, 24, 24]}},
                                    ValueError, "mrope_section", "64"),
    "scaling_mrope_positions": lambda a: (a.q, a.k, {"scaling": {"rope_type": "default",
                                                                  "mrope_section": [16, 8, 8]},
                                                      "positions": a.positions},
                                          ValueError, "positions", r"\[3, \.\.\.\]"),
    "scaling_mrope_tables": lambda a: (a.q, a.k, {"scaling": {"rope_type": "default",
                                                               "mrope_section": [16, 8, 8]},
                                                   "cos": a.cos, "sin": a.sin},
                                       ValueError, "mrope_section", None),
    # --- validate ----------------------------------------------------------------------------------
    "validate_out_of_range": lambda a: (a.q, a.k, {"positions": np.where(np.arange(T) == 3, MAX_POSITION,
                                                                        a.positions),
                                                   "cos_sin_cache": a.cache, "validate": True},
                                        IndexError, "positions", str(MAX_POSITION)),
    "validate_negative": lambda a: (a.q, a.k, {"positions": np.where(np.arange(T) == 0, -5, a.positions),
                                               "cos_sin_cache": a.cache, "validate": True},
                                    IndexError, "positions", "-5"),
}


def _arrays_in(q, k, kwargs):
    arrays = {"q": q, "k": k}
    arrays.update({name: v for name, v in kwargs.items() if isinstance(v, np.ndarray)})
    return {name: v for name, v in arrays.items() if isinstance(v, np.ndarray)}


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_raises_and_writes_nothing(case, inplace, randn, rng):
    q, k, kwargs, exc, name_regex, given_regex = CASES[case](Inputs(randn, rng))
    arrays = _arrays_in(q, k, kwargs)
    before = {name: np.array(v, copy=True) for name, v in arrays.items()}
    with pytest.raises(exc, match=name_regex) as info:
        cr.apply_rope(q, k, inplace=inplace, **kwargs)
    if given_regex is not None:
        assert re.search(given_regex, str(info.value)), (
            f"message does not say what was given ({given_regex!r}): {info.value}"
        )
    for name, v in arrays.items():
        assert_bits_equal(v, before[name], what=f"{name} after a failed call")


def test_rotary_dim_not_an_int(randn, rng):
    """docs/api_decisions.md: 'rotary_dim must be an int' (a float is refused, naming rotary_dim)."""
    a = Inputs(randn, rng)
    with pytest.raises((TypeError, ValueError), match="rotary_dim"):
        cr.apply_rope(a.q, a.k, rotary_dim=float(D))
    with pytest.raises((TypeError, ValueError), match="rotary_dim"):
        cr.apply_rope(a.q, a.k, rotary_dim="64")


# ----------------------------------------------------------------------------------------------------
# in-place specific


def test_inplace_read_only_q(randn, rng):
    a = Inputs(randn, rng)
    a.q.flags.writeable = False
    before_q, before_k = a.q.copy(), a.k.copy()
    with pytest.raises(ValueError, match=Q):
        cr.apply_rope(a.q, a.k, a.positions, inplace=True)
    assert_bits_equal(a.q, before_q, what="q")
    assert_bits_equal(a.k, before_k, what="k")
    # out of place a read-only input is fine
    out_q, _ = cr.apply_rope(a.q, a.k, a.positions)
    assert out_q.flags.writeable


def test_inplace_read_only_k_writes_nothing_to_q(randn, rng):
    """k is checked before q is written: the failed call leaves q untouched too."""
    a = Inputs(randn, rng)
    a.k.flags.writeable = False
    before_q = a.q.copy()
    with pytest.raises(ValueError, match=K):
        cr.apply_rope(a.q, a.k, a.positions, inplace=True)
    assert_bits_equal(a.q, before_q, what="q")


@pytest.mark.parametrize("which", ["q", "k"])
def test_inplace_zero_stride(which, randn, rng):
    a = Inputs(randn, rng)
    base = randn((1, HQ if which == "q" else HK, D))
    aliased = np.lib.stride_tricks.as_strided(base, shape=(T,) + base.shape[1:], strides=(0,) + base.strides[1:],
                                              writeable=True)
    q, k = (aliased, a.k) if which == "q" else (a.q, aliased)
    before = {"base": base.copy(), "q": q.copy(), "k": k.copy()}
    with pytest.raises(ValueError, match=Q if which == "q" else K):
        cr.apply_rope(q, k, a.positions, inplace=True)
    assert_bits_equal(base, before["base"], what="aliased storage")
    assert_bits_equal(a.q if which == "k" else a.k, before["q" if which == "k" else "k"], what="other input")
    # out of place an aliased (broadcast) input is fine: every token reads the same row
    out_q, _ = cr.apply_rope(q, k, a.positions)
    assert out_q.shape == q.shape and np.all(np.isfinite(out_q.astype(np.float64)))


def test_inplace_q_is_k(randn, rng):
    a = Inputs(randn, rng)
    before = a.q.copy()
    with pytest.raises(ValueError, match=Q + "|" + K):
        cr.apply_rope(a.q, a.q, a.positions, inplace=True)
    assert_bits_equal(a.q, before, what="q")


# ----------------------------------------------------------------------------------------------------
# helpers


@pytest.mark.parametrize("call, exc, regex", [
    (lambda: cr.cos_sin_cache(128, 63), ValueError, "rotary_dim"),
    (lambda: cr.cos_sin_cache(128, 0), ValueError, "rotary_dim"),
    (lambda: cr.cos_sin_cache(128, 64, theta=0.0), ValueError, "theta"),
    (lambda: cr.cos_sin_cache(128, 64, theta=float("nan")), ValueError, "theta"),
    (lambda: cr.cos_sin_cache(-1, 64), ValueError, "max_position"),
    (lambda: cr.cos_sin_cache(128, 64, dtype="int32"), ValueError, "dtype"),
    (lambda: cr.cos_sin_cache(128, 64, scaling={"rope_type": "banana"}), ValueError, "scaling|rope_type"),
    (lambda: cr.cos_sin_cache(128, 64, scaling={"rope_type": "llama3", "factor": 8.0}), ValueError,
     "low_freq_factor"),
    (lambda: cr.cos_sin_cache(128, 64, scaling={"rope_type": "linear", "factor": 0.0}), ValueError, "factor"),
    (lambda: cr.rope_frequencies(63), ValueError, "rotary_dim"),
    (lambda: cr.rope_frequencies(64, theta=-1.0), ValueError, "theta"),
    (lambda: cr.rope_frequencies(64, scaling={"rope_type": "banana"}), ValueError, "scaling|rope_type"),
    (lambda: cr.rope_frequencies(64, scaling={"type": "yarn", "factor": 4.0}), ValueError,
     "original_max_position_embeddings"),
], ids=["cache_odd", "cache_zero", "cache_theta0", "cache_theta_nan", "cache_maxpos", "cache_dtype",
        "cache_scaling_unknown", "cache_llama3", "cache_factor0", "freq_odd", "freq_theta", "freq_unknown",
        "freq_yarn_legacy_key"])
def test_helper_errors(call, exc, regex):
    with pytest.raises(exc, match=regex):
        call()
