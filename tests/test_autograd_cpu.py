"""Autograd and torch.compile through apply_rope for torch CPU tensors (cupyrope.frontends.torch.ops).

The custom ops run the NumPy path on CPU tensors, float64 for float64 inputs, so the gradients are
checked here without a GPU:

- ``torch.autograd.gradcheck`` / ``gradgradcheck`` in float64 for every angle source, both pairings,
  partial rotary, k or no k, GQA and strided views (fused QKV, transposed ``[B, H, S, D]`` storage);
- gradients against autograd of an independent float64 torch formulation (tests/autograd_cases.py),
  and, for every dtype, against the float64 reference's inverse rotation of the upstream gradient
  through the shared tolerance table;
- in place under autograd: q and k views of a projection's output give the out-of-place gradients;
  leaves (and views of leaves) that require grad are refused before anything is written;
- ``torch.library.opcheck`` of both operators; ``torch.compile(fullgraph=True)`` with the
  ``aot_eager`` backend and with Inductor (static and dynamic shapes), forward and backward equal to
  eager; errors keep their types through the operator route.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupyrope as cr  # noqa: E402
from autograd_cases import (  # noqa: E402
    SOURCES,
    THETA,
    angle_call,
    to_torch,
    torch_reference_rope,
)
from reference import reference_rope  # noqa: E402
from tolerances import as_numpy, assert_bits_equal, assert_rope_close  # noqa: E402

DTYPES = ["float64", "float32", "bfloat16", "float16"]


def make_qk(randn, layout, dtype="float64", *, T=3, Hq=2, Hk=1, D=8):
    """(leaves to differentiate, fn(leaves) -> (q, k) views in ``layout``)."""
    if layout == "contiguous":
        q, k = to_torch(randn((T, Hq, D), dtype), requires_grad=True), \
            to_torch(randn((T, Hk, D), dtype), requires_grad=True)
        return (q, k), lambda q, k: (q, k)
    if layout == "fused_qkv":  # q, k, v heads of one [T, Hq + 2 Hk, D] projection
        qkv = to_torch(randn((T, Hq + 2 * Hk, D), dtype), requires_grad=True)
        return (qkv,), lambda qkv: (qkv[:, :Hq], qkv[:, Hq:Hq + Hk])
    assert layout == "bhsd"  # [B, H, S, D] storage seen as [B, S, H, D]
    q = to_torch(randn((1, Hq, T, D), dtype), requires_grad=True)
    k = to_torch(randn((1, Hk, T, D), dtype), requires_grad=True)
    return (q, k), lambda q, k: (q.transpose(1, 2), k.transpose(1, 2))


def token_shape_of(layout, T=3):
    return (1, T) if layout == "bhsd" else (T,)


# ----------------------------------------------------------------------------------------------------
# gradcheck in float64


@pytest.mark.parametrize("layout", ["contiguous", "fused_qkv", "bhsd"])
@pytest.mark.parametrize("rotary", ["full", "partial"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("source", SOURCES)
def test_gradcheck(source, interleaved, rotary, layout, randn, rng):
    D = 8
    r = D if rotary == "full" else 4
    leaves, views = make_qk(randn, layout, D=D)
    lib, _, _, _ = angle_call(source, token_shape_of(layout), r, interleaved=interleaved, rng=rng)

    def fn(*inputs):
        q, k = views(*inputs)
        return cr.apply_rope(q, k, interleaved=interleaved, **lib)

    assert torch.autograd.gradcheck(fn, leaves)
    assert torch.autograd.gradgradcheck(fn, leaves)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("which", ["q_only", "k_only", "no_k"])
def test_gradcheck_one_side(source, which, randn, rng):
    T, D = 4, 6
    q = to_torch(randn((T, 3, D), "float64"), requires_grad=which != "k_only")
    k = to_torch(randn((T, 2, D), "float64"), requires_grad=which == "k_only")
    lib, _, _, _ = angle_call(source, (T,), D, interleaved=False, rng=rng)
    if which == "no_k":
        assert torch.autograd.gradcheck(lambda q: cr.apply_rope(q, **lib), (q,))
        return
    leaf = q if which == "q_only" else k
    fn = (lambda q: cr.apply_rope(q, k, **lib)) if which == "q_only" else \
        (lambda k: cr.apply_rope(q, k, **lib))
    assert torch.autograd.gradcheck(fn, (leaf,))
    q_out, k_out = fn(leaf)
    (q_out.sum() + k_out.sum()).backward()
    other = k if which == "q_only" else q
    assert other.grad is None and leaf.grad is not None


# ----------------------------------------------------------------------------------------------------
# gradients against independent references


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("inverse", [False, True])
def test_gradients_match_autograd_of_float64_reference(source, interleaved, inverse, randn, rng):
    T, Hq, Hk, D, r = 5, 4, 2, 16, 12
    q0, k0, gq, gk = randn((T, Hq, D)), randn((T, Hk, D)), randn((T, Hq, D)), randn((T, Hk, D))
    lib, _, _, (cos, sin) = angle_call(source, (T,), r, interleaved=interleaved, rng=rng)
    q, k = to_torch(q0.astype(np.float64), requires_grad=True), \
        to_torch(k0.astype(np.float64), requires_grad=True)
    q_out, k_out = cr.apply_rope(q, k, interleaved=interleaved, inverse=inverse, **lib)
    grads = torch.autograd.grad((q_out, k_out), (q, k), (to_torch(gq).double(), to_torch(gk).double()))

    cos_t, sin_t = torch.from_numpy(cos), torch.from_numpy(-sin if inverse else sin)
    q_ref, k_ref = (x.detach().clone().requires_grad_(True) for x in (q, k))
    outs = [torch_reference_rope(x, cos_t, sin_t, r, interleaved) for x in (q_ref, k_ref)]
    expected = torch.autograd.grad(outs, (q_ref, k_ref),
                                   (to_torch(gq).double(), to_torch(gk).double()))
    for got, want, out, ref_out in zip(grads, expected, (q_out, k_out), outs):
        torch.testing.assert_close(out.detach(), ref_out.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("source", SOURCES)
def test_gradient_is_inverse_rotation_every_dtype(dtype, interleaved, source, randn, rng):
    """grad_q = R(-angle) grad_q_out, within the forward's tolerance for every dtype; the
    pass-through dims pass the gradient through bit for bit."""
    B, S, Hq, Hk, D, r = 2, 3, 4, 2, 16, 8
    table_dtype = "float64" if dtype == "float64" else "float32"
    lib, ref, check, _ = angle_call(source, (B, S), r, interleaved=interleaved, rng=rng,
                                    table_dtype=table_dtype)
    q = to_torch(randn((B, S, Hq, D), dtype), requires_grad=True)
    k = to_torch(randn((B, S, Hk, D), dtype), requires_grad=True)
    gq, gk = randn((B, S, Hq, D), dtype), randn((B, S, Hk, D), dtype)
    q_out, k_out = cr.apply_rope(q, k, interleaved=interleaved, **lib)
    assert q_out.dtype == q.dtype
    grad_q, grad_k = torch.autograd.grad((q_out, k_out), (q, k), (to_torch(gq), to_torch(gk)))
    for grad, g, x, out in ((grad_q, gq, q, q_out), (grad_k, gk, k, k_out)):
        assert grad.dtype == x.dtype and grad.shape == x.shape
        expected = reference_rope(g, interleaved=interleaved, inverse=True, **ref)
        assert_rope_close(as_numpy(grad), expected, g, interleaved=interleaved, rotary_dim=r, **check)
        forward = reference_rope(as_numpy(x), interleaved=interleaved, **ref)
        assert_rope_close(as_numpy(out), forward, as_numpy(x), interleaved=interleaved,
                          rotary_dim=r, **check)


def test_expanded_upstream_gradient(randn, rng):
    """out.sum() hands back an expanded gradient (stride 0 along head_dim)."""
    T, D = 4, 8
    q = to_torch(randn((T, 2, D)).astype(np.float64), requires_grad=True)
    lib, ref, _, _ = angle_call("computed", (T,), D, interleaved=True, rng=rng)
    cr.apply_rope(q, interleaved=True, **lib).sum().backward()
    ones = np.ones((T, 2, D))
    np.testing.assert_allclose(q.grad.numpy(), reference_rope(ones, interleaved=True, inverse=True,
                                                              **ref), rtol=1e-13, atol=1e-13)


def test_attention_factor_and_linear_scaling_gradients(randn, rng):
    """A scaling dict (with NumPy scalars) passes through the operator as JSON."""
    T, D = 3, 8
    q = to_torch(randn((T, 2, D)).astype(np.float64), requires_grad=True)
    positions = torch.from_numpy(rng.integers(0, 100, T))
    scaling = {"rope_type": "linear", "factor": np.float32(4.0)}
    assert torch.autograd.gradcheck(lambda q: cr.apply_rope(q, positions=positions, scaling=scaling), (q,))
    out = cr.apply_rope(q, positions=positions, scaling=scaling)
    expected = reference_rope(q.detach().numpy(), positions.numpy(), linear_factor=4.0)
    np.testing.assert_allclose(out.detach().numpy(), expected, rtol=1e-13, atol=1e-13)


def test_tables_get_no_gradient(randn, rng):
    """Documented: user-given cos / sin / cos_sin_cache tensors are not differentiated."""
    T, D = 3, 8
    q = to_torch(randn((T, 2, D)).astype(np.float64), requires_grad=True)
    lib, _, _, _ = angle_call("tables_full", (T,), D, interleaved=False, rng=rng)
    cos, sin = lib["cos"].requires_grad_(True), lib["sin"].requires_grad_(True)
    cr.apply_rope(q, cos=cos, sin=sin).sum().backward()
    assert q.grad is not None and cos.grad is None and sin.grad is None


# ----------------------------------------------------------------------------------------------------
# in place under autograd


class QKVProjection(torch.nn.Module):
    """A linear layer whose output [T, Hq + 2 Hk, D] holds q, k and v (non-leaf views)."""

    def __init__(self, Hq, Hk, D, hidden=12):
        super().__init__()
        self.Hq, self.Hk, self.D = Hq, Hk, D
        self.linear = torch.nn.Linear(hidden, (Hq + 2 * Hk) * D, dtype=torch.float64)

    def forward(self, x):
        qkv = self.linear(x).view(x.shape[0], self.Hq + 2 * self.Hk, self.D)
        return qkv, qkv[:, :self.Hq], qkv[:, self.Hq:self.Hq + self.Hk]


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("with_k", [True, False])
@pytest.mark.parametrize("compiled", [False, True])
def test_inplace_on_views_matches_out_of_place(source, interleaved, with_k, compiled, randn, rng):
    T, Hq, Hk, D, r = 5, 3, 1, 8, 6
    torch._dynamo.reset()  # every case compiles the same code object anew
    torch.manual_seed(0)
    proj = QKVProjection(Hq, Hk, D)
    x = to_torch(randn((T, 12)).astype(np.float64))
    weights = to_torch(randn((T, Hq + 2 * Hk, D)).astype(np.float64))
    lib, _, _, _ = angle_call(source, (T,), r, interleaved=interleaved, rng=rng)

    def loss(inplace):
        qkv, q, k = proj(x)
        if inplace:
            cr.apply_rope(q, k if with_k else None, inplace=True, interleaved=interleaved, **lib)
            out = qkv
        else:
            if with_k:
                q, k = cr.apply_rope(q, k, interleaved=interleaved, **lib)
            else:
                q = cr.apply_rope(q, interleaved=interleaved, **lib)
            out = torch.cat([q, k, qkv[:, Hq + Hk:]], dim=1)
        return (out * weights).sum() + (out ** 2).sum()

    results = []
    for inplace in (False, True):
        fn = torch.compile(loss, fullgraph=True, backend="aot_eager") if compiled and inplace else loss
        proj.zero_grad()
        value = fn(inplace)
        value.backward()
        results.append((value.detach(), proj.linear.weight.grad.clone(), proj.linear.bias.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("needs_grad", ["q", "k"])
def test_inplace_one_side_requires_grad(needs_grad, randn, rng):
    T, D = 4, 8
    lib, ref, _, _ = angle_call("computed", (T,), D, interleaved=False, rng=rng)
    leaf = to_torch(randn((T, 2, D), "float64"), requires_grad=True)
    x = leaf * 1.0  # a non-leaf that requires grad
    other = to_torch(randn((T, 1, D), "float64"))
    q, k = (x, other) if needs_grad == "q" else (other[:, :1].expand(T, 2, D).clone(), x[:, :1])
    q0, k0 = q.detach().clone(), k.detach().clone()
    q_out, k_out = cr.apply_rope(q, k, inplace=True, **lib)
    assert q_out is q and k_out is k
    for out, x0 in ((q, q0), (k, k0)):
        np.testing.assert_allclose(out.detach().numpy(), reference_rope(x0.numpy(), **ref),
                                   rtol=1e-13, atol=1e-13)
    assert q.requires_grad == (needs_grad == "q") and k.requires_grad == (needs_grad == "k")
    g = randn((T, 2, D), "float64")
    target = q if needs_grad == "q" else k
    target.backward(to_torch(g[:, :target.shape[1]]))
    expected = reference_rope(g[:, :target.shape[1]], inverse=True, **ref)
    got = leaf.grad.numpy() if needs_grad == "q" else leaf.grad.numpy()[:, :1]
    np.testing.assert_allclose(got, expected, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("what", ["leaf", "view_of_leaf"])
def test_inplace_on_leaf_refused_before_writing(what, randn, rng):
    T, D = 4, 8
    base = to_torch(randn((T, 3, D)), requires_grad=True)
    q = base if what == "leaf" else base[:, :2]
    before = base.detach().clone()
    with pytest.raises(RuntimeError, match="leaf"):
        cr.apply_rope(q, positions=torch.arange(T), inplace=True)
    assert_bits_equal(base.detach(), before, what="q after a refused in-place call")


def test_inplace_same_tensor_refused(randn):
    y = to_torch(randn((4, 2, 8)), requires_grad=True) * 1.0  # a non-leaf
    before = y.detach().clone()
    with pytest.raises(ValueError, match="same array"):
        cr.apply_rope(y, y, inplace=True)
    assert_bits_equal(y.detach(), before, what="q after a refused in-place call")


# ----------------------------------------------------------------------------------------------------
# routing: what takes the operator, what does not


def test_no_grad_and_detached_take_the_array_path(randn):
    q = to_torch(randn((4, 2, 8)), requires_grad=True)
    with torch.no_grad():
        assert cr.apply_rope(q).grad_fn is None
    assert cr.apply_rope(q.detach()).grad_fn is None
    out = cr.apply_rope(q)
    assert "cupyrope_apply_rope" in type(out.grad_fn).__name__
    assert_bits_equal(out.detach(), cr.apply_rope(q.detach()), what="op vs array path")


@pytest.mark.parametrize("call, error, match", [
    (lambda q, p: cr.apply_rope(q, positions=p, rotary_dim=7), ValueError, "rotary_dim"),
    (lambda q, p: cr.apply_rope(q, positions=p, rotary_dim=4.0), TypeError, "rotary_dim"),
    (lambda q, p: cr.apply_rope(q, positions=p, interleaved=1), TypeError, "interleaved"),
    (lambda q, p: cr.apply_rope(q, positions=p.numpy()), TypeError, "positions"),
    (lambda q, p: cr.apply_rope(q, positions=p.double()), TypeError, "positions"),
    (lambda q, p: cr.apply_rope(q, positions=p, theta="big"), TypeError, "theta"),
    (lambda q, p: cr.apply_rope(q, positions=p, theta=-1.0), ValueError, "theta"),
    (lambda q, p: cr.apply_rope(q, positions=p, scaling="linear"), TypeError, "scaling"),
    (lambda q, p: cr.apply_rope(q, positions=p, scaling={"rope_type": "nope"}), ValueError, "nope"),
    (lambda q, p: cr.apply_rope(q, positions=p, cos=torch.ones(5, 8), sin=torch.ones(5, 8)),
     ValueError, "positions must be None"),
    (lambda q, p: cr.apply_rope(q, q[:, :1].detach().double(), positions=p), TypeError, "dtype"),
    (lambda q, p: cr.apply_rope(q, positions=p, cos_sin_cache=torch.ones(8, 8), validate=True),
     IndexError, "positions"),
])
def test_errors_keep_their_types_through_the_op(call, error, match, randn):
    q = to_torch(randn((5, 2, 8)), requires_grad=True)
    positions = torch.tensor([0, 1, 2, 3, 100])
    with pytest.raises(error, match=match):
        call(q, positions)


def test_integer_theta_and_numpy_options(randn, rng):
    q = to_torch(randn((3, 2, 8)).astype(np.float64), requires_grad=True)
    positions = torch.arange(3)
    a = cr.apply_rope(q, positions=positions, theta=10000, rotary_dim=np.int64(8),
                      interleaved=np.bool_(True))
    b = cr.apply_rope(q.detach(), positions=positions, theta=10000.0, rotary_dim=8, interleaved=True)
    assert_bits_equal(a.detach(), b, what="numpy-typed options")


# ----------------------------------------------------------------------------------------------------
# torch.library.opcheck


def _op_args(source, dtype, with_k, interleaved, rng, randn):
    T, D, r = 4, 8, 6
    lib, _, _, _ = angle_call(source, (T,), r, interleaved=interleaved, rng=rng,
                              table_dtype="float32")
    from cupyrope.core.scaling import scaling_op_args

    q = to_torch(randn((T, 2, D), dtype))
    k = to_torch(randn((T, 1, D), dtype)) if with_k else None
    return (q, k, lib.get("positions"), lib.get("cos_sin_cache"), lib.get("cos"), lib.get("sin"),
            THETA, *scaling_op_args(lib.get("scaling")), interleaved, lib.get("rotary_dim", r),
            False, None, False)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("with_k", [True, False])
def test_opcheck(dtype, source, with_k, rng, randn):
    args = _op_args(source, dtype, with_k, True, rng, randn)
    torch.library.opcheck(torch.ops.cupyrope.apply_rope.default, args)
    grad_args = (args[0].clone().requires_grad_(True),
                 None if args[1] is None else args[1].clone().requires_grad_(True)) + args[2:]
    torch.library.opcheck(torch.ops.cupyrope.apply_rope.default, grad_args)
    inplace_args = (args[0].clone(), None if args[1] is None else args[1].clone()) + args[2:]
    torch.library.opcheck(torch.ops.cupyrope.apply_rope_.default, inplace_args)


# ----------------------------------------------------------------------------------------------------
# torch.compile


def _has_cpp_compiler() -> bool:
    import shutil

    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


BACKENDS = ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    not _has_cpp_compiler(), reason="Inductor on the CPU needs a C++ compiler"))]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("source", ["cache", "tables_full", "computed_linear"])
def test_compile_fullgraph_forward_and_backward(backend, dynamic, source, randn, rng):
    torch._dynamo.reset()
    T, Hq, Hk, D = 6, 4, 2, 16
    lib, _, _, _ = angle_call(source, (T,), D, interleaved=False, rng=rng, table_dtype="float32")
    gq, gk = to_torch(randn((T, Hq, D))), to_torch(randn((T, Hk, D)))

    def step(q, k):
        q_out, k_out = cr.apply_rope(q, k, **lib)
        return (q_out * gq).sum() + (k_out * gk).sum(), q_out, k_out

    compiled = torch.compile(step, fullgraph=True, backend=backend, dynamic=dynamic)
    for _ in range(2):  # the second call runs the cached graph
        q, k = to_torch(randn((T, Hq, D)), requires_grad=True), to_torch(randn((T, Hk, D)), requires_grad=True)
        loss, q_out, k_out = compiled(q, k)
        grads = torch.autograd.grad(loss, (q, k))
        q_e, k_e = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
        loss_e, q_out_e, k_out_e = step(q_e, k_e)
        grads_e = torch.autograd.grad(loss_e, (q_e, k_e))
        for a, b in zip((q_out, k_out) + grads, (q_out_e, k_out_e) + grads_e):
            assert_bits_equal(a.detach(), b.detach(), what="compiled vs eager")


def test_compile_inference_and_inplace_no_grad(randn, rng):
    """Without grad the compiled graph holds the functional / mutating op (no graph break)."""
    torch._dynamo.reset()
    T, D = 5, 8
    lib, _, _, _ = angle_call("cache", (T,), D, interleaved=True, rng=rng, table_dtype="float32")

    def rotate(q, k):
        cr.apply_rope(q, k, inplace=True, interleaved=True, **lib)
        return cr.apply_rope(q, interleaved=True, inverse=True, **lib)

    q0, k0 = to_torch(randn((T, 2, D))), to_torch(randn((T, 1, D)))
    q1, k1, q2, k2 = q0.clone(), k0.clone(), q0.clone(), k0.clone()
    with torch.no_grad():
        back = torch.compile(rotate, fullgraph=True, backend="aot_eager")(q1, k1)
        back_eager = rotate(q2, k2)
    for a, b in ((q1, q2), (k1, k2), (back, back_eager)):
        assert_bits_equal(a, b, what="compiled in-place vs eager")
    np.testing.assert_allclose(back.numpy(), q0.numpy(), rtol=1e-5, atol=1e-5)


def test_compile_graph_holds_the_custom_op(randn, rng):
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    q = to_torch(randn((4, 2, 8)), requires_grad=True)
    torch.compile(lambda q: cr.apply_rope(q, positions=torch.arange(4)), fullgraph=True,
                  backend=backend)(q)
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes]
    assert any("cupyrope.apply_rope" in t for t in targets), targets
