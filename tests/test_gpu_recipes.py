"""Repeated calls reuse a cached launch recipe: it must give the same answers as a first call."""

import numpy as np
import pytest

import cupyrope as cr
from reference import reference_rope
from tolerances import as_numpy, assert_rope_close

pytestmark = pytest.mark.gpu


@pytest.fixture
def torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


def _counting(monkeypatch, module, name: str) -> list:
    """Patch ``module.<name>`` to record each call (and still make it); returns the record."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name,
                        lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    return calls


def _repeats_skip(call, monkeypatch, *skipped) -> list:
    """``call()`` once (planned in full, its recipe kept under the caller's key), then three
    repeats during which none of ``skipped`` ((module, name) pairs) may run; returns their
    records, which keep counting."""
    call()
    records = [_counting(monkeypatch, module, name) for module, name in skipped]
    for _ in range(3):
        call()
    assert not any(records)
    return records


def _check(out, x, positions, cache, interleaved=False):
    ref = reference_rope(as_numpy(x), as_numpy(positions), cos_sin_cache=as_numpy(cache),
                         interleaved=interleaved)
    assert_rope_close(as_numpy(out), ref, as_numpy(x), interleaved=interleaved,
                      rotary_dim=x.shape[-1])


def test_repeated_calls_use_new_data_every_time(torch_cuda):
    torch = torch_cuda
    cache = cr.cos_sin_cache(4096, 128, like=torch.empty(1, device="cuda"))
    for _ in range(4):  # same layout each time: the second call on takes the cached recipe
        q = torch.randn(33, 8, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(33, 2, 128, device="cuda", dtype=torch.bfloat16)
        positions = torch.randint(0, 4096, (33,), device="cuda")
        q_out, k_out = cr.apply_rope(q, k, positions, cos_sin_cache=cache)
        _check(q_out, q, positions, cache)
        _check(k_out, k, positions, cache)


def test_layout_changes_are_not_served_from_the_cache(torch_cuda):
    torch = torch_cuda
    cache = cr.cos_sin_cache(4096, 64, like=torch.empty(1, device="cuda"))
    positions = torch.randint(0, 4096, (17,), device="cuda")
    base = torch.randn(17, 4, 65, device="cuda", dtype=torch.float32)
    aligned = base[..., :64]
    misaligned = base[..., 1:]  # same shape and strides, pointer off by 4 bytes: scalar path
    transposed = torch.randn(4, 17, 64, device="cuda").transpose(0, 1)  # other strides
    for q in (aligned, misaligned, transposed, aligned, misaligned, transposed):
        out = cr.apply_rope(q, positions=positions, cos_sin_cache=cache)
        _check(out, q, positions, cache)


def test_in_place_replay_writes_into_the_new_tensor(torch_cuda):
    torch = torch_cuda
    cache = cr.cos_sin_cache(1024, 64, like=torch.empty(1, device="cuda"))
    for _ in range(3):
        q = torch.randn(9, 4, 64, device="cuda", dtype=torch.float16)
        original = q.clone()
        positions = torch.randint(0, 1024, (9,), device="cuda", dtype=torch.int32)
        assert cr.apply_rope(q, positions=positions, cos_sin_cache=cache, inplace=True) is q
        _check(q, original, positions, cache)


def test_cached_layout_still_refuses_q_and_k_the_same_in_place(torch_cuda):
    torch = torch_cuda
    q = torch.randn(5, 2, 32, device="cuda")
    k = torch.randn(5, 2, 32, device="cuda")
    cr.apply_rope(q, k, inplace=True)  # caches the layout
    with pytest.raises(ValueError, match="same array"):
        cr.apply_rope(q, q, inplace=True)


def test_cached_layout_still_refuses_non_bool_flags(torch_cuda):
    torch = torch_cuda
    q = torch.randn(5, 2, 32, device="cuda")
    cr.apply_rope(q, interleaved=True)
    with pytest.raises(TypeError, match="interleaved"):
        cr.apply_rope(q, interleaved=1)


def test_cupy_repeats_and_other_streams():
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(7)
    cache = cr.cos_sin_cache(2048, 96, like=cupy.empty(1))
    stream = cupy.cuda.Stream(non_blocking=True)
    for use_stream in (False, True, False, True):
        q = cupy.asarray(rng.standard_normal((21, 3, 96)).astype(np.float32))
        positions = cupy.asarray(rng.integers(0, 2048, 21))
        if use_stream:
            cupy.cuda.get_current_stream().synchronize()  # inputs were written on another stream
            with stream:
                out = cr.apply_rope(q, positions=positions, cos_sin_cache=cache, interleaved=True)
            stream.synchronize()
        else:
            out = cr.apply_rope(q, positions=positions, cos_sin_cache=cache, interleaved=True)
        _check(out, q, positions, cache, interleaved=True)


# ------------------------------------------------------------------------------------------------
# The fused ops: a repeat call with the same layout fills in the pointers of every operand
# (weights, v, caches, slot mapping, scale arrays) and launches, without checking and planning.


def _rms_norm64(x, w, eps=1e-6):
    x = as_numpy(x).astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * as_numpy(w)


def _fused_call(torch, case, T=19, Hq=6, Hk=2, D=128, num_blocks=4, block_size=16):
    """One call of ``case`` on fresh tensors: (outputs, what to check them against)."""
    cache = cr.cos_sin_cache(4096, D, like=torch.empty(1, device="cuda"))
    q = torch.randn(T, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, Hk, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(T, Hk, D, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(D, device="cuda", dtype=torch.bfloat16) + 0.5
    positions = torch.randint(0, 4096, (T,), device="cuda")
    q0, k0 = q.clone(), k.clone()
    exact = {name: reference_rope(_rms_norm64(x, w) if "norm" in case else as_numpy(x),
                                  as_numpy(positions), cos_sin_cache=as_numpy(cache))
             for name, x in (("q", q0), ("k", k0))}
    if case == "rms_norm_rope":
        q_out, k_out = cr.rms_norm_rope(q, k, w, w, positions, eps=1e-6, cos_sin_cache=cache)
        return {"q": q_out, "k": k_out}, exact
    if case == "rms_norm_rope in place":
        q_out, k_out = cr.rms_norm_rope(q, k, w, w, positions, eps=1e-6, cos_sin_cache=cache,
                                        inplace=True)
        assert q_out is q and k_out is k
        return {"q": q, "k": k}, exact
    if case == "fp8 out":
        scale = torch.full((), 0.5, device="cuda")
        q8, k8 = cr.apply_rope(q, k, positions, cos_sin_cache=cache, out_dtype="float8_e4m3fn",
                               q_scale=scale, k_scale=0.25)
        assert q8.dtype == torch.float8_e4m3fn
        return {"q": q8.float() * 0.5, "k": k8.float() * 0.25}, exact
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:T]
    slots[::5] = -1
    k_cache = torch.zeros(num_blocks, block_size, Hk, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    norm = {"q_weight": w, "k_weight": w, "eps": 1e-6} if "norm" in case else {}
    result = cr.rope_and_cache(q, k, v, positions, k_cache, v_cache, slots, cos_sin_cache=cache,
                               **norm)
    assert result[0] is q and result[2] is k_cache
    valid = as_numpy(slots) >= 0
    rows = as_numpy(slots)[valid]
    got = {"q": q, "k": k, "k cache": k_cache.reshape(-1, Hk, D)[rows],
           "v cache": v_cache.reshape(-1, Hk, D)[rows]}
    exact = {**exact, "k cache": exact["k"][valid], "v cache": as_numpy(v).astype(np.float64)[valid]}
    return got, exact


@pytest.mark.parametrize("case", ["rms_norm_rope", "rms_norm_rope in place", "fp8 out",
                                  "rope_and_cache", "norm rope_and_cache"])
def test_fused_repeat_calls_replay_the_launch(torch_cuda, monkeypatch, case):
    """The second call of a layout is not planned (plan_fused would raise) and computes on its
    own new tensors; a new layout is planned again."""
    from cupyrope import execute

    execute.clear()
    _fused_call(torch_cuda, case)  # plans in full and keeps the recipe
    planned = []
    full_path = execute.plan_fused
    monkeypatch.setattr(execute, "plan_fused",
                        lambda *args, **kwargs: planned.append(1) or full_path(*args, **kwargs))
    for _ in range(3):
        got, exact = _fused_call(torch_cuda, case)
        for name, value in got.items():
            value = as_numpy(value.float()).astype(np.float64)
            bound = np.max(np.abs(exact[name]), axis=-1, keepdims=True) * (
                2.0 ** -3 if case == "fp8 out" else 2.0 ** -7)
            assert np.all(np.abs(value - exact[name]) <= bound), (case, name)
    assert not planned
    _fused_call(torch_cuda, case, T=23)  # another shape: planned again
    assert planned


@pytest.mark.parametrize("kind", ["torch", "cupy"])
@pytest.mark.parametrize("case", ["rms_norm_rope", "rms_norm_rope in place", "rope_and_cache",
                                  "norm rope_and_cache"])
def test_fused_repeat_calls_replay_by_the_arguments_as_given(torch_cuda, monkeypatch, case, kind):
    """After one call of a layout, its repeats replay from the public function's own arguments:
    the call's dicts and general key (execute.run_fused) are never reached, and each repeat
    computes on its own new arrays; a scaling dict (no fast key) still replays through
    run_fused."""
    import cupy as cp
    from cupyrope import execute

    torch = torch_cuda
    T, Hq, Hk, D = 11, 4, 2, 64
    like = torch.empty(1, device="cuda") if kind == "torch" else cp.empty(1)
    cache = cr.cos_sin_cache(512, D, like=like)

    def new(*shape, dtype=torch.bfloat16, low=None):
        x = (torch.randn(*shape, device="cuda", dtype=dtype) if low is None
             else torch.rand(*shape, device="cuda", dtype=dtype) + low)
        return x if kind == "torch" else cp.from_dlpack(x)

    def call(scaling=None):
        q, k, v = new(T, Hq, D), new(T, Hk, D), new(T, Hk, D)
        w = new(D, dtype=torch.float32, low=0.5)
        positions = torch.randint(0, 256, (T,), device="cuda")
        positions = positions if kind == "torch" else cp.from_dlpack(positions)
        rope = dict(cos_sin_cache=cache) if scaling is None else dict(scaling=scaling)
        q0, k0 = as_numpy(q).astype(np.float64), as_numpy(k).astype(np.float64)
        if "norm" in case:
            q0, k0 = _rms_norm64(q0, w), _rms_norm64(k0, w)
        if case.startswith("rms_norm_rope"):
            result = cr.rms_norm_rope(q, k, w, w, positions, eps=1e-6,
                                      inplace=case.endswith("in place"), **rope)
            got = dict(zip("qk", result))
        else:
            k_cache = new(2, 16, Hk, D) * 0
            v_cache = k_cache * 0
            slots = torch.randperm(32, device="cuda")[:T]
            slots = slots if kind == "torch" else cp.from_dlpack(slots)
            norm = dict(q_weight=w, k_weight=w, eps=1e-6) if "norm" in case else {}
            cr.rope_and_cache(q, k, v, positions, k_cache, v_cache, slots, **rope, **norm)
            rows = as_numpy(slots)
            got = {"q": q, "k": k, "cache": as_numpy(k_cache).reshape(-1, Hk, D)[rows]}
        for name, x0 in (("q", q0), ("k", k0), ("cache", k0)):
            if name in got:
                exact = (reference_rope(x0, as_numpy(positions), cos_sin_cache=as_numpy(cache))
                         if scaling is None else None)
                if exact is not None:
                    bound = np.max(np.abs(exact), axis=-1, keepdims=True) * 2.0 ** -7
                    value = as_numpy(got[name]).astype(np.float64)
                    assert np.all(np.abs(value - exact) <= bound), (case, name)

    execute.clear()
    call()  # plans in full; keeps the recipe under both keys
    general = execute.run_fused
    reached = []
    monkeypatch.setattr(execute, "run_fused",
                        lambda *args, **kwargs: reached.append(1) or general(*args, **kwargs))
    for _ in range(3):
        call()
    assert not reached
    scaling = {"rope_type": "linear", "factor": 2.0}
    call(scaling)
    call(scaling)  # a repeat without a fast key: through run_fused's general key
    assert len(reached) == 2


def test_parameters_replay_under_no_grad_and_take_autograd_with_it(torch_cuda, monkeypatch):
    """Norm weights that are nn.Parameters (a model's, as a patched layer passes them) replay
    under torch.no_grad() like plain tensors; with grad mode on the call is autograd's (a
    differentiable output), not a replay of the recipe kept without it."""
    from cupyrope import execute

    torch = torch_cuda
    T, H, D = 5, 4, 64
    cache = cr.cos_sin_cache(256, D, like=torch.empty(1, device="cuda"))
    positions = torch.arange(T, device="cuda")
    weight = torch.nn.Parameter(torch.rand(D, device="cuda") + 0.5)

    def call():
        q = torch.randn(T, H, D, device="cuda")
        out = cr.rms_norm_rope(q, None, weight, None, positions, eps=1e-6, cos_sin_cache=cache)
        exact = reference_rope(_rms_norm64(q, weight.detach()), as_numpy(positions),
                               cos_sin_cache=as_numpy(cache))
        np.testing.assert_allclose(as_numpy(out.detach()), exact, rtol=1e-5, atol=1e-5)
        return out

    execute.clear()
    with torch.no_grad():
        call()  # planned in full, the recipe kept
        planned = []
        full_path = execute.plan_fused
        monkeypatch.setattr(execute, "plan_fused", lambda *args, **kwargs: planned.append(1)
                            or full_path(*args, **kwargs))
        assert not call().requires_grad
        assert not planned
    out = call()
    assert out.requires_grad
    out.sum().backward()
    assert weight.grad is not None and torch.isfinite(weight.grad).all()


FUSED_MUTATIONS = {
    "eps": [1e-6, 1e-5, 0, "1e-6", True, np.float32(1e-6)],
    "weight_offset": [0.0, 1.0, 0, True],
    "norm_over": ["head", "all_heads", "heads"],
    "inplace": [False, True, 1],
    "out_dtype": [None, "float8_e4m3fn", "float16", "fp8"],
    "q_scale": [None, 0.5, 0.125, 2, True, "per_head", "half"],  # with fp8 outputs
    "interleaved": [False, True, 1],
}


@pytest.mark.parametrize("kind", ["torch", "cupy"])
@pytest.mark.parametrize("name,index", [(name, index) for name, values in FUSED_MUTATIONS.items()
                                        for index in range(1, len(values))])
def test_fused_repeat_calls_accept_exactly_what_the_full_path_accepts(torch_cuda, name, index,
                                                                     kind):
    """rms_norm_rope with one argument changed: its outcome (results, or the exception and its
    message) with nothing cached is its outcome as a repeat call of a cached layout."""
    import cupy as cp

    torch = torch_cuda
    if name in ("out_dtype", "q_scale") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 outputs need sm_89")
    rng = np.random.default_rng(3)
    host = {"q": rng.standard_normal((8, 4, 64)), "k": rng.standard_normal((8, 2, 64)),
            "w": rng.uniform(0.5, 1.5, 64)}
    positions_host = rng.integers(0, 64, 8)
    base = {option: values[0] for option, values in FUSED_MUTATIONS.items()}
    if name == "q_scale":  # cached with another number: the key holds a number scale's value
        base.update(out_dtype="float8_e4m3fn", q_scale=0.5)
    options = dict(base, **{name: FUSED_MUTATIONS[name][index]})

    def array(x, dtype):
        x = torch.from_numpy(x).to(device="cuda", dtype=dtype)
        return x if kind == "torch" else cp.from_dlpack(x)

    def call(**chosen):
        q, k = array(host["q"], torch.bfloat16), array(host["k"], torch.bfloat16)
        heads = (4, 2) if chosen["norm_over"] == "all_heads" else (1, 1)  # a weight per element
        q_weight, k_weight = (array(np.tile(host["w"], h), torch.float32) for h in heads)
        k_scale = 0.5 if chosen["out_dtype"] not in (None, "float16") else None
        if chosen["q_scale"] == "per_head":  # both per row (new scale arrays each call)
            k_scale = "per_head"
        return cr.rms_norm_rope(q, k, q_weight, k_weight, array(positions_host, torch.int64),
                                eps=chosen["eps"], weight_offset=chosen["weight_offset"],
                                norm_over=chosen["norm_over"], inplace=chosen["inplace"],
                                out_dtype=chosen["out_dtype"], q_scale=chosen["q_scale"],
                                k_scale=k_scale, interleaved=chosen["interleaved"])

    _assert_repeat_outcome_is_the_full_paths(call, options, base, name)


def _outcome_bytes(result) -> tuple:
    """("returns", the result's types, each array's bytes) of a call's result (fp8 tensors read
    as their bits)."""
    import torch

    results = result if isinstance(result, tuple) else (result,)
    return ("returns", tuple(type(r) for r in results),
            tuple(as_numpy(r.view(torch.uint8) if isinstance(r, torch.Tensor)
                           and r.dtype.itemsize == 1 else r).tobytes() for r in results))


def _assert_repeat_outcome_is_the_full_paths(call, options, base, name) -> None:
    """``call(**options)``'s outcome (results, or the exception and its message) with nothing
    cached equals its outcome as a repeat call after ``call(**base)`` (the same layout, cached)
    and, when it returns, after one call of its own."""
    from cupyrope import execute

    def outcome():
        try:
            return _outcome_bytes(call(**options))
        except Exception as exc:  # noqa: BLE001 - the exception is the outcome compared
            return ("raises", type(exc), str(exc))

    execute.clear()
    full = outcome()  # nothing cached: the full path decides
    call(**base)  # cached
    if full[0] == "returns":
        call(**options)  # a second, cached call of the mutated one
    cached = outcome()
    assert cached[:2] == full[:2], (name, options[name], full[:2], cached[:2])
    assert cached[2] == full[2]


CACHE_MUTATIONS = {
    "layout": ["NHD", "HND", "nhd"],
    "cache": ["same", "fp8"],
    "k_scale": [None, 0.5, 0.125, 2, True, "x"],  # with an fp8 cache
    "v_scale": [None, 0.25, 0.5, True],
    "inplace": [True, False, 1],
    "norm": ["head", None, "all_heads"],
    "eps": [1e-6, 0, "1e-6"],
    "interleaved": [False, True, 1],
}


@pytest.mark.parametrize("kind", ["torch", "cupy"])
@pytest.mark.parametrize("name,index", [(name, index) for name, values in CACHE_MUTATIONS.items()
                                        for index in range(1, len(values))])
def test_cache_write_repeat_calls_accept_exactly_what_the_full_path_accepts(torch_cuda, name,
                                                                            index, kind):
    """rope_and_cache with one argument changed: its outcome (q and k, both caches, or the
    exception and its message) with nothing cached is its outcome as a repeat call."""
    import cupy as cp

    torch = torch_cuda
    if name == "cache" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 caches need sm_89")
    rng = np.random.default_rng(4)
    T, Hq, Hk, D, blocks, block_size = 6, 4, 2, 64, 2, 8
    host = {"q": rng.standard_normal((T, Hq, D)), "k": rng.standard_normal((T, Hk, D)),
            "v": rng.standard_normal((T, Hk, D)), "w": rng.uniform(0.5, 1.5, D)}
    positions_host = rng.integers(0, 64, T)
    slots_host = rng.permutation(blocks * block_size)[:T]
    slots_host[2] = -1  # padding
    base = {option: values[0] for option, values in CACHE_MUTATIONS.items()}
    if name in ("k_scale", "v_scale"):  # cached with other numbers: the key holds their values
        base.update(cache="fp8", k_scale=0.5, v_scale=0.25)
    options = dict(base, **{name: CACHE_MUTATIONS[name][index]})

    def array(x, dtype):
        x = torch.from_numpy(np.ascontiguousarray(x)).to(device="cuda", dtype=dtype)
        return x if kind == "torch" else cp.from_dlpack(x)

    def call(**chosen):
        q, k, v = (array(host[x], torch.bfloat16) for x in "qkv")
        shape = ((blocks, Hk, block_size, D) if chosen["layout"] == "HND"
                 else (blocks, block_size, Hk, D))
        cache_dtype = None
        if chosen["cache"] == "fp8" and kind == "torch":
            caches = [torch.zeros(shape, device="cuda", dtype=torch.float8_e4m3fn)
                      for _ in range(2)]
        elif chosen["cache"] == "fp8":  # CuPy holds fp8 caches as their bits
            caches, cache_dtype = [cp.zeros(shape, np.uint8) for _ in range(2)], "float8_e4m3fn"
        else:
            caches = [array(np.zeros(shape), torch.bfloat16) for _ in range(2)]
        norm = {}
        if chosen["norm"] is not None:
            heads = (Hq, Hk) if chosen["norm"] == "all_heads" else (1, 1)
            q_weight, k_weight = (array(np.tile(host["w"], h), torch.float32) for h in heads)
            norm = dict(q_weight=q_weight, k_weight=k_weight, eps=chosen["eps"],
                        norm_over=chosen["norm"])
        result = cr.rope_and_cache(q, k, v, array(positions_host, torch.int64), *caches,
                                   array(slots_host, torch.int64), layout=chosen["layout"],
                                   k_scale=chosen["k_scale"], v_scale=chosen["v_scale"],
                                   cache_dtype=cache_dtype, inplace=chosen["inplace"],
                                   interleaved=chosen["interleaved"], **norm)
        assert result[2] is caches[0] and result[3] is caches[1]
        return result

    _assert_repeat_outcome_is_the_full_paths(call, options, base, name)


def test_fused_repeat_call_still_refuses_a_cache_over_q(torch_cuda):
    """A repeat call whose k cache now shares q's memory (same shapes, strides and alignment as
    the cached call) goes to the full path, which refuses it before writing anything."""
    torch = torch_cuda
    T, H, D = 16, 2, 64
    cache = cr.cos_sin_cache(256, D, like=torch.empty(1, device="cuda"))
    positions = torch.arange(T, device="cuda")
    slots = torch.arange(T, device="cuda")
    v = torch.randn(T, H, D, device="cuda")
    for overlap in (False, True):
        buffer = torch.randn(3 * T * H * D, device="cuda")
        q = buffer[:T * H * D].view(T, H, D)
        k = torch.randn(T, H, D, device="cuda")
        start = T * H * D // 2 if overlap else T * H * D  # half over q, or right after it
        k_cache = buffer[start:start + T * H * D].view(1, T, H, D)
        v_cache = torch.zeros(1, T, H, D, device="cuda")
        if overlap:
            before = buffer.clone()
            with pytest.raises(ValueError, match="k_cache"):
                cr.rope_and_cache(q, k, v, positions, k_cache, v_cache, slots,
                                  cos_sin_cache=cache)
            assert torch.equal(buffer, before) and not v_cache.any()
        else:
            cr.rope_and_cache(q, k, v, positions, k_cache, v_cache, slots, cos_sin_cache=cache)


def test_vllm_adapter_repeat_calls_replay_on_the_flat_tensors(torch_cuda, monkeypatch):
    """compat.rotary_embedding's second call of a layout is neither planned nor given head views
    (it replays on the flat [T, H * D] tensors); each call rotates its own new tensors; another
    head_size over the same flat tensors, or a flag of the wrong type, goes to the full path."""
    from cupyrope import compat, execute
    from cupyrope.compat import vllm
    from reference import reference_rope

    torch = torch_cuda
    execute.clear()
    T, width, R = 7, 256, 32  # flat rows of 256 elements; a cache of rotary_dim 32
    cache = cr.cos_sin_cache(512, R, like=torch.empty(1, device="cuda"))

    def call(head_size=64, is_neox=True):
        query = torch.randn(T, width, device="cuda", dtype=torch.bfloat16)
        key = torch.randn(T, width // 2, device="cuda", dtype=torch.bfloat16)
        positions = torch.randint(0, 512, (T,), device="cuda")
        before = (query.clone(), key.clone())
        compat.rotary_embedding(positions, query, key, head_size, cache, is_neox)
        for got, x in zip((query, key), before):
            x = as_numpy(x.view(T, -1, head_size))
            ref = reference_rope(x, as_numpy(positions), cos_sin_cache=as_numpy(cache),
                                 interleaved=not is_neox)
            assert_rope_close(as_numpy(got.view(x.shape)), ref, x, interleaved=not is_neox,
                              rotary_dim=R)

    planned, viewed = _repeats_skip(call, monkeypatch, (execute, "plan_rope"),
                                    (vllm, "heads_view"))
    call(head_size=32)  # the same flat layout split into other heads: planned again
    assert planned and viewed
    call(is_neox=False)
    with pytest.raises(TypeError, match="is_neox"):
        call(is_neox=1)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_vllm_cache_adapter_repeat_calls_replay_on_the_flat_tensors(torch_cuda, monkeypatch,
                                                                    kv_cache_dtype):
    """compat.rope_and_reshape_and_cache_flash's second call of a layout is neither planned nor
    given head views (it replays on the flat tensors as given) and each call rotates and caches
    its own new tensors; a short slot_mapping (padded each call) is never replayed; a scale the
    full path refuses is still refused after the layout is cached."""
    from cupyrope import compat, execute
    from cupyrope.compat import vllm

    torch = torch_cuda
    if kv_cache_dtype == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 caches need sm_89")
    execute.clear()
    T, Hq, Hk, D, blocks, block_size = 9, 4, 2, 64, 4, 16
    table = cr.cos_sin_cache(512, D, like=torch.empty(1, device="cuda"))
    cache_dtype = torch.uint8 if kv_cache_dtype == "fp8" else torch.bfloat16
    k_scale, v_scale = torch.tensor([0.5], device="cuda"), torch.tensor([2.0], device="cuda")

    def call(slots_given=T, scale=k_scale):
        query = torch.randn(T, Hq * D, device="cuda", dtype=torch.bfloat16)
        key = torch.randn(T, Hk * D, device="cuda", dtype=torch.bfloat16)
        value = torch.randn(T, Hk * D, device="cuda", dtype=torch.bfloat16)
        positions = torch.randint(0, 512, (T,), device="cuda")
        slots = torch.randperm(blocks * block_size, device="cuda")[:slots_given]
        caches = [torch.zeros(blocks, block_size, Hk, D, device="cuda", dtype=cache_dtype)
                  for _ in range(2)]
        k0 = key.clone()
        compat.rope_and_reshape_and_cache_flash(positions, query, key, value, *caches, slots,
                                                kv_cache_dtype, scale, v_scale, D, table, True)
        exact = reference_rope(as_numpy(k0.view(T, Hk, D)).astype(np.float64),
                               as_numpy(positions), cos_sin_cache=as_numpy(table))
        _check(key.view(T, Hk, D), k0.view(T, Hk, D), positions, table)
        rows = as_numpy(slots)
        stored = caches[0].view(-1, Hk, D)[slots]
        if kv_cache_dtype == "fp8":
            stored = stored.view(torch.float8_e4m3fn).float() * 0.5
        got = as_numpy(stored.float()).astype(np.float64)
        bound = np.max(np.abs(exact[:len(rows)]), axis=-1, keepdims=True) * (
            2.0 ** -3 if kv_cache_dtype == "fp8" else 2.0 ** -7)
        assert np.all(np.abs(got - exact[:len(rows)]) <= bound)

    _, viewed = _repeats_skip(call, monkeypatch, (execute, "plan_fused"),
                              (vllm, "token_heads_view"))
    call(slots_given=T - 2)  # padded: a new slot tensor each call, so never replayed
    call(slots_given=T - 2)
    assert len(viewed) == 6
    with pytest.raises(ValueError, match="per-head scales are not supported"):
        call(scale=torch.tensor([0.5, 0.5], device="cuda"))


def test_vllm_qk_norm_adapter_repeat_calls_replay_on_the_fused_projection(torch_cuda,
                                                                        monkeypatch):
    """compat.fused_qk_norm_rope's second call of a layout is neither planned nor split into
    views (it replays on qkv as given, k's heads at their offset) and normalises and rotates its
    own new projection each time; other head counts over the same qkv width are planned again."""
    from cupyrope import compat, execute
    from cupyrope.compat import vllm

    torch = torch_cuda
    execute.clear()
    T, Hq, Hk, D = 7, 4, 2, 64
    table = cr.cos_sin_cache(512, D, like=torch.empty(1, device="cuda"))
    w = torch.rand(D, device="cuda") + 0.5

    def call(heads=(Hq, Hk)):
        hq, hk = heads
        qkv = torch.randn(T, (Hq + 2 * Hk) * D, device="cuda")
        positions = torch.randint(0, 512, (T,), device="cuda")
        before = qkv.clone()
        compat.fused_qk_norm_rope(qkv, hq, hk, Hq + 2 * Hk - hq - hk, D, 1e-6, w, w, table, True,
                                  positions)
        for lo, h in ((0, hq), (hq * D, hk)):
            x = before[:, lo:lo + h * D].view(T, h, D)
            exact = reference_rope(_rms_norm64(x, w), as_numpy(positions),
                                   cos_sin_cache=as_numpy(table))
            got = as_numpy(qkv[:, lo:lo + h * D].view(T, h, D)).astype(np.float64)
            np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5)
        assert torch.equal(qkv[:, (hq + hk) * D:], before[:, (hq + hk) * D:])  # v untouched

    planned, split = _repeats_skip(call, monkeypatch, (execute, "plan_fused"),
                                   (vllm, "split_qkv"))
    call(heads=(Hq + 2, Hk))  # the same qkv width split into other heads: planned again
    assert planned and split
