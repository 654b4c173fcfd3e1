"""Training on the GPU: autograd, torch.compile, CUDA graphs, opcheck and JAX transformations.

- ``gradcheck`` / ``gradgradcheck`` in float64 on CUDA tensors for every angle source, both pairings,
  partial rotary and strided layouts (fused QKV views, ``[B, H, S, D]`` storage): in fast mode
  (random projections of the Jacobian), and every entry of it for each layout and pairing;
- gradients in every dtype: the float64 reference's inverse rotation of the upstream gradient within
  the forward's tolerance (docs/contract.md §3), and float64 gradients against autograd of an independent torch
  formulation;
- the backward runs on the forward's stream (a side stream whose inputs are still being written);
- ``torch.library.opcheck`` of both operators on CUDA;
- ``torch.compile(fullgraph=True)`` in the ``"default"`` and ``"reduce-overhead"`` (CUDA graphs) modes:
  forward and backward equal eager over several steps with new data, and Inductor skipped no CUDA
  graph; the in-place op under ``reduce-overhead`` without grad;
- a forward + backward step captured in a ``torch.cuda.CUDAGraph`` and replayed on new data;
- in place under autograd on views of a projection's output;
- the adapters of cupyrope.compat inside CUDA-graph capture (vLLM in place, TransformerEngine thd
  with its on-device positions);
- JAX on GPU: ``jax.jit`` (buffer_callback on XLA's stream, XLA's buffers) equals the eager DLPack
  path bit for bit, inside a jitted computation whose input is produced by XLA just before;
  ``jax.jit(jax.grad)`` is the inverse rotation.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import cupyrope as cr  # noqa: E402
from autograd_cases import SOURCES, angle_call, to_torch, torch_reference_rope  # noqa: E402
from reference import reference_rope  # noqa: E402
from tolerances import as_numpy, assert_bits_equal, assert_rope_close  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


def layout_qk(torch, rng, layout, dtype="float64", T=5, Hq=3, Hk=2, D=16):
    values = lambda shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    if layout == "contiguous":
        leaves = (to_torch(values((T, Hq, D)), DEVICE, True), to_torch(values((T, Hk, D)), DEVICE, True))
        return leaves, (T,), lambda q, k: (q, k)
    if layout == "fused_qkv":
        qkv = to_torch(values((T, Hq + 2 * Hk, D)), DEVICE, True)
        return (qkv,), (T,), lambda qkv: (qkv[:, :Hq], qkv[:, Hq:Hq + Hk])
    q = to_torch(values((2, Hq, T, D)), DEVICE, True)
    k = to_torch(values((2, Hk, T, D)), DEVICE, True)
    return (q, k), (2, T), lambda q, k: (q.transpose(1, 2), k.transpose(1, 2))


# ----------------------------------------------------------------------------------------------------
# gradients


def check_gradients(torch, rng, source, interleaved, rotary_dim, layout, *, fast_mode):
    leaves, token_shape, views = layout_qk(torch, rng, layout)
    lib, _, _, _ = angle_call(source, token_shape, rotary_dim, interleaved=interleaved, rng=rng,
                              device=DEVICE)

    def fn(*inputs):
        q, k = views(*inputs)
        return cr.apply_rope(q, k, interleaved=interleaved, **lib)

    assert torch.autograd.gradcheck(fn, leaves, fast_mode=fast_mode)
    assert torch.autograd.gradgradcheck(fn, leaves, fast_mode=fast_mode)


# gradcheck's fast mode compares the analytic and the numerical Jacobian projected on random
# vectors (one directional derivative instead of one per input element): a wrong entry anywhere
# moves the projection, and the whole matrix of sources, pairings, widths and layouts costs what
# one full check does (each of those takes ~10 s on CUDA tensors, one forward per element).
@pytest.mark.parametrize("layout", ["contiguous", "fused_qkv", "bhsd"])
@pytest.mark.parametrize("rotary_dim", [16, 10])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("source", SOURCES)
def test_gradcheck_float64(torch, source, interleaved, rotary_dim, layout, rng):
    check_gradients(torch, rng, source, interleaved, rotary_dim, layout, fast_mode=True)


# Every entry of the Jacobian (gradcheck's default mode), for each layout and pairing, with
# pass-through dims beside the rotated ones.
@pytest.mark.parametrize("layout", ["contiguous", "fused_qkv", "bhsd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_gradcheck_float64_every_jacobian_entry(torch, interleaved, layout, rng):
    check_gradients(torch, rng, "cache", interleaved, 10, layout, fast_mode=False)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("rotary_dim", [128, 64])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("source", SOURCES)
def test_gradients_every_dtype(torch, dtype, rotary_dim, interleaved, source, rng):
    T, Hq, Hk, D = 67, 8, 2, 128  # odd T, GQA; 16-byte path and pass-through dims
    table_dtype = "float64" if dtype == "float64" else "float32"
    lib, ref, check, (cos, sin) = angle_call(source, (T,), rotary_dim, interleaved=interleaved,
                                             rng=rng, device=DEVICE, table_dtype=table_dtype)
    xq, xk = rng.standard_normal((T, Hq, D)), rng.standard_normal((T, Hk, D))
    gq, gk = rng.standard_normal((T, Hq, D)), rng.standard_normal((T, Hk, D))
    q = to_torch(xq, DEVICE).to(getattr(torch, dtype)).requires_grad_(True)
    k = to_torch(xk, DEVICE).to(getattr(torch, dtype)).requires_grad_(True)
    g_q, g_k = (to_torch(g, DEVICE).to(getattr(torch, dtype)) for g in (gq, gk))
    q_out, k_out = cr.apply_rope(q, k, interleaved=interleaved, **lib)
    grad_q, grad_k = torch.autograd.grad((q_out, k_out), (q, k), (g_q, g_k))
    for grad, g in ((grad_q, g_q), (grad_k, g_k)):
        assert grad.dtype == g.dtype and grad.device == g.device
        g_host = as_numpy(g)
        expected = reference_rope(g_host, interleaved=interleaved, inverse=True, **ref)
        assert_rope_close(as_numpy(grad), expected, g_host, interleaved=interleaved,
                          rotary_dim=rotary_dim, **check)
    if dtype == "float64":  # and against autograd of the float64 torch formulation
        c = torch.from_numpy(cos).to(DEVICE)
        s = torch.from_numpy(sin).to(DEVICE)
        q_ref, k_ref = (x.detach().clone().requires_grad_(True) for x in (q, k))
        outs = [torch_reference_rope(x, c, s, rotary_dim, interleaved) for x in (q_ref, k_ref)]
        expected = torch.autograd.grad(outs, (q_ref, k_ref), (g_q, g_k))
        for got, want in zip((grad_q, grad_k), expected):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_backward_on_the_forward_stream(torch, rng):
    """Inputs written on a side stream (behind a long sleep): forward and backward must run on it."""
    T, H, D = 4096, 8, 128
    positions = torch.arange(T, device=DEVICE)
    x, g = rng.standard_normal((T, H, D)).astype(np.float32), rng.standard_normal((T, H, D)).astype(np.float32)
    x_dev, g_dev = to_torch(x, DEVICE), to_torch(g, DEVICE)
    q = torch.zeros((T, H, D), device=DEVICE, requires_grad=True)
    grad_out = torch.zeros((T, H, D), device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        with torch.no_grad():
            q.copy_(x_dev)
            grad_out.copy_(g_dev)
        out = cr.apply_rope(q, positions=positions)
        (grad,) = torch.autograd.grad(out, q, grad_out)
    torch.cuda.synchronize()
    ref = dict(positions=np.arange(T), theta=10000.0)
    assert_rope_close(as_numpy(out), reference_rope(x, **ref), x, interleaved=False, rotary_dim=D,
                      max_angle=float(T))
    assert_rope_close(as_numpy(grad), reference_rope(g, inverse=True, **ref), g, interleaved=False,
                      rotary_dim=D, max_angle=float(T))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_inplace_autograd_on_projection_views(torch, dtype, rng):
    T, Hq, Hk, D = 33, 4, 2, 64
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, (Hq + 2 * Hk) * D, device=DEVICE, dtype=getattr(torch, dtype))
    x = torch.randn(T, 32, device=DEVICE, dtype=getattr(torch, dtype))
    positions = torch.from_numpy(rng.integers(0, 4096, T)).to(DEVICE)
    cache = cr.cos_sin_cache(4096, D, like=x)
    weights = torch.randn(T, Hq + 2 * Hk, D, device=DEVICE, dtype=getattr(torch, dtype))

    def loss(inplace):
        qkv = linear(x).view(T, Hq + 2 * Hk, D)
        q, k = qkv[:, :Hq], qkv[:, Hq:Hq + Hk]
        if inplace:
            cr.apply_rope(q, k, positions, cos_sin_cache=cache, inplace=True)
            out = qkv
        else:
            q, k = cr.apply_rope(q, k, positions, cos_sin_cache=cache)
            out = torch.cat([q, k, qkv[:, Hq + Hk:]], dim=1)
        return (out.float() * weights.float()).sum()

    grads = []
    for inplace in (False, True):
        linear.zero_grad()
        loss(inplace).backward()
        grads.append(linear.weight.grad.clone())
    assert_bits_equal(grads[1], grads[0], what="in-place vs out-of-place weight gradient")


# ----------------------------------------------------------------------------------------------------
# opcheck


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("source", ["cache", "tables_full", "computed_linear"])
def test_opcheck_cuda(torch, dtype, source, rng):
    from cupyrope.core.scaling import scaling_op_args

    T, D = 9, 64
    lib, _, _, _ = angle_call(source, (T,), D, interleaved=False, rng=rng, device=DEVICE,
                              table_dtype="float32")
    torch_dtype = getattr(torch, dtype)
    q = torch.randn(T, 4, D, device=DEVICE, dtype=torch_dtype)
    k = torch.randn(T, 2, D, device=DEVICE, dtype=torch_dtype)
    rest = (lib.get("positions"), lib.get("cos_sin_cache"), lib.get("cos"), lib.get("sin"), 10000.0,
            *scaling_op_args(lib.get("scaling")), False, lib.get("rotary_dim"), False, None, False)
    op, op_ = torch.ops.cupyrope.apply_rope.default, torch.ops.cupyrope.apply_rope_.default
    torch.library.opcheck(op, (q, k) + rest)
    torch.library.opcheck(op, (q.clone().requires_grad_(dtype != "bfloat16"), None) + rest)
    torch.library.opcheck(op_, (q.clone(), k.clone()) + rest)


# ----------------------------------------------------------------------------------------------------
# torch.compile and CUDA graphs


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("source", ["cache", "tables_half", "computed"])
def test_compile_fullgraph_modes(torch, mode, source, rng):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    T, Hq, Hk, D = 128, 8, 2, 128
    lib, _, _, _ = angle_call(source, (T,), D, interleaved=False, rng=rng, device=DEVICE,
                              table_dtype="float32")

    def step(q, k, gq, gk):
        q_out, k_out = cr.apply_rope(q, k, **lib)
        return (q_out.float() * gq).sum() + (k_out.float() * gk).sum()

    compiled = torch.compile(step, fullgraph=True, mode=mode)
    for _ in range(4):  # warm-up, recording, then replays of the CUDA graphs
        q = torch.randn(T, Hq, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(T, Hk, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        gq, gk = torch.randn(T, Hq, D, device=DEVICE), torch.randn(T, Hk, D, device=DEVICE)
        loss = compiled(q, k, gq, gk)
        grads = [g.clone() for g in torch.autograd.grad(loss, (q, k))]
        q_e, k_e = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
        loss_e = step(q_e, k_e, gq, gk)
        grads_e = torch.autograd.grad(loss_e, (q_e, k_e))
        torch.testing.assert_close(loss.detach(), loss_e.detach(), rtol=1e-5, atol=1e-3)
        for a, b in zip(grads, grads_e):
            assert_bits_equal(a, b, what=f"compiled ({mode}) vs eager gradient")
    if mode == "reduce-overhead":
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def test_compile_reduce_overhead_inplace_inference(torch, rng):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    T, D = 64, 128
    positions = torch.from_numpy(rng.integers(0, 4096, T)).to(DEVICE)
    cache = cr.cos_sin_cache(4096, D, like=positions.float())

    def rotate(x):
        # In place on an intermediate (Inductor re-inplaces the functionalised op). An in-place
        # call on a graph *input* works too, but Inductor skips CUDA graphs for any graph that
        # mutates its inputs (its rule for every mutating op), so that is not asserted here.
        qkv = x * 2
        q, k = qkv[:, :4], qkv[:, 4:6]
        cr.apply_rope(q, k, positions, cos_sin_cache=cache, inplace=True)
        return qkv

    compiled = torch.compile(rotate, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(4):
            qkv = torch.randn(T, 8, D, device=DEVICE, dtype=torch.bfloat16)
            expected = rotate(qkv)
            assert_bits_equal(compiled(qkv).clone(), expected, what="compiled in place")
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def test_cuda_graph_capture_forward_backward(torch, rng):
    T, Hq, Hk, D = 256, 8, 2, 128
    cache = cr.cos_sin_cache(8192, D, like=torch.empty(0, device=DEVICE))
    q = torch.zeros(T, Hq, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k = torch.zeros(T, Hk, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    gq = torch.zeros(T, Hq, D, device=DEVICE, dtype=torch.bfloat16)
    gk = torch.zeros(T, Hk, D, device=DEVICE, dtype=torch.bfloat16)
    positions = torch.zeros(T, device=DEVICE, dtype=torch.int64)

    def step():
        q_out, k_out = cr.apply_rope(q, k, positions, cos_sin_cache=cache)
        return (q_out, k_out) + torch.autograd.grad((q_out, k_out), (q, k), (gq, gk))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(2):
        data = {name: rng.standard_normal(t.shape).astype(np.float32)
                for name, t in (("q", q), ("k", k), ("gq", gq), ("gk", gk))}
        new_positions = rng.integers(0, 8192, T)
        with torch.no_grad():
            for name, t in (("q", q), ("k", k), ("gq", gq), ("gk", gk)):
                t.copy_(torch.from_numpy(data[name]))
            positions.copy_(torch.from_numpy(new_positions))
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = dict(positions=new_positions, cos_sin_cache=as_numpy(cache).astype(np.float64))
        inputs = [as_numpy(t.detach()) for t in (q, k, gq, gk)]
        expected = [reference_rope(inputs[0], **ref), reference_rope(inputs[1], **ref),
                    reference_rope(inputs[2], inverse=True, **ref),
                    reference_rope(inputs[3], inverse=True, **ref)]
        for out, exp, x in zip(outs, expected, (inputs[0], inputs[1], inputs[2], inputs[3])):
            assert_rope_close(as_numpy(out), exp, x, interleaved=False, rotary_dim=D)


# ----------------------------------------------------------------------------------------------------
# adapters inside CUDA graphs


def test_compat_adapters_capture(torch, rng):
    from cupyrope import compat

    T, Hq, Hk, D = 48, 4, 2, 64
    cache = cr.cos_sin_cache(1024, D, like=torch.empty(0, device=DEVICE)).to(torch.bfloat16)
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, device=DEVICE, dtype=torch.bfloat16)
    positions = torch.from_numpy(rng.integers(0, 1024, T)).to(DEVICE)
    t = torch.randn(T, Hq, D, device=DEVICE, dtype=torch.bfloat16)
    cu_seqlens = torch.tensor([0, 16, 40, 48], device=DEVICE, dtype=torch.int32)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=DEVICE).float() / D))
    freqs = torch.outer(torch.arange(64, device=DEVICE).float(), inv_freq)
    freqs = torch.cat([freqs, freqs], -1)[:, None, None, :]

    def step():
        q, k = qkv[:, :Hq * D], qkv[:, Hq * D:(Hq + Hk) * D]
        compat.rotary_embedding(positions, q, k, D, cache, True)
        return compat.te_apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=cu_seqlens)

    qkv0 = qkv.clone()
    eager_te = step()  # compiles; rotates qkv once
    eager_qkv = qkv.clone()
    qkv.copy_(qkv0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    qkv.copy_(qkv0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        te_out = step()
    qkv.copy_(qkv0)
    graph.replay()
    torch.cuda.synchronize()
    assert_bits_equal(qkv, eager_qkv, what="vLLM adapter replayed")
    assert_bits_equal(te_out, eager_te, what="TransformerEngine adapter replayed")
    host = compat.te_apply_rotary_pos_emb(t.cpu(), freqs.cpu(), "thd", cu_seqlens=cu_seqlens.cpu())
    assert_rope_close(as_numpy(te_out), as_numpy(host).astype(np.float64), as_numpy(t),
                      interleaved=False, rotary_dim=D)


# ----------------------------------------------------------------------------------------------------
# JAX on GPU


@pytest.fixture(scope="module")
def jax_gpu():
    jax = pytest.importorskip("jax")
    pytest.importorskip("jax.experimental.buffer_callback")
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        pytest.skip("JAX has no GPU backend")
    return jax, devices[0]


@pytest.mark.parametrize("source", ["cache", "tables_full", "computed"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_jax_jit_on_gpu_matches_eager(jax_gpu, source, dtype, rng):
    jax, device = jax_gpu
    T, Hq, Hk, D = 257, 8, 2, 128
    lib_np, _, _, _ = angle_call(source, (T,), D, interleaved=False, rng=rng, table_dtype="float32")
    lib = {name: (jax.device_put(value.numpy(), device) if hasattr(value, "numpy") else value)
           for name, value in lib_np.items()}
    arrays = {name: v for name, v in lib.items() if hasattr(v, "shape")}
    options = {name: v for name, v in lib.items() if name not in arrays}
    q = jax.device_put(rng.standard_normal((T, Hq, D)).astype(np.float32), device).astype(dtype)
    k = jax.device_put(rng.standard_normal((T, Hk, D)).astype(np.float32), device).astype(dtype)
    eager = cr.apply_rope(q * 2, k, **lib)  # concrete arrays: DLPack path

    @jax.jit
    def fused(q, k, arrays):  # q * 2 is produced by XLA right before the callback reads it
        q_out, k_out = cr.apply_rope(q * 2, k, **arrays, **options)
        return q_out, k_out

    for _ in range(3):
        got = fused(q, k, arrays)
        for a, b in zip(got, eager):
            assert next(iter(a.devices())) == device
            assert_bits_equal(np.asarray(a), np.asarray(b), what=f"jit vs eager ({source})")


def test_jax_jit_grad_on_gpu(jax_gpu, rng):
    jax, device = jax_gpu
    jnp = jax.numpy
    T, H, D = 300, 4, 64
    positions = rng.integers(0, 100000, T).astype(np.int32)
    x = jax.device_put(rng.standard_normal((T, H, D)).astype(np.float32), device)
    w = rng.standard_normal((T, H, D)).astype(np.float32)
    pos = jax.device_put(positions, device)
    w_dev = jax.device_put(w, device)
    grad = jax.jit(jax.grad(lambda x, p: jnp.sum(cr.apply_rope(x, positions=p, interleaved=True) * w_dev)))
    got = np.asarray(grad(x, pos))
    expected = reference_rope(w, positions, interleaved=True, inverse=True)
    assert_rope_close(got, expected, w, interleaved=True, rotary_dim=D, max_angle=100000.0)
