"""The serving adapters of cupyrope.compat against float64 references written from each peer's
documented semantics (torch CPU here; the torch-cuda variants are marked gpu):

- vLLM ``fused_qk_norm_rope`` (csrc/fused_qknorm_rope_kernel.cu): per-head RMSNorm of the q and
  k heads of the fused ``qkv`` buffer, then RoPE on the first ``cos_sin_cache.shape[1]`` dims,
  in place, v untouched; and transformers' Qwen3 ``q_norm`` / ``k_norm`` +
  ``apply_rotary_pos_emb`` on the same buffer;
- vLLM ``rotary_embedding`` + ``reshape_and_cache_flash`` (csrc/cache_kernels.cu): slot
  ``s`` -> block ``s // block_size``, row ``s % block_size``; negative slots write nothing; only
  the first ``slot_mapping.shape[0]`` tokens are cached; fp8 stores ``fp8(x / scale)`` saturated
  (quantization/.../quant_utils.cuh), ``"auto"`` ignores the scales;
- SGLang ``apply_rope_with_cos_sin_cache_inplace`` (sgl-kernel elementwise.py) with
  ``FusedSetKVBufferArg``: ``k_buffer[cache_loc[t]] = rope(k)[t]``, scales divided as SGLang's
  ``set_kv_buffer`` does for fp8 pools;
- FlashInfer ``rope_quantize_fp8`` (flashinfer/rope.py): ``fp8(rope(x_rope) * scale)`` and
  ``fp8(x_nope * scale)`` (FlashInfer MULTIPLIES), MLA k as ``(nnz, dim)``.

Every output buffer starts poisoned (NaN bits), so unwritten elements show; refused calls leave
every buffer as it was.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupyrope as cr  # noqa: E402
from backends import Backend, backend_params  # noqa: E402
from cupyrope import compat  # noqa: E402
from reference import reference_rope  # noqa: E402
from test_fused_mla import FP8, as_fp8, assert_fp8_close, host_values, put_fp8  # noqa: E402
from tolerances import assert_bits_equal, np_dtype, unit_roundoff  # noqa: E402

TORCH = backend_params(["torch", "torch-cuda"])
MAX_POSITION = 1024


def _rms_norm64(x, weight, eps):
    x = np.asarray(x, dtype=np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight.astype(np.float64)


def _assert_rounded_once(got, exact, dtype, what):
    """Within one rounding to ``dtype`` plus float32 arithmetic of the exact value, relative to
    each head's largest magnitude (normalised heads)."""
    magnitude = np.abs(exact).max(axis=-1, keepdims=True)
    error = np.abs(np.asarray(got, dtype=np.float64) - exact) / magnitude
    allowed = 2 * unit_roundoff(dtype) + 64 * 2.0**-24
    assert error.max() <= allowed, f"{what}: error {error.max():.3g} x head max > {allowed:.3g}"


def _unchanged(*pairs):
    """Each (tensor, host copy taken before) pair is bit-identical: nothing was written."""
    for tensor, before in pairs:
        assert_bits_equal(host_values(Backend("torch"), tensor), before,
                          what="buffer after a refusal")


def _cache_values(backend, cache, fmt):
    """A cache's values as NumPy ``[num_slots, heads, dim]`` (any strides; fp8 bits decoded)."""
    values = host_values(backend, cache)
    values = as_fp8(values, fmt) if fmt in FP8 else values
    return values.reshape(-1, *values.shape[2:])


# ----------------------------------------------------------------------------------------------
# vLLM fused_qk_norm_rope


def _qkv_case(rng, randn, dtype, T=13, Hq=8, Hk=2, D=128):
    """A fused projection inside a wider row buffer (a row stride past its width), q/k weights."""
    width = (Hq + 2 * Hk) * D
    rows = randn((T, width + 32), dtype) * 3
    weights = [rng.uniform(0.5, 1.5, D).astype(np_dtype(dtype)) for _ in range(2)]
    return rows, weights, rng.integers(0, MAX_POSITION, T)


@pytest.mark.parametrize("backend", TORCH, indirect=True)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [128, 64])
@pytest.mark.parametrize("weight_dtype", ["qkv", "float32"])
def test_fused_qk_norm_rope_matches_the_reference(backend, rng, randn, dtype, is_neox,
                                                  rotary_dim, weight_dtype):
    T, Hq, Hk, D = 13, 8, 2, 128
    rows, (wq, wk), positions = _qkv_case(rng, randn, dtype)
    if weight_dtype == "float32":  # vLLM requires qkv's dtype; cupyrope reads float32 too
        wq, wk = wq.astype(np.float32), wk.astype(np.float32)
    cache = cr.cos_sin_cache(MAX_POSITION, rotary_dim, theta=1e6, dtype="float32")
    buffer = backend.put(rows)
    width = (Hq + 2 * Hk) * D
    result = compat.fused_qk_norm_rope(buffer[:, :width], Hq, Hk, Hk, D, 1e-6, backend.put(wq),
                                       backend.put(wk), backend.put(cache), is_neox,
                                       backend.put(positions))
    assert result is None
    got = host_values(backend, buffer)
    assert_bits_equal(got[:, (Hq + Hk) * D:], rows[:, (Hq + Hk) * D:], what="v and row padding")
    for lo, heads, w, name in ((0, Hq, wq, "q"), (Hq * D, Hk, wk, "k")):
        x = rows[:, lo:lo + heads * D].reshape(T, heads, D)
        exact = reference_rope(_rms_norm64(x, w, 1e-6), positions, cos_sin_cache=cache,
                               interleaved=not is_neox)
        _assert_rounded_once(got[:, lo:lo + heads * D].reshape(T, heads, D), exact, dtype, name)


def _adapter_key_is_its_calls(monkeypatch, adapter_key, adapter, op_name: str, args) -> tuple:
    """An adapter's repeat key on its arguments as given against the fast key of the one cupyrope
    call it makes: different keys, the same pointers (CPU tensors standing in for CUDA ones:
    get_device answers 0). Returns the adapter's (key, pointers)."""
    from cupyrope import api, execute
    from cupyrope.core import arrays as array_info

    # The recipes of earlier GPU tests are forgotten first: CPU tensors passing for CUDA ones
    # would otherwise replay a real launch on host pointers (an illegal address on a GPU host).
    execute.clear()
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setitem(array_info.GPU_KINDS, torch.Tensor, "torch")
    made = []
    keyed = api.fast_fused_key
    monkeypatch.setattr(api, "fast_fused_key", lambda *a: made.append(keyed(*a)) or made[-1])
    outer = adapter_key(op_name, *args)
    adapter(*args)
    (inner,) = made
    assert outer is not None and inner is not None and outer[0] != inner[0]
    assert outer[1] == inner[1]
    return outer


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_qk_norm_rope_repeat_key_points_where_its_launch_does(rng, randn, monkeypatch,
                                                                    dtype):
    """The adapter's repeat key on qkv as given holds the pointers of the rms_norm_rope call it
    makes on qkv's head views (k's heads an offset into qkv), in that call's order. (CPU tensors
    stand in for CUDA ones: get_device answers 0.)"""
    from cupyrope.compat import vllm

    Hq, Hk, D = 8, 2, 128
    rows, (wq, wk), positions = _qkv_case(rng, randn, dtype)
    backend = Backend("torch")
    buffer = backend.put(rows)
    args = (buffer[:, :(Hq + 2 * Hk) * D], Hq, Hk, Hk, D, 1e-6, backend.put(wq),
            backend.put(wk), backend.put(cr.cos_sin_cache(MAX_POSITION, D, dtype="float32")),
            True, backend.put(positions))
    outer = _adapter_key_is_its_calls(monkeypatch, vllm._qkv_norm_key, compat.fused_qk_norm_rope,
                                      "fused_qk_norm_rope", args)
    assert outer[1][1] - outer[1][0] == Hq * D * buffer.element_size()
    assert vllm._qkv_norm_key("fused_qk_norm_rope", args[0], float(Hq), *args[2:]) is None


def test_fused_qk_norm_rope_matches_transformers_qwen3(rng, randn):
    """Qwen3's attention on the same fused buffer: q_norm / k_norm on the head views, then
    apply_rotary_pos_emb with the cache's cos / sin; bfloat16 (transformers rounds after each op)
    within 2 ulps of the head's largest value."""
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    T, Hq, Hk, D = 16, 8, 2, 128
    rows, (wq, wk), positions = _qkv_case(rng, randn, "bfloat16", T=T)
    qkv = Backend("torch").put(rows)[:, :(Hq + 2 * Hk) * D]
    cache = cr.cos_sin_cache(MAX_POSITION, D, theta=1e6, like=qkv, dtype="bfloat16")
    norms = []
    for weight in (wq, wk):
        norm = qwen3.Qwen3RMSNorm(D, eps=1e-6).to(torch.bfloat16)
        with torch.no_grad():
            norm.weight.copy_(Backend("torch").put(weight))
        norms.append(norm)
    pos = torch.from_numpy(positions)
    cos, sin = cache[pos].chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]
    with torch.no_grad():
        q = norms[0](qkv[:, :Hq * D].reshape(1, T, Hq, D)).transpose(1, 2)
        k = norms[1](qkv[:, Hq * D:(Hq + Hk) * D].reshape(1, T, Hk, D)).transpose(1, 2)
        want_q, want_k = qwen3.apply_rotary_pos_emb(q, k, cos, sin)
        compat.fused_qk_norm_rope(qkv, Hq, Hk, Hk, D, 1e-6, norms[0].weight, norms[1].weight,
                                  cache, True, pos)
    for got, want in ((qkv[:, :Hq * D].view(T, Hq, D), want_q[0].transpose(0, 1)),
                      (qkv[:, Hq * D:(Hq + Hk) * D].view(T, Hk, D), want_k[0].transpose(0, 1))):
        diff = (got.double() - want.double()).abs()
        assert torch.all(diff <= want.double().abs().amax(dim=-1, keepdim=True) * 2 * 2.0**-7)


@pytest.mark.parametrize("case,error,match", [
    ("3d_qkv", ValueError, "qkv must be 2-d"),
    ("width", ValueError, "qkv has 1536 columns, expected"),
    ("no_q_heads", ValueError, "num_heads_q must be >= 1"),
    ("float_heads", TypeError, "num_heads_k must be an int"),
    ("positions", ValueError, r"position_ids must have shape \(13,\)"),
    ("weight", ValueError, r"q_weight must have shape \(128,\)"),
    ("is_neox", TypeError, "is_neox must be a bool"),
    ("wide_cache", ValueError, "rotary_dim"),
])
def test_fused_qk_norm_rope_refusals_write_nothing(rng, randn, case, error, match):
    T, Hq, Hk, D = 13, 8, 2, 128
    rows, (wq, wk), positions = _qkv_case(rng, randn, "bfloat16")
    put = Backend("torch").put
    qkv = put(rows)[:, :(Hq + 2 * Hk) * D]
    args = [qkv, Hq, Hk, Hk, D, 1e-6, put(wq), put(wk),
            put(cr.cos_sin_cache(MAX_POSITION, D)), True, put(positions)]
    if case == "3d_qkv":
        args[0] = qkv.view(T, -1, D)
    elif case == "width":
        args[3] = 0
    elif case == "no_q_heads":
        args[1] = 0
    elif case == "float_heads":
        args[2] = 2.0
    elif case == "positions":
        args[10] = args[10][:-1]
    elif case == "weight":
        args[6] = args[6][:64]
    elif case == "is_neox":
        args[9] = 1
    elif case == "wide_cache":
        args[8] = put(cr.cos_sin_cache(MAX_POSITION, 2 * D))
    with pytest.raises(error, match=match):
        compat.fused_qk_norm_rope(*args)
    _unchanged((qkv, rows[:, :(Hq + 2 * Hk) * D]))


# ----------------------------------------------------------------------------------------------
# vLLM rotary_embedding + reshape_and_cache_flash

VLLM_FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def _kv_case(backend, rng, randn, *, T=21, Hq=4, Hk=2, D=64, rotary_dim=32, dtype="bfloat16"):
    """Host q/k/v as one fused ``[T, (Hq + 2 Hk) D]`` projection, positions, the cache table,
    and the backend's buffer with flat q / k views and a ``[T, Hk, D]`` v view."""
    qkv = randn((T, (Hq + 2 * Hk) * D), dtype)
    positions = rng.integers(0, MAX_POSITION, T)
    table = cr.cos_sin_cache(MAX_POSITION, rotary_dim, dtype="float32")
    buffer = backend.put(qkv)
    views = (buffer[:, :Hq * D], buffer[:, Hq * D:(Hq + Hk) * D],
             buffer[:, (Hq + Hk) * D:].view(T, Hk, D))
    host = (qkv[:, :Hq * D].reshape(T, Hq, D), qkv[:, Hq * D:(Hq + Hk) * D].reshape(T, Hk, D),
            qkv[:, (Hq + Hk) * D:].reshape(T, Hk, D))
    return host, positions, table, buffer, views


@pytest.fixture
def cpu_kv(rng, randn):
    """:func:`_kv_case` on torch CPU tensors (the refusal tests)."""
    return _kv_case(Backend("torch"), rng, randn)


def _poisoned_caches(backend, fmt, shape, storage):
    """Key and value caches full of NaN bits (bfloat16, or the fp8 format ``fmt``),
    ``[num_blocks, block_size, Hk, D]`` by shape; HND
    storage is a ``[num_blocks, Hk, block_size, D]`` buffer seen through a permute (vLLM's)."""
    stored = shape if storage == "NHD" else (shape[0], shape[2], shape[1], shape[3])
    nan = np.full(stored, np.nan, np_dtype("bfloat16"))
    caches = []
    for _ in range(2):
        if fmt in FP8:
            cache = put_fp8(backend, nan.astype(np_dtype(fmt)))
            cache = cache.view(torch.uint8) if storage == "HND" else cache  # both forms of fp8
        else:
            cache = backend.put(nan)
        caches.append(cache if storage == "NHD" else cache.permute(0, 2, 1, 3))
    return caches


def _check_cache(backend, caches, fmt, slots, k_exact, v_exact, what):
    """Written rows hold rotated k and v (rounded once), the others are still NaN."""
    valid = slots >= 0
    for cache, exact in zip(caches, (k_exact, v_exact)):
        rows = _cache_values(backend, cache, fmt)
        got = rows[slots[valid]]
        if fmt in FP8:
            assert_fp8_close(got, exact[valid], what)
        else:
            _assert_rounded_once(got, exact[valid], "bfloat16", what)
        untouched = np.setdiff1d(np.arange(rows.shape[0]), slots[valid])
        assert np.isnan(rows[untouched].astype(np.float32)).all(), f"{what}: stray write"


@pytest.mark.parametrize("backend", TORCH, indirect=True)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("storage", ["NHD", "HND"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("is_neox", [True, False])
def test_vllm_rope_and_cache(backend, rng, randn, kv_cache_dtype, storage, block_size, is_neox):
    (q, k, v), positions, table, buffer, (query, key, value) = _kv_case(backend, rng, randn)
    T, Hk, D = k.shape
    fmt = VLLM_FP8.get(kv_cache_dtype)
    num_blocks = 2 * T // block_size + 1
    caches = _poisoned_caches(backend, fmt, (num_blocks, block_size, Hk, D), storage)
    slots = rng.permutation(num_blocks * block_size)[:T]
    slots[::5] = -1
    device = buffer.device
    # vLLM passes [1] float32 scale tensors even to "auto" caches, which ignore them.
    k_scale = torch.tensor([0.5 if fmt else 1.0], device=device)
    v_scale = torch.tensor(2.0 if fmt else 1.0, device=device)  # 0-d
    assert compat.rope_and_reshape_and_cache_flash(
        backend.put(positions), query, key, value, *caches, backend.put(slots), kv_cache_dtype,
        k_scale, v_scale, D, backend.put(table), is_neox) is None
    k_rot = reference_rope(k, positions, cos_sin_cache=table, interleaved=not is_neox)
    q_rot = reference_rope(q, positions, cos_sin_cache=table, interleaved=not is_neox)
    scales = (0.5, 2.0) if fmt else (1.0, 1.0)
    _check_cache(backend, caches, fmt, slots, k_rot / scales[0], v.astype(np.float64) / scales[1],
                 f"{kv_cache_dtype} {storage} cache")
    got = host_values(backend, buffer)
    _assert_rounded_once(got[:, :q.shape[1] * D].reshape(q.shape), q_rot, "bfloat16", "query")
    _assert_rounded_once(got[:, q.shape[1] * D:-Hk * D].reshape(k.shape), k_rot, "bfloat16", "key")
    assert_bits_equal(got[:, -Hk * D:].reshape(v.shape), v, what="value")


@pytest.mark.parametrize("backend", TORCH, indirect=True)
def test_vllm_rope_and_cache_caches_only_the_slotted_tokens(backend, rng, randn):
    """vLLM V1 pads the batch (CUDA graphs) but not slot_mapping: the padded tokens are rotated
    and not cached."""
    (q, k, v), positions, table, buffer, (query, key, value) = _kv_case(backend, rng, randn)
    T, Hk, D = k.shape
    n = T - 5
    caches = _poisoned_caches(backend, None, (4, 16, Hk, D), "NHD")
    slots = rng.permutation(64)[:n]
    compat.rope_and_reshape_and_cache_flash(
        backend.put(positions), query, key, value, *caches, backend.put(slots), "auto", 1.0, 1.0,
        D, backend.put(table))
    k_rot = reference_rope(k, positions, cos_sin_cache=table)
    padded = np.concatenate([slots, np.full(T - n, -1)])
    _check_cache(backend, caches, None, padded, k_rot, v.astype(np.float64), "short slot_mapping")
    got = host_values(backend, buffer)[:, q.shape[1] * D:-Hk * D].reshape(k.shape)
    _assert_rounded_once(got, k_rot, "bfloat16", "key, padded tokens included")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("scales", ["tensors", "numbers"])
@pytest.mark.parametrize("flat_value", [True, False])
def test_vllm_rope_and_cache_repeat_key_points_where_its_launch_does(rng, randn, monkeypatch,
                                                                     kv_cache_dtype, scales,
                                                                     flat_value):
    """The adapter's repeat key on its tensors as given holds the pointers of the rope_and_cache
    call it makes, in that call's order (the head views and the scales' 0-d views share the
    given tensors' pointers; "auto" caches take no scale pointers), so the launch that call kept
    replays on them. (CPU tensors stand in for CUDA ones: get_device answers 0.)"""
    from cupyrope.compat import vllm

    backend = Backend("torch")
    (q, k, v), positions, table, buffer, (query, key, value) = _kv_case(backend, rng, randn)
    T, Hk, D = k.shape
    if flat_value:
        value = value.reshape(T, Hk * D)
    caches = _poisoned_caches(backend, VLLM_FP8.get(kv_cache_dtype), (4, 16, Hk, D), "NHD")
    k_scale, v_scale = ((torch.tensor([0.5]), torch.tensor(2.0)) if scales == "tensors"
                        else (0.5, 2.0))
    args = (backend.put(positions), query, key, value, *caches,
            backend.put(rng.permutation(64)[:T]), kv_cache_dtype, k_scale, v_scale, D,
            backend.put(table), True)
    outer = _adapter_key_is_its_calls(monkeypatch, vllm._flat_cache_key,
                                      compat.rope_and_reshape_and_cache_flash,
                                      "rope_and_reshape_and_cache_flash", args)
    scale_pointers = [outer[1][at] for at in vllm._SCALE_POINTERS]
    assert (scale_pointers == [0, 0]) == (kv_cache_dtype == "auto" or scales == "numbers")


@pytest.mark.parametrize("case,error,match", [
    ("kv_cache_dtype", ValueError, "kv_cache_dtype must be one of"),
    ("auto_uint8", TypeError, "must hold key's dtype"),
    ("e5m2_of_e4m3", TypeError, "needs caches of float8_e5m2"),
    ("fp8_of_bf16", TypeError, "needs caches of float8_e4m3fn"),
    ("per_head_scale", ValueError, "per-head scales are not supported"),
    ("text_scale", TypeError, "k_scale must be a number"),
    ("long_slots", ValueError, "slot_mapping must be 1-d with at most 21"),
    ("positions_2d", ValueError, "positions must be 1-d"),
    ("head_size", ValueError, "head size 64, expected head_size=32"),
    ("mixed_caches", TypeError, "one dtype"),
    ("cache_heads", ValueError, "does not hold 2 heads"),
    ("overlap", ValueError, "k_cache shares memory with v_cache"),
    ("no_key", TypeError, "key must be a torch tensor, got NoneType"),
])
def test_vllm_rope_and_cache_refusals_write_nothing(rng, cpu_kv, case, error, match):
    backend = Backend("torch")
    (_, k, _), positions, table, buffer, (query, key, value) = cpu_kv
    T, Hk, D = k.shape
    before = host_values(backend, buffer).copy()
    kv_cache_dtype, fmt, scale = "auto", None, 1.0
    if case in ("e5m2_of_e4m3", "per_head_scale", "text_scale"):
        kv_cache_dtype, fmt = ("fp8_e5m2" if case == "e5m2_of_e4m3" else "fp8"), "float8_e4m3fn"
    caches = _poisoned_caches(backend, fmt, (4, 16, Hk, D), "NHD")
    args = dict(positions=backend.put(positions), query=query, key=key, value=value,
                key_cache=caches[0], value_cache=caches[1], slot_mapping=backend.put(
                    rng.permutation(64)[:T]), kv_cache_dtype=kv_cache_dtype, k_scale=scale,
                v_scale=scale, head_size=D, cos_sin_cache=backend.put(table))
    if case == "kv_cache_dtype":
        args["kv_cache_dtype"] = "fp8_inc"
    elif case == "auto_uint8":
        args["key_cache"], args["value_cache"] = _poisoned_caches(backend, "float8_e4m3fn",
                                                                  (4, 16, Hk, D), "HND")
    elif case == "fp8_of_bf16":
        args["kv_cache_dtype"] = "fp8"
    elif case == "per_head_scale":
        args["k_scale"] = torch.ones(Hk)
    elif case == "text_scale":
        args["k_scale"] = "0.5"
    elif case == "long_slots":
        args["slot_mapping"] = backend.put(np.arange(T + 1))
    elif case == "positions_2d":
        args["positions"] = args["positions"].view(1, T)
    elif case == "head_size":
        args["head_size"] = D // 2
    elif case == "mixed_caches":
        args["value_cache"] = args["value_cache"].float()
    elif case == "cache_heads":
        args["key_cache"] = args["key_cache"][:, :, :1]
        args["value_cache"] = args["value_cache"][:, :, :1]
    elif case == "overlap":
        args["value_cache"] = args["key_cache"]
    elif case == "no_key":
        args["key"] = None
    cache_before = [host_values(backend, c).copy() for c in (args["key_cache"],
                                                              args["value_cache"])]
    with pytest.raises(error, match=match):
        compat.rope_and_reshape_and_cache_flash(**args)
    _unchanged((buffer, before), (args["key_cache"], cache_before[0]),
               (args["value_cache"], cache_before[1]))


# ----------------------------------------------------------------------------------------------
# SGLang apply_rope_with_cos_sin_cache_inplace


@pytest.mark.parametrize("backend", TORCH, indirect=True)
@pytest.mark.parametrize("is_neox", [True, False])
def test_sglang_without_kv_buffer_rotates_in_place(backend, rng, randn, is_neox):
    (q, k, _), positions, table, buffer, (query, key, _) = _kv_case(backend, rng, randn)
    assert compat.apply_rope_with_cos_sin_cache_inplace(
        backend.put(positions), query, key, q.shape[-1], backend.put(table), is_neox) is None
    got = host_values(backend, buffer)
    for x, cols in ((q, slice(0, q.shape[1] * q.shape[2])),
                    (k, slice(q.shape[1] * q.shape[2], -k.shape[1] * k.shape[2]))):
        exact = reference_rope(x, positions, cos_sin_cache=table, interleaved=not is_neox)
        _assert_rounded_once(got[:, cols].reshape(x.shape), exact, "bfloat16", "rotated")


@pytest.mark.parametrize("backend", TORCH, indirect=True)
@pytest.mark.parametrize("buffers", ["flat", "heads"])
@pytest.mark.parametrize("stored", ["bfloat16", "float8_e4m3fn", "uint8"])
@pytest.mark.parametrize("arg_type", ["dataclass", "any_object"])
def test_sglang_fused_set_kv_buffer(backend, rng, randn, buffers, stored, arg_type):
    (q, k, v), positions, table, buffer, (query, key, value) = _kv_case(backend, rng, randn)
    T, Hk, D = k.shape
    num_slots = 3 * T
    fmt = "float8_e4m3fn" if stored != "bfloat16" else None
    k_buffer, v_buffer = (c.view(num_slots, Hk, D)
                          for c in _poisoned_caches(backend, fmt, (num_slots, 1, Hk, D), "NHD"))
    if stored == "uint8":  # SGLang's store_dtype for fp8 pools
        k_buffer, v_buffer = k_buffer.view(torch.uint8), v_buffer.view(torch.uint8)
    if buffers == "flat":  # SGLang's pool may hand out [num_slots, Hk * D]
        k_buffer, v_buffer = k_buffer.view(num_slots, Hk * D), v_buffer.view(num_slots, Hk * D)
    cache_loc = rng.permutation(num_slots)[:T]
    cache_loc[::6] = -1
    # 16-bit pools ignore the scales (SGLang's set_kv_buffer divides only when it casts to fp8).
    k_scale, v_scale = 0.5, torch.tensor(2.0, device=buffer.device)
    fields = dict(value=value.reshape(T, Hk * D), k_buffer=k_buffer, v_buffer=v_buffer,
                  k_scale=k_scale, v_scale=v_scale, cache_loc=backend.put(cache_loc),
                  cache_dtype=fmt if stored == "uint8" else None)
    arg = (compat.FusedSetKVBufferArg(**fields) if arg_type == "dataclass"
           else types.SimpleNamespace(**fields))
    compat.apply_rope_with_cos_sin_cache_inplace(backend.put(positions), query, key, D,
                                                 backend.put(table), True, arg)
    k_rot = reference_rope(k, positions, cos_sin_cache=table)
    scales = (0.5, 2.0) if fmt else (1.0, 1.0)
    caches = [b.view(num_slots, 1, Hk, D) for b in (k_buffer, v_buffer)]
    _check_cache(backend, caches, fmt, cache_loc, k_rot / scales[0],
                 v.astype(np.float64) / scales[1], f"SGLang {stored} {buffers} buffers")
    q_rot = reference_rope(q, positions, cos_sin_cache=table)
    got = host_values(backend, buffer)[:, :q.shape[1] * D].reshape(q.shape)
    _assert_rounded_once(got, q_rot, "bfloat16", "query")


@pytest.mark.parametrize("case,error,match", [
    ("missing", TypeError, "SimpleNamespace has no cache_loc"),
    ("uint8_format", TypeError, "name the format with fused_set_kv_buffer_arg.cache_dtype"),
    ("format_mismatch", ValueError, "cache_dtype is float8_e5m2 but the buffers are"),
    ("format_of_bf16", ValueError, "names an fp8 format but the buffers are bfloat16"),
    ("buffer_width", ValueError, "is not a multiple of head_size=64"),
    ("enable_pdl", TypeError, "enable_pdl must be a bool"),
    ("per_head", ValueError, "per-head scales are not supported"),
])
def test_sglang_refusals_write_nothing(cpu_kv, case, error, match):
    backend = Backend("torch")
    (_, k, _), positions, table, buffer, (query, key, value) = cpu_kv
    T, Hk, D = k.shape
    fmt = None if case in ("format_of_bf16", "buffer_width", "missing") else "float8_e4m3fn"
    caches = [c.view(3 * T, Hk, D)
              for c in _poisoned_caches(backend, fmt, (3 * T, 1, Hk, D), "NHD")]
    fields = dict(value=value, k_buffer=caches[0], v_buffer=caches[1], k_scale=None,
                  v_scale=None, cache_loc=backend.put(np.arange(T)), cache_dtype=None)
    kwargs = {}
    if case == "missing":
        del fields["cache_loc"]
    elif case == "uint8_format":
        fields["k_buffer"], fields["v_buffer"] = (c.view(torch.uint8) for c in caches)
    elif case in ("format_mismatch", "format_of_bf16"):
        fields["cache_dtype"] = "float8_e5m2" if case == "format_mismatch" else "float8_e4m3fn"
    elif case == "buffer_width":
        fields["k_buffer"] = caches[0].view(3 * T, Hk * D)[:, :-2]
    elif case == "enable_pdl":
        kwargs["enable_pdl"] = "yes"
    elif case == "per_head":
        fields["k_scale"] = torch.ones(Hk)
    before = [host_values(backend, x).copy() for x in (buffer, *caches)]
    with pytest.raises(error, match=match):
        compat.apply_rope_with_cos_sin_cache_inplace(
            backend.put(positions), query, key, D, backend.put(table), True,
            types.SimpleNamespace(**fields), **kwargs)
    _unchanged(*zip((buffer, *caches), before))


# ----------------------------------------------------------------------------------------------
# FlashInfer rope_quantize_fp8

FI_SHAPES = {"mla": (8, None, 64, 128), "gqa": (4, 2, 32, 32)}  # Hq, Hk (None: 2-d k), rope, nope


def _fi_inputs(backend, randn, attention, layout, T=17):
    """Host (q_rope, k_rope, q_nope, k_nope) and the backend's: separate tensors, or the two
    slices of one head laid out rope first or rope last."""
    Hq, Hk, R, N = FI_SHAPES[attention]
    k_heads = () if Hk is None else (Hk,)
    q_in, k_in = randn((T, Hq, R + N), "bfloat16"), randn((T, *k_heads, R + N), "bfloat16")
    if layout == "separate":
        parts = [randn((T, Hq, R), "bfloat16"), randn((T, *k_heads, R), "bfloat16"),
                 randn((T, Hq, N), "bfloat16"), randn((T, *k_heads, N), "bfloat16")]
        return parts, [backend.put(x) for x in parts]
    rope, nope = (slice(0, R), slice(R, None)) if layout == "rope_first" else (slice(N, None),
                                                                              slice(0, N))
    q, k = backend.put(q_in), backend.put(k_in)
    return ([q_in[..., rope], k_in[..., rope], q_in[..., nope], k_in[..., nope]],
            [q[..., rope], k[..., rope], q[..., nope], k[..., nope]])


def _fi_outs(backend, fmt, like, layout):
    """Poisoned fp8 ``*_out`` buffers in the inputs' layout (slices of one tensor unless
    separate)."""
    if layout == "separate":
        return [put_fp8(backend, np.full(x.shape, np.nan, np.float32).astype(np_dtype(fmt)))
                for x in like]
    outs = []
    for rope, nope in ((like[0], like[2]), (like[1], like[3])):
        whole = put_fp8(backend, np.full((*rope.shape[:-1], rope.shape[-1] + nope.shape[-1]),
                                         np.nan, np.float32).astype(np_dtype(fmt)))
        R = rope.shape[-1]
        outs.append((whole[..., :R], whole[..., R:]) if layout == "rope_first"
                    else (whole[..., -R:], whole[..., :-R]))
    return [outs[0][0], outs[1][0], outs[0][1], outs[1][1]]


def _fi_check(backend, results, host, positions, table, is_neox, scales, fmt):
    """FlashInfer's semantics: fp8(rope(x) * scale_q or scale_kv), fp8(x_nope * scale)."""
    for at, (got, x) in enumerate(zip(results, host)):
        exact = x.astype(np.float64)
        if at < 2:
            heads = exact if exact.ndim == 3 else exact[:, None]
            exact = reference_rope(heads, positions, cos_sin_cache=table,
                                   interleaved=not is_neox).reshape(x.shape)
        values = host_values(backend, got)
        assert values.dtype.name == fmt and values.shape == x.shape
        assert_fp8_close(values, exact * scales[at % 2], f"part {at}")


@pytest.mark.parametrize("backend", TORCH, indirect=True)
@pytest.mark.parametrize("attention", ["mla", "gqa"])
@pytest.mark.parametrize("layout", ["separate", "rope_first", "rope_last"])
@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("with_out", [False, True])
@pytest.mark.parametrize("is_neox", [True, False])
def test_flashinfer_rope_quantize_fp8(backend, rng, randn, attention, layout, fmt, with_out,
                                      is_neox):
    host, inputs = _fi_inputs(backend, randn, attention, layout)
    positions = rng.integers(0, MAX_POSITION, host[0].shape[0])
    table = cr.cos_sin_cache(MAX_POSITION, host[0].shape[-1], dtype="float32")
    outs = _fi_outs(backend, fmt, host, layout) if with_out else [None] * 4
    scale_kv = torch.tensor(0.5, device=inputs[0].device)  # a 0-d tensor, multiplied in
    results = compat.rope_quantize_fp8(
        *inputs, backend.put(table), backend.put(positions), is_neox=is_neox,
        quantize_dtype=None if with_out else getattr(torch, fmt), quant_scale_q=2.0,
        quant_scale_kv=scale_kv, q_rope_out=outs[0], k_rope_out=outs[1], q_nope_out=outs[2],
        k_nope_out=outs[3])
    if with_out:
        assert all(r is o for r, o in zip(results, outs))
    _fi_check(backend, results, host, positions, table, is_neox, (2.0, 0.5), fmt)
    for x, before in zip(inputs, host):
        assert_bits_equal(host_values(backend, x), before, what="input")


@pytest.mark.parametrize("layout,launch_widths", [("rope_first", [64 + 128]),
                                                  ("rope_last", ["mla"]), ("separate", ["mla"])])
def test_flashinfer_rope_and_nope_in_one_launch_when_adjacent(rng, randn, monkeypatch, layout,
                                                              launch_widths):
    """Rope part first and nope part right after it in memory: one cupyrope launch over the
    joined heads; otherwise one launch of the MLA op, which stores rope and nope parts."""
    from cupyrope.compat import flashinfer

    widths = []

    def counting(q, k, *args, **kwargs):
        widths.append(q.shape[-1])
        return cr.apply_rope(q, k, *args, **kwargs)

    def counting_mla(*args, **kwargs):
        widths.append("mla")
        return cr.mla_rope_quantize(*args, **kwargs)

    monkeypatch.setattr(flashinfer, "cupyrope_apply_rope", counting)
    monkeypatch.setattr(flashinfer, "cupyrope_mla_rope_quantize", counting_mla)
    host, inputs = _fi_inputs(Backend("torch"), randn, "mla", layout)
    positions = rng.integers(0, MAX_POSITION, host[0].shape[0])
    table = cr.cos_sin_cache(MAX_POSITION, 64, dtype="float32")
    results = compat.rope_quantize_fp8(*inputs, torch.from_numpy(table),
                                       torch.from_numpy(positions), quant_scale_q=3.0)
    assert widths == launch_widths
    _fi_check(Backend("torch"), results, host, positions, table, True, (3.0, 1.0),
              "float8_e4m3fn")


def test_flashinfer_saturates_both_parts_and_mla_alias_agrees(rng, randn):
    backend = Backend("torch")
    host, inputs = _fi_inputs(backend, randn, "mla", "rope_last")
    inputs[0][0, 0, 0] = 3e3  # rope part, quantised by the rotation's launch
    inputs[2][0, 0, 0] = -3e3  # nope part, cast by torch
    positions = torch.zeros(host[0].shape[0], dtype=torch.int64)  # angle 0: the value itself
    table = cr.cos_sin_cache(MAX_POSITION, 64, like=inputs[0], dtype="float32")
    results = compat.rope_quantize_fp8(*inputs, table, positions, quant_scale_q=1.0)
    assert float(results[0][0, 0, 0]) == 448.0 and float(results[2][0, 0, 0]) == -448.0
    alias = compat.mla_rope_quantize_fp8(*inputs, table, positions, quant_scale_q=1.0)
    for a, b in zip(results, alias):
        assert_bits_equal(host_values(backend, a), host_values(backend, b), what="mla alias")


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_flashinfer_without_nope_parts(rng, randn, attention):
    """q_nope / k_nope None: size-0 nope outputs, quantize_dtype taken from the outs given."""
    backend = Backend("torch")
    host, inputs = _fi_inputs(backend, randn, attention, "separate")
    positions = rng.integers(0, MAX_POSITION, host[0].shape[0])
    table = cr.cos_sin_cache(MAX_POSITION, host[0].shape[-1], dtype="float32")
    k_out = torch.full(inputs[1].shape, float("nan")).to(torch.float8_e5m2)
    results = compat.rope_quantize_fp8(inputs[0], inputs[1], None, None, torch.from_numpy(table),
                                       torch.from_numpy(positions), k_rope_out=k_out)
    assert results[1] is k_out
    assert results[0].dtype == results[2].dtype == results[3].dtype == torch.float8_e5m2
    assert results[2].shape == (*host[0].shape[:2], 0)
    assert results[3].shape == (*host[1].shape[:-1], 0)
    _fi_check(backend, results[:2], host[:2], positions, table, True, (1.0, 1.0), "float8_e5m2")


@pytest.mark.parametrize("case,error,match", [
    ("quantize_dtype", ValueError, "quantize_dtype must be torch.float8_e4m3fn"),
    ("out_shape", ValueError, r"q_nope_out must have its input's shape \(17, 8, 128\)"),
    ("out_dtype", TypeError, "k_rope_out must have quantize_dtype torch.float8_e4m3fn"),
    ("zero_scale", ValueError, "quant_scale_q must be finite and > 0"),
    ("float64_scale", ValueError, "quant_scale_kv must be a number or a one-element float32"),
    ("nope_widths", ValueError, "q_nope and k_nope must have one no_rope_dim"),
    ("pos_ids", ValueError, r"pos_ids must have shape \(17,\)"),
    ("not_a_tensor", TypeError, "q_rope must be a torch tensor"),
    ("nope_dtype", TypeError, "k_nope must have the rope part's dtype"),
])
def test_flashinfer_refusals_write_nothing(rng, randn, case, error, match):
    backend = Backend("torch")
    host, inputs = _fi_inputs(backend, randn, "mla", "separate")
    positions = torch.from_numpy(rng.integers(0, MAX_POSITION, host[0].shape[0]))
    outs = _fi_outs(backend, "float8_e4m3fn", host, "separate")
    kwargs = dict(quant_scale_q=2.0, quant_scale_kv=0.5)
    if case == "quantize_dtype":
        kwargs["quantize_dtype"] = torch.bfloat16
    elif case == "out_shape":
        outs[2] = outs[2][:, :, :-1]
    elif case == "out_dtype":
        outs[1] = outs[1].view(torch.float8_e5m2)
    elif case == "zero_scale":
        kwargs["quant_scale_q"] = 0.0
    elif case == "float64_scale":
        kwargs["quant_scale_kv"] = torch.tensor(0.5, dtype=torch.float64)
    elif case == "nope_widths":
        inputs[3] = inputs[3][:, :-2]
    elif case == "pos_ids":
        positions = positions[:-1]
    elif case == "not_a_tensor":
        inputs[0] = host[0]
    elif case == "nope_dtype":
        inputs[3] = inputs[3].float()
    before = [host_values(backend, out).copy() for out in outs]
    with pytest.raises(error, match=match):
        compat.rope_quantize_fp8(*inputs, torch.from_numpy(cr.cos_sin_cache(MAX_POSITION, 64)),
                                 positions, q_rope_out=outs[0], k_rope_out=outs[1],
                                 q_nope_out=outs[2], k_nope_out=outs[3], **kwargs)
    _unchanged(*zip(outs, before))
