"""``apply_rope(..., out=...)``: preallocated outputs on every mutable backend (NumPy and torch CPU
in CI; CuPy and torch CUDA on the GPU, with the repeat-call path and CUDA-graph capture), and every
refusal before anything is written."""

from __future__ import annotations

import numpy as np
import pytest

import cupyrope as cr
from backends import angle_source, backend_params
from reference import reference_rope
from tolerances import assert_rope_close, np_dtype

MUTABLE = backend_params(["numpy", "torch", "cupy", "torch-cuda"])
T, HQ, HK, D = 11, 4, 2, 64


def _qk(rng, dtype="float32"):
    q = rng.standard_normal((T, HQ, D)).astype(np_dtype(dtype))
    k = rng.standard_normal((T, HK, D)).astype(np_dtype(dtype))
    return q, k


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
@pytest.mark.parametrize("source", ["cache", "tables_half", "computed"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_out_receives_the_rotation(backend, rng, source, dtype):
    """The results land in the given arrays (strided views of larger buffers too), which are
    returned; the inputs are untouched; the values are those of an out-of-place call."""
    q, k = _qk(rng, dtype)
    positions = rng.integers(0, 4096, T)
    lib, ref_kw, _ = angle_source(source, (T,), positions, D, interleaved=False)
    angles = {name: backend.put(x) if isinstance(x, np.ndarray) else x for name, x in lib.items()}
    qb, kb = backend.put(q), backend.put(k)
    # q_out: every other head of a larger buffer; k_out: contiguous.
    q_buffer = backend.put(np.full((T, 2 * HQ, D), np.nan, np_dtype(dtype)))
    q_out, k_out = q_buffer[:, ::2], backend.put(np.full((T, HK, D), np.nan, np_dtype(dtype)))
    result = cr.apply_rope(qb, kb, out=(q_out, k_out), **angles)
    assert result[0] is q_out and result[1] is k_out
    expected = cr.apply_rope(qb, kb, **angles)
    for got, exact, x in ((q_out, expected[0], q), (k_out, expected[1], k)):
        np.testing.assert_array_equal(backend.get(got), backend.get(exact))
        assert_rope_close(backend.get(got), reference_rope(x, **ref_kw), x, interleaved=False,
                          rotary_dim=D)
    assert np.isnan(backend.get(q_buffer)[:, 1::2].astype(np.float32)).all()  # nothing else written
    np.testing.assert_array_equal(backend.get(qb), q)
    # Without k: out is q_out alone (or a 1-tuple).
    single = backend.put(np.zeros((T, HQ, D), np_dtype(dtype)))
    assert cr.apply_rope(qb, out=single, **angles) is single
    assert cr.apply_rope(qb, out=(single,), **angles) is single


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
@pytest.mark.parametrize("case,error,match", [
    ("both", ValueError, "inplace=True .* or out="),
    ("count", TypeError, r"out must be \(q_out, k_out\)"),
    ("shape", ValueError, "k_out must have k's shape"),
    ("dtype", ValueError, "q_out must have q's shape, dtype"),
    ("over q", ValueError, "q_out shares memory with q"),
    ("over each other", ValueError, "q_out shares memory with k_out"),
    ("fp8", ValueError, "out= is not supported with fp8"),
])
def test_out_refusals_write_nothing(backend, rng, case, error, match):
    q, k = _qk(rng)
    q, k = q[:, :2].copy(), k  # q and k of one shape: outputs that could alias each other
    qb, kb = backend.put(q), backend.put(k)
    q_out, k_out = backend.put(np.zeros_like(q)), backend.put(np.zeros_like(k))
    kwargs = {"out": (q_out, k_out)}
    if case == "both":
        kwargs["inplace"] = True
    elif case == "count":
        kwargs["out"] = (q_out,)
    elif case == "shape":
        kwargs["out"] = (q_out, backend.put(np.zeros((T, HK + 1, D), np.float32)))
    elif case == "dtype":
        kwargs["out"] = (backend.put(np.zeros_like(q, dtype=np.float64)), k_out)
    elif case == "over q":
        kwargs["out"] = (qb, k_out)
    elif case == "over each other":
        kwargs["out"] = (q_out, q_out)
    elif case == "fp8":
        kwargs.update(out_dtype="float8_e4m3fn", q_scale=1.0, k_scale=1.0)
    with pytest.raises(error, match=match):
        cr.apply_rope(qb, kb, np.arange(T) if backend.framework == "numpy" else
                      backend.put(np.arange(T)), theta=1e4, **kwargs)
    assert not backend.get(q_out).any() and not backend.get(k_out).any()
    np.testing.assert_array_equal(backend.get(qb), q)


def test_out_refuses_read_only_and_aliased_arrays(rng):
    q, _ = _qk(rng)
    read_only = np.zeros_like(q)
    read_only.flags.writeable = False
    with pytest.raises(TypeError, match="q_out is read-only"):
        cr.apply_rope(q, out=read_only)
    aliased = np.broadcast_to(np.zeros((1, HQ, D), np.float32), q.shape)
    with pytest.raises((TypeError, ValueError), match="q_out"):
        cr.apply_rope(q, out=aliased)
    with pytest.raises(TypeError, match="q_out must be a numpy array"):
        torch = pytest.importorskip("torch")
        cr.apply_rope(q, out=torch.zeros(q.shape))


def test_out_refuses_jax_arrays_and_autograd(rng):
    jnp = pytest.importorskip("jax.numpy")
    torch = pytest.importorskip("torch")
    q, _ = _qk(rng)
    with pytest.raises(TypeError, match="immutable JAX array"):
        cr.apply_rope(jnp.asarray(q), out=jnp.zeros(q.shape))
    tq = torch.from_numpy(q).requires_grad_(True)
    out = torch.zeros(q.shape)
    with pytest.raises(RuntimeError, match="out= arguments do not support automatic differentiation"):
        cr.apply_rope(tq, out=out)
    assert not out.any()
    with torch.no_grad():
        assert cr.apply_rope(tq, out=out) is out
    torch.testing.assert_close(out, cr.apply_rope(tq.detach()), rtol=0, atol=0)


def test_out_under_torch_compile(rng):
    torch = pytest.importorskip("torch")
    q, k = _qk(rng)
    tq, tk = torch.from_numpy(q), torch.from_numpy(k)
    positions = torch.arange(T)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(q, k, q_out, k_out):
        cr.apply_rope(q, k, positions, theta=1e4, out=(q_out, k_out))
        return q_out.sum() + k_out.sum()

    q_out, k_out = torch.zeros_like(tq), torch.zeros_like(tk)
    step(tq, tk, q_out, k_out)
    expected = cr.apply_rope(tq, tk, positions, theta=1e4)
    torch.testing.assert_close(q_out, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(k_out, expected[1], rtol=0, atol=0)


@pytest.mark.parametrize("backend", backend_params(["cupy", "torch-cuda"]), indirect=True)
def test_out_repeat_calls_replay_and_still_refuse_overlaps(backend, rng, monkeypatch):
    """A repeat call with out= of a layout seen before is not planned and writes its own out
    arrays; out arrays moved over q (same shapes, strides and alignment) are refused."""
    from cupyrope import execute

    execute.clear()
    q, k = _qk(rng)
    positions = backend.put(rng.integers(0, 4096, T))
    cache = backend.put(cr.cos_sin_cache(4096, D, dtype="float32"))
    outs = lambda: (backend.put(np.zeros((T, HQ, D), np.float32)),  # noqa: E731
                    backend.put(np.zeros((T, HK, D), np.float32)))
    cr.apply_rope(backend.put(q), backend.put(k), positions, cos_sin_cache=cache, out=outs())
    planned = []
    full_path = execute.plan_rope
    monkeypatch.setattr(execute, "plan_rope",
                        lambda *args, **kwargs: planned.append(1) or full_path(*args, **kwargs))
    for _ in range(3):
        q, k = _qk(rng)
        out = outs()
        q_out, k_out = cr.apply_rope(backend.put(q), backend.put(k), positions,
                                     cos_sin_cache=cache, out=out)
        assert q_out is out[0] and k_out is out[1]
        expected = reference_rope(q, backend.get(positions), cos_sin_cache=backend.get(cache))
        assert_rope_close(backend.get(out[0]), expected, q, interleaved=False, rotary_dim=D)
    assert not planned
    # q_out over q's own buffer: same metadata as before, so only the overlap guard tells.
    buffer = backend.put(np.concatenate([q.reshape(-1), np.zeros(q.size, np.float32)]))
    q_view = buffer[:q.size].reshape(q.shape)
    q_out = buffer[q.size // 2:q.size // 2 + q.size].reshape(q.shape)
    with pytest.raises(ValueError, match="q_out shares memory with q"):
        cr.apply_rope(q_view, backend.put(k), positions, cos_sin_cache=cache,
                      out=(q_out, outs()[1]))
    np.testing.assert_array_equal(backend.get(q_view), q)


@pytest.mark.parametrize("backend", backend_params(["torch-cuda"]), indirect=True)
def test_out_in_a_cuda_graph(backend, rng):
    """Preallocated outputs are what CUDA-graph users want: a captured call writes them on every
    replay, with the inputs' new values."""
    import torch

    q, k = _qk(rng)
    tq, tk = backend.put(q), backend.put(k)
    positions = backend.put(rng.integers(0, 4096, T))
    cache = cr.cos_sin_cache(4096, D, dtype="float32", like=tq)
    out = (torch.empty_like(tq), torch.empty_like(tk))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        cr.apply_rope(tq, tk, positions, cos_sin_cache=cache, out=out)  # compiles, caches
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cr.apply_rope(tq, tk, positions, cos_sin_cache=cache, out=out)
    q2, _ = _qk(rng)
    tq.copy_(backend.put(q2))
    graph.replay()
    torch.cuda.synchronize()
    expected = reference_rope(q2, backend.get(positions), cos_sin_cache=backend.get(cache))
    assert_rope_close(backend.get(out[0]), expected, q2, interleaved=False, rotary_dim=D)
