"""M-RoPE (Qwen2-VL sectioned, Qwen3-VL interleaved) against transformers' own rotary embeddings.

transformers' ``recomposition_frequencies`` is applied to float64 angles, so the reference has
Hugging Face's layout of temporal / height / width components exactly and float64 values; the
NumPy path (CI) and the kernels (GPU) must match it to rounding.
"""

import numpy as np
import pytest

import cupyrope as cr
from tolerances import assert_rope_close

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2_vl  # noqa: E402
from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3_vl  # noqa: E402

THETA, D, HEADS, B, S = 1_000_000.0, 128, 4, 2, 24
MODELS = {
    # (rotary embedding class, config class, mrope dict)
    "qwen2_vl": (qwen2_vl.Qwen2VLRotaryEmbedding, qwen2_vl.Qwen2VLTextConfig,
                 {"rope_type": "default", "mrope_section": [16, 24, 24]}),
    "qwen3_vl": (qwen3_vl.Qwen3VLTextRotaryEmbedding, qwen3_vl.Qwen3VLTextConfig,
                 {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
}


def _hf_cos_sin(model: str, position_ids: np.ndarray):
    """float64 cos/sin [B, S, D] laid out by transformers' recomposition_frequencies."""
    rotary_cls, config_cls, scaling = MODELS[model]
    params = {k: v for k, v in scaling.items() if k != "mrope_interleaved"}
    config = config_cls(hidden_size=HEADS * D, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                        head_dim=D, rope_parameters={**params, "rope_theta": THETA})
    rotary = rotary_cls(config)
    inv_freq = 1.0 / THETA ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    freqs = torch.from_numpy(position_ids).double()[..., None] * inv_freq  # [3, B, S, D/2]
    return (rotary.recomposition_frequencies(freqs.cos()).numpy(),
            rotary.recomposition_frequencies(freqs.sin()).numpy())


def _reference(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, inverse=False) -> np.ndarray:
    """x [B, S, H, D] rotated NeoX-style by full-width cos/sin [B, S, D], in float64."""
    x = x.astype(np.float64)
    half = D // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    sign = -1.0 if inverse else 1.0
    return x * cos[:, :, None, :] + sign * rotated * sin[:, :, None, :]


def _inputs(rng, dtype=np.float32, position_dtype=np.int64):
    q = rng.standard_normal((B, S, HEADS, D)).astype(dtype)
    k = rng.standard_normal((B, S, 1, D)).astype(dtype)
    # Three different components, as for image tokens; text tokens would have all three equal.
    positions = rng.integers(0, 4096, size=(3, B, S)).astype(position_dtype)
    return q, k, positions


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("source", ["computed", "cache"])
@pytest.mark.parametrize("position_dtype", [np.int32, np.int64])
def test_numpy_path_matches_transformers(model, source, position_dtype, rng):
    q, k, positions = _inputs(rng, position_dtype=position_dtype)
    scaling = MODELS[model][2]
    kwargs = {"theta": THETA} if source == "computed" else {
        "cos_sin_cache": cr.cos_sin_cache(4096, D, theta=THETA, dtype="float64")}
    q_out, k_out = cr.apply_rope(q, k, positions, scaling=scaling, **kwargs)
    cos, sin = _hf_cos_sin(model, positions.astype(np.int64))
    for out, x in ((q_out, q), (k_out, k)):
        assert_rope_close(out, _reference(x, cos, sin), x, interleaved=False, rotary_dim=D)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_components_really_differ(model, rng):
    """Guard against a layout that ignores height/width: using only the temporal component must
    give a different answer."""
    q, _, positions = _inputs(rng)
    out = cr.apply_rope(q, positions=positions, theta=THETA, scaling=MODELS[model][2])
    temporal_only = cr.apply_rope(q, positions=positions[0], theta=THETA)
    assert np.abs(out - temporal_only).max() > 0.1


def test_inverse_and_equal_components_reduce_to_plain_rope(rng):
    q, _, positions = _inputs(rng)
    scaling = MODELS["qwen2_vl"][2]
    same = np.broadcast_to(positions[:1], positions.shape)
    mrope = cr.apply_rope(q, positions=same, theta=THETA, scaling=scaling)
    plain = cr.apply_rope(q, positions=positions[0], theta=THETA)
    np.testing.assert_array_equal(mrope, plain)
    back = cr.apply_rope(mrope, positions=same, theta=THETA, scaling=scaling, inverse=True)
    np.testing.assert_allclose(back, q, atol=2e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("source", ["computed", "cache"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernels_match_transformers(model, source, dtype, rng):
    import cupy

    from tolerances import as_numpy, np_dtype

    q, k, positions = _inputs(rng, dtype=np_dtype(dtype))
    scaling = MODELS[model][2]
    q_gpu, k_gpu, positions_gpu = (cupy.asarray(a) for a in (q, k, positions))
    if source == "computed":
        kwargs = {"theta": THETA}
    else:
        kwargs = {"cos_sin_cache": cr.cos_sin_cache(4096, D, theta=THETA, like=q_gpu)}
    q_out, k_out = cr.apply_rope(q_gpu, k_gpu, positions_gpu, scaling=scaling, **kwargs)
    cos, sin = _hf_cos_sin(model, positions)
    table_dtype = "float32" if source == "cache" else None
    for out, x in ((q_out, q), (k_out, k)):
        assert_rope_close(as_numpy(out), _reference(x, cos, sin), x, interleaved=False,
                          rotary_dim=D, table_dtype=table_dtype)
