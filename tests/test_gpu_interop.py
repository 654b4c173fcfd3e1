"""GPU interop: torch CUDA tensors, JAX GPU arrays and a bare DLPack producer, against the reference.

- torch: every dtype (bfloat16 included) comes back as a torch tensor on the same device with the same
  dtype; in place returns the same tensors; strided views (fused QKV, transposed storage) are honoured;
  the kernel runs on torch's *current* stream (a side stream whose inputs are still being written when
  apply_rope is called); apply_rope can be captured in a CUDA graph, out of place and in place, and a
  replay after new data was copied into the inputs gives the rotation of the new data; tensors that
  require grad (with grad enabled) go through the differentiable custom op (gradients:
  tests/test_gpu_autograd.py).
- JAX: results are jax.Arrays of the same dtype on the same device; inplace=True raises TypeError.
- A producer exposing only ``__dlpack__`` / ``__dlpack_device__``: results are CuPy arrays.

Out-of-place torch outputs come from torch's caching allocator: ``poison_torch_allocator`` frees
NaN-filled blocks of exactly the outputs' sizes right before the call, so that unwritten elements show
as NaN (``assert_rope_close`` requires finite values wherever the reference is finite).
"""

from __future__ import annotations

import os

# JAX grabs 75% of GPU memory when its GPU backend starts unless told otherwise; the torch and CuPy
# tests of the same process need theirs. (Must be set before the backend starts, i.e. before any
# JAX array exists; test collection imports this module before any test runs.)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import cupyrope as cr  # noqa: E402
from reference import reference_cos_sin_cache, reference_inv_freq, reference_rope  # noqa: E402
from tolerances import (  # noqa: E402
    as_numpy,
    assert_bits_equal,
    assert_rope_close,
    max_abs_angle,
    np_dtype,
)

pytestmark = pytest.mark.gpu

T, HQ, HK, D = 53, 4, 2, 128
MAX_POSITION = 4096
TORCH_DEVICE = "cuda"  # torch's current CUDA device
JAX_PLATFORM = "gpu"


def random_host(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """N(0, 1) rounded to ``dtype``, with no exact zeros (as conftest's ``randn``)."""
    values = rng.standard_normal(shape)
    values = np.where(np.abs(values) < 1e-3, np.copysign(0.5, values), values)
    return values.astype(np_dtype(dtype))


def host_copy(a) -> np.ndarray:
    """A contiguous NumPy copy of any array (bfloat16 as ml_dtypes.bfloat16)."""
    return np.array(as_numpy(a), copy=True, order="C")


def ref_kwargs_cache(positions_host, cache_host):
    return dict(positions=positions_host, cos_sin_cache=np.asarray(cache_host, dtype=np.float64))


# --------------------------------------------------------------------------------------------------
# torch


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


def to_torch(torch, host: np.ndarray, device=None):
    host = np.ascontiguousarray(host)
    device = TORCH_DEVICE if device is None else device
    if host.dtype == np_dtype("bfloat16"):
        return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16).to(device, copy=True)
    return torch.from_numpy(host).to(device, copy=True)  # never shares memory with host


def poison_torch_allocator(torch, *nbytes) -> None:
    """Leave freed, NaN-filled (0xFF bytes) blocks of exactly these sizes in torch's caching
    allocator (current stream), which its next allocations of those sizes reuse."""
    blocks = [torch.empty(int(n), dtype=torch.uint8, device=TORCH_DEVICE).fill_(255) for n in nbytes if n]
    del blocks


def nbytes(t) -> int:
    return t.numel() * t.element_size()


def check_torch_outputs(torch, outs, inputs, *, inplace):
    for out, inp in zip(outs, inputs):
        assert isinstance(out, torch.Tensor), f"got {type(out)}, not a torch tensor"
        if inplace:
            assert out is inp
        else:
            assert out.data_ptr() != inp.data_ptr()
            assert out.is_contiguous()
        assert out.device == inp.device and out.dtype == inp.dtype and out.shape == inp.shape


def torch_rope_and_check(torch, q, k, hosts, call, ref, *, inplace=False, max_angle=0.0):
    """apply_rope on torch tensors q, k (host copies ``hosts`` taken before the call); checks the
    outputs' type and placement, then every rotated value against the float64 reference. Out of
    place, the allocator is poisoned first, so that an output element never written shows."""
    if not inplace:
        poison_torch_allocator(torch, nbytes(q), nbytes(k))
    outs = cr.apply_rope(q, k, **call, inplace=inplace)
    check_torch_outputs(torch, outs, (q, k), inplace=inplace)
    for out, x in zip(outs, hosts):
        assert_rope_close(out, reference_rope(x, **ref), x, interleaved=False, rotary_dim=D,
                          max_angle=max_angle)
    return outs


def torch_angles(torch, source, positions_host, *, rotary_dim=D, interleaved=False,
                 token_shape=(T,)):
    """(apply_rope kwargs with torch tensors, reference kwargs, max_angle)."""
    if source == "cache":
        like = torch.empty(1, device=TORCH_DEVICE)
        cache = cr.cos_sin_cache(MAX_POSITION, rotary_dim, like=like)
        assert isinstance(cache, torch.Tensor) and cache.device == like.device
        assert cache.dtype == torch.float32 and tuple(cache.shape) == (MAX_POSITION, rotary_dim)
        return (dict(positions=to_torch(torch, positions_host), cos_sin_cache=cache),
                ref_kwargs_cache(positions_host, host_copy(cache)), 0.0)
    if source == "computed":
        inv_freq = reference_inv_freq(rotary_dim, 500000.0)
        return (dict(positions=to_torch(torch, positions_host), theta=500000.0),
                dict(positions=positions_host, theta=500000.0),
                max_abs_angle(positions_host, inv_freq))
    if source == "tables":  # Hugging Face full-width float32 tables
        rows = reference_cos_sin_cache(0, rotary_dim, positions=np.broadcast_to(positions_host,
                                                                                token_shape))
        half = rotary_dim // 2
        cos, sin = rows[..., :half], rows[..., half:]
        if interleaved:
            cos, sin = np.repeat(cos, 2, -1), np.repeat(sin, 2, -1)
        else:
            cos, sin = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)
        cos, sin = cos.astype(np.float32), sin.astype(np.float32)
        return (dict(cos=to_torch(torch, cos), sin=to_torch(torch, sin)),
                dict(cos=cos.astype(np.float64), sin=sin.astype(np.float64)), 0.0)
    raise ValueError(source)


@pytest.mark.parametrize("source", ["cache", "computed", "tables"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_torch_dtypes_and_sources(torch, rng, dtype, source):
    xq, xk = random_host(rng, (T, HQ, D), dtype), random_host(rng, (T, HK, D), dtype)
    q, k = to_torch(torch, xq), to_torch(torch, xk)
    positions = rng.integers(0, MAX_POSITION, T).astype("int64" if dtype != "float16" else "int32")
    call, ref, max_angle = torch_angles(torch, source, positions)
    torch_rope_and_check(torch, q, k, (xq, xk), call, ref, max_angle=max_angle)
    for inp, x in zip((q, k), (xq, xk)):
        assert_bits_equal(inp, x, what="input of an out-of-place call")


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_torch_inplace(torch, rng, dtype, interleaved):
    xq, xk = random_host(rng, (T, HQ, D), dtype), random_host(rng, (T, HK, D), dtype)
    q, k = to_torch(torch, xq), to_torch(torch, xk)
    positions = rng.integers(0, MAX_POSITION, T)
    call, ref, _ = torch_angles(torch, "cache", positions)
    outs = cr.apply_rope(q, k, **call, interleaved=interleaved, inplace=True)
    check_torch_outputs(torch, outs, (q, k), inplace=True)
    for out, x in zip(outs, (xq, xk)):
        assert_rope_close(out, reference_rope(x, **ref, interleaved=interleaved), x,
                          interleaved=interleaved, rotary_dim=D)


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
def test_torch_fused_qkv_views(torch, rng, inplace):
    hq, hk = 8, 2
    before = random_host(rng, (T, (hq + 2 * hk) * D), "bfloat16")
    qkv = to_torch(torch, before)
    q = qkv[:, : hq * D].view(T, hq, D)
    k = qkv[:, hq * D : (hq + hk) * D].view(T, hk, D)
    assert q.data_ptr() == qkv.data_ptr() and not q.is_contiguous()
    xq, xk = host_copy(q), host_copy(k)
    positions = rng.integers(0, MAX_POSITION, T)
    call, ref, _ = torch_angles(torch, "cache", positions)
    torch_rope_and_check(torch, q, k, (xq, xk), call, ref, inplace=inplace)
    after = host_copy(qkv)
    assert_bits_equal(after[:, (hq + hk) * D :], before[:, (hq + hk) * D :], what="v part of qkv")
    if not inplace:
        assert_bits_equal(after, before, what="qkv after an out-of-place call")


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
def test_torch_transposed_storage(torch, rng, inplace):
    """[B, H, S, D] storage viewed as [B, S, H, D], positions [B, S]."""
    b, s = 2, 33
    q = to_torch(torch, random_host(rng, (b, HQ, s, D), "float16")).transpose(1, 2)
    k = to_torch(torch, random_host(rng, (b, HK, s, D), "float16")).transpose(1, 2)
    xq, xk = host_copy(q), host_copy(k)
    positions = rng.integers(0, MAX_POSITION, (b, s))
    call, ref, _ = torch_angles(torch, "cache", positions)
    torch_rope_and_check(torch, q, k, (xq, xk), call, ref, inplace=inplace)


def test_torch_runs_on_current_stream(torch, rng):
    """On a side stream, the inputs are written only after ~0.1 s of GPU work; apply_rope is called
    right away. Only a kernel on that same (current) stream sees the data instead of the NaN poison."""
    xq, xk = random_host(rng, (T, HQ, D), "bfloat16"), random_host(rng, (T, HK, D), "bfloat16")
    q_src, k_src = to_torch(torch, xq), to_torch(torch, xk)
    positions = rng.integers(0, MAX_POSITION, T)
    call, ref, _ = torch_angles(torch, "cache", positions)
    torch.cuda.synchronize()

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert torch.cuda.current_stream() == side
        q = torch.full_like(q_src, float("nan"))
        k = torch.full_like(k_src, float("nan"))
        poison_torch_allocator(torch, nbytes(q), nbytes(k))  # before the spin: may cudaMalloc
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(200_000_000)  # GPU spin on this stream, ~0.1 s
        else:  # pragma: no cover - every CUDA build of torch has _sleep
            a = torch.randn(4096, 4096, device=TORCH_DEVICE)
            for _ in range(20):
                a = a @ a / 64
        q.copy_(q_src)
        k.copy_(k_src)
        q_out, k_out = cr.apply_rope(q, k, **call)
        q_in, k_in = cr.apply_rope(q, k, **call, inplace=True)  # ordered after the first call
    side.synchronize()
    refs = [reference_rope(x, **ref) for x in (xq, xk)]
    for out, x, r in zip((q_out, k_out, q_in, k_in), (xq, xk, xq, xk), refs + refs):
        assert_rope_close(out, r, x, interleaved=False, rotary_dim=D)


@pytest.mark.parametrize("source", ["cache", "computed"])
def test_torch_cuda_graph_capture_and_replay(torch, rng, source):
    """Capture apply_rope (out of place and in place) in CUDA graphs, copy new data into the input
    tensors (and new positions), replay: the outputs are the rotation of the NEW data."""
    dtype = "bfloat16"
    shape_q, shape_k = (T, HQ, D), (T, HK, D)
    q = to_torch(torch, random_host(rng, shape_q, dtype))
    k = to_torch(torch, random_host(rng, shape_k, dtype))
    q2, k2 = q.clone(), k.clone()  # in-place graph's own tensors
    positions_host = rng.integers(0, MAX_POSITION, T)
    call, _, _ = torch_angles(torch, source, positions_host)
    positions = call["positions"]

    # Warm up (compile, upload constants) on a side stream, as PyTorch's capture recipe asks.
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        cr.apply_rope(q, k, **call)
        cr.apply_rope(q2, k2, **call, inplace=True)
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()

    graph, graph_inplace = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out, k_out = cr.apply_rope(q, k, **call)
    with torch.cuda.graph(graph_inplace):
        q2_ret, k2_ret = cr.apply_rope(q2, k2, **call, inplace=True)
    assert q2_ret is q2 and k2_ret is k2

    # New contents for every input the graphs read.
    new_q, new_k = random_host(rng, shape_q, dtype), random_host(rng, shape_k, dtype)
    new_positions = rng.integers(0, MAX_POSITION, T)
    for dst, src in ((q, new_q), (k, new_k), (q2, new_q), (k2, new_k)):
        dst.copy_(to_torch(torch, src))
    positions.copy_(to_torch(torch, new_positions))
    q_out.fill_(float("nan"))  # the graph's outputs keep their memory: poison it before replay
    k_out.fill_(float("nan"))

    graph.replay()
    graph_inplace.replay()
    torch.cuda.synchronize()

    _, ref, max_angle = torch_angles(torch, source, new_positions)
    if source == "cache":  # the cache tensor itself is unchanged; only the positions moved
        ref = dict(ref, cos_sin_cache=host_copy(call["cos_sin_cache"]).astype(np.float64))
    for out, x in ((q_out, new_q), (k_out, new_k), (q2, new_q), (k2, new_k)):
        assert_rope_close(out, reference_rope(x, **ref), x, interleaved=False, rotary_dim=D,
                          max_angle=max_angle)


def test_torch_requires_grad_uses_custom_op(torch, rng):
    xq = random_host(rng, (T, HQ, D), "float32")
    positions = rng.integers(0, MAX_POSITION, T)
    call, ref, max_angle = torch_angles(torch, "computed", positions)
    q = to_torch(torch, xq).requires_grad_(True)
    k = to_torch(torch, random_host(rng, (T, HK, D), "float32"))
    with torch.enable_grad():
        out = cr.apply_rope(q, **call)
        assert "cupyrope" in type(out.grad_fn).__name__
        _, k_out = cr.apply_rope(k, q[:, :HK], **call)  # k requiring grad takes the op too
        assert k_out.grad_fn is not None
    assert_rope_close(out.detach(), reference_rope(xq, **ref), xq, interleaved=False,
                      rotary_dim=D, max_angle=max_angle)
    with torch.no_grad():  # no history: the plain path
        out = cr.apply_rope(q, **call)
    assert isinstance(out, torch.Tensor) and out.dtype == q.dtype and out.device == q.device
    assert out.grad_fn is None
    assert_rope_close(out, reference_rope(xq, **ref), xq, interleaved=False, rotary_dim=D,
                      max_angle=max_angle)


# --------------------------------------------------------------------------------------------------
# JAX


@pytest.fixture(scope="module")
def jax_gpu():
    jax = pytest.importorskip("jax")
    try:
        devices = jax.devices(JAX_PLATFORM)
    except Exception as exc:  # RuntimeError: no GPU backend in this jaxlib
        pytest.skip(f"JAX has no GPU backend ({type(exc).__name__}: {exc})")
    if not devices:
        pytest.skip("JAX sees no GPU")
    return jax, devices[0]


@pytest.mark.parametrize("source", ["cache", "computed"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_jax_arrays(jax_gpu, rng, dtype, source):
    jax, device = jax_gpu
    xq, xk = random_host(rng, (T, HQ, D), dtype), random_host(rng, (T, HK, D), dtype)
    q, k = jax.device_put(xq, device), jax.device_put(xk, device)
    positions_host = rng.integers(0, MAX_POSITION, T).astype(np.int32)  # int64 needs jax x64
    positions = jax.device_put(positions_host, device)
    if source == "cache":
        cache = cr.cos_sin_cache(MAX_POSITION, D, like=q)
        assert isinstance(cache, jax.Array) and cache.devices() == {device}
        call = dict(positions=positions, cos_sin_cache=cache)
        ref = ref_kwargs_cache(positions_host, np.asarray(cache))
        max_angle = 0.0
    else:
        call = dict(positions=positions, theta=10000.0)
        ref = dict(positions=positions_host, theta=10000.0)
        max_angle = max_abs_angle(positions_host, reference_inv_freq(D))
    outs = cr.apply_rope(q, k, **call)
    for out, x, inp in zip(outs, (xq, xk), (q, k)):
        assert isinstance(out, jax.Array), f"got {type(out)}, not a jax.Array"
        assert out.dtype == inp.dtype and out.shape == inp.shape
        assert out.devices() == {device}
        assert_rope_close(np.asarray(out), reference_rope(x, **ref), x, interleaved=False,
                          rotary_dim=D, max_angle=max_angle)
        assert_bits_equal(np.asarray(inp), x, what="JAX input after the call")


# --------------------------------------------------------------------------------------------------
# A generic DLPack producer


class DLPackOnly:
    """Exposes nothing but the DLPack protocol of the array it wraps."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, *args, **kwargs):
        return self._array.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


@pytest.fixture(scope="module")
def cupy():
    return pytest.importorskip("cupy")


def cupy_from_host(cupy, host):
    host = np.ascontiguousarray(host)
    bits = np.dtype(f"u{host.dtype.itemsize}")
    return cupy.asarray(host.view(bits)).view(host.dtype)


def cupy_to_host(array) -> np.ndarray:
    bits = np.dtype(f"u{array.dtype.itemsize}")
    return array.view(bits).get().view(array.dtype)


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_generic_dlpack_producer(cupy, rng, dtype, inplace):
    xq, xk = random_host(rng, (T, HQ, D), dtype), random_host(rng, (T, HK, D), dtype)
    q_dev, k_dev = cupy_from_host(cupy, xq), cupy_from_host(cupy, xk)
    positions_host = rng.integers(0, MAX_POSITION, T)
    cache_host = cr.cos_sin_cache(MAX_POSITION, D)
    q, k = DLPackOnly(q_dev), DLPackOnly(k_dev)
    positions = DLPackOnly(cupy.asarray(positions_host))
    cache = DLPackOnly(cupy.asarray(cache_host))
    outs = cr.apply_rope(q, k, positions, cos_sin_cache=cache, inplace=inplace)
    ref = ref_kwargs_cache(positions_host, cache_host)
    for out, x, inp, dev in zip(outs, (xq, xk), (q, k), (q_dev, k_dev)):
        if inplace:
            assert out is inp  # in place hands back the caller's own objects
            result = dev
        else:
            assert isinstance(out, cupy.ndarray), f"got {type(out)}, not a CuPy array"
            assert out.dtype == dev.dtype and out.shape == dev.shape
            assert_bits_equal(cupy_to_host(dev), x, what="producer's array after an out-of-place call")
            result = out
        assert_rope_close(cupy_to_host(result), reference_rope(x, **ref), x, interleaved=False,
                          rotary_dim=D)
