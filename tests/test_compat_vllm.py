"""cupyrope.compat's vLLM adapters against float64 references written here from vLLM's documented
semantics (torch CPU; the torch-cuda variants are marked gpu):

- ``reshape_and_cache_flash`` (csrc/cache_kernels.cu): key and value, unrotated, to slot ``s`` ->
  block ``s // block_size``, row ``s % block_size`` of the flash-layout caches; negative slots and
  tokens past ``slot_mapping.shape[0]`` are not cached; fp8 stores ``fp8(x / scale)`` saturated,
  ``"auto"`` ignores the scales; key and value are never written;
- ``fused_qk_norm_rope_kvcache`` (vllm/_custom_ops.py, tests/kernels/core/
  test_fused_qk_norm_rope_kvcache.py): ``fused_qk_norm_rope`` followed by
  ``reshape_and_cache_flash`` with the results in ``q_out`` / ``k_out`` and ``qkv`` read only;
- ``batched_rotary_embedding`` (csrc/pos_encoding_kernels.cu): ``rotary_embedding`` at cache row
  ``positions[t] + cos_sin_cache_offsets[t]``, in place;
- the accuracy claim of ``rotary_embedding``'s docstring: vLLM's references round to bfloat16
  after every multiply and add; cupyrope's one rounding is closer to the exact result.

Every cache starts poisoned (NaN), so stray and missing writes show; refusals leave every buffer as
it was.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupyrope as cr  # noqa: E402
from backends import Backend, backend_params  # noqa: E402
from cupyrope import compat  # noqa: E402
from cupyrope.compat import vllm  # noqa: E402
from reference import reference_rope  # noqa: E402
from test_fused_compat import VLLM_FP8, _assert_rounded_once, _cache_values  # noqa: E402
from test_fused_compat import _kv_case, _poisoned_caches, _rms_norm64  # noqa: E402
from test_fused_mla import assert_fp8_close, host_values  # noqa: E402
from tolerances import assert_bits_equal, assert_rope_close, np_dtype  # noqa: E402

TORCH = backend_params(["torch", "torch-cuda"])
MAX_POSITION = 1024


@pytest.fixture
def launches(monkeypatch):
    """The keyword arguments of every cupyrope op the vLLM adapters call (one per call
    expected), by op."""
    seen = {"rope_and_cache": [], "apply_rope": [], "write_unrotated": []}
    for name in seen:
        real = getattr(vllm, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            seen[_name].append((args, kwargs))
            return _real(*args, **kwargs)

        monkeypatch.setattr(vllm, name, counting)
    return seen


def _unchanged(backend, *pairs):
    for tensor, before in pairs:
        assert_bits_equal(host_values(backend, tensor), before, what="buffer after a refusal")


# ----------------------------------------------------------------------------------------------
# reshape_and_cache_flash


@pytest.mark.parametrize("backend", TORCH, indirect=True)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("storage", ["NHD", "HND"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reshape_and_cache_flash(backend, rng, randn, launches, kv_cache_dtype, storage,
                                 block_size, dtype):
    (_, k, v), _, _, buffer, (_, key, value) = _kv_case(backend, rng, randn, dtype=dtype)
    T, Hk, D = k.shape
    key = key.view(T, Hk, D)  # vLLM's op takes [T, H, D]: here a strided view of the projection
    fmt = VLLM_FP8.get(kv_cache_dtype)
    num_blocks = 2 * T // block_size + 1
    caches = _poisoned_caches(backend, fmt, (num_blocks, block_size, Hk, D), storage)
    if fmt is None:
        caches = [c.to(key.dtype) for c in caches]
    n = T - 3  # CUDA-graph padding: the last tokens have no slot
    slots = rng.permutation(num_blocks * block_size)[:n]
    slots[::4] = -1
    before = host_values(backend, buffer).copy()
    k_scale = torch.tensor([0.5], device=buffer.device)
    result = compat.reshape_and_cache_flash(key, value, *caches, backend.put(slots),
                                            kv_cache_dtype, k_scale, 2.0)
    assert result is None
    assert_bits_equal(host_values(backend, buffer), before, what="key and value")
    written = slots >= 0
    for cache, x, scale in zip(caches, (k, v), (0.5, 2.0)):
        rows = _cache_values(backend, cache, fmt)
        if fmt is None:  # the values themselves, bit for bit
            assert_bits_equal(rows[slots[written]], x[:n][written], what="cached rows")
        else:
            assert_fp8_close(rows[slots[written]], x[:n][written].astype(np.float64) / scale,
                             f"{kv_cache_dtype} rows")
        untouched = np.setdiff1d(np.arange(rows.shape[0]), slots[written])
        assert np.isnan(rows[untouched].astype(np.float32)).all(), "stray write"
    (args, kwargs), = launches["write_unrotated"]  # cupyrope.write_cache: no rotation
    assert args[0].shape == (n, Hk, D) and not launches["rope_and_cache"]


def test_reshape_and_cache_flash_carries_every_value(randn):
    """Every dim is copied whatever it holds (inf, NaN, -0.0), the first two included: no
    rotation touches them."""
    key = torch.from_numpy(randn((3, 2, 8)))
    key[:, :, 2:5] = torch.tensor([float("inf"), float("nan"), -0.0])
    key[0, 0, :2] = torch.tensor([float("nan"), float("inf")])
    key[1, 1, :2] = torch.tensor([float("-inf"), 3.0])
    value = torch.from_numpy(randn((3, 2, 8)))
    value[0, 0, 0] = float("-inf")
    caches = [torch.full((2, 4, 2, 8), 7.0) for _ in range(2)]
    compat.reshape_and_cache_flash(key, value, *caches, torch.tensor([5, 0, 2]), "auto", 1.0,
                                   1.0)
    for cache, x in zip(caches, (key, value)):
        assert_bits_equal(cache.view(-1, 2, 8)[[5, 0, 2]], x, what="cached rows")


@pytest.mark.parametrize("case,error,match", [
    ("kv_cache_dtype", ValueError, "kv_cache_dtype must be one of"),
    ("flat_key", ValueError, r"key must be \[num_tokens, num_heads, head_size\]"),
    ("value_shape", ValueError, "value must have key's shape"),
    ("long_slots", ValueError, "slot_mapping must be 1-d with at most 21"),
    ("auto_fp8", TypeError, "must hold key's dtype"),
    ("per_head_scale", ValueError, "per-head scales are not supported"),
    ("head_size", ValueError, "head_size must be >= 2"),
    ("overlap", ValueError, "k_cache shares memory with v_cache"),
])
def test_reshape_and_cache_flash_refusals_write_nothing(rng, randn, case, error, match):
    backend = Backend("torch")
    (_, k, _), _, _, buffer, (_, key, value) = _kv_case(backend, rng, randn)
    T, Hk, D = k.shape
    key = key.view(T, Hk, D)
    fmt = "float8_e4m3fn" if case in ("auto_fp8", "per_head_scale") else None
    caches = _poisoned_caches(backend, fmt, (4, 16, Hk, D), "NHD")
    args = dict(key=key, value=value, key_cache=caches[0], value_cache=caches[1],
                slot_mapping=backend.put(rng.permutation(64)[:T]), kv_cache_dtype="auto",
                k_scale=1.0, v_scale=1.0)
    if case == "kv_cache_dtype":
        args["kv_cache_dtype"] = "int8"
    elif case == "flat_key":
        args["key"] = key.flatten(1)
    elif case == "value_shape":
        args["value"] = value[:, :1]
    elif case == "long_slots":
        args["slot_mapping"] = backend.put(np.arange(T + 1))
    elif case == "per_head_scale":
        args["kv_cache_dtype"], args["k_scale"] = "fp8", torch.ones(Hk)
    elif case == "head_size":
        args["key"], args["value"] = key[..., :1], value[..., :1]
        args["key_cache"], args["value_cache"] = caches[0][..., :1], caches[1][..., :1]
    elif case == "overlap":
        args["value_cache"] = args["key_cache"]
    before = [host_values(backend, x).copy() for x in (buffer, *caches)]
    with pytest.raises(error, match=match):
        compat.reshape_and_cache_flash(**args)
    _unchanged(backend, *zip((buffer, *caches), before))


# ----------------------------------------------------------------------------------------------
# fused_qk_norm_rope_kvcache


def _flash_kv(backend, T, Hk, D, dtype, block_size=16):
    """vLLM's FlashAttention cache: one ``[num_blocks, Hk, block_size, 2 * D]`` buffer of NaN,
    split into transposed key / value views ``[num_blocks, block_size, Hk, D]``."""
    num_blocks = -(-T // block_size) + 2
    kv = backend.put(np.full((num_blocks, Hk, block_size, 2 * D), np.nan, np_dtype(dtype)))
    return kv, kv.transpose(1, 2).split(D, dim=-1)


@pytest.mark.parametrize("backend", TORCH, indirect=True)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [128, 64])
@pytest.mark.parametrize("slots_given", ["all", "padded", "short"])
def test_fused_qk_norm_rope_kvcache(backend, rng, randn, launches, dtype, is_neox, rotary_dim,
                                    slots_given):
    T, Hq, Hk, D = 21, 8, 2, 128
    rows = randn((T, (Hq + 2 * Hk) * D), dtype) * 3
    wq, wk = (rng.uniform(0.5, 1.5, D).astype(np_dtype(dtype)) for _ in range(2))
    positions = rng.integers(0, MAX_POSITION, T)
    table = cr.cos_sin_cache(MAX_POSITION, rotary_dim, theta=1e6, dtype="float32")
    qkv = backend.put(rows)
    kv, (key_cache, value_cache) = _flash_kv(backend, T, Hk, D, dtype)
    n = T - 4 if slots_given == "short" else T
    slots = rng.permutation(key_cache.shape[0] * key_cache.shape[1])[:n]
    if slots_given == "padded":
        slots[-5:] = -1
    q_out, k_out = (backend.put(np.full((T, h, D), np.nan, np_dtype(dtype))) for h in (Hq, Hk))
    args = (Hq, Hk, Hk, D, 1e-6, backend.put(wq), backend.put(wk), backend.put(table), is_neox,
            backend.put(positions))
    assert compat.fused_qk_norm_rope_kvcache(qkv, q_out, k_out, *args, key_cache, value_cache,
                                             backend.put(slots), 4) is None
    assert len(launches["rope_and_cache"]) == 1
    assert_bits_equal(host_values(backend, qkv), rows, what="qkv (read only)")
    got = {"q": host_values(backend, q_out), "k": host_values(backend, k_out)}
    for name, lo, heads, w in (("q", 0, Hq, wq), ("k", Hq * D, Hk, wk)):
        x = rows[:, lo:lo + heads * D].reshape(T, heads, D)
        exact = reference_rope(_rms_norm64(x, w, 1e-6), positions, cos_sin_cache=table,
                               interleaved=not is_neox)
        _assert_rounded_once(got[name], exact, dtype, name)
    # vLLM's own claim: fused_qk_norm_rope then reshape_and_cache_flash, bit for bit.
    unfused = backend.put(rows)
    compat.fused_qk_norm_rope(unfused, *args)
    kv_unfused, caches_unfused = _flash_kv(backend, T, Hk, D, dtype)
    compat.reshape_and_cache_flash(unfused[:, Hq * D:(Hq + Hk) * D].view(T, Hk, D),
                                   unfused[:, (Hq + Hk) * D:].view(T, Hk, D), *caches_unfused,
                                   backend.put(slots), "auto", 1.0, 1.0)
    unfused_rows = host_values(backend, unfused)
    assert_bits_equal(got["q"], unfused_rows[:, :Hq * D].reshape(T, Hq, D), what="q_out")
    assert_bits_equal(got["k"], unfused_rows[:, Hq * D:(Hq + Hk) * D].reshape(T, Hk, D),
                      what="k_out")
    assert_bits_equal(host_values(backend, kv), host_values(backend, kv_unfused),
                      what="the KV cache")


@pytest.mark.parametrize("case,error,match", [
    ("num_heads_v", ValueError, "num_heads_v must equal num_heads_k"),
    ("q_out_shape", ValueError, r"q_out must be a torch.bfloat16 tensor of shape \(13, 8, 128\)"),
    ("k_out_dtype", ValueError, "k_out must be a torch.bfloat16 tensor"),
    ("fp8_cache", TypeError, "kv_cache_dtype='auto'"),
    ("long_slots", ValueError, "slot_mapping must be 1-d with at most 13"),
    ("heads_per_warp", TypeError, "forced_token_heads_per_warp must be an int"),
    ("weight", ValueError, r"q_weight must have shape \(128,\)"),
    ("is_neox", TypeError, "is_neox must be a bool"),
])
def test_fused_qk_norm_rope_kvcache_refusals_write_nothing(rng, randn, case, error, match):
    backend = Backend("torch")
    T, Hq, Hk, D = 13, 8, 2, 128
    qkv = backend.put(randn((T, (Hq + 2 * Hk) * D), "bfloat16"))
    outs = [torch.full((T, h, D), float("nan"), dtype=torch.bfloat16) for h in (Hq, Hk)]
    kv, caches = _flash_kv(backend, T, Hk, D, "bfloat16")
    args = dict(qkv=qkv, q_out=outs[0], k_out=outs[1], num_heads_q=Hq, num_heads_k=Hk,
                num_heads_v=Hk, head_dim=D, eps=1e-6,
                q_weight=torch.ones(D, dtype=torch.bfloat16),
                k_weight=torch.ones(D, dtype=torch.bfloat16),
                cos_sin_cache=backend.put(cr.cos_sin_cache(MAX_POSITION, D)), is_neox=True,
                position_ids=backend.put(rng.integers(0, MAX_POSITION, T)),
                key_cache=caches[0], value_cache=caches[1],
                slot_mapping=backend.put(rng.permutation(64)[:T]))
    if case == "num_heads_v":
        args["num_heads_q"], args["num_heads_v"] = Hq + 1, Hk - 1
    elif case == "q_out_shape":
        args["q_out"] = outs[0][:, :-1]
    elif case == "k_out_dtype":
        args["k_out"] = outs[1].half()
    elif case == "fp8_cache":
        fp8 = kv.to(torch.float8_e4m3fn).transpose(1, 2).split(D, dim=-1)
        args["key_cache"], args["value_cache"] = fp8
    elif case == "long_slots":
        args["slot_mapping"] = torch.arange(T + 1)
    elif case == "heads_per_warp":
        args["forced_token_heads_per_warp"] = 4.0
    elif case == "weight":
        args["q_weight"] = args["q_weight"][:64]
    elif case == "is_neox":
        args["is_neox"] = 1
    before = [host_values(backend, x).copy() for x in (qkv, *outs, kv)]
    with pytest.raises(error, match=match):
        compat.fused_qk_norm_rope_kvcache(**args)
    _unchanged(backend, *zip((qkv, *outs, kv), before))


# ----------------------------------------------------------------------------------------------
# batched_rotary_embedding


@pytest.mark.parametrize("backend", TORCH, indirect=True)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("layout", ["flat", "heads", "batched", "no_key"])
@pytest.mark.parametrize("rot_dim", [64, 32])
def test_batched_rotary_embedding(backend, rng, randn, launches, dtype, is_neox, layout,
                                  rot_dim):
    T, Hq, Hk, D, rows = 12, 4, 2, 64, 512
    # Two scaling factors' tables one after the other (vLLM's multi-LoRA long-context cache).
    table = np.concatenate([
        cr.cos_sin_cache(rows, rot_dim, dtype="float32"),
        cr.cos_sin_cache(rows, rot_dim, scaling={"rope_type": "linear", "factor": 4.0},
                         dtype="float32")])
    positions = rng.integers(0, rows, T)
    offsets = rng.integers(0, 2, T) * rows
    query, key = randn((T, Hq, D), dtype), randn((T, Hk, D), dtype)
    pos = backend.put(positions.astype(np.int32))
    off = backend.put(offsets)  # int64 beside int32 positions
    shape = {"flat": lambda x: x.reshape(T, -1), "heads": lambda x: x, "no_key": lambda x: x,
             "batched": lambda x: x.reshape(3, 4, -1)}[layout]
    if layout == "batched":
        pos = pos.view(3, 4)  # offsets stay [T]: one per token
    q, k = backend.put(shape(query)), backend.put(shape(key))
    result = compat.batched_rotary_embedding(pos, q, None if layout == "no_key" else k, D,
                                             backend.put(table), is_neox, rot_dim, off)
    assert result is None
    (args, kwargs), = launches["apply_rope"]
    np.testing.assert_array_equal(backend.get(args[2]).reshape(-1), positions + offsets)
    assert kwargs["inplace"] is True
    for got, x in ((q, query), (k, key)):
        if x is key and layout == "no_key":
            assert_bits_equal(backend.get(k), shape(key), what="key (not given)")
            continue
        ref = reference_rope(x, positions + offsets, cos_sin_cache=table,
                             interleaved=not is_neox)
        assert_rope_close(backend.get(got).reshape(x.shape), ref, x, interleaved=not is_neox,
                          rotary_dim=rot_dim)


def test_batched_rotary_embedding_refusals_leave_the_inputs(randn):
    op = "batched_rotary_embedding"
    query, key = torch.from_numpy(randn((5, 3 * 16))), torch.from_numpy(randn((5, 16)))
    table = cr.cos_sin_cache(64, 16, like=query)
    cases = [
        (dict(rot_dim=8), ValueError, r"rot_dim=8 must be the cache's row width "
                                      r"cos_sin_cache.shape\[1\] = 16"),
        (dict(cos_sin_cache_offsets=torch.zeros(4, dtype=torch.int64)), ValueError,
         r"cos_sin_cache_offsets must have one entry per token \(5\)"),
        (dict(cos_sin_cache_offsets=torch.zeros(5)), TypeError,
         "cos_sin_cache_offsets must be int32 or int64, got torch.float32"),
        (dict(positions=torch.zeros(5)), TypeError, "positions must be int32 or int64"),
        (dict(cos_sin_cache=table[0]), ValueError, "cos_sin_cache must be 2-d"),
        (dict(rot_dim=16.0), TypeError, "rot_dim must be an int"),
        (dict(head_size=7), ValueError, "query's last dim 48 is not a multiple of head_size=7"),
        (dict(is_neox=None), TypeError, "is_neox must be a bool"),
    ]
    for change, error, match in cases:
        args = dict(positions=torch.arange(5), query=query, key=key, head_size=16,
                    cos_sin_cache=table, is_neox=True, rot_dim=16,
                    cos_sin_cache_offsets=torch.zeros(5, dtype=torch.int64))
        args.update(change)
        before = (query.clone(), key.clone())
        with pytest.raises(error, match=f"^{op}: {match}"):
            compat.batched_rotary_embedding(**args)
        assert_bits_equal(query, before[0], what="query")
        assert_bits_equal(key, before[1], what="key")


# ----------------------------------------------------------------------------------------------
# vLLM's bfloat16 references: rounded after every multiply and add


def _per_op_bf16(x, cos, sin, is_neox):
    """vLLM's torch reference in bfloat16 tensors: ``x1 * cos - x2 * sin`` and
    ``x2 * cos + x1 * sin``, every multiply and add rounded to bfloat16."""
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    return torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)


@pytest.mark.parametrize("backend", TORCH, indirect=True)
@pytest.mark.parametrize("is_neox", [True, False])
def test_one_rounding_beats_the_per_op_bf16_reference(backend, randn, rng, is_neox):
    """On the same bfloat16 query and vLLM's bfloat16 table (cos / sin of float32 angles,
    rounded), against the float64 result of those very values: cupyrope's largest error is
    smaller than that of vLLM's per-op reference, and on every element where the two differ by
    more than vLLM's test tolerance (atol 1e-3, rtol 1.6e-2) cupyrope's error is the smaller."""
    T, H, D, max_position = 1024, 8, 128, 8192
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    table = torch.cat((angles.cos(), angles.sin()), -1).to(torch.bfloat16)
    host = randn((T, H, D), "bfloat16")
    query, positions = Backend("torch").put(host), rng.integers(0, max_position, T)
    cos, sin = (x[:, None] for x in table[torch.from_numpy(positions)].chunk(2, dim=-1))

    got = backend.put(host)
    compat.rotary_embedding(backend.put(positions), got, None, D, table.to(got.device), is_neox)
    got = got.cpu().double()
    per_op = _per_op_bf16(query, cos, sin, is_neox).double()
    exact = _per_op_bf16(query.double(), cos.double(), sin.double(), is_neox)

    error, per_op_error = (got - exact).abs(), (per_op - exact).abs()
    assert error.max() < per_op_error.max()
    outside = (got - per_op).abs() > 1e-3 + 1.6e-2 * per_op.abs()
    assert outside.any(), "the per-op reference should miss vLLM's tolerance somewhere"
    assert torch.all(error[outside] < per_op_error[outside])
    # and cupyrope's own error is the one rounding of the exact value
    assert_rope_close(got.to(torch.bfloat16), exact.numpy(), query, interleaved=not is_neox,
                      rotary_dim=D)
