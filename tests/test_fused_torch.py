"""The fused ops as torch.library operators (cupyrope.frontends.torch.ops): gradients of ``rms_norm_rope``,
torch.compile, CUDA graphs, opcheck and the refusals of what has no gradient.

The operators run the NumPy path on CPU tensors, so everything but CUDA-graph capture is checked
here without a GPU; the same bodies run on CUDA tensors (marked gpu):

- gradients of ``rms_norm_rope`` for q, k, q_weight and k_weight against autograd of an independent
  float64 torch formulation (RMSNorm, then Hugging Face's ``rotate_half`` RoPE, or the stacked
  pairs for GPT-J), for every angle source, both pairings, partial rotary, weight_offset 0 and 1,
  GQA and float32 / bfloat16 / float16, within one rounding to the gradient's dtype plus float32
  arithmetic; double backward against the reference's; one side requiring grad at a time;
- ``inplace=True`` under autograd on views of a QKV projection: the out-of-place gradients, eager
  and compiled; leaves, views of leaves and overlapping views refused before anything is written;
- fp8 outputs and ``rope_and_cache`` refuse tensors that require grad (nothing written), and run
  under ``torch.no_grad()``;
- ``torch.library.opcheck`` of every fused operator (schema mutations, fake implementations,
  autograd registration, AOT dispatch), the fake implementations under ``FakeTensorMode`` (fp8
  dtypes, the placeholder of k=None);
- ``torch.compile(fullgraph=True)`` of each fused op: forward and backward equal eager,
  positions / slots / scales as tensors, the cache writes visible after the compiled call;
- on the GPU: ``"reduce-overhead"`` with no CUDA graph skipped, and ``rope_and_cache`` and an
  ``rms_norm_rope`` forward + backward captured in a ``torch.cuda.CUDAGraph`` and replayed on new
  data.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupyrope as cr  # noqa: E402
from autograd_cases import SOURCES, angle_call, to_torch, torch_reference_rope  # noqa: E402
from cupyrope.frontends.torch import ops as torch_ops  # noqa: E402
from cupyrope.core.scaling import scaling_op_args  # noqa: E402
from reference import reference_rope  # noqa: E402
from tolerances import (  # noqa: E402
    as_numpy,
    assert_bits_equal,
    assert_rope_close,
    np_dtype,
    unit_roundoff,
)

EPS = 1e-6
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
FP8 = ["float8_e4m3fn", "float8_e5m2"]


@pytest.fixture
def device(request) -> str:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return request.param


def _needs_fp8(device: str) -> None:
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 outputs need compute capability 8.9 or newer")


def _has_cpp_compiler() -> bool:
    import shutil

    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


COMPILE_BACKENDS = ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    not _has_cpp_compiler(), reason="Inductor on the CPU needs a C++ compiler"))]


# ----------------------------------------------------------------------------------------------------
# The float64 reference and its error bounds


def norm_rope_reference(x, weight, weight_offset, cos, sin, rotary_dim, interleaved):
    """float64 RMSNorm of each head, times ``weight_offset + weight``, then RoPE with per-token
    float64 ``cos`` / ``sin`` [..., rotary_dim / 2], in torch ops that autograd differentiates."""
    x = x.double()
    normed = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS)
    return torch_reference_rope(normed * (weight_offset + weight.double()), cos, sin, rotary_dim,
                                interleaved)


def gradient_bounds(x, weight, grad_out, weight_offset):
    """Elementwise bounds on |computed - exact| for the gradients of x and of the weight.

    One rounding to the gradient's dtype (``unit_roundoff * |exact|``, added by the caller) plus
    float32 arithmetic, 16 float32 ulps of the magnitude of the terms it sums: per head
    ``r * (max|g_n| + max|n| * max|g_n| * mean|n|)`` for x (``g_x = r * (g_n - n * mean(g_n *
    n))``), and ``sum |g| |n|`` over tokens and heads for the weight; ``|g| <= sqrt(2) *
    max|g_y|`` (a rotated pair), ``|g_n| <= |g| * max|weight_offset + weight|``."""
    x = x.detach().double()
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS)
    normed = (x * rstd).abs()
    grad_max = 2 ** 0.5 * grad_out.detach().double().abs().amax(-1, keepdim=True)
    grad_n = grad_max * (weight_offset + weight.detach().double()).abs().max()
    magnitude_x = rstd * grad_n * (1 + normed.amax(-1, keepdim=True) * normed.mean(-1, keepdim=True))
    magnitude_w = (grad_max * normed).sum(dim=tuple(range(x.dim() - 1)))
    return 16 * 2.0 ** -24 * magnitude_x, 16 * 2.0 ** -24 * magnitude_w


def assert_within(got, exact, arithmetic_bound, what):
    dtype = str(got.dtype).removeprefix("torch.")
    err = (got.detach().double().cpu() - exact.detach().double().cpu()).abs()
    bound = unit_roundoff(dtype) * exact.detach().double().cpu().abs() + arithmetic_bound.cpu()
    worst = torch.argmax(err - bound)
    assert bool(torch.all(err <= bound)), (
        f"{what}: error {err.flatten()[worst].item():.3g} over its bound "
        f"{bound.flatten()[worst].item():.3g} at flat index {worst.item()} (max error "
        f"{err.max().item():.3g}, max |exact| {exact.abs().max().item():.3g})")


def _case(randn, rng, device, dtype, *, T=7, Hq=4, Hk=2, D=32, weight_offset=0.0,
          weight_dtype=None):
    """q, k (scaled by 3: the norm must matter), weights and upstream gradients on ``device``."""
    put = lambda a: to_torch(a, device)  # noqa: E731
    q, k = put(randn((T, Hq, D), dtype) * 3), put(randn((T, Hk, D), dtype) * 3)
    low, high = (0.5, 1.5) if weight_offset == 0 else (-0.5, 0.5)  # Gemma stores w near 0
    weights = [put(rng.uniform(low, high, D).astype(np_dtype(weight_dtype or dtype)))
               for _ in range(2)]
    grads = put(randn((T, Hq, D), dtype)), put(randn((T, Hk, D), dtype))
    return q, k, weights, grads


# ----------------------------------------------------------------------------------------------------
# Gradients of rms_norm_rope


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary", ["full", "partial"])
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_rms_norm_rope_gradients_match_float64_autograd(device, dtype, source, interleaved,
                                                        rotary, weight_offset, randn, rng):
    T, D = 7, 32
    r = D if rotary == "full" else D // 2
    # Gemma-style calls keep float32 weights beside 16-bit activations: mixed dtypes covered.
    weight_dtype = "float32" if weight_offset else dtype
    q, k, (wq, wk), (gq, gk) = _case(randn, rng, device, dtype, T=T, D=D,
                                     weight_offset=weight_offset, weight_dtype=weight_dtype)
    lib, _, _, (cos, sin) = angle_call(source, (T,), r, interleaved=interleaved, rng=rng,
                                       device=device, table_dtype="float32")
    leaves = [x.requires_grad_(True) for x in (q, k, wq, wk)]
    q_out, k_out = cr.rms_norm_rope(q, k, wq, wk, eps=EPS, weight_offset=weight_offset,
                                    interleaved=interleaved, **lib)
    assert "cupyrope_rms_norm_rope" in type(q_out.grad_fn).__name__
    got = torch.autograd.grad((q_out, k_out), leaves, (gq, gk))

    exact_leaves = [x.detach().double().requires_grad_(True) for x in leaves]
    c, s = torch.from_numpy(cos).to(device), torch.from_numpy(sin).to(device)
    outs = [norm_rope_reference(x, w, weight_offset, c, s, r, interleaved)
            for x, w in ((exact_leaves[0], exact_leaves[2]), (exact_leaves[1], exact_leaves[3]))]
    exact = torch.autograd.grad(outs, exact_leaves, (gq.double(), gk.double()))
    bounds_q = gradient_bounds(q, wq, gq, weight_offset)
    bounds_k = gradient_bounds(k, wk, gk, weight_offset)
    for name, g, e, bound, leaf in zip(("q", "k", "q_weight", "k_weight"), got, exact,
                                       (bounds_q[0], bounds_k[0], bounds_q[1], bounds_k[1]),
                                       leaves):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape and g.device == leaf.device
        assert_within(g, e, bound, f"grad of {name}")


def test_rms_norm_rope_double_backward_matches_float64(randn, rng):
    """The backward is torch arithmetic plus the apply_rope operator: differentiable again."""
    T, D, r = 5, 16, 12
    q, k, (wq, wk), (gq, gk) = _case(randn, rng, "cpu", "float32", T=T, D=D)
    lib, _, _, (cos, sin) = angle_call("cache", (T,), r, interleaved=False, rng=rng,
                                       table_dtype="float32")
    directions = [to_torch(randn(tuple(x.shape))) for x in (q, k, wq, wk)]

    def second_order(leaves, forward):
        outs = forward(*leaves)
        grads = torch.autograd.grad(outs, leaves, (gq.to(outs[0].dtype), gk.to(outs[0].dtype)),
                                    create_graph=True)
        total = sum((g * v.to(g.dtype)).sum() for g, v in zip(grads, directions))
        return torch.autograd.grad(total, leaves)

    got = second_order([x.clone().requires_grad_(True) for x in (q, k, wq, wk)],
                       lambda q, k, wq, wk: cr.rms_norm_rope(q, k, wq, wk, eps=EPS, **lib))
    c, s = torch.from_numpy(cos), torch.from_numpy(sin)
    exact = second_order(
        [x.double().requires_grad_(True) for x in (q, k, wq, wk)],
        lambda q, k, wq, wk: (norm_rope_reference(q, wq, 0.0, c, s, r, False),
                              norm_rope_reference(k, wk, 0.0, c, s, r, False)))
    for name, g, e in zip(("q", "k", "q_weight", "k_weight"), got, exact):
        # float32 arithmetic through two derivatives: 2^-16 of the largest element (measured
        # ~2e-7 relative on this case).
        err = (g.double() - e).abs().max().item()
        assert err <= 2.0 ** -16 * e.abs().max().item(), f"{name}: {err:.3g}"


@pytest.mark.parametrize("which", ["q", "k", "q_weight", "k_weight", "no_k"])
def test_rms_norm_rope_one_side_requires_grad(which, randn, rng):
    """Only the tensors that require grad get one (a weight alone routes to the operator too),
    the same values as when all do."""
    T = 6
    q, k, weights, (gq, gk) = _case(randn, rng, "cpu", "float32", T=T)
    lib, _, _, _ = angle_call("computed", (T,), 32, interleaved=True, rng=rng)
    if which == "no_k":
        k, weights[1] = None, None
    names = ("q", "k", "q_weight", "k_weight")
    leaves = dict(zip(names, (q, k, *weights)))

    def grads(wanted):
        inputs = {n: None if x is None else x.detach().clone().requires_grad_(n in wanted)
                  for n, x in leaves.items()}
        out = cr.rms_norm_rope(inputs["q"], inputs["k"], inputs["q_weight"], inputs["k_weight"],
                               eps=EPS, interleaved=True, **lib)
        outs = (out,) if inputs["k"] is None else out
        sources = [inputs[n] for n in wanted]
        return dict(zip(wanted, torch.autograd.grad(outs, sources, (gq, gk)[:len(outs)])))

    everything = grads([n for n in names if leaves[n] is not None])
    wanted = ["q", "q_weight"] if which == "no_k" else [which]
    alone = grads(wanted)
    for name in wanted:
        assert_bits_equal(alone[name], everything[name], what=f"grad of {name} alone")


def test_rms_norm_rope_tables_get_no_gradient(randn, rng):
    T = 4
    q, k, (wq, wk), _ = _case(randn, rng, "cpu", "float32", T=T)
    lib, _, _, _ = angle_call("tables_full", (T,), 32, interleaved=False, rng=rng)
    cos, sin = lib["cos"].requires_grad_(True), lib["sin"].requires_grad_(True)
    q.requires_grad_(True)
    q_out, _ = cr.rms_norm_rope(q, k, wq, wk, eps=EPS, cos=cos, sin=sin)
    q_out.sum().backward()
    assert q.grad is not None and cos.grad is None and sin.grad is None


# ----------------------------------------------------------------------------------------------------
# In place under autograd


class QKVProjection(torch.nn.Module):
    """A linear layer whose output [T, Hq + 2 Hk, D] holds q, k and v (non-leaf views)."""

    def __init__(self, Hq, Hk, D, hidden=12):
        super().__init__()
        self.Hq, self.Hk, self.D = Hq, Hk, D
        self.linear = torch.nn.Linear(hidden, (Hq + 2 * Hk) * D)
        self.q_weight = torch.nn.Parameter(torch.rand(D) + 0.5)
        self.k_weight = torch.nn.Parameter(torch.rand(D) + 0.5)

    def forward(self, x):
        qkv = self.linear(x).view(x.shape[0], self.Hq + 2 * self.Hk, self.D)
        return qkv, qkv[:, :self.Hq], qkv[:, self.Hq:self.Hq + self.Hk]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("source", ["cache", "tables_half", "computed"])
def test_in_place_under_autograd_matches_out_of_place(source, compiled, randn, rng):
    T, Hq, Hk, D = 5, 3, 1, 16
    torch._dynamo.reset()
    torch.manual_seed(0)
    proj = QKVProjection(Hq, Hk, D)
    x = to_torch(randn((T, 12)))
    weights = to_torch(randn((T, Hq + 2 * Hk, D)))
    lib, _, _, _ = angle_call(source, (T,), D, interleaved=False, rng=rng, table_dtype="float32")

    def loss(inplace):
        qkv, q, k = proj(x)
        if inplace:
            cr.rms_norm_rope(q, k, proj.q_weight, proj.k_weight, eps=EPS, inplace=True, **lib)
            out = qkv
        else:
            q, k = cr.rms_norm_rope(q, k, proj.q_weight, proj.k_weight, eps=EPS, **lib)
            out = torch.cat([q, k, qkv[:, Hq + Hk:]], dim=1)
        return (out * weights).sum() + (out ** 2).sum()

    results = []
    for inplace in (False, True):
        fn = (torch.compile(loss, fullgraph=True, backend="aot_eager") if compiled and inplace
              else loss)
        proj.zero_grad()
        value = fn(inplace)
        value.backward()
        results.append([value.detach()] + [p.grad.clone() for p in proj.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("what,error,match", [
    ("leaf", RuntimeError, "rms_norm_rope: inplace=True on q, a leaf"),
    ("view_of_leaf", RuntimeError, "rms_norm_rope: inplace=True on q, a view of a leaf"),
    ("split", RuntimeError, "several views"),
    ("overlap", ValueError, "share"),
])
def test_in_place_under_autograd_refusals_write_nothing(what, error, match, randn):
    T, D = 4, 16
    base = to_torch(randn((T, 4, D)), requires_grad=True)
    w = torch.ones(D)
    if what == "leaf":
        q, k, written = base, None, base
    elif what == "view_of_leaf":
        q, k, written = base[:, :2], None, base
    else:
        written = base * 1.0  # a non-leaf
        q, k = (written.split(2, dim=1) if what == "split" else (written[:, :3], written[:, 2:]))
    before = written.detach().clone()
    with pytest.raises(error, match=match):
        cr.rms_norm_rope(q, k, w, None if k is None else w, torch.arange(T), eps=EPS,
                         inplace=True)
    assert_bits_equal(written.detach(), before, what=f"{what} after a refused in-place call")


# ----------------------------------------------------------------------------------------------------
# What has no gradient


def _cache_case(randn, rng, device="cpu", *, T=9, Hq=4, Hk=2, D=32, num_blocks=6, block_size=4,
                layout="NHD", dtype="float32"):
    q, k, v = (to_torch(randn(shape, dtype), device) for shape in ((T, Hq, D), (T, Hk, D),
                                                                  (T, Hk, D)))
    slots = rng.permutation(num_blocks * block_size)[:T].astype(np.int64)
    slots[::4] = -1  # padding
    shape = (num_blocks, block_size, Hk, D) if layout == "NHD" else (num_blocks, Hk, block_size, D)
    caches = [torch.full(shape, 7.0, device=device).to(q.dtype) for _ in range(2)]
    positions = torch.from_numpy(rng.integers(0, 256, T)).to(device)
    return q, k, v, caches, torch.from_numpy(slots).to(device), positions


@pytest.mark.parametrize("case,names", [
    ("fp8_apply_rope", "q requires grad"),
    ("fp8_rms_norm_rope", "q_weight requires grad"),
    ("cache_q", "q, k require grad"),
    ("cache_v", "v requires grad"),
    ("cache_weight", "k_weight requires grad"),
])
def test_what_has_no_gradient_refuses_and_writes_nothing(case, names, randn, rng):
    q, k, v, (kc, vc), slots, positions = _cache_case(randn, rng)
    wq, wk = torch.ones(q.shape[-1]), torch.ones(q.shape[-1])
    cache = torch.from_numpy(cr.cos_sin_cache(256, q.shape[-1]))

    def call():
        if case == "fp8_apply_rope":
            return cr.apply_rope(q, k, positions, cos_sin_cache=cache, out_dtype="float8_e5m2")
        if case == "fp8_rms_norm_rope":
            return cr.rms_norm_rope(q, k, wq, wk, positions, eps=EPS, cos_sin_cache=cache,
                                    out_dtype="float8_e4m3fn", q_scale=0.5)
        return cr.rope_and_cache(q, k, v, positions, kc, vc, slots, cos_sin_cache=cache,
                                 q_weight=wq if case == "cache_weight" else None,
                                 k_weight=wk if case == "cache_weight" else None, eps=EPS)

    needing = {"fp8_apply_rope": [q], "fp8_rms_norm_rope": [wq], "cache_q": [q, k],
               "cache_v": [v], "cache_weight": [wk]}[case]
    for x in needing:
        x.requires_grad_(True)
    before = [x.detach().clone() for x in (q, k, v, kc, vc)]
    what = "the KV-cache write" if case.startswith("cache") else "fp8 outputs"
    with pytest.raises(NotImplementedError, match=f"no gradient for {what}.*{names}.*no_grad"):
        call()
    for x, x0 in zip((q, k, v, kc, vc), before):
        assert_bits_equal(x.detach(), x0, what="an input after a refused call")
    with torch.no_grad():  # what the message says works
        call()
    if case.startswith("cache"):
        assert not torch.equal(kc, before[3])


# ----------------------------------------------------------------------------------------------------
# The operators: schemas, opcheck, fake implementations


def test_schemas_declare_what_each_operator_writes():
    written = {op.name: set(op.mutated) for op in torch_ops.FUSED_OPS}
    assert written == {"rms_norm_rope": set(), "rms_norm_rope_": {"q", "k"},
                       "apply_rope_fp8": set(), "rope_and_cache": {"k_cache", "v_cache"},
                       "rope_and_cache_": {"q", "k", "k_cache", "v_cache"},
                       "write_cache": {"k_cache", "v_cache"}}
    apply_rope = torch.ops.cupyrope.apply_rope.default._schema.arguments
    for op in torch_ops.FUSED_OPS:
        schema = getattr(torch.ops.cupyrope, op.name).default._schema
        names = [a.name for a in schema.arguments]
        # Every operator takes the rotation's arguments as apply_rope does, in its order.
        assert names[2:13] == [a.name for a in apply_rope[2:13]], op.name
        assert [str(a.type) for a in schema.arguments[2:13]] == \
            [str(a.type) for a in apply_rope[2:13]], op.name
        assert len(schema.returns) == (0 if op.inplace else 2), op.name
        for scale in ("q_scale", "k_scale", "v_scale"):
            if scale in names:  # a number or a tensor (vLLM's one-element float32 scales)
                assert f"{scale}_tensor" in names, (op.name, scale)


def op_args(name: str, **given) -> tuple:
    """Positional arguments of operator ``name`` from its schema's argument names (the options
    the public functions default to where not given)."""
    defaults = dict(theta=10000.0, interleaved=False, inverse=False, weight_offset=0.0,
                    layout="NHD", validate=False, norm_over="head")
    schema = getattr(torch.ops.cupyrope, name).default._schema
    return tuple(given.get(a.name, defaults.get(a.name)) for a in schema.arguments)


def _rotation(source, T, D, device, rng):
    lib, _, _, _ = angle_call(source, (T,), D, interleaved=False, rng=rng, device=device,
                              table_dtype="float32")
    scaling, numbers = scaling_op_args(lib.pop("scaling", None))
    return dict(lib, scaling=scaling, scaling_numbers=numbers)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("source", ["cache", "tables_half", "computed_linear"])
def test_opcheck_rms_norm_rope(device, dtype, source, randn, rng):
    T, D = 5, 16
    q, k, (wq, wk), _ = _case(randn, rng, device, dtype, T=T, D=D)
    rotation = _rotation(source, T, D, device, rng)
    op, op_ = torch.ops.cupyrope.rms_norm_rope.default, torch.ops.cupyrope.rms_norm_rope_.default
    torch.library.opcheck(op, op_args("rms_norm_rope", q=q, k=k, q_weight=wq, k_weight=wk,
                                      eps=EPS, **rotation))
    grad_args = dict(q=q.clone().requires_grad_(True), k=None, eps=EPS, weight_offset=1.0,
                     q_weight=wq.clone().requires_grad_(True), **rotation)
    torch.library.opcheck(op, op_args("rms_norm_rope", **grad_args))
    torch.library.opcheck(op_, op_args("rms_norm_rope_", q=q.clone(), k=k.clone(), q_weight=wq,
                                       k_weight=wk, eps=EPS, **rotation))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("fp8", FP8)
def test_opcheck_fp8_outputs(device, fp8, randn, rng):
    _needs_fp8(device)
    T, D = 6, 16
    q, k, (wq, wk), _ = _case(randn, rng, device, "bfloat16", T=T, D=D)
    rotation = _rotation("cache", T, D, device, rng)
    scale = torch.tensor([0.5], device=device)
    torch.library.opcheck(torch.ops.cupyrope.apply_rope_fp8.default,
                          op_args("apply_rope_fp8", q=q, k=k, out_dtype=fp8, q_scale=2.0,
                                  k_scale_tensor=scale, **rotation))
    torch.library.opcheck(torch.ops.cupyrope.rms_norm_rope.default,
                          op_args("rms_norm_rope", q=q, k=None, q_weight=wq, eps=EPS,
                                  out_dtype=fp8, q_scale_tensor=scale[0], **rotation))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("cache_dtype", [None, "float8_e4m3fn"])
def test_opcheck_rope_and_cache(device, layout, cache_dtype, randn, rng):
    if cache_dtype is not None:
        _needs_fp8(device)
    q, k, v, (kc, vc), slots, positions = _cache_case(randn, rng, device, layout=layout)
    if cache_dtype is not None:
        kc, vc = kc.to(getattr(torch, cache_dtype)), vc.to(getattr(torch, cache_dtype))
    D = q.shape[-1]
    rotation = _rotation("cache", q.shape[0], D, device, rng)
    rotation["positions"] = positions
    scales = {} if cache_dtype is None else dict(k_scale=0.5,
                                                 v_scale_tensor=torch.tensor(2.0, device=device))
    w = torch.rand(D, device=device) + 0.5
    cache_args = dict(v=v, slot_mapping=slots, layout=layout, **scales, **rotation)
    # opcheck's schema test compares mutated arguments with arithmetic torch lacks for fp8 on
    # the CPU; the same schema is checked with caches of q's dtype.
    tests = ("test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_static", "test_aot_dispatch_dynamic")[cache_dtype is not None:]
    torch.library.opcheck(torch.ops.cupyrope.rope_and_cache.default,
                          op_args("rope_and_cache", q=q, k=k, k_cache=kc.clone(),
                                  v_cache=vc.clone(), q_weight=w, k_weight=w, eps=EPS,
                                  **cache_args), test_utils=tests)
    torch.library.opcheck(torch.ops.cupyrope.rope_and_cache_.default,
                          op_args("rope_and_cache_", q=q.clone(), k=k.clone(), k_cache=kc.clone(),
                                  v_cache=vc.clone(), **cache_args), test_utils=tests)


def test_fake_implementations_give_shapes_and_dtypes_without_running(randn, rng):
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, (wq, wk), _ = _case(randn, rng, "cpu", "bfloat16", T=5, D=16)
    _, _, v, (kc, vc), slots, positions = _cache_case(randn, rng, T=5, D=16, dtype="bfloat16")
    rotation = _rotation("cache", 5, 16, "cpu", rng)
    mode = FakeTensorMode()
    fake = lambda x: None if not isinstance(x, torch.Tensor) else mode.from_tensor(x)  # noqa: E731
    with mode:
        args = {name: fake(x) for name, x in dict(
            q=q, k=k, q_weight=wq, k_weight=wk, v=v, k_cache=kc, v_cache=vc, slot_mapping=slots,
            **{n: x for n, x in rotation.items() if isinstance(x, torch.Tensor)}).items()}
        options = {n: x for n, x in rotation.items() if not isinstance(x, torch.Tensor)}
        ops = torch.ops.cupyrope
        q8, k8 = ops.apply_rope_fp8(*op_args("apply_rope_fp8", out_dtype="float8_e5m2",
                                             **args, **options))
        qn, placeholder = ops.rms_norm_rope(*op_args("rms_norm_rope", eps=EPS, **dict(args, k=None),
                                                     **options))
        qc, kc8 = ops.rope_and_cache(*op_args("rope_and_cache", eps=EPS, out_dtype="float8_e4m3fn",
                                              **args, **options))
        nothing = ops.rope_and_cache_(*op_args("rope_and_cache_", **args, **options))
    assert (q8.shape, k8.shape, q8.dtype, k8.dtype) == (q.shape, k.shape, torch.float8_e5m2,
                                                        torch.float8_e5m2)
    assert (qn.shape, qn.dtype, placeholder.shape) == (q.shape, torch.bfloat16, (0,))
    assert (qc.dtype, kc8.shape, kc8.dtype) == (torch.float8_e4m3fn, k.shape, torch.float8_e4m3fn)
    assert nothing is None
    assert qn.is_contiguous() and kc8.is_contiguous()
    assert bool((kc == 7).all()), "a fake call wrote into the real cache"


# ----------------------------------------------------------------------------------------------------
# torch.compile


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("source", ["cache", "tables_full", "computed_linear"])
def test_compile_rms_norm_rope_forward_and_backward(device, backend, dynamic, source, randn, rng):
    if device == "cuda" and backend != "inductor":
        pytest.skip("aot_eager is checked on the CPU")
    torch._dynamo.reset()
    T = 6
    lib, _, _, _ = angle_call(source, (T,), 32, interleaved=False, rng=rng, device=device,
                              table_dtype="float32")
    _, _, _, (gq, gk) = _case(randn, rng, device, "float32", T=T)

    def step(q, k, wq, wk):
        q_out, k_out = cr.rms_norm_rope(q, k, wq, wk, eps=EPS, weight_offset=1.0, **lib)
        return (q_out * gq).sum() + (k_out * gk).sum(), q_out, k_out

    compiled = torch.compile(step, fullgraph=True, backend=backend, dynamic=dynamic)
    for _ in range(2):  # the second call runs the cached graph
        q, k, weights, _ = _case(randn, rng, device, "float32", T=T, weight_offset=1.0)
        leaves = [x.requires_grad_(True) for x in (q, k, *weights)]
        loss, q_out, k_out = compiled(*leaves)
        grads = torch.autograd.grad(loss, leaves)
        eager_leaves = [x.detach().requires_grad_(True) for x in leaves]
        loss_e, q_out_e, k_out_e = step(*eager_leaves)
        grads_e = torch.autograd.grad(loss_e, eager_leaves)
        assert_bits_equal(q_out.detach(), q_out_e.detach(), what="compiled q_out")
        assert_bits_equal(k_out.detach(), k_out_e.detach(), what="compiled k_out")
        for a, b in zip(grads, grads_e):
            if backend == "aot_eager":
                assert_bits_equal(a, b, what="compiled gradient (aot_eager)")
            else:  # Inductor generates its own code for the norm's backward arithmetic
                torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("fp8", FP8)
def test_compile_fp8_outputs_with_number_and_tensor_scales(device, fp8, randn, rng):
    _needs_fp8(device)
    torch._dynamo.reset()
    T = 8
    q, k, _, _ = _case(randn, rng, device, "bfloat16", T=T, D=64)
    positions = torch.from_numpy(rng.integers(0, 4096, T)).to(device)
    k_scale = torch.tensor([0.25], device=device)

    def quantise(q, k, positions, k_scale):
        return cr.apply_rope(q, k, positions, out_dtype=fp8, q_scale=2.0, k_scale=k_scale)

    compiled = torch.compile(quantise, fullgraph=True,
                             backend="inductor" if device == "cuda" else "aot_eager")
    for scale in (0.25, 0.5):  # a new scale value reaches the compiled graph
        k_scale.fill_(scale)
        got = compiled(q, k, positions, k_scale)
        with torch.no_grad():
            expected = quantise(q, k, positions, k_scale)
            as_number = cr.apply_rope(q, k, positions, out_dtype=fp8, q_scale=2.0, k_scale=scale)
        for a, b, c in zip(got, expected, as_number):
            assert a.dtype == getattr(torch, fp8)
            assert_bits_equal(a.view(torch.uint8), b.view(torch.uint8), what="compiled fp8")
            assert_bits_equal(a.view(torch.uint8), c.view(torch.uint8), what="tensor vs number")


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_compile_rope_and_cache_writes_the_caches(device, backend, inplace, layout, randn, rng):
    torch._dynamo.reset()
    T, D = 9, 32
    cache = cr.cos_sin_cache(256, D, like=torch.empty(0, device=device))

    def serve(q, k, v, positions, k_cache, v_cache, slots):
        return cr.rope_and_cache(q, k, v, positions, k_cache, v_cache, slots,
                                 cos_sin_cache=cache, layout=layout, inplace=inplace)

    compiled = torch.compile(serve, fullgraph=True, backend=backend)
    for _ in range(2):  # new tokens, slots and positions: the graph is reused
        q, k, v, (kc, vc), slots, positions = _cache_case(randn, rng, device, T=T, D=D,
                                                          layout=layout)
        q0, k0 = q.clone(), k.clone()
        eager_inputs = [x.clone() for x in (q, k, kc, vc)]
        eager = serve(*eager_inputs[:2], v, positions, *eager_inputs[2:], slots)
        q_out, k_out, kc_out, vc_out = compiled(q, k, v, positions, kc, vc, slots)
        assert kc_out is kc and vc_out is vc
        if inplace:
            assert q_out is q and k_out is k
        else:
            assert_bits_equal(q, q0, what="q after an out-of-place call")
        for got, want, what in zip((q_out, k_out, kc, vc), eager, ("q_out", "k_out", "k_cache",
                                                                    "v_cache")):
            assert_bits_equal(got, want, what=f"compiled {what}")
        # The caches hold the rotated k and v of each valid slot, 7 elsewhere.
        valid = slots >= 0
        for written, value in ((kc, k_out), (vc, v)):
            rows = (written if layout == "NHD" else written.transpose(1, 2)).reshape(
                -1, *k.shape[1:])
            assert_bits_equal(rows[slots[valid]], value[valid], what="cache rows")
            untouched = torch.ones(rows.shape[0], dtype=torch.bool, device=device)
            untouched[slots[valid]] = False
            assert bool((rows[untouched] == 7).all())
        np.testing.assert_allclose(
            as_numpy(k_out), reference_rope(as_numpy(k0), positions.cpu().numpy(),
                                            cos_sin_cache=as_numpy(cache).astype(np.float64)),
            rtol=1e-5, atol=1e-5)


def test_compiled_graphs_hold_the_fused_operators(randn, rng):
    from torch._dynamo.testing import EagerAndRecordGraphs

    torch._dynamo.reset()
    backend = EagerAndRecordGraphs()
    q, k, v, (kc, vc), slots, positions = _cache_case(randn, rng)
    w = torch.rand(q.shape[-1]) + 0.5

    def fused(q, k, v, kc, vc):
        q8 = cr.apply_rope(q, k, positions, out_dtype="float8_e4m3fn")[0]
        qn, kn = cr.rms_norm_rope(q, k, w, w, positions, eps=EPS)
        cr.rope_and_cache(qn, kn, v, positions, kc, vc, slots)
        return q8, qn

    with torch.no_grad():
        torch.compile(fused, fullgraph=True, backend=backend)(q, k, v, kc, vc)
    targets = {str(node.target) for gm in backend.graphs for node in gm.graph.nodes}
    for name in ("apply_rope_fp8", "rms_norm_rope", "rope_and_cache_"):
        assert f"cupyrope.{name}" in targets, sorted(targets)


# ----------------------------------------------------------------------------------------------------
# Errors through the operator route


@pytest.mark.parametrize("kwargs,error,match", [
    ({"eps": None}, TypeError, "eps is required"),
    ({"eps": "1e-6"}, TypeError, "eps must be a number"),
    ({"q_weight": torch.ones(8)}, ValueError, r"q_weight must have shape \(16,\)"),
    ({"q_weight": np.ones(16, np.float32)}, TypeError, "q_weight must be a torch tensor"),
    ({"positions": np.arange(3)}, TypeError, "positions must be a torch tensor"),
    ({"out_dtype": "int8"}, ValueError, "out_dtype must be None or one of"),
    ({"q_scale": "2"}, TypeError, "q_scale must be a number"),
    ({"rotary_dim": 7}, ValueError, "rotary_dim"),
    ({"inplace": 1}, TypeError, "inplace must be a bool"),
])
def test_errors_keep_their_types_through_the_operators(kwargs, error, match, randn):
    q = to_torch(randn((3, 2, 16)), requires_grad=True)
    args = dict(q_weight=torch.ones(16), k_weight=None, eps=EPS, positions=torch.arange(3))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        cr.rms_norm_rope(q, None, args.pop("q_weight"), args.pop("k_weight"), **args)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"layout": "NDH"}, ValueError, "layout must be one of"),
    ({"cache_dtype": "int4"}, ValueError, "cache_dtype must be None or one of"),
    ({"v_scale": [1.0]}, TypeError, "v_scale must be a number"),
    ({"k_cache": np.zeros((6, 4, 2, 32), np.float32)}, TypeError, "k_cache must be a torch tensor"),
])
def test_rope_and_cache_argument_errors_come_before_the_gradient_refusal(kwargs, error, match,
                                                                           randn, rng):
    q, k, v, (kc, vc), slots, positions = _cache_case(randn, rng)
    args = dict(dict(k_cache=kc, v_cache=vc), **kwargs)
    with pytest.raises(error, match=match):
        cr.rope_and_cache(q, k, v.requires_grad_(True), positions, args.pop("k_cache"),
                          args.pop("v_cache"), slots, **args)
    assert bool((kc == 7).all())


# ----------------------------------------------------------------------------------------------------
# CUDA graphs (GPU)


@pytest.mark.gpu
def test_compile_reduce_overhead_rms_norm_rope_training(rng):
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    T, Hq, Hk, D = 128, 8, 2, 128
    lib, _, _, _ = angle_call("cache", (T,), D, interleaved=False, rng=rng, device="cuda",
                              table_dtype="float32")

    def step(q, k, wq, wk, gq, gk):
        q_out, k_out = cr.rms_norm_rope(q, k, wq, wk, eps=EPS, **lib)
        return (q_out.float() * gq).sum() + (k_out.float() * gk).sum()

    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    for _ in range(4):  # warm-up, recording, then replays of the CUDA graphs
        q = torch.randn(T, Hq, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(T, Hk, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        wq = (torch.rand(D, device="cuda") + 0.5).to(torch.bfloat16).requires_grad_(True)
        wk = (torch.rand(D, device="cuda") + 0.5).to(torch.bfloat16).requires_grad_(True)
        gq, gk = torch.randn(T, Hq, D, device="cuda"), torch.randn(T, Hk, D, device="cuda")
        leaves = (q, k, wq, wk)
        grads = [g.clone() for g in torch.autograd.grad(compiled(*leaves, gq, gk), leaves)]
        eager_leaves = [x.detach().requires_grad_(True) for x in leaves]
        grads_e = torch.autograd.grad(step(*eager_leaves, gq, gk), eager_leaves)
        for a, b in zip(grads, grads_e):
            # Inductor fuses the norm's backward and may keep in float32 what eager rounds to
            # bfloat16 between ops: a bfloat16 ulp or two of the largest gradient apart.
            torch.testing.assert_close(a, b, rtol=2 ** -6, atol=2 ** -6 * b.abs().max().item())
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def _capture(step):
    """Warm ``step`` up on a side stream (compiles the kernels), then capture it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return graph, outs


@pytest.mark.gpu
def test_cuda_graph_capture_rope_and_cache(rng):
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    T, Hq, Hk, D, num_blocks, block_size = 64, 8, 2, 128, 16, 16
    cache = cr.cos_sin_cache(8192, D, like=torch.empty(0, device="cuda"))
    q = torch.zeros(T, Hq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.zeros(T, Hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kc, vc = (torch.zeros(num_blocks, block_size, Hk, D, device="cuda", dtype=torch.bfloat16)
              for _ in range(2))
    positions = torch.zeros(T, device="cuda", dtype=torch.int64)
    slots = torch.full((T,), -1, device="cuda", dtype=torch.int64)

    def step():
        return cr.rope_and_cache(q, k, v, positions, kc, vc, slots, cos_sin_cache=cache)

    graph, _ = _capture(step)
    for _ in range(2):
        host = {name: rng.standard_normal(tuple(t.shape)).astype(np.float32)
                for name, t in (("q", q), ("k", k), ("v", v))}
        new_positions = rng.integers(0, 8192, T)
        new_slots = rng.permutation(num_blocks * block_size)[:T]
        with torch.no_grad():
            for name, t in (("q", q), ("k", k), ("v", v)):
                t.copy_(torch.from_numpy(host[name]))
            positions.copy_(torch.from_numpy(new_positions))
            slots.copy_(torch.from_numpy(new_slots))
            kc.fill_(float("nan"))
            vc.fill_(float("nan"))
        inputs = {name: as_numpy(t) for name, t in (("q", q), ("k", k), ("v", v))}
        graph.replay()
        torch.cuda.synchronize()
        ref = dict(positions=new_positions, cos_sin_cache=as_numpy(cache).astype(np.float64))
        rows = torch.from_numpy(new_slots).to("cuda")
        for got, name in ((q, "q"), (kc.reshape(-1, Hk, D)[rows], "k")):
            assert_rope_close(as_numpy(got), reference_rope(inputs[name], **ref), inputs[name],
                              interleaved=False, rotary_dim=D)
        assert_bits_equal(as_numpy(vc.reshape(-1, Hk, D)[rows]), inputs["v"],
                          what="v cache rows after replay")


@pytest.mark.gpu
def test_cuda_graph_capture_rms_norm_rope_forward_backward(rng):
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    T, Hq, Hk, D = 64, 8, 2, 128
    cache = cr.cos_sin_cache(8192, D, like=torch.empty(0, device="cuda"))
    q = torch.zeros(T, Hq, D, device="cuda", requires_grad=True)
    k = torch.zeros(T, Hk, D, device="cuda", requires_grad=True)
    wq = torch.ones(D, device="cuda", requires_grad=True)
    wk = torch.ones(D, device="cuda", requires_grad=True)
    gq, gk = torch.zeros(T, Hq, D, device="cuda"), torch.zeros(T, Hk, D, device="cuda")
    positions = torch.zeros(T, device="cuda", dtype=torch.int64)
    leaves = (q, k, wq, wk)

    def step():
        q_out, k_out = cr.rms_norm_rope(q, k, wq, wk, positions, eps=EPS, cos_sin_cache=cache)
        return (q_out, k_out) + torch.autograd.grad((q_out, k_out), leaves, (gq, gk))

    graph, outs = _capture(step)
    for _ in range(2):
        with torch.no_grad():
            for t in (q, k, gq, gk):
                t.copy_(torch.from_numpy(rng.standard_normal(tuple(t.shape)).astype(np.float32)))
            for w in (wq, wk):
                w.copy_(torch.from_numpy(rng.uniform(0.5, 1.5, D).astype(np.float32)))
            positions.copy_(torch.from_numpy(rng.integers(0, 8192, T)))
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager_leaves = [x.detach().clone().requires_grad_(True) for x in leaves]
        expected_out = cr.rms_norm_rope(*eager_leaves, positions, eps=EPS, cos_sin_cache=cache)
        expected = tuple(expected_out) + torch.autograd.grad(expected_out, eager_leaves, (gq, gk))
        for got, want in zip(outs, expected):
            assert_bits_equal(got, want.detach(), what="replayed rms_norm_rope step")
