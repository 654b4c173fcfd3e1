"""Reliability: a wrong call fails loudly before anything is written, a right call is never
corrupted. Runs on the CPU (NumPy, torch) in CI and on CuPy / torch CUDA with a GPU.

- aliasing: random strided views of one buffer as q and k in place are refused exactly when their
  element sets intersect (the ground truth comes from the elements' indices), and rotate right
  otherwise (hypothesis);
- the repeat-call path accepts exactly what the full path accepts, with the same types and values
  (hypothesis, on the GPU where that path exists);
- autograd's version counters, views of graph tensors, inference tensors;
- options a call would ignore; position helpers past 2^31; misaligned pointers; CUDA grid limits;
  CUDA-graph capture and warmup; a failing allocation leaves inputs and the process intact; guard
  bytes around every array written.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupyrope as cr

torch = pytest.importorskip("torch")

HYPOTHESIS = settings(max_examples=60, deadline=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture])


def _gpu_available() -> bool:
    try:
        import cupy

        return bool(cupy.is_available())
    except Exception:
        return False


GPU = pytest.mark.gpu
BACKENDS = ["numpy", "torch", pytest.param("cupy", marks=GPU), pytest.param("torch-cuda", marks=GPU)]


class Backend:
    """Host data in, arrays of one backend out, results back to NumPy."""

    def __init__(self, name: str):
        self.name = name

    def put(self, host: np.ndarray):
        if self.name == "numpy":
            return host.copy()
        if self.name == "torch":
            return torch.from_numpy(host.copy())
        if self.name == "torch-cuda":
            return torch.from_numpy(host.copy()).cuda()
        import cupy

        return cupy.asarray(host)

    def get(self, x) -> np.ndarray:
        if isinstance(x, torch.Tensor):
            return x.detach().cpu().numpy()
        if hasattr(x, "get"):
            return x.get()
        return np.asarray(x)

    def positions(self, host: np.ndarray):
        return self.put(host.astype(np.int64))


@pytest.fixture(params=BACKENDS)
def backend(request):
    return Backend(request.param)


# ----------------------------------------------------------------------------------------------
# Aliasing in place: refused exactly when an element is shared


@st.composite
def two_views(draw):
    """Two [T, H, D] views of one [T, W] buffer: head ranges and a head stride each."""
    D = draw(st.sampled_from([2, 4, 8]))
    T = draw(st.integers(1, 4))
    heads_in_buffer = draw(st.integers(2, 8))

    def view():
        stride = draw(st.integers(1, 3))  # in heads
        count = draw(st.integers(1, max(1, (heads_in_buffer - 1) // stride + 1)))
        first = draw(st.integers(0, heads_in_buffer - 1 - (count - 1) * stride))
        offset = draw(st.integers(0, D - 1)) if draw(st.booleans()) else 0  # sub-head shift
        if first * D + offset + ((count - 1) * stride + 1) * D > heads_in_buffer * D:
            offset = 0
        return first * D + offset, count, stride * D

    return T, heads_in_buffer * D, D, view(), view()


def _as_view(buffer, start, count, head_stride, D):
    """buffer[:, start : start + ...] seen as [T, count, D] with the given head stride."""
    if isinstance(buffer, np.ndarray):
        item = buffer.itemsize
        return np.lib.stride_tricks.as_strided(buffer[:, start:], shape=(buffer.shape[0], count, D),
                                               strides=(buffer.strides[0], head_stride * item, item))
    if isinstance(buffer, torch.Tensor):
        return buffer[:, start:].as_strided((buffer.shape[0], count, D),
                                            (buffer.stride(0), head_stride, 1),
                                            buffer.storage_offset() + start)
    import cupy

    item = buffer.itemsize
    return cupy.lib.stride_tricks.as_strided(buffer[:, start:], shape=(buffer.shape[0], count, D),
                                             strides=(buffer.strides[0], head_stride * item, item))


def _element_ids(T, W, view, D):
    ids = np.arange(T * W).reshape(T, W)
    return set(_as_view(ids, view[0], view[1], view[2], D).ravel().tolist())


@pytest.mark.parametrize("backend_name", ["numpy", "torch",
                                          pytest.param("cupy", marks=GPU),
                                          pytest.param("torch-cuda", marks=GPU)])
@HYPOTHESIS
@given(case=two_views(), seed=st.integers(0, 2**16))
def test_in_place_views_refused_exactly_when_they_share_an_element(backend_name, case, seed):
    backend = Backend(backend_name)
    T, W, D, q_view, k_view = case
    rng = np.random.default_rng(seed)
    host = rng.standard_normal((T, W)).astype(np.float32)
    shared = _element_ids(T, W, q_view, D) & _element_ids(T, W, k_view, D)
    positions = np.arange(T)
    buffer = backend.put(host)
    q, k = _as_view(buffer, *q_view, D), _as_view(buffer, *k_view, D)
    if shared:
        with pytest.raises(ValueError, match="shares memory with k|same array"):
            cr.apply_rope(q, k, backend.positions(positions), inplace=True)
        np.testing.assert_array_equal(backend.get(buffer), host)  # nothing written
        return
    q_host, k_host = _as_view(host, *q_view, D), _as_view(host, *k_view, D)
    want_q = cr.apply_rope(np.ascontiguousarray(q_host), positions=positions)
    want_k = cr.apply_rope(np.ascontiguousarray(k_host), positions=positions)
    cr.apply_rope(q, k, backend.positions(positions), inplace=True)
    np.testing.assert_allclose(backend.get(q), want_q, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(backend.get(k), want_k, rtol=1e-6, atol=1e-6)


def test_in_place_refuses_every_kind_of_alias(backend):
    rng = np.random.default_rng(0)
    T, D = 4, 8
    buf = backend.put(rng.standard_normal((T, 3, D)).astype(np.float32))
    positions = backend.positions(np.arange(T))
    with pytest.raises(ValueError, match="k|same array"):
        cr.apply_rope(buf, buf[:], positions, inplace=True)
    with pytest.raises(ValueError, match="q shares memory with k"):
        cr.apply_rope(buf[:, :2], buf[:, 1:], positions, inplace=True)
    # a table that is a view of q's memory
    table_buf = backend.put(rng.standard_normal((T, 2, D)).astype(np.float32))
    with pytest.raises(ValueError, match="q shares memory with cos"):
        cr.apply_rope(table_buf, cos=table_buf[:, 0, : D // 2], sin=table_buf[:, 1, : D // 2],
                      inplace=True, rotary_dim=D)
    # fused QKV views interleave without sharing: accepted
    qkv = backend.put(rng.standard_normal((T, 6 * D)).astype(np.float32))
    q = qkv[:, : 4 * D].reshape(T, 4, D) if backend.name != "numpy" else qkv[:, : 4 * D].reshape(T, 4, D)
    k = qkv[:, 4 * D: 5 * D].reshape(T, 1, D)
    cr.apply_rope(q, k, positions, inplace=True)


# ----------------------------------------------------------------------------------------------
# torch autograd: version counters, views of graph tensors, inference tensors


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_in_place_bumps_the_version_counter(device):
    q = torch.randn(4, 2, 8, device=device)
    w = torch.randn(4, 2, 8, device=device, requires_grad=True)
    positions = torch.arange(4, device=device)
    for _ in range(2):  # the second call replays a cached launch on a GPU
        y = (q * w).sum()  # saves q for backward
        before = q._version
        cr.apply_rope(q, positions=positions, inplace=True)
        assert q._version == before + 1  # one write, one bump, as torch's in-place ops do
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_in_place_on_split_views_of_a_graph_tensor_is_refused_before_writing(device):
    base = torch.randn(4, 3 * 8, device=device, requires_grad=True)
    qkv = base * 1.0
    q, k = qkv.view(4, 3, 8).split([2, 1], dim=1)
    before = qkv.detach().clone()
    with pytest.raises(RuntimeError, match="returns several views"):
        cr.apply_rope(q, k, torch.arange(4, device=device), inplace=True)
    assert torch.equal(qkv.detach(), before)
    # slices of the same tensor are fine, and differentiable
    qkv = base * 1.0
    q, k = qkv[:, :16].view(4, 2, 8), qkv[:, 16:].view(4, 1, 8)
    cr.apply_rope(q, k, torch.arange(4, device=device), inplace=True)
    qkv.sum().backward()
    assert base.grad is not None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_inference_tensors_follow_torchs_rule(device):
    with torch.inference_mode():
        q = torch.randn(4, 2, 8, device=device)
        positions = torch.arange(4, device=device)
    before = q.clone()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="inference tensor"):
            cr.apply_rope(q, positions=positions, inplace=True)
        assert torch.equal(q, before)
    with torch.no_grad():
        out = cr.apply_rope(q, positions=positions)  # out of place is fine
    with torch.inference_mode():
        for _ in range(2):
            cr.apply_rope(q, positions=positions, inplace=True)
    assert torch.allclose(q, cr.apply_rope(cr.apply_rope(before, positions=positions),
                                           positions=positions), atol=1e-6)
    assert torch.equal(out, cr.apply_rope(before, positions=positions))


# ----------------------------------------------------------------------------------------------
# Options a call would ignore; helpers that would wrap


def test_schedule_options_given_with_a_table_are_refused(backend):
    rng = np.random.default_rng(1)
    q = backend.put(rng.standard_normal((4, 2, 8)).astype(np.float32))
    positions = backend.positions(np.arange(4))
    cache = backend.put(cr.cos_sin_cache(16, 8))
    cos = backend.put(np.ones((4, 4), np.float32))
    sin = backend.put(np.zeros((4, 4), np.float32))
    for table in ({"cos_sin_cache": cache}, {"cos": cos, "sin": sin}):
        call = dict(table) if "cos" in table else dict(table, positions=positions)
        with pytest.raises(ValueError, match="theta=500000.0 is given with"):
            cr.apply_rope(q, theta=500000.0, rotary_dim=8, **call)
        with pytest.raises(ValueError, match=r"scaling keys \['factor', 'rope_type'\]"):
            cr.apply_rope(q, scaling={"rope_type": "linear", "factor": 2.0}, rotary_dim=8, **call)
        with pytest.raises(ValueError, match="seq_len is given with"):
            cr.apply_rope(q, seq_len=100, rotary_dim=8, **call)
    cr.apply_rope(q, positions=positions, cos_sin_cache=cache, theta=10000.0)  # the default is no schedule
    with pytest.raises(ValueError, match="'default' schedule does not use it"):
        cr.apply_rope(q, positions=positions, seq_len=100)
    cr.apply_rope(q, positions=positions, seq_len=100, scaling={"rope_type": "dynamic", "factor": 2.0,
                                                     "max_position_embeddings": 64})


def test_position_helpers_never_wrap():
    cu = np.array([0, 3, 5], np.int32)
    big = np.array([2**31 - 2, 2**31 + 5], np.int64)
    got = cr.varlen_positions(cu, offsets=big)
    assert got.dtype == np.int64 and (got >= 0).all()
    assert got.tolist() == [2**31 - 2, 2**31 - 1, 2**31, 2**31 + 5, 2**31 + 6]
    got = cr.context_parallel_positions(np.array([0, 8], np.int32), 2, 1, offsets=np.array([2**31 - 3]))
    assert got.dtype == np.int64 and got.min() > 0
    assert cr.varlen_positions(cu).dtype == np.int32  # small values keep cu_seqlens' dtype
    t = cr.varlen_positions(torch.tensor([0, 2], dtype=torch.int32),
                            offsets=torch.tensor([2**31 - 1], dtype=torch.int64))
    assert t.dtype == torch.int64 and t.tolist() == [2**31 - 1, 2**31]


# ----------------------------------------------------------------------------------------------
# Faults: a failing allocation leaves the inputs and the process usable


def test_a_failing_output_allocation_writes_nothing_and_the_next_call_works(backend, monkeypatch):
    from cupyrope.core import arrays

    rng = np.random.default_rng(2)
    host_q = rng.standard_normal((4, 2, 8)).astype(np.float32)
    host_k = rng.standard_normal((4, 1, 8)).astype(np.float32)
    q, k = backend.put(host_q), backend.put(host_k)
    positions = backend.positions(np.arange(4))
    real = arrays.new_output
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # k's output: q's is already allocated
            raise MemoryError("out of memory (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(arrays, "new_output", failing)
    with pytest.raises(MemoryError, match="injected"):
        cr.apply_rope(q, k, positions)
    monkeypatch.setattr(arrays, "new_output", real)
    np.testing.assert_array_equal(backend.get(q), host_q)
    np.testing.assert_array_equal(backend.get(k), host_k)
    q_out, k_out = cr.apply_rope(q, k, positions)
    want_q, want_k = cr.apply_rope(host_q, host_k, np.arange(4))
    np.testing.assert_allclose(backend.get(q_out), want_q, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(backend.get(k_out), want_k, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# CUDA grid limits (the launch geometry alone; tests/test_reliability_gpu.py runs them)


@pytest.mark.parametrize("shape", [(2**31 + 7, 1, 2), (1, 2**31 + 7, 2), (3, 2**30, 2), (2**20, 2**12, 2)])
def test_launch_grid_stays_within_cuda_limits(shape, monkeypatch):
    from cupyrope.cuda import launch
    from cupyrope.core.plan import plan_rope

    monkeypatch.setattr(launch, "_multiprocessors", lambda device: 132)
    q = np.lib.stride_tricks.as_strided(np.zeros(2, np.float32), shape=shape, strides=(0, 0, 4))
    plan = plan_rope(q, positions=np.zeros(shape[0], np.int64))
    for access, pairs in ((1, 1), (4, 4)):
        block, grid = launch.launch_geometry(plan, access, pairs, False, num_regs=48)
        assert grid[0] <= 2**31 - 1 and grid[1] <= 65535
        assert block[0] * block[1] * block[2] <= 256 and block[2] <= 64
