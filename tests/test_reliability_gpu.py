"""Reliability on the GPU: misaligned pointers, CUDA grid limits, CUDA-graph capture and warmup,
the repeat-call path against the full path (hypothesis), and guard bytes around every array
written (hypothesis). Every result is compared with the NumPy path of the same call."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupyrope as cr
from cupyrope.cuda.recipes import recipes

cp = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

HYPOTHESIS = settings(max_examples=40, deadline=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture])


def _at_offset(host: np.ndarray, offset: int):
    """A CuPy copy of ``host`` whose data starts ``offset`` bytes into a 256-byte aligned buffer."""
    raw = cp.zeros(host.nbytes + 64, dtype=cp.uint8)
    out = cp.ndarray(host.shape, dtype=host.dtype, memptr=raw.data + offset)
    out.set(np.ascontiguousarray(host))
    return out


def _close(got, want, dtype=np.float32):
    tol = 1e-6 if np.dtype(dtype) == np.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               rtol=tol, atol=tol)


# ----------------------------------------------------------------------------------------------
# Misaligned pointers: refused on every call, repeat calls included; the context stays usable


@pytest.mark.parametrize("operand", ["q", "k", "positions", "cos_sin_cache", "cos", "sin"])
def test_every_byte_offset_of_every_operand(operand):
    rng = np.random.default_rng(3)
    T, D = 8, 64
    host = {
        "q": rng.standard_normal((T, 4, D)).astype(np.float32),
        "k": rng.standard_normal((T, 2, D)).astype(np.float32),
        "positions": rng.integers(0, 32, T).astype(np.int64),
        "cos_sin_cache": cr.cos_sin_cache(32, D),
    }
    angles = rng.uniform(-3, 3, (T, D // 2))
    host["cos"], host["sin"] = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    table = operand in ("cos", "sin")
    names = ["q", "k"] + (["cos", "sin"] if table else ["positions", "cos_sin_cache"])

    def call(offset):
        args = {n: _at_offset(host[n], offset if n == operand else 0) for n in names}
        if table:
            return cr.apply_rope(args["q"], args["k"], cos=args["cos"], sin=args["sin"])
        return cr.apply_rope(args["q"], args["k"], args["positions"],
                             cos_sin_cache=args["cos_sin_cache"])

    want = (cr.apply_rope(host["q"], host["k"], cos=host["cos"], sin=host["sin"]) if table else
            cr.apply_rope(host["q"], host["k"], host["positions"], cos_sin_cache=host["cos_sin_cache"]))
    itemsize = host[operand].itemsize
    for offset in range(16):
        for _ in range(2):  # the second call of each layout would replay a cached launch
            if offset % itemsize:
                with pytest.raises(ValueError, match=f"{operand}'s data pointer .* not a multiple"):
                    call(offset)
            else:
                q_out, k_out = call(offset)
                _close(q_out.get(), want[0])
                _close(k_out.get(), want[1])
    cp.cuda.Device().synchronize()  # the context is still healthy


# ----------------------------------------------------------------------------------------------
# CUDA grid limits


@pytest.mark.parametrize("shape, positions_shape", [
    ((70000, 1, 1, 64), (70000, 1)),
    ((65535, 1, 64), (65535,)),
    ((65536, 1, 64), (65536,)),
    ((3, 70000, 1, 8), (3, 70000)),
    ((1, 2**21, 2), (1,)),   # one token, many heads: heads over blockIdx.y
    ((2, 2**20 + 3, 4), (2,)),
])
@pytest.mark.parametrize("source", ["cache", "computed"])
def test_grid_limits(shape, positions_shape, source):
    rng = np.random.default_rng(4)
    host = rng.standard_normal(shape).astype(np.float32)
    positions = rng.integers(0, 1024, positions_shape).astype(np.int64)
    D = shape[-1]
    kwargs = {"cos_sin_cache": cr.cos_sin_cache(1024, D)} if source == "cache" else {"theta": 10000.0}
    want = cr.apply_rope(host, positions=positions, **kwargs)
    gpu_kwargs = {key: cp.asarray(value) if isinstance(value, np.ndarray) else value
                  for key, value in kwargs.items()}
    got = cr.apply_rope(cp.asarray(host), positions=cp.asarray(positions), **gpu_kwargs)
    _close(got.get(), want)
    q = cp.asarray(host)
    cr.apply_rope(q, positions=cp.asarray(positions), inplace=True, **gpu_kwargs)
    _close(q.get(), want)


# ----------------------------------------------------------------------------------------------
# CUDA-graph capture: warmup prepares what a call needs; a call that would upload names warmup


def test_capture_needs_warmup_for_a_new_schedule_and_survives_clear_cache():
    device = torch.device("cuda")
    q = torch.randn(16, 4, 64, device=device)
    positions = torch.arange(16, device=device)
    theta = 12345.5  # a schedule no other test uploads
    cr.apply_rope(q, positions=positions, theta=10000.0)  # kernels compiled, another schedule
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with pytest.raises(RuntimeError, match=r"cupyrope\.warmup"):
            with torch.cuda.graph(graph, stream=stream):
                cr.apply_rope(q, positions=positions, theta=theta)
    torch.cuda.synchronize()
    cr.warmup(dtypes=("float32",), sources=("computed",), interleaved=(False,), theta=theta,
              rotary_dim=64)
    out = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(cr.apply_rope(q, positions=positions, theta=theta))
    graph.replay()
    torch.cuda.synchronize()
    want = cr.apply_rope(q.cpu(), positions=positions.cpu(), theta=theta)
    _close(out.cpu().numpy(), want.numpy())
    cr.clear_cache()  # forgets, never frees, what the graph reads
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    _close(out.cpu().numpy(), want.numpy())


def test_warmup_checks_its_schedule_before_compiling():
    with pytest.raises(ValueError, match="rotary_dim is needed"):
        cr.warmup(theta=500000.0)
    with pytest.raises(ValueError, match="warmup: unknown scaling rope_type"):
        cr.warmup(rotary_dim=64, scaling={"rope_type": "banana"})


# ----------------------------------------------------------------------------------------------
# The repeat-call path accepts exactly what the full path accepts


def _outcome(call):
    try:
        result = call()
    except Exception as exc:  # noqa: BLE001 - the exception is the outcome being compared
        return ("raises", type(exc), str(exc))
    results = result if isinstance(result, tuple) else (result,)
    return ("returns", tuple(type(r) for r in results),
            tuple(r.detach().cpu().numpy() if isinstance(r, torch.Tensor) else r.get()
                  for r in results))


MUTATIONS = {
    "rotary_dim": [32, 32.0, np.int64(32), True, "32", 64],
    "theta": [10000.0, 10000, np.float32(10000.0), "10000", 500000.0, True],
    "interleaved": [False, True, 0, 1, np.bool_(True)],
    "inverse": [False, True, 1],
    "inplace": [False, True, 1],
    "k_type": ["same", "cupy", "torch", "none"],
    "positions_dtype": ["int64", "int32", "float32"],
    "scaling": [None, {"rope_type": "linear", "factor": 2.0}, {"rope_type": "linear", "factor": True},
                {"rope_type": "linear", "factor": 2}],
}


@pytest.mark.parametrize("array_type", ["cupy", "torch"])
@HYPOTHESIS
@given(changes=st.dictionaries(st.sampled_from(sorted(MUTATIONS)), st.integers(0, 5), max_size=3))
def test_repeat_calls_accept_exactly_what_the_full_path_accepts(array_type, changes):
    rng = np.random.default_rng(5)
    T, D = 8, 64
    q_host = rng.standard_normal((T, 4, D)).astype(np.float32)
    k_host = rng.standard_normal((T, 2, D)).astype(np.float32)
    positions_host = rng.integers(0, 64, T)
    choice = {name: values[changes.get(name, 0) % len(values)] for name, values in MUTATIONS.items()}

    def as_type(host, kind):
        return torch.from_numpy(host).cuda() if kind == "torch" else cp.asarray(host)

    def call():
        q = as_type(q_host, array_type)
        k_kind = {"same": array_type, "none": None}.get(choice["k_type"], choice["k_type"])
        k = None if k_kind is None else as_type(k_host, k_kind)
        positions = as_type(positions_host.astype(choice["positions_dtype"]), array_type)
        return cr.apply_rope(q, k, positions, theta=choice["theta"], rotary_dim=choice["rotary_dim"],
                             interleaved=choice["interleaved"], inverse=choice["inverse"],
                             inplace=choice["inplace"], scaling=choice["scaling"])

    def base_call():  # the same shapes with every option at its first value: cached
        q, k = as_type(q_host, array_type), as_type(k_host, array_type)
        return cr.apply_rope(q, k, as_type(positions_host, array_type), theta=10000.0, rotary_dim=32)

    recipes.clear()
    full = _outcome(call)  # nothing cached for this call: the full path decides
    base_call()
    call() if full[0] == "returns" else None  # a second, cached call of the mutated layout
    cached = _outcome(call)
    assert cached[0] == full[0], (choice, full[:2], cached[:2])
    assert cached[1] == full[1]
    if full[0] == "raises":
        assert cached[2] == full[2]
    else:
        for a, b in zip(cached[2], full[2]):
            np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------------------------
# Guard bytes: nothing is written outside the arrays a call writes


@HYPOTHESIS
@given(T=st.integers(1, 9), heads=st.integers(1, 5), D=st.sampled_from([2, 6, 8, 64, 80]),
       pad_heads=st.integers(0, 3), lead=st.integers(0, 40), dtype=st.sampled_from(["float32", "float16"]),
       source=st.sampled_from(["cache", "computed", "tables"]), rot=st.sampled_from([1.0, 0.5]))
def test_guard_bytes_around_arrays_written_in_place(T, heads, D, pad_heads, lead, dtype, source, rot):
    rng = np.random.default_rng(T * 1000 + heads * 10 + D)
    rotary_dim = max(2, int(D * rot) // 2 * 2)
    row = (heads + pad_heads) * D
    total = lead + T * row + 64
    sentinel = np.float32(1234.5).astype(dtype)
    buffer_host = np.full(total, sentinel, dtype=dtype)
    values = rng.standard_normal((T, heads, D)).astype(dtype)
    view_host = np.lib.stride_tricks.as_strided(buffer_host[lead:], shape=(T, heads, D),
                                                strides=(row * buffer_host.itemsize, D * buffer_host.itemsize,
                                                         buffer_host.itemsize))
    view_host[...] = values
    buffer = cp.asarray(buffer_host)
    q = cp.lib.stride_tricks.as_strided(buffer[lead:], shape=(T, heads, D),
                                        strides=(row * buffer.itemsize, D * buffer.itemsize, buffer.itemsize))
    positions = rng.integers(0, 64, T)
    if source == "cache":
        cache = cr.cos_sin_cache(64, rotary_dim)
        kwargs, gpu = {"positions": positions, "cos_sin_cache": cache}, {
            "positions": cp.asarray(positions), "cos_sin_cache": cp.asarray(cache)}
    elif source == "computed":
        kwargs, gpu = {"positions": positions}, {"positions": cp.asarray(positions)}
    else:
        angles = rng.uniform(-3, 3, (T, rotary_dim // 2))
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        kwargs, gpu = {"cos": cos, "sin": sin}, {"cos": cp.asarray(cos), "sin": cp.asarray(sin)}
    want = cr.apply_rope(np.ascontiguousarray(values), rotary_dim=rotary_dim, **kwargs)
    cr.apply_rope(q, rotary_dim=rotary_dim, inplace=True, **gpu)
    got = buffer.get()
    inside = np.zeros(total, bool)
    np.lib.stride_tricks.as_strided(inside[lead:], shape=(T, heads, D),
                                    strides=(row, D, 1))[...] = True
    np.testing.assert_array_equal(got[~inside], buffer_host[~inside])
    got_view = np.lib.stride_tricks.as_strided(got[lead:], shape=(T, heads, D),
                                               strides=(row * got.itemsize, D * got.itemsize, got.itemsize))
    _close(got_view, want, dtype)
