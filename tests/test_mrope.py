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


def _rms_normalised(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("source", ["computed", "cache"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("op", ["rms_norm_rope", "rope_and_cache"])
@pytest.mark.parametrize("kernel", ["numpy", pytest.param("lean", marks=pytest.mark.gpu),
                                    pytest.param("general", marks=pytest.mark.gpu)])
def test_fused_ops_match_transformers(model, source, dtype, op, kernel, rng, monkeypatch,
                                      launched_kernels):
    """QK-RMSNorm + M-RoPE (+ the paged cache write) in one launch: the NumPy path, the lean fused
    kernel's M-RoPE specialisation and the general fused kernel, each within one rounding of the
    output dtype (plus float32 arithmetic) of the float64 norm rotated by transformers' cos/sin."""
    from cupyrope.cuda import launch
    from tolerances import as_numpy, np_dtype, unit_roundoff

    if kernel == "numpy":
        xp = np
    else:
        xp = pytest.importorskip("cupy")
        if not xp.is_available():
            pytest.skip("needs CuPy and a CUDA GPU")
    kernels = launched_kernels
    if kernel == "general":
        monkeypatch.setattr(launch, "fused_lean_applies", lambda *args, **kwargs: False)
    q4, k4, positions4 = _inputs(rng, dtype=np_dtype(dtype))
    T = B * S
    q, k = q4.reshape(T, HEADS, D) * 3, k4.reshape(T, 1, D) * 3
    positions = positions4.reshape(3, T)
    v = rng.standard_normal((T, 1, D)).astype(np_dtype(dtype))
    weights = {"q": rng.uniform(0.5, 1.5, D).astype(np.float32),
               "k": rng.uniform(0.5, 1.5, D).astype(np.float32)}
    gpu = {name: xp.asarray(x) for name, x in (("q", q), ("k", k), ("v", v))}
    angles = ({"theta": THETA} if source == "computed" else
              {"cos_sin_cache": cr.cos_sin_cache(4096, D, theta=THETA, like=gpu["q"])})
    norm = {"q_weight": xp.asarray(weights["q"]), "k_weight": xp.asarray(weights["k"]),
            "eps": 1e-6}
    scaling, positions_gpu = MODELS[model][2], xp.asarray(positions)
    if op == "rms_norm_rope":
        q_out, k_out = cr.rms_norm_rope(gpu["q"], gpu["k"], norm["q_weight"], norm["k_weight"],
                                        positions_gpu, eps=1e-6, scaling=scaling, **angles)
    else:
        slots = rng.permutation(4 * 16)[:T].astype(np.int64)
        slots[::7] = -1  # padding tokens: nothing written
        caches = [xp.zeros((4, 16, 1, D), dtype=gpu["k"].dtype) for _ in range(2)]
        q_out, k_out, k_cache, v_cache = cr.rope_and_cache(
            gpu["q"], gpu["k"], gpu["v"], positions_gpu, *caches, xp.asarray(slots),
            scaling=scaling, inplace=False, **norm, **angles)
        kept = slots >= 0
        stored = {name: as_numpy(c).reshape(-1, 1, D)[slots[kept]]
                  for name, c in (("k", k_cache), ("v", v_cache))}
        np.testing.assert_array_equal(stored["k"].view(np.uint8),
                                      as_numpy(k_out)[kept].view(np.uint8))
        np.testing.assert_array_equal(stored["v"].view(np.uint8), v[kept].view(np.uint8))
    if kernel != "numpy":
        (spec,) = kernels
        assert spec.fused and spec.lean is (kernel == "lean") and spec.mrope is (kernel == "lean")

    cos, sin = _hf_cos_sin(model, positions4)
    for name, x, out in (("q", q, q_out), ("k", k, k_out)):
        normed = _rms_normalised(x, weights[name], 1e-6).reshape(B, S, -1, D)
        expected = _reference(normed, cos, sin).reshape(T, -1, D)
        got = as_numpy(out).astype(np.float64)
        scale = np.max(np.abs(expected), axis=-1, keepdims=True)
        bound = scale * (2 * unit_roundoff(dtype) + 64 * 2.0 ** -24)
        err = np.abs(got - expected)
        assert np.all(err <= bound), (f"{name}: max error {err.max():.3g} over bound "
                                      f"{bound.min():.3g}")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rms_norm_rope", "rope_and_cache"])
def test_sectioned_mrope_persistent_grid_gives_the_same_bits(op, rng, monkeypatch,
                                                            planned_launches):
    """On fast memory sectioned M-RoPE runs the lean kernel on a persistent grid (each block
    loops over its tokens): the same outputs and cache rows, bit for bit, as one block per
    token group on slower memory, whose values the tests above hold to transformers'. (Hopper
    GPUs of fast memory take these launches onto the staged kernel, tests/test_fused_staged.py;
    kept off here, as on GPUs without it.)"""
    from cupyrope import execute
    from cupyrope.cuda import launch

    monkeypatch.setattr(launch, "STAGED_LAYOUT_MIN_TOKENS", 1 << 62)

    cp = pytest.importorskip("cupy")
    if not cp.is_available():
        pytest.skip("needs CuPy and a CUDA GPU")
    T, Hq, Hk = 20011, 5, 3
    q = cp.asarray((rng.standard_normal((T, Hq, D)) * 3).astype(np.float32)).astype(cp.float16)
    k = cp.asarray((rng.standard_normal((T, Hk, D)) * 3).astype(np.float32)).astype(cp.float16)
    v = cp.asarray(rng.standard_normal((T, Hk, D)).astype(np.float16))
    positions = cp.asarray(rng.integers(0, 4096, (3, T)))
    w = cp.asarray(rng.uniform(0.5, 1.5, D).astype(np.float16))
    table = cr.cos_sin_cache(4096, D, theta=THETA, like=q)
    scaling = {"rope_type": "default", "mrope_section": [16, 24, 24]}
    slots = cp.asarray(rng.permutation(T + 64)[:T])
    results = []
    for bandwidth in (4.8e12, 3.35e12):
        monkeypatch.setattr(launch, "_memory_bandwidth", lambda device, b=bandwidth: b)
        execute.clear()
        if op == "rms_norm_rope":
            out = cr.rms_norm_rope(q, k, w, w, positions, eps=1e-6, scaling=scaling,
                                   cos_sin_cache=table)
        else:
            caches = [cp.zeros(((T + 64) // 16 + 1, 16, Hk, D), cp.float16) for _ in range(2)]
            out = cr.rope_and_cache(q, k, v, positions, *caches, slots, scaling=scaling,
                                    cos_sin_cache=table, inplace=False)
        results.append([cp.asnumpy(x) for x in out])
    (fast_kernel, fast_grid, block), (slow_kernel, slow_grid, _) = (
        (spec.kernel, spec.grid, spec.block) for spec in planned_launches)
    assert fast_kernel == slow_kernel and fast_kernel.lean and fast_kernel.mrope
    assert fast_grid[0] < -(-T // block[2]) == slow_grid[0], (fast_grid, slow_grid, block)
    for fast, slow in zip(*results):
        np.testing.assert_array_equal(fast.view(np.uint8), slow.view(np.uint8))
