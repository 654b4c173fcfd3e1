"""Frequency schedules (``scaling``) against transformers' ``ROPE_INIT_FUNCTIONS``, and through every
angle source.

- ``rope_frequencies`` gives Hugging Face's inverse frequencies to within the float32 rounding of
  Hugging Face's own computation, and its attention factor exactly (both are Python-float formulas),
  for every rope_type, both dict styles (legacy ``rope_scaling`` and transformers 5
  ``rope_parameters``), partial rotary, and the length-dependent schedules at several ``seq_len``.
- ``apply_rope`` (NumPy path) with a schedule equals an independent float64 rotation by Hugging Face's
  angles and attention factor; ``cos_sin_cache`` rows are cos/sin of float64 angles times the
  attention factor, rounded once. On a GPU the kernel's in-kernel angles are checked the same way.
- Every documented error: unknown rope_type, missing keys, inconsistent values.

transformers (with torch CPU) is imported once per module; without it the comparisons skip and the
error tests still run.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import cupyrope as cr
from reference import reference_rope, round_to_dtype
from tolerances import (
    ANGLE_EPS,
    C_COMPUTE,
    assert_bits_equal,
    assert_rope_close,
    compute_eps,
    max_abs_angle,
    ulp,
)

U32 = 2.0**-24  # float32 unit roundoff

# ----------------------------------------------------------------------------------------------------
# Hugging Face's numbers


@pytest.fixture(scope="module")
def hf():
    """hf(params, head_dim, max_position_embeddings, seq_len=None, legacy_theta=None) ->
    (inv_freq float64 of Hugging Face's float32 values, attention_factor) from transformers.

    ``params`` is a transformers 5 ``rope_parameters`` dict, or with ``legacy_theta`` a legacy
    ``rope_scaling`` dict (the base then comes from the config's ``rope_theta``)."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()  # unrecognised-key notices for our extra keys
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

    def compute(params, head_dim, max_position_embeddings, seq_len=None, legacy_theta=None):
        params = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in params.items()}
        common = dict(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                      max_position_embeddings=max_position_embeddings)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if legacy_theta is None:
                config = LlamaConfig(rope_parameters=params, **common)
            else:
                config = LlamaConfig(rope_scaling=params, rope_theta=legacy_theta, **common)
            rope_type = config.rope_parameters["rope_type"]
            if rope_type == "default":
                # Llama's default ignores partial_rotary_factor; GPT-NeoX's (same formula) honours it.
                inv_freq, attention_factor = GPTNeoXRotaryEmbedding.compute_default_rope_parameters(config)
            else:
                inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, seq_len=seq_len)
        return inv_freq.double().numpy(), attention_factor

    return compute


def hf_rtol(inv_freq_hf: np.ndarray) -> np.ndarray:
    """Relative error of Hugging Face's float32 inverse frequencies, per entry.

    ``theta ** (2j / dim)`` with the exponent rounded to float32: a relative exponent error of 2^-24
    becomes ``|ln(inv_freq)| * 2^-24`` in the result; a handful of float32 roundings (pow, division,
    the schedule's products and sums) add a few 2^-24 more.
    """
    with np.errstate(divide="ignore"):
        log = np.abs(np.log(np.where(inv_freq_hf > 0, inv_freq_hf, 1.0)))
    return U32 * (8.0 + log)


def assert_frequencies_match(ours, hf_values, what: str) -> None:
    inv_freq, attention_factor = ours
    inv_freq_hf, attention_factor_hf = hf_values
    assert inv_freq.dtype == np.float64 and inv_freq.shape == inv_freq_hf.shape, (
        f"{what}: inv_freq {inv_freq.dtype}{inv_freq.shape}, Hugging Face {inv_freq_hf.shape}")
    assert isinstance(attention_factor, float)
    # attention factors are Python-float formulas on both sides: equal to 1e-12 (in fact bitwise)
    assert attention_factor == pytest.approx(float(attention_factor_hf), rel=1e-12, abs=0), (
        f"{what}: attention_factor {attention_factor!r}, Hugging Face {attention_factor_hf!r}")
    np.testing.assert_array_equal(inv_freq == 0, inv_freq_hf == 0, err_msg=f"{what}: zero pattern")
    rel = np.abs(inv_freq - inv_freq_hf) / np.where(inv_freq_hf != 0, np.abs(inv_freq_hf), 1.0)
    bound = hf_rtol(inv_freq_hf)
    worst = int(np.argmax(rel / bound))
    assert rel[worst] <= bound[worst], (
        f"{what}: inv_freq[{worst}] = {inv_freq[worst]!r}, Hugging Face {inv_freq_hf[worst]!r} "
        f"(relative {rel[worst]:.3g} > {bound[worst]:.3g})")


# ----------------------------------------------------------------------------------------------------
# the cases: real model configurations and the corners of each formula

_rng = np.random.default_rng(20260101)
PHI3_SHORT = (1.0 + 0.1 * _rng.random(48)).round(6).tolist()
PHI3_LONG = (1.0 + 40.0 * _rng.random(48)).round(6).tolist()
PHI4_SHORT = (1.0 + 0.5 * _rng.random(48)).round(6).tolist()
PHI4_LONG = (1.0 + 20.0 * _rng.random(48)).round(6).tolist()


# name -> (rope_parameters, head_dim, max_position_embeddings, seq_lens to try)
CASES = {
    "default_llama2": ({"rope_type": "default", "rope_theta": 10000.0}, 128, 4096, [None]),
    "default_llama3": ({"rope_type": "default", "rope_theta": 500000.0}, 128, 8192, [None]),
    "default_partial_phi2": ({"rope_type": "default", "rope_theta": 10000.0,
                              "partial_rotary_factor": 0.4}, 80, 2048, [None]),
    "default_partial_neox": ({"rope_type": "default", "rope_theta": 10000.0,
                              "partial_rotary_factor": 0.25}, 128, 2048, [None]),
    "linear": ({"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}, 128, 16384, [None]),
    "linear_gemma3": ({"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}, 256, 131072, [None]),
    "linear_partial": ({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.5}, 96, 4096, [None]),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, 128, 4096,
                [None, 100, 4096, 4097, 10000, 2**20]),
    "dynamic_partial": ({"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5}, 64, 2048, [None, 3000, 65536]),
    "yarn_qwen": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                   "rope_theta": 1e6}, 128, 131072, [None]),
    "yarn_deepseek_v3": ({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                          "rope_theta": 10000.0}, 64, 163840, [None]),
    "yarn_mscale_ratio": ({"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096,
                           "mscale": 0.707, "mscale_all_dim": 1.0, "rope_theta": 10000.0}, 64, 65536,
                          [None]),
    "yarn_mscale_only": ({"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096,
                          "mscale": 0.707, "rope_theta": 10000.0}, 64, 65536, [None]),
    "yarn_gpt_oss": ({"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0},
                     64, 131072, [None]),
    "yarn_attention_factor": ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048,
                               "attention_factor": 0.8, "beta_fast": 16.0, "beta_slow": 2.0,
                               "rope_theta": 10000.0}, 96, 16384, [None]),
    "yarn_factor_from_lengths": ({"rope_type": "yarn", "factor": None,
                                  "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
                                 128, 65536, [None]),
    "yarn_small_factor": ({"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096,
                           "rope_theta": 10000.0}, 32, 4096, [None]),
    "yarn_partial": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                      "partial_rotary_factor": 0.5, "rope_theta": 10000.0}, 128, 16384, [None]),
    "llama3_1": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_theta": 500000.0}, 128, 131072, [None]),
    "llama3_2": ({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_theta": 500000.0}, 64, 131072, [None]),
    "llama3_partial": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                        "high_freq_factor": 8.0, "original_max_position_embeddings": 4096,
                        "partial_rotary_factor": 0.5, "rope_theta": 10000.0}, 128, 32768, [None]),
    "longrope_phi3": ({"rope_type": "longrope", "short_factor": PHI3_SHORT, "long_factor": PHI3_LONG,
                       "original_max_position_embeddings": 4096, "rope_theta": 10000.0}, 96, 131072,
                      [None, 0, 4096, 4097, 131072]),
    "longrope_factor": ({"rope_type": "longrope", "short_factor": PHI3_SHORT, "long_factor": PHI3_LONG,
                         "factor": 8.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0},
                        96, 131072, [None, 5000]),
    "longrope_attention_factor": ({"rope_type": "longrope", "short_factor": PHI3_SHORT,
                                   "long_factor": PHI3_LONG, "attention_factor": 1.25,
                                   "original_max_position_embeddings": 4096, "rope_theta": 10000.0},
                                  96, 131072, [5000]),
    "longrope_partial_phi4": ({"rope_type": "longrope", "short_factor": PHI4_SHORT, "long_factor": PHI4_LONG,
                               "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
                               "rope_theta": 10000.0}, 128, 131072, [None, 8192]),
    "proportional": ({"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
                     256, 131072, [None]),
    "proportional_factor": ({"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 8.0,
                             "rope_theta": 1e6}, 128, 131072, [None]),
    "proportional_full": ({"rope_type": "proportional", "rope_theta": 10000.0}, 64, 4096, [None]),
}

SEQ_CASES = [(name, seq_len) for name, case in CASES.items() for seq_len in case[3]]


def rotary_dim_of(params, head_dim) -> int:
    """The rotated dims of a case: Hugging Face's int(head_dim * partial_rotary_factor); proportional
    spans head_dim."""
    if params.get("rope_type") == "proportional":
        return head_dim
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def our_dict(params, max_position_embeddings) -> dict:
    """The case's dict with the config value Hugging Face reads from the model config added."""
    return {**params, "max_position_embeddings": max_position_embeddings}


# ----------------------------------------------------------------------------------------------------
# rope_frequencies == Hugging Face


@pytest.mark.parametrize("name, seq_len", SEQ_CASES, ids=[f"{n}-{s}" for n, s in SEQ_CASES])
def test_frequencies_match_transformers(hf, name, seq_len):
    params, head_dim, max_position, _ = CASES[name]
    rotary_dim = rotary_dim_of(params, head_dim)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a known dict must not warn
        ours = cr.rope_frequencies(rotary_dim, scaling=our_dict(params, max_position), seq_len=seq_len)
    assert_frequencies_match(ours, hf(params, head_dim, max_position, seq_len), name)


def mp_frequencies(params, rotary_dim, seq_len):
    """The schedule's inverse frequencies in 40-digit mpmath, written plainly from transformers'
    formulas (``ROPE_INIT_FUNCTIONS``), for the float64-accuracy check."""
    mp = pytest.importorskip("mpmath").mp
    mp.dps = 40
    mpf = mp.mpf
    rope_type = params["rope_type"]
    dim = rotary_dim
    base = mpf(params.get("rope_theta", 10000.0))
    original = params.get("original_max_position_embeddings")
    max_position = params.get("max_position_embeddings")
    factor = params.get("factor")

    def plain(base):
        return [1 / base ** (mpf(2 * j) / dim) for j in range(dim // 2)]

    if rope_type == "default":
        return plain(base)
    if rope_type == "linear":
        return [f / mpf(factor) for f in plain(base)]
    if rope_type == "dynamic":
        n = max_position if seq_len is None else max(seq_len, max_position)
        return plain(base * (mpf(factor) * n / max_position - (mpf(factor) - 1)) ** (mpf(dim) / (dim - 2)))
    if rope_type == "yarn":
        factor = mpf(max_position) / original if factor is None else mpf(factor)
        beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

        def correction_dim(rotations):
            return dim * mp.log(original / (rotations * 2 * mp.pi)) / (2 * mp.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if params.get("truncate", True):
            low, high = mp.floor(low), mp.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high + mpf("0.001") if low == high else high
        out = []
        for j, f in enumerate(plain(base)):
            ramp = min(max((j - low) / (high - low), 0), 1)
            out.append(f / factor * ramp + f * (1 - ramp))
        return out
    if rope_type == "llama3":
        low_wavelen = mpf(original) / params["low_freq_factor"]
        high_wavelen = mpf(original) / params["high_freq_factor"]
        out = []
        for f in plain(base):
            wavelen = 2 * mp.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / factor)
            else:
                smooth = ((original / wavelen - params["low_freq_factor"])
                          / (mpf(params["high_freq_factor"]) - params["low_freq_factor"]))
                out.append((1 - smooth) * f / factor + smooth * f)
        return out
    if rope_type == "longrope":
        ext = params["long_factor"] if seq_len and seq_len > original else params["short_factor"]
        return [f / mpf(e) for f, e in zip(plain(base), ext)]
    if rope_type == "proportional":
        angles = int(params.get("partial_rotary_factor", 1.0) * dim // 2)
        return [f / mpf(factor or 1.0) if j < angles else mpf(0) for j, f in enumerate(plain(base))]
    raise AssertionError(rope_type)


@pytest.mark.parametrize("name, seq_len", SEQ_CASES, ids=[f"{n}-{s}" for n, s in SEQ_CASES])
def test_frequencies_are_float64_accurate(name, seq_len):
    """float64 numbers, not float32 ones: within ~1e-14 of a 40-digit evaluation of the same
    formulas (Hugging Face's float32 values are ~1e-7 away)."""
    params, head_dim, max_position, _ = CASES[name]
    rotary_dim = rotary_dim_of(params, head_dim)
    scaling = our_dict(params, max_position)
    inv_freq, _ = cr.rope_frequencies(rotary_dim, scaling=scaling, seq_len=seq_len)
    exact = np.array([float(v) for v in mp_frequencies(scaling, rotary_dim, seq_len)])
    np.testing.assert_array_equal(inv_freq == 0, exact == 0)
    np.testing.assert_allclose(inv_freq, exact, rtol=2e-14, atol=0, err_msg=name)


LEGACY = {  # legacy rope_scaling dicts: "type", the base as theta=, lengths from the config
    "linear": ({"type": "linear", "factor": 2.0}, 10000.0, 128, 4096, None),
    "dynamic": ({"type": "dynamic", "factor": 2.0}, 10000.0, 128, 4096, 9000),
    "yarn": ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 1e6, 128,
             131072, None),
    "yarn_deepseek": ({"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                       "mscale_all_dim": 0.8, "original_max_position_embeddings": 4096}, 10000.0, 64,
                      163840, None),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}, 500000.0, 128, 131072, None),
    "longrope": ({"type": "longrope", "short_factor": PHI3_SHORT, "long_factor": PHI3_LONG,
                  "original_max_position_embeddings": 4096}, 10000.0, 96, 131072, 131072),
    "su": ({"type": "su", "short_factor": PHI3_SHORT, "long_factor": PHI3_LONG,
            "original_max_position_embeddings": 4096}, 10000.0, 96, 131072, 100),
}


@pytest.mark.parametrize("name", list(LEGACY))
def test_legacy_rope_scaling_dicts(hf, name):
    params, theta, head_dim, max_position, seq_len = LEGACY[name]
    ours = cr.rope_frequencies(head_dim, theta=theta, scaling=our_dict(params, max_position),
                               seq_len=seq_len)
    hf_params = {**params, "type": "longrope"} if params.get("type") == "su" else params
    assert_frequencies_match(ours, hf(hf_params, head_dim, max_position, seq_len, legacy_theta=theta), name)


def test_longrope_switches_exactly_past_original_length(hf):
    params, head_dim, max_position, _ = CASES["longrope_phi3"]
    scaling = our_dict(params, max_position)
    short = cr.rope_frequencies(96, scaling=scaling, seq_len=4096)[0]
    long = cr.rope_frequencies(96, scaling=scaling, seq_len=4097)[0]
    assert not np.allclose(short, long)
    np.testing.assert_array_equal(cr.rope_frequencies(96, scaling=scaling)[0], short)  # None: short
    # Hugging Face's long_inv_freq is computed at seq_len = original + 1
    assert_frequencies_match((long, cr.rope_frequencies(96, scaling=scaling, seq_len=4097)[1]),
                             hf(params, head_dim, max_position, 4097), "long")


def test_dynamic_depends_on_seq_len_only_beyond_max():
    scaling = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 4096}
    plain = cr.rope_frequencies(128)[0]
    for seq_len in (None, 0, 1, 4096):
        np.testing.assert_array_equal(cr.rope_frequencies(128, scaling=scaling, seq_len=seq_len)[0], plain)
    longer = cr.rope_frequencies(128, scaling=scaling, seq_len=8192)[0]
    assert longer[0] == 1.0 and np.all(longer[1:] < plain[1:])


def test_theta_precedence():
    in_dict = {"rope_type": "default", "rope_theta": 500000.0}
    expected = cr.rope_frequencies(64, theta=500000.0)[0]
    np.testing.assert_array_equal(cr.rope_frequencies(64, scaling=in_dict)[0], expected)  # theta at default
    np.testing.assert_array_equal(cr.rope_frequencies(64, theta=500000.0, scaling=in_dict)[0], expected)
    with pytest.raises(ValueError, match=r"theta.*rope_theta"):
        cr.rope_frequencies(64, theta=1e6, scaling=in_dict)


def test_seq_len_ignored_by_length_independent_schedules():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    base = cr.rope_frequencies(128, theta=500000.0, scaling=scaling)
    for seq_len in (0, 100, 2**20):
        got = cr.rope_frequencies(128, theta=500000.0, scaling=scaling, seq_len=seq_len)
        np.testing.assert_array_equal(got[0], base[0])


# ----------------------------------------------------------------------------------------------------
# apply_rope and cos_sin_cache honour every schedule


def scaled_arithmetic(attention_factor: float, dtype) -> float:
    """The arithmetic term of the tolerance grows with the outputs: cos and sin are scaled by the
    attention factor (the table's pair magnitude |x1| + |x2| is that of the inputs)."""
    return max(attention_factor - 1.0, 0.0) * C_COMPUTE * compute_eps(dtype)


APPLY_CASES = [(name, case[3][-1]) for name, case in CASES.items()]


@pytest.mark.parametrize("name, seq_len", APPLY_CASES, ids=[n for n, _ in APPLY_CASES])
def test_apply_rope_numpy_path_rotates_by_hf_angles(hf, name, seq_len, randn, rng):
    """apply_rope with a schedule == a float64 rotation by Hugging Face's angles and attention factor.

    The comparison allows Hugging Face's own float32 rounding of inv_freq (times the position); a
    second, tight comparison against the library's float64 frequencies checks the rest exactly."""
    params, head_dim, max_position, _ = CASES[name]
    scaling = our_dict(params, max_position)
    rotary_dim = rotary_dim_of(params, head_dim)
    inv_freq_hf, attention_factor_hf = hf(params, head_dim, max_position, seq_len)
    inv_freq, attention_factor = cr.rope_frequencies(rotary_dim, scaling=scaling, seq_len=seq_len)
    T = 24
    positions = rng.integers(0, 2**12, size=T)
    positions[:2] = (0, 2**12 - 1)
    interleaved = bool(rng.integers(2))
    for dtype in ("float64", "float32"):
        q = randn((T, 3, head_dim), dtype)
        k = randn((T, 1, head_dim), dtype)
        # rotary_dim left out: apply_rope takes int(head_dim * partial_rotary_factor) from the dict
        q_out, k_out = cr.apply_rope(q, k, positions, scaling=scaling, seq_len=seq_len,
                                     interleaved=interleaved)
        for out, x in ((q_out, q), (k_out, k)):
            ref_hf = reference_rope(x, positions, inv_freq=inv_freq_hf, attention_factor=attention_factor_hf,
                                    interleaved=interleaved, rotary_dim=rotary_dim)
            # Hugging Face's float32 inv_freq is off by up to position * rtol * inv_freq radians
            hf_rounding = float(np.max(positions) * np.max(hf_rtol(inv_freq_hf) * inv_freq_hf))
            assert_rope_close(out, ref_hf, x, interleaved=interleaved, rotary_dim=rotary_dim,
                              max_angle=max_abs_angle(positions, inv_freq_hf),
                              extra_pair_rel=attention_factor_hf * hf_rounding
                              + scaled_arithmetic(attention_factor, dtype))
            ref = reference_rope(x, positions, inv_freq=inv_freq, attention_factor=attention_factor,
                                 interleaved=interleaved, rotary_dim=rotary_dim)
            assert_rope_close(out, ref, x, interleaved=interleaved, rotary_dim=rotary_dim,
                              max_angle=max_abs_angle(positions, inv_freq),
                              extra_pair_rel=scaled_arithmetic(attention_factor, dtype))


@pytest.mark.parametrize("name", list(CASES))
def test_cos_sin_cache_rows(name):
    """cos_sin_cache rows are cos/sin of float64 angles times the attention factor; seq_len of the
    length-dependent schedules is max_position."""
    params, head_dim, max_position_embeddings, _ = CASES[name]
    scaling = our_dict(params, max_position_embeddings)
    rotary_dim = rotary_dim_of(params, head_dim)
    half = rotary_dim // 2
    for max_position in (4096, 5000):
        inv_freq, attention_factor = cr.rope_frequencies(rotary_dim, scaling=scaling, seq_len=max_position)
        cache64 = cr.cos_sin_cache(max_position, rotary_dim, scaling=scaling, dtype="float64")
        rows = np.array([0, 1, 2, 3, 1000, max_position - 1])
        angles = rows[:, None].astype(np.float64) * inv_freq
        ref = np.concatenate([np.cos(angles), np.sin(angles)], axis=-1) * attention_factor
        bound = 2 * ulp(ref, "float64") + ANGLE_EPS * np.concatenate([angles, angles], axis=-1)
        assert np.all(np.abs(cache64[rows] - ref) <= bound), name
        assert_bits_equal(cache64[0], np.concatenate([np.full(half, attention_factor), np.zeros(half)]),
                          what="row 0")
        cache32 = cr.cos_sin_cache(max_position, rotary_dim, scaling=scaling, dtype="float32")
        assert_bits_equal(cache32, round_to_dtype(cache64, "float32"), what="float32 cache")


def test_cos_sin_cache_longrope_uses_long_factors_past_original_length():
    params, _, max_position_embeddings, _ = CASES["longrope_phi3"]
    scaling = our_dict(params, max_position_embeddings)
    short = cr.cos_sin_cache(4096, 96, scaling=scaling, dtype="float64")
    long = cr.cos_sin_cache(4097, 96, scaling=scaling, dtype="float64")
    inv_long = cr.rope_frequencies(96, scaling=scaling, seq_len=4097)[0]
    assert not np.array_equal(short[5], long[5])
    np.testing.assert_allclose(long[5, :48], np.cos(5 * inv_long) * cr.rope_frequencies(96, scaling=scaling)[1],
                               rtol=1e-15)


def test_partial_rotary_factor_sets_apply_rope_rotary_dim(randn, rng):
    q = randn((8, 2, 128), "float32")
    positions = rng.integers(0, 1000, size=8)
    scaling = {"rope_type": "default", "partial_rotary_factor": 0.25}
    out = cr.apply_rope(q, positions=positions, theta=10000.0, scaling=scaling)
    explicit = cr.apply_rope(q, positions=positions, theta=10000.0, rotary_dim=32)
    assert_bits_equal(out, explicit, what="partial_rotary_factor 0.25 vs rotary_dim=32")
    assert_bits_equal(out, cr.apply_rope(q, positions=positions, scaling=scaling, rotary_dim=32),
                      what="consistent explicit rotary_dim")
    # proportional spans head_dim: pairs past int(0.25 * 128 // 2) = 16 have frequency 0 (identity)
    out = cr.apply_rope(q, positions=positions, scaling={"rope_type": "proportional",
                                                          "partial_rotary_factor": 0.25})
    idle = np.r_[16:64, 80:128]
    assert_bits_equal(out[..., idle], q[..., idle], what="proportional's zero-frequency pairs")
    assert not np.array_equal(out[..., :16], q[..., :16])


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n, _ in APPLY_CASES])
def test_in_kernel_angles_honour_schedules_on_gpu(name, rng):
    """The kernel's computed angles (host float64 inv_freq, attention factor on cos and sin) and the
    cache source, against a float64 rotation by the schedule's float64 numbers (which the tests above
    compare with Hugging Face's; transformers is not needed here)."""
    cp = pytest.importorskip("cupy")
    from conftest import random_array

    def to_gpu(host):  # bit for bit, bfloat16 included
        bits = np.dtype(f"u{host.dtype.itemsize}")
        return cp.asarray(np.ascontiguousarray(host).view(bits)).view(host.dtype)

    def to_host(dev):
        bits = np.dtype(f"u{dev.dtype.itemsize}")
        return dev.view(bits).get().view(dev.dtype)

    params, head_dim, max_position, seq_lens = CASES[name]
    seq_len = seq_lens[-1]
    scaling = our_dict(params, max_position)
    rotary_dim = rotary_dim_of(params, head_dim)
    inv_freq, attention_factor = cr.rope_frequencies(rotary_dim, scaling=scaling, seq_len=seq_len)
    T = 64
    positions = rng.integers(0, 2**16, size=T)
    for dtype in ("float32", "bfloat16"):
        q = random_array(rng, (T, 4, head_dim), dtype)
        q_gpu = to_gpu(q)
        out = to_host(cr.apply_rope(q_gpu, positions=cp.asarray(positions), scaling=scaling,
                                    seq_len=seq_len))
        ref = reference_rope(q, positions, inv_freq=inv_freq, attention_factor=attention_factor,
                             rotary_dim=rotary_dim)
        assert_rope_close(out, ref, q, interleaved=False, rotary_dim=rotary_dim,
                          max_angle=max_abs_angle(positions, inv_freq),
                          extra_pair_rel=scaled_arithmetic(attention_factor, dtype))
        cache = cr.cos_sin_cache(2**16, rotary_dim, scaling=scaling, like=q_gpu)
        out = to_host(cr.apply_rope(q_gpu, positions=cp.asarray(positions), cos_sin_cache=cache))
        ref = reference_rope(q, positions, inv_freq=cr.rope_frequencies(rotary_dim, scaling=scaling,
                                                                        seq_len=2**16)[0],
                             attention_factor=attention_factor, rotary_dim=rotary_dim)
        assert_rope_close(out, ref, q, interleaved=False, rotary_dim=rotary_dim, table_dtype="float32",
                          max_angle=max_abs_angle(positions, inv_freq),
                          extra_pair_rel=scaled_arithmetic(attention_factor, dtype))


# ----------------------------------------------------------------------------------------------------
# errors


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32,
            "original_max_position_embeddings": 4096, "factor": 8.0}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 4096}


def without(d, key):
    return {k: v for k, v in d.items() if k != key}


# (scaling, extra rope_frequencies kwargs, exception, regex); rotary_dim is 64
ERROR_CASES = {
    "unknown_type": ({"rope_type": "banana"}, {}, ValueError,
                     r"banana.*'default', 'linear', 'dynamic', 'yarn', 'llama3', 'longrope', 'proportional'"),
    "unknown_legacy_type": ({"type": "ntk"}, {}, ValueError, r"rope_type 'ntk'"),
    "type_not_str": ({"rope_type": 3}, {}, TypeError, r"rope_type"),
    "type_conflict": ({"rope_type": "linear", "type": "dynamic", "factor": 2.0}, {}, ValueError,
                      r"'type'.*'rope_type'|'rope_type'.*'type'"),
    "not_a_dict": ([("rope_type", "linear")], {}, TypeError, r"scaling"),
    "nested_layer_types": ({"full_attention": {"rope_type": "default"},
                            "sliding_attention": {"rope_type": "default"}}, {}, ValueError,
                           r"layer type.*scaling\['full_attention'\]"),
    "mrope_sum": ({"rope_type": "default", "mrope_section": [16, 8, 4]}, {}, ValueError,
                  r"mrope_section.*add up to rotary_dim // 2 = 32"),
    "mrope_not_three": ({"rope_type": "default", "mrope_section": [16, 16]}, {}, ValueError,
                        r"mrope_section.*3 non-negative ints"),
    "mrope_interleaved_alone": ({"rope_type": "default", "mrope_interleaved": True}, {}, ValueError,
                                r"mrope_interleaved.*mrope_section"),
    "linear_no_factor": ({"rope_type": "linear"}, {}, ValueError, r"'factor'"),
    "linear_factor_zero": ({"rope_type": "linear", "factor": 0.0}, {}, ValueError, r"'factor'.*> 0"),
    "linear_factor_str": ({"rope_type": "linear", "factor": "2"}, {}, TypeError, r"'factor'"),
    "linear_factor_nan": ({"rope_type": "linear", "factor": float("nan")}, {}, ValueError, r"'factor'"),
    "dynamic_no_max": (without(DYNAMIC, "max_position_embeddings"), {}, ValueError,
                       r"'max_position_embeddings'"),
    "dynamic_no_factor": (without(DYNAMIC, "factor"), {}, ValueError, r"'factor'"),
    "dynamic_factor_negative": ({**DYNAMIC, "factor": -2.0}, {}, ValueError, r"'factor'"),
    "dynamic_max_zero": ({**DYNAMIC, "max_position_embeddings": 0}, {}, ValueError,
                         r"'max_position_embeddings'"),
    "yarn_no_original": (without(YARN, "original_max_position_embeddings"), {}, ValueError,
                         r"'original_max_position_embeddings'"),
    "yarn_factor_none_no_max": ({**YARN, "factor": None}, {}, ValueError, r"'max_position_embeddings'"),
    "yarn_factor_zero": ({**YARN, "factor": 0}, {}, ValueError, r"'factor'"),
    "yarn_beta_order": ({**YARN, "beta_fast": 1.0, "beta_slow": 32.0}, {}, ValueError, r"beta_fast"),
    "yarn_beta_negative": ({**YARN, "beta_slow": -1.0}, {}, ValueError, r"beta_slow"),
    "yarn_attention_factor_zero": ({**YARN, "attention_factor": 0.0}, {}, ValueError, r"'attention_factor'"),
    "yarn_truncate_str": ({**YARN, "truncate": "yes"}, {}, TypeError, r"'truncate'"),
    "yarn_original_fraction": ({**YARN, "original_max_position_embeddings": 4096.5}, {}, ValueError,
                               r"'original_max_position_embeddings'"),
    "llama3_no_low": (without(LLAMA3, "low_freq_factor"), {}, ValueError, r"'low_freq_factor'"),
    "llama3_no_high": (without(LLAMA3, "high_freq_factor"), {}, ValueError, r"'high_freq_factor'"),
    "llama3_no_factor": (without(LLAMA3, "factor"), {}, ValueError, r"'factor'"),
    "llama3_no_original": (without(LLAMA3, "original_max_position_embeddings"), {}, ValueError,
                           r"'original_max_position_embeddings'"),
    "llama3_low_ge_high": ({**LLAMA3, "low_freq_factor": 4.0}, {}, ValueError,
                           r"low_freq_factor < high_freq_factor"),
    "llama3_low_zero": ({**LLAMA3, "low_freq_factor": 0.0}, {}, ValueError, r"'low_freq_factor'"),
    "longrope_no_short": (without(LONGROPE, "short_factor"), {}, ValueError, r"'short_factor'"),
    "longrope_no_long": (without(LONGROPE, "long_factor"), {}, ValueError, r"'long_factor'"),
    "longrope_short_length": ({**LONGROPE, "short_factor": [1.0] * 31}, {}, ValueError,
                              r"'short_factor'.*32"),
    "longrope_long_length": ({**LONGROPE, "long_factor": [1.0] * 64}, {}, ValueError, r"'long_factor'.*32"),
    "longrope_factor_entry": ({**LONGROPE, "long_factor": [1.0] * 31 + [0.0]}, {}, ValueError,
                              r"'long_factor'"),
    "longrope_factor_str": ({**LONGROPE, "long_factor": "1.0"}, {}, TypeError, r"'long_factor'"),
    "longrope_no_factor_no_max": (without(LONGROPE, "factor"), {}, ValueError, r"'max_position_embeddings'"),
    "partial_zero": ({"rope_type": "default", "partial_rotary_factor": 0.0}, {}, ValueError,
                     r"partial_rotary_factor"),
    "partial_above_one": ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 1.5}, {},
                          ValueError, r"partial_rotary_factor"),
    "rope_theta_negative": ({"rope_type": "default", "rope_theta": -1.0}, {}, ValueError, r"rope_theta"),
    "rope_theta_disagrees": ({"rope_type": "default", "rope_theta": 500000.0}, {"theta": 1e6}, ValueError,
                             r"rope_theta"),
    "seq_len_negative": (DYNAMIC, {"seq_len": -1}, ValueError, r"seq_len"),
    "seq_len_float": (DYNAMIC, {"seq_len": 10.0}, TypeError, r"seq_len"),
}


@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_errors(name):
    scaling, kwargs, exc, regex = ERROR_CASES[name]
    q = np.ones((2, 1, 64), np.float32)
    calls = {"rope_frequencies": lambda: cr.rope_frequencies(64, scaling=scaling, **kwargs),
             "apply_rope": lambda: cr.apply_rope(q, scaling=scaling, **kwargs)}
    if "seq_len" not in kwargs:  # cos_sin_cache's seq_len is its max_position
        calls["cos_sin_cache"] = lambda: cr.cos_sin_cache(16, 64, scaling=scaling, **kwargs)
    for where, call in calls.items():
        with pytest.raises(exc, match=regex):
            call()
    assert_bits_equal(q, np.ones((2, 1, 64), np.float32), what="q after a failed call")


def test_errors_name_the_function():
    with pytest.raises(ValueError, match=r"^rope_frequencies: 'llama3' scaling needs the key 'low_freq_factor'"):
        cr.rope_frequencies(64, scaling=without(LLAMA3, "low_freq_factor"))
    with pytest.raises(ValueError, match=r"^cos_sin_cache: 'yarn' scaling"):
        cr.cos_sin_cache(16, 64, scaling=without(YARN, "original_max_position_embeddings"))
    with pytest.raises(ValueError, match=r"^apply_rope: 'dynamic' scaling"):
        cr.apply_rope(np.ones((2, 1, 64), np.float32), scaling=without(DYNAMIC, "max_position_embeddings"))


def test_dynamic_needs_rotary_dim_above_2():
    with pytest.raises(ValueError, match="rotary_dim > 2"):
        cr.rope_frequencies(2, scaling=DYNAMIC)


def test_apply_rope_rotary_dim_must_agree_with_partial_rotary_factor():
    q = np.ones((2, 1, 64), np.float32)
    with pytest.raises(ValueError, match=r"rotary_dim is 64.*partial_rotary_factor.*32"):
        cr.apply_rope(q, scaling={"partial_rotary_factor": 0.5}, rotary_dim=64)
    with pytest.raises(ValueError, match=r"partial_rotary_factor.*not even"):
        cr.apply_rope(np.ones((2, 1, 10), np.float32), scaling={"partial_rotary_factor": 0.5})


def test_unused_keys_warn():
    with pytest.warns(UserWarning, match=r"\['beta_fast'\].*'linear'"):
        cr.rope_frequencies(64, scaling={"rope_type": "linear", "factor": 2.0, "beta_fast": 32})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the config keys any dict may carry do not warn
        cr.rope_frequencies(64, scaling={"type": "linear", "rope_type": "linear", "factor": 2.0,
                                         "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                                         "max_position_embeddings": 4096,
                                         "original_max_position_embeddings": 2048})


def test_known_types_listed():
    from cupyrope.core import frequencies

    assert frequencies.ROPE_TYPES == ("default", "linear", "dynamic", "yarn", "llama3", "longrope",
                                         "proportional")
    for rope_type in frequencies.ROPE_TYPES:
        assert frequencies.scaling_type({"rope_type": rope_type}, "x") == rope_type
    assert frequencies.scaling_type({"type": "su"}, "x") == "longrope"
    assert frequencies.scaling_type(None, "x") == "default"
    assert frequencies.scaling_type({}, "x") == "default"
    assert math.isclose(cr.rope_frequencies(64, scaling={"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 4096})[1],
                        0.1 * math.log(4.0) + 1.0, rel_tol=0, abs_tol=0)
