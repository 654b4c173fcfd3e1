"""The TransformerEngine adapter (cupyrope.compat.te) against a float64 reference written from
TransformerEngine's documented semantics (its ``apply_rotary_pos_emb`` docstring and the position
arithmetic of its fused kernel):

- token ``s`` of sequence ``b`` takes row ``start_positions[b] + p(s)`` of ``freqs``, where
  ``p(s) = s`` without context parallelism, and with ``cp_size > 1`` (each sequence cut into
  ``2 * cp_size`` chunks, rank ``r`` holding chunks ``r`` and ``2 * cp_size - 1 - r``, ``L`` the
  local length) ``p(s) = r * L/2 + s`` for ``s < L/2``, else ``(2 * cp_size - 1 - r) * L/2 +
  s - L/2``; for ``"thd"`` ``L`` is each sequence's ``(cu_seqlens[i + 1] - cu_seqlens[i]) /
  cp_size``;
- the first ``d2`` dims become ``x * cos(f) + rotate_half(x) * sin(f)`` with ``f`` that row;
  the rest pass through;
- ``apply_fused_qkv_rotary_pos_emb``: groups of q heads, k heads and one v head along the last
  dim of ``[s, b, h, q + k + v]``; q and k rotated by their own tables, v copied; TE's output
  shapes.

Values and gradients in float64 (CPU here; the same cases on CUDA tensors are marked gpu), last
dims of every stride, and the calls that cannot map, with what to call instead.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cupyrope.compat import te  # noqa: E402
from tolerances import as_numpy, assert_rope_close  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return request.param


def te_freqs(rows, rotary_dim, interleaved, theta=10000.0, device="cpu"):
    """Angles as TransformerEngine's RotaryPositionEmbedding returns them: float32
    [rows, 1, 1, rotary_dim] on the tensors' device, each pair's angle twice (halves repeated for
    NeoX, side by side for interleaved)."""
    inv_freq = 1.0 / theta ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    angles = np.outer(np.arange(rows), inv_freq).astype(np.float32)
    full = (np.repeat(angles, 2, axis=-1) if interleaved
            else np.concatenate([angles, angles], axis=-1))
    return torch.from_numpy(full).reshape(rows, 1, 1, rotary_dim).to(device)


def cp_position(s, local_length, cp_size, cp_rank):
    if cp_size == 1:
        return s
    half = local_length // 2
    if s < half:
        return cp_rank * half + s
    return (2 * cp_size - 1 - cp_rank) * half + s - half


def reference_positions(shape, tensor_format, start_positions, cu_seqlens, cp_size, cp_rank):
    """The row of freqs for every token: [s, b] (sbhd), [b, s] (bshd) or [t] (thd)."""
    starts = None if start_positions is None else [int(x) for x in start_positions]
    if tensor_format == "thd":
        bounds = [int(x) // cp_size for x in cu_seqlens]
        rows = []
        for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            rows += [cp_position(s, hi - lo, cp_size, cp_rank) + (starts[i] if starts else 0)
                     for s in range(hi - lo)]
        return torch.tensor(rows, dtype=torch.int64)
    seq, batch = (shape[0], shape[1]) if tensor_format == "sbhd" else (shape[1], shape[0])
    rows = torch.tensor([[cp_position(s, seq, cp_size, cp_rank) + (starts[b] if starts else 0)
                          for s in range(seq)] for b in range(batch)], dtype=torch.int64)
    return rows.t() if tensor_format == "sbhd" else rows


def reference(t, freqs, *, tensor_format="sbhd", start_positions=None, interleaved=False,
              cu_seqlens=None, cp_size=1, cp_rank=0):
    """float64, differentiable: ``x * cos(f) + rotate_half(x) * sin(f)`` on the first d2 dims."""
    rows = reference_positions(t.shape, tensor_format, start_positions, cu_seqlens, cp_size,
                               cp_rank).to(t.device)
    table = freqs.reshape(freqs.shape[0], -1).double().to(t.device)
    angles = table[rows].unsqueeze(-2)  # over heads
    d2 = angles.shape[-1]
    x, rest = t[..., :d2].double(), t[..., d2:].double()
    if interleaved:
        rotated_half = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        rotated_half = torch.cat((-x[..., d2 // 2:], x[..., :d2 // 2]), dim=-1)
    return torch.cat((x * angles.cos() + rotated_half * angles.sin(), rest), dim=-1)


def check(got, want, x, interleaved, rotary_dim):
    """Within the bound of cos/sin rounded to float32 (the adapter's table), pass-through exact."""
    assert got.shape == x.shape and got.dtype == x.dtype and got.device == x.device
    assert_rope_close(as_numpy(got), as_numpy(want.detach()), as_numpy(x.detach()),
                      interleaved=interleaved, rotary_dim=rotary_dim, table_dtype="float32")


def layout(t, how):
    """t's values in another memory layout: as given, or stored with its last two dims swapped
    (a non-unit stride in the last dim, as TransformerEngine's own tests make them)."""
    if how == "dense":
        return t
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


# sbhd / bshd: [s_local, b] or [b, s_local] of H heads; thd: packed sequences.
CP_CASES = [
    pytest.param(dict(tensor_format="sbhd", cp_size=2, cp_rank=1), id="sbhd-cp2r1"),
    pytest.param(dict(tensor_format="bshd", cp_size=4, cp_rank=0), id="bshd-cp4r0"),
    pytest.param(dict(tensor_format="bshd", cp_size=4, cp_rank=3), id="bshd-cp4r3"),
    pytest.param(dict(tensor_format="thd", cp_size=2, cp_rank=0, cu_seqlens=[0, 8, 20, 32]),
                 id="thd-cp2r0"),
    pytest.param(dict(tensor_format="thd", cp_size=3, cp_rank=2, cu_seqlens=[0, 12, 12, 30]),
                 id="thd-cp3r2-empty"),
]


def make_input(case, rng, device, H=3, D=32, B=3, S=6):
    fmt, cp = case["tensor_format"], case.get("cp_size", 1)
    if fmt == "thd":
        shape = (case["cu_seqlens"][-1] // cp, H, D)
        batch = len(case["cu_seqlens"]) - 1
    else:
        shape = (S, B, H, D) if fmt == "sbhd" else (B, S, H, D)
        batch = B
    t = torch.from_numpy(rng.standard_normal(shape)).to(device)
    kwargs = dict(case)
    if "cu_seqlens" in kwargs:
        kwargs["cu_seqlens"] = torch.tensor(kwargs["cu_seqlens"], dtype=torch.int32, device=device)
    return t, kwargs, batch


@pytest.mark.parametrize("case", CP_CASES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [32, 16])
@pytest.mark.parametrize("memory", ["dense", "last_dims_swapped"])
def test_start_positions_with_context_parallelism(case, interleaved, rotary_dim, memory, device,
                                                  rng):
    t, kwargs, batch = make_input(case, rng, device)
    t = layout(t, memory)
    starts = torch.tensor(rng.integers(0, 9, batch), dtype=torch.int32, device=device)
    freqs = te_freqs(128, rotary_dim, interleaved, device=device)
    got = te.te_apply_rotary_pos_emb(t, freqs, start_positions=starts, interleaved=interleaved,
                                     **kwargs)
    want = reference(t, freqs, start_positions=starts.cpu(), interleaved=interleaved, **kwargs)
    check(got, want, t, interleaved, rotary_dim)


@pytest.mark.parametrize("case", CP_CASES[:2] + CP_CASES[3:4])
@pytest.mark.parametrize("memory", ["dense", "last_dims_swapped"])
def test_gradients_with_start_positions_and_context_parallelism(case, memory, device, rng):
    x, kwargs, batch = make_input(case, rng, device)
    x = layout(x, memory).requires_grad_(True)
    starts = torch.tensor(rng.integers(0, 9, batch), dtype=torch.int64, device=device)
    freqs = te_freqs(128, 24, True, device=device)
    upstream = torch.from_numpy(rng.standard_normal(x.shape)).to(device)
    got = te.te_apply_rotary_pos_emb(x, freqs, start_positions=starts, interleaved=True, **kwargs)
    (grad,) = torch.autograd.grad(got, x, upstream)
    ref_x = x.detach().clone().requires_grad_(True)
    want = reference(ref_x, freqs, start_positions=starts.cpu(), interleaved=True, **kwargs)
    (expected,) = torch.autograd.grad(want, ref_x, upstream)
    # The gradient is the inverse rotation of the upstream: the forward's bound, sin negated.
    inverse = reference(upstream, -freqs, start_positions=starts.cpu(), interleaved=True, **kwargs)
    check(grad, inverse, upstream, True, 24)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-6)


def test_context_parallel_ranks_cover_every_position_once(rng):
    """With start positions, the ranks' rows of one sbhd batch are the full sequence's, shifted."""
    cp_size, seq = 4, 6
    starts = torch.tensor([0, 5], dtype=torch.int32)
    freqs = te_freqs(64, 8, False)
    seen = []
    for rank in range(cp_size):
        t = torch.ones(seq, 2, 1, 8, dtype=torch.float64)
        out = te.te_apply_rotary_pos_emb(t, freqs, start_positions=starts, cp_size=cp_size,
                                         cp_rank=rank)
        # dims 0 and 4 of ones become cos - sin and cos + sin of the row's first angle (the
        # position itself): their sum, 2 cos, tells the rows apart
        seen.append(out[:, :, 0, 0] + out[:, :, 0, 4])
    rows = torch.cat(seen).t()  # [b, all tokens of all ranks]
    table = freqs[:, 0, 0, 0].double()
    for b in range(2):
        expected = 2 * table.cos()[int(starts[b]):int(starts[b]) + cp_size * seq]
        torch.testing.assert_close(rows[b].sort().values, expected.sort().values, rtol=0,
                                   atol=1e-6)


def test_odd_local_sequence_with_context_parallelism_is_refused(rng):
    t = torch.from_numpy(rng.standard_normal((5, 2, 1, 8)))
    with pytest.raises(ValueError, match="apply_rotary_pos_emb: .*even"):
        te.te_apply_rotary_pos_emb(t, te_freqs(64, 8, False), cp_size=2, cp_rank=0)


# ----------------------------------------------------------------------------------------------------
# apply_fused_qkv_rotary_pos_emb


def split_reference(qkv, q_freqs, k_freqs, split, **kwargs):
    """TE's outputs from the documented layout: per group, q heads, k heads, one v head."""
    q_width, k_width, d = split
    lead, groups = qkv.shape[:2], qkv.shape[2]
    q = qkv[..., :q_width].reshape(*lead, groups * (q_width // d), d)
    k = qkv[..., q_width:q_width + k_width].reshape(*lead, groups * (k_width // d), d)
    v = qkv[..., q_width + k_width:]
    return (reference(q, q_freqs, **kwargs).reshape(*lead, groups * q_width // k_width, k_width),
            reference(k, k_freqs, **kwargs).reshape(*lead, groups, k_width), v.double())


QKV_CASES = [
    pytest.param(dict(tensor_format="sbhd"), id="sbhd"),
    pytest.param(dict(tensor_format="bshd"), id="bshd"),
    pytest.param(dict(tensor_format="sbhd", start_positions=[4, 0, 11]), id="sbhd-start"),
    pytest.param(dict(tensor_format="bshd", start_positions=[2, 7, 1]), id="bshd-start"),
    pytest.param(dict(tensor_format="sbhd", cp_size=2, cp_rank=1), id="sbhd-cp2r1"),
    pytest.param(dict(tensor_format="bshd", cp_size=3, cp_rank=0), id="bshd-cp3r0"),
]


def make_qkv(case, rng, device, split, S=6, B=3, groups=2, dtype=torch.float64):
    shape = (S, B) if case["tensor_format"] == "sbhd" else (B, S)
    qkv = torch.from_numpy(rng.standard_normal((*shape, groups, sum(split)))).to(device, dtype)
    kwargs = dict(case)
    if "start_positions" in kwargs:
        kwargs["start_positions"] = torch.tensor(kwargs["start_positions"], dtype=torch.int32,
                                                 device=device)
    return qkv, kwargs


def reference_kwargs(kwargs):
    out = dict(kwargs)
    if "start_positions" in out:
        out["start_positions"] = out["start_positions"].cpu()
    return out


@pytest.mark.parametrize("case", QKV_CASES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("split, rotary_dim", [([64, 16, 16], 16), ([32, 32, 16], 8),
                                               ([32, 16, 16], 12)])
@pytest.mark.parametrize("shared_freqs", [True, False])
def test_fused_qkv_matches_the_reference(case, interleaved, split, rotary_dim, shared_freqs,
                                         device, rng):
    qkv, kwargs = make_qkv(case, rng, device, split)
    q_freqs = te_freqs(64, rotary_dim, interleaved, device=device)
    k_freqs = q_freqs if shared_freqs else te_freqs(64, rotary_dim, interleaved, theta=500.0,
                                                    device=device)
    got = te.te_apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, split,
                                               interleaved=interleaved, **kwargs)
    want = split_reference(qkv, q_freqs, k_freqs, split, interleaved=interleaved,
                           **reference_kwargs(kwargs))
    assert len(got) == 3
    q_width, k_width, d = split
    lead, groups = tuple(qkv.shape[:2]), qkv.shape[2]
    shapes = [(*lead, groups * q_width // k_width, k_width), (*lead, groups, k_width),
              (*lead, groups, d)]
    for out, ref, shape in zip(got, want, shapes):
        assert tuple(out.shape) == shape and out.is_contiguous()
    # Checked head by head: the layout the reference rotates.
    heads = lambda x: x.reshape(*lead, -1, d)  # noqa: E731
    inputs = (qkv[..., :q_width], qkv[..., q_width:q_width + k_width])
    for out, ref, x in zip(got[:2], want[:2], inputs):
        check(heads(out), heads(ref), heads(x.contiguous()), interleaved, rotary_dim)
    assert torch.equal(got[2], qkv[..., q_width + k_width:])
    assert got[2].data_ptr() != qkv.data_ptr()  # a copy, as TransformerEngine returns


def test_fused_qkv_one_launch_for_one_table(monkeypatch, rng):
    calls = []
    original = te.apply_rope
    monkeypatch.setattr(te, "apply_rope",
                        lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    qkv, kwargs = make_qkv(QKV_CASES[0].values[0], rng, "cpu", [32, 16, 16])
    freqs = te_freqs(64, 16, False)
    te.te_apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, [32, 16, 16], **kwargs)
    assert len(calls) == 1  # q and k together
    te.te_apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs.clone(), [32, 16, 16], **kwargs)
    assert len(calls) == 3  # two tables: one call each


@pytest.mark.parametrize("case", [QKV_CASES[1], QKV_CASES[4]])
def test_fused_qkv_gradients(case, device, rng):
    split = [32, 16, 16]
    qkv, kwargs = make_qkv(case, rng, device, split)
    qkv.requires_grad_(True)
    q_freqs = te_freqs(64, 16, True, device=device)
    k_freqs = te_freqs(64, 16, True, theta=100.0, device=device)
    got = te.te_apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, split, interleaved=True,
                                               **kwargs)
    upstream = [torch.from_numpy(rng.standard_normal(out.shape)).to(device) for out in got]
    (grad,) = torch.autograd.grad(got, qkv, upstream)
    ref_qkv = qkv.detach().clone().requires_grad_(True)
    want = split_reference(ref_qkv, q_freqs, k_freqs, split, interleaved=True,
                           **reference_kwargs(kwargs))
    (expected,) = torch.autograd.grad(want, ref_qkv, upstream)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-6)


def test_fused_qkv_bfloat16(rng):
    split = [64, 32, 32]
    qkv, kwargs = make_qkv(QKV_CASES[0].values[0], rng, "cpu", split, dtype=torch.bfloat16)
    freqs = te_freqs(64, 32, False)
    q, k, v = te.te_apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, split, **kwargs)
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16
    want = split_reference(qkv.double(), freqs, freqs, split)
    lead = tuple(qkv.shape[:2])
    for out, ref, x in ((q, want[0], qkv[..., :64]), (k, want[1], qkv[..., 64:96])):
        heads = lambda t: t.reshape(*lead, -1, 32)  # noqa: E731
        assert_rope_close(as_numpy(heads(out)), as_numpy(heads(ref)), as_numpy(heads(x.contiguous())),
                          interleaved=False, rotary_dim=32, table_dtype="float32")


@pytest.mark.parametrize("kwargs, match", [
    (dict(tensor_format="thd"), r"'thd' is not supported.*te_apply_rotary_pos_emb"),
    (dict(tensor_format="hbsd"), "tensor_format"),
    (dict(cp_size=2, cp_rank=0, start_positions=torch.zeros(3, dtype=torch.int32)),
     r"start_positions with cp_size > 1.*te_apply_rotary_pos_emb"),
    (dict(cp_size=2, cp_rank=2), "cp_rank"),
    (dict(split=[32, 16, 8]), "adds up to 56"),
    (dict(split=[24, 24, 16]), "whole heads"),
    (dict(split=[32, 24, 8]), "whole heads"),  # 32 not a multiple of 24
    (dict(split=[32, 16]), "three positive ints"),
    (dict(split=[32, 16.0, 16]), "three positive ints"),
])
def test_fused_qkv_refusals(kwargs, match, rng):
    qkv = torch.from_numpy(rng.standard_normal((6, 3, 2, 64)))
    split = kwargs.pop("split", [32, 16, 16])
    freqs = te_freqs(64, 16, False)
    with pytest.raises(ValueError, match="apply_fused_qkv_rotary_pos_emb: .*" + match):
        te.te_apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, split, **kwargs)


def test_fused_qkv_odd_freqs_width_names_the_call(rng):
    qkv = torch.from_numpy(rng.standard_normal((6, 3, 2, 64)))
    with pytest.raises(ValueError, match="apply_fused_qkv_rotary_pos_emb: freqs"):
        te.te_apply_fused_qkv_rotary_pos_emb(qkv, torch.zeros(64, 1, 1, 15),
                                             torch.zeros(64, 1, 1, 15), [32, 16, 16])


@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("cp_rank", [0, 1])
def test_te_positions_agrees_with_the_adapter_under_context_parallelism(tensor_format, cp_rank):
    """cupyrope.te_positions (host) and the adapter's device positions give the same rows for
    start_positions with cp_size > 1."""
    import cupyrope as cr

    cp_size, starts = 2, torch.tensor([5, 0, 11])
    if tensor_format == "thd":
        cu_seqlens = torch.tensor([0, 8, 12, 24])  # whole sequences; this rank holds half of each
        t = torch.zeros(12, 1, 8)
    else:
        cu_seqlens = None
        t = torch.zeros((6, 3, 1, 8) if tensor_format == "sbhd" else (3, 6, 1, 8))
    host = cr.te_positions(t, tensor_format, cu_seqlens=cu_seqlens, start_positions=starts,
                           cp_size=cp_size, cp_rank=cp_rank)
    device = te.positions_on_device(t, tensor_format, cu_seqlens, starts, cp_size, cp_rank)
    torch.testing.assert_close(torch.as_tensor(host).expand_as(device), device, rtol=0, atol=0)
