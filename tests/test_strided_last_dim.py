"""Heads whose elements are not adjacent: any stride in the last dim (TransformerEngine's
``t.transpose(2, 3).contiguous().transpose(2, 3)``, every other element of a wider buffer, a
reversed NumPy view).

- ``apply_rope`` takes them on every mutable backend (NumPy and torch CPU here; CuPy and torch
  CUDA on the GPU, the kernels' scalar path) against the float64 reference: every angle source,
  both pairings, partial rotary, every dtype, in place (elements between the heads' untouched),
  ``out=`` arrays, and the torch autograd backward;
- the refusals that remain: written layouts whose indices reach one element twice, in-place
  operands that share elements, and the fused ops (with a message that says what to do);
- the launch: a strided head never takes a 16-byte path, and a dense one still does;
- repeat calls: a recipe of a dense call is never replayed for a strided one.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupyrope as cr
from autograd_cases import SOURCES as AUTOGRAD_SOURCES
from autograd_cases import angle_call, to_torch, torch_reference_rope
from backends import Backend, backend_params, rope_and_check
from tolerances import assert_bits_equal, np_dtype

MUTABLE = backend_params(["numpy", "torch", "cupy", "torch-cuda"])
TORCH = backend_params(["torch", "torch-cuda"])
T, HQ, HK, D = 7, 4, 2, 64
SENTINEL = 3.25  # between-head elements of the buffers: never written


def _swap_last(backend: Backend, x):
    return x.transpose(-1, -2) if backend.framework == "torch" else x.swapaxes(-1, -2)


def strided(backend: Backend, host: np.ndarray, layout: str):
    """(view, buffer): ``host``'s values on the backend as a view whose last dim is not dense,
    and the buffer it lives in.

    every_other: the even elements of a buffer twice as wide (the odd ones hold SENTINEL);
    transposed: ``[..., D, H]`` storage seen as ``[..., H, D]`` (last stride H, TE's layout);
    reversed: a NumPy / CuPy view with stride -1 (torch has no negative strides)."""
    if layout == "every_other":
        buffer = np.full(host.shape[:-1] + (2 * host.shape[-1],), SENTINEL, host.dtype)
        buffer[..., ::2] = host
        stored = backend.put(buffer)
        return stored[..., ::2], stored
    if layout == "transposed":
        stored = backend.put(np.swapaxes(host, -1, -2))
        return _swap_last(backend, stored), stored
    assert layout == "reversed"
    if backend.framework == "torch":
        pytest.skip("torch tensors have no negative strides")
    stored = backend.put(host[..., ::-1])
    return stored[..., ::-1], stored


def _last_stride(backend: Backend, x) -> int:
    if backend.framework == "torch":
        return x.stride(-1)
    return x.strides[-1] // x.itemsize


def _check_gaps(backend: Backend, buffer, layout: str) -> None:
    if layout == "every_other":
        gaps = backend.get(buffer)[..., 1::2].astype(np.float64)
        assert (gaps == SENTINEL).all(), "an element between two heads' elements was written"


# ----------------------------------------------------------------------------------------------------
# values


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
@pytest.mark.parametrize("layout", ["every_other", "transposed"])
@pytest.mark.parametrize("source", ["cache", "tables_half", "tables_full", "computed"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [D, 40])
@pytest.mark.parametrize("inplace", [False, True])
def test_strided_heads_rotate_like_the_reference(backend, layout, source, interleaved, rotary_dim,
                                                 inplace, rng):
    q_view, q_buffer = strided(backend, rng.standard_normal((T, HQ, D)).astype(np.float32), layout)
    k_view, k_buffer = strided(backend, rng.standard_normal((T, HK, D)).astype(np.float32), layout)
    assert _last_stride(backend, q_view) != 1 and _last_stride(backend, k_view) != 1
    positions = rng.integers(0, 4096, T)
    rope_and_check(backend, q_view, k_view, source, rotary_dim, interleaved=interleaved,
                   positions=positions, inplace=inplace)
    _check_gaps(backend, q_buffer, layout)
    _check_gaps(backend, k_buffer, layout)


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("layout", ["every_other", "transposed"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_every_dtype(backend, dtype, layout, interleaved, rng):
    """[B, S, H, D] with two token dims; the cache in the input's precision class."""
    table_dtype = "float64" if dtype == "float64" else "float32"
    q = rng.standard_normal((2, T, HQ, D)).astype(np_dtype(dtype))
    k = rng.standard_normal((2, T, HK, D)).astype(np_dtype(dtype))
    q_view, q_buffer = strided(backend, q, layout)
    k_view, _ = strided(backend, k, layout)
    for inplace in (False, True):
        rope_and_check(backend, q_view, k_view, "cache", D, interleaved=interleaved,
                       positions=rng.integers(0, 4096, (2, T)), inplace=inplace,
                       table_dtype=table_dtype)
    _check_gaps(backend, q_buffer, layout)


@pytest.mark.parametrize("backend", backend_params(["numpy", "cupy"]), indirect=True)
@pytest.mark.parametrize("source", ["cache", "tables_half", "computed"])
@pytest.mark.parametrize("inplace", [False, True])
def test_negative_last_dim_stride(backend, source, inplace, rng):
    q_view, _ = strided(backend, rng.standard_normal((T, HQ, D)).astype(np.float32), "reversed")
    k_view, _ = strided(backend, rng.standard_normal((T, HK, D)).astype(np.float32), "reversed")
    assert _last_stride(backend, q_view) == -1
    rope_and_check(backend, q_view, k_view, source, 48, interleaved=False,
                   positions=rng.integers(0, 4096, T), inplace=inplace)


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
@pytest.mark.parametrize("interleaved", [False, True])
def test_q_and_k_interleaved_in_one_buffer_rotate_in_place(backend, interleaved, rng):
    """q the even and k the odd elements of one buffer share no element: in place is allowed, and
    each is rotated exactly as on its own."""
    buffer = rng.standard_normal((T, HQ, 2 * D)).astype(np.float32)
    stored = backend.put(buffer)
    q, k = stored[..., 0::2], stored[..., 1::2]
    positions = rng.integers(0, 4096, T)
    cache = cr.cos_sin_cache(4096, D)
    alone = [backend.get(cr.apply_rope(backend.put(np.ascontiguousarray(part)),
                                       positions=backend.put(positions),
                                       cos_sin_cache=backend.put(cache), interleaved=interleaved))
             for part in (buffer[..., 0::2], buffer[..., 1::2])]
    got = cr.apply_rope(q, k, backend.put(positions), cos_sin_cache=backend.put(cache),
                        interleaved=interleaved, inplace=True)
    assert got[0] is q and got[1] is k
    for expected, view in zip(alone, (q, k)):
        np.testing.assert_array_equal(backend.get(view), expected)


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
@pytest.mark.parametrize("interleaved", [False, True])
def test_out_arrays_with_a_strided_last_dim(backend, interleaved, rng):
    """out= views with every other element: the results land there, bit for bit those of a dense
    call, and nothing between them is written."""
    q = rng.standard_normal((T, HQ, D)).astype(np.float32)
    k = rng.standard_normal((T, HK, D)).astype(np.float32)
    positions = backend.put(rng.integers(0, 4096, T))
    cache = backend.put(cr.cos_sin_cache(4096, 48))
    q_out, q_buffer = strided(backend, np.full_like(q, np.nan), "every_other")
    k_out, k_buffer = strided(backend, np.full_like(k, np.nan), "every_other")
    qb, kb = backend.put(q), backend.put(k)
    result = cr.apply_rope(qb, kb, positions, cos_sin_cache=cache, interleaved=interleaved,
                           out=(q_out, k_out))
    assert result[0] is q_out and result[1] is k_out
    dense = cr.apply_rope(qb, kb, positions, cos_sin_cache=cache, interleaved=interleaved)
    for got, want in zip((q_out, k_out), dense):
        np.testing.assert_array_equal(backend.get(got), backend.get(want))
    _check_gaps(backend, q_buffer, "every_other")
    _check_gaps(backend, k_buffer, "every_other")


@pytest.mark.parametrize("backend", backend_params(["numpy", "torch"]), indirect=True)
def test_strided_and_dense_inputs_give_the_same_bits_on_the_host(backend, rng):
    q = rng.standard_normal((T, HQ, D)).astype(np_dtype("bfloat16"))
    view, _ = strided(backend, q, "transposed")
    positions = backend.put(rng.integers(0, 4096, T))
    np.testing.assert_array_equal(backend.get(cr.apply_rope(view, positions=positions)),
                                  backend.get(cr.apply_rope(backend.put(q), positions=positions)))


# ----------------------------------------------------------------------------------------------------
# autograd


def _torch_device(backend: Backend) -> str:
    return "cuda" if backend.on_gpu else "cpu"


@pytest.mark.parametrize("backend", TORCH, indirect=True)
@pytest.mark.parametrize("source", AUTOGRAD_SOURCES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_gradients_through_strided_heads(backend, source, interleaved, rng):
    """Leaves stored [T, D, H] and rotated as [T, H, D] views (partial rotary): the gradients are
    those of autograd through an independent float64 torch formulation."""
    import torch

    device, rotary_dim = _torch_device(backend), 48
    lib, _, _, (cos, sin) = angle_call(source, (T,), rotary_dim, interleaved=interleaved, rng=rng,
                                       device=device)
    leaves = [to_torch(rng.standard_normal((T, D, h)), device, True) for h in (HQ, HK)]
    upstream = [to_torch(rng.standard_normal((T, h, D)), device) for h in (HQ, HK)]
    q, k = (leaf.transpose(1, 2) for leaf in leaves)
    outs = cr.apply_rope(q, k, interleaved=interleaved, **lib)
    grads = torch.autograd.grad(outs, leaves, upstream)
    c, s = (torch.from_numpy(x).to(device) for x in (cos, sin))
    ref_leaves = [leaf.detach().clone().requires_grad_(True) for leaf in leaves]
    ref_outs = [torch_reference_rope(leaf.transpose(1, 2), c, s, rotary_dim, interleaved)
                for leaf in ref_leaves]
    expected = torch.autograd.grad(ref_outs, ref_leaves, upstream)
    for got, want, out, ref in zip(grads, expected, outs, ref_outs):
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", TORCH, indirect=True)
@pytest.mark.parametrize("interleaved", [False, True])
def test_in_place_gradients_on_strided_views_of_a_projection(backend, interleaved, rng):
    """In place on [T, H, D] views of a non-leaf stored [T, D, H]: the forward rotates the
    projection's storage, the backward gives the leaf the inverse rotation of the upstream."""
    import torch

    device, rotary_dim = _torch_device(backend), D
    lib, _, _, (cos, sin) = angle_call("cache", (T,), rotary_dim, interleaved=interleaved,
                                       rng=rng, device=device)
    leaf = to_torch(rng.standard_normal((T, D, HQ + HK)), device, True)
    upstream = to_torch(rng.standard_normal((T, HQ + HK, D)), device)
    projected = leaf * 1.0
    q, k = projected[..., :HQ].transpose(1, 2), projected[..., HQ:].transpose(1, 2)
    q_out, k_out = cr.apply_rope(q, k, interleaved=interleaved, inplace=True, **lib)
    assert q_out is q and k_out is k
    (grad,) = torch.autograd.grad(torch.cat((q_out, k_out), dim=1), leaf, upstream)
    c, s = (torch.from_numpy(x).to(device) for x in (cos, sin))
    ref_leaf = leaf.detach().clone().requires_grad_(True)
    ref = torch_reference_rope(ref_leaf.transpose(1, 2), c, s, rotary_dim, interleaved)
    (expected,) = torch.autograd.grad(ref, ref_leaf, upstream)
    torch.testing.assert_close(torch.cat((q_out, k_out), dim=1).detach(), ref.detach(),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------------
# refusals


def _as_strided(backend: Backend, buffer, shape, strides):
    """A writable view of a 1-d backend buffer with element strides."""
    if backend.framework == "torch":
        return buffer.as_strided(shape, strides)
    item = buffer.itemsize
    if backend.framework == "cupy":
        import cupy

        return cupy.lib.stride_tricks.as_strided(buffer, shape, tuple(s * item for s in strides))
    return np.lib.stride_tricks.as_strided(buffer, shape, tuple(s * item for s in strides),
                                           writeable=True)


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
@pytest.mark.parametrize("written", ["inplace", "out"])
def test_written_layouts_whose_indices_meet_are_refused(backend, written, rng):
    """Head h's element d at h + 2 d: heads 0 and 2 share elements (no zero stride anywhere).
    Reading such a view is fine; writing it is refused before anything is written."""
    host = rng.standard_normal(2 * 64).astype(np.float32)
    buffer = backend.put(host)
    aliased = _as_strided(backend, buffer, (2, 4, 8), (64, 1, 2))
    positions = backend.put(np.arange(2))
    cr.apply_rope(aliased, positions=positions)  # read only: fine
    if written == "inplace":
        call = lambda: cr.apply_rope(aliased, positions=positions, inplace=True)  # noqa: E731
        name = r"\bq\b"
    else:
        q = backend.put(rng.standard_normal((2, 4, 8)).astype(np.float32))
        call = lambda: cr.apply_rope(q, positions=positions, out=aliased)  # noqa: E731
        name = r"\bq_out\b"
    with pytest.raises(ValueError, match=name + r".*same element"):
        call()
    assert_bits_equal(backend.get(buffer), host, what="the aliased buffer")


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
def test_zero_last_dim_stride_reads_but_is_not_written(backend, rng):
    host = rng.standard_normal(T * HQ).astype(np.float32)
    buffer = backend.put(host)
    broadcast = _as_strided(backend, buffer, (T, HQ, D), (HQ, 1, 0))  # each head one value
    positions = backend.put(np.arange(T))
    out = backend.get(cr.apply_rope(broadcast, positions=positions))
    dense = backend.get(cr.apply_rope(backend.put(backend.get(broadcast)), positions=positions))
    # The general kernel and the 16-byte one round float32 differently in places (1 ulp): both are
    # within the accuracy bound of the same rotation.
    np.testing.assert_allclose(out, dense, rtol=2.0 ** -20, atol=2.0 ** -22)
    with pytest.raises(ValueError, match=r"\bq\b.*zero stride"):
        cr.apply_rope(broadcast, positions=positions, inplace=True)
    assert_bits_equal(backend.get(buffer), host, what="the broadcast buffer")


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
def test_in_place_strided_views_that_share_elements_are_refused(backend, rng):
    """q the even elements [0, 2D) and k the even elements [2, 2D]: they share all but one."""
    host = rng.standard_normal((T, HQ, 2 * D + 2)).astype(np.float32)
    stored = backend.put(host)
    q, k = stored[..., 0:2 * D:2], stored[:, :HK, 2::2]
    with pytest.raises(ValueError, match=r"\bk\b shares memory with \bq\b|\bq\b shares memory"):
        cr.apply_rope(q, k, backend.put(np.arange(T)), inplace=True)
    assert_bits_equal(backend.get(stored), host, what="the shared buffer")


def test_overlaps_itself_is_exact(rng):
    """Against brute force over random small layouts, negative and zero strides included."""
    from cupyrope.core.arrays import ArrayInfo
    from cupyrope.core.overlap import overlaps_itself

    seen = set()
    for _ in range(3000):
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(n) for n in rng.integers(0, 5, ndim))
        strides = tuple(int(s) for s in rng.integers(-7, 8, ndim))
        offsets = np.zeros(shape, np.int64)
        for axis, stride in enumerate(strides):
            index = np.arange(shape[axis]).reshape((-1,) + (1,) * (ndim - axis - 1))
            offsets = offsets + index * stride
        expected = offsets.size != np.unique(offsets).size
        info = ArrayInfo(None, "numpy", None, 1 << 20, shape, strides, "float32")
        assert overlaps_itself(info) == expected, (shape, strides)
        seen.add(expected)
    assert seen == {False, True}


def _fused_calls(backend: Backend, q, k, rng):
    positions = backend.put(rng.integers(0, 512, T))
    cache = backend.put(cr.cos_sin_cache(512, D))
    weight = backend.put(np.ones(D, np.float32))
    v = backend.put(rng.standard_normal((T, HK, D)).astype(np.float32))
    caches = [backend.put(np.zeros((4, 4, HK, D), np.float32)) for _ in range(2)]
    slots = backend.put(np.arange(T, dtype=np.int64))
    return {
        "rms_norm_rope": lambda: cr.rms_norm_rope(q, k, weight, weight, positions, eps=1e-6,
                                                  cos_sin_cache=cache),
        "apply_rope": lambda: cr.apply_rope(q, k, positions, cos_sin_cache=cache,
                                            out_dtype="float8_e4m3fn"),
        "rope_and_cache": lambda: cr.rope_and_cache(q, k, v, positions, *caches, slots,
                                                    cos_sin_cache=cache),
    }


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
@pytest.mark.parametrize("op", ["rms_norm_rope", "apply_rope", "rope_and_cache"])
@pytest.mark.parametrize("which", ["q", "k"])
def test_fused_ops_say_what_to_pass_instead(backend, op, which, rng):
    """The fused ops read and write whole dense heads: a strided q or k is refused with a message
    that names it and says what to do instead, and nothing is written."""
    q = rng.standard_normal((T, HQ, D)).astype(np.float32)
    k = rng.standard_normal((T, HK, D)).astype(np.float32)
    q_view, q_buffer = (strided(backend, q, "every_other") if which == "q"
                        else (backend.put(q),) * 2)
    k_view, k_buffer = (strided(backend, k, "every_other") if which == "k"
                        else (backend.put(k),) * 2)
    before = [backend.get(x).copy() for x in (q_buffer, k_buffer)]
    call = _fused_calls(backend, q_view, k_view, rng)[op]
    with pytest.raises(ValueError, match=rf"{op}: \b{which}\b must have stride 1 in its last dim"
                                         r".*contiguous.*apply_rope"):
        call()
    for x, b in zip((q_buffer, k_buffer), before):
        assert_bits_equal(backend.get(x), b, what="an input of the refused call")


# ----------------------------------------------------------------------------------------------------
# the launch and the repeat-call path (no GPU needed)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_strided_heads_take_the_scalar_kernel_and_dense_ones_the_vector_path(inplace,
                                                                             interleaved):
    from cupyrope.core.arrays import describe
    from cupyrope.core.plan import plan_rope
    from cupyrope.cuda import launch

    tokens = 2 * launch.DECODE_MAX_TOKENS  # past the decode kernel (its own parameters)
    buffer = np.zeros((tokens, 2, 2 * D), np.float32)
    k = np.zeros((tokens, 1, D), np.float32)
    specs = {}
    for name, q in (("dense", np.ascontiguousarray(buffer[..., ::2])), ("strided", buffer[..., ::2])):
        plan = plan_rope(q, k, np.arange(tokens), cos_sin_cache=cr.cos_sin_cache(tokens, D),
                         interleaved=interleaved, inplace=inplace)
        outputs = ([plan.q, plan.k] if inplace
                   else [describe(np.empty_like(q), "q_out"), describe(np.empty_like(k), "k_out")])
        specs[name] = launch.plan_launch(plan, outputs, num_regs=lambda spec: 40,
                                         multiprocessors=132)
    dense, scalar = specs["dense"], specs["strided"]
    assert dense.kernel.vector and dense.vector
    assert not scalar.kernel.vector and not scalar.vector
    assert not scalar.kernel.lean and not scalar.kernel.decode and not scalar.kernel.fused
    p = scalar.params
    assert int(p["q_dim_stride"]) == 2 and int(p["k_dim_stride"]) == 1
    assert int(p["q_out_dim_stride"]) == (2 if inplace else 1) and int(p["k_out_dim_stride"]) == 1
    for name in ("q_dim_stride", "k_dim_stride", "q_out_dim_stride", "k_out_dim_stride"):
        assert int(dense.params[name]) == 1, name


def test_a_recipe_key_tells_the_last_dim_stride_apart(monkeypatch):
    """Two calls that differ only in the last dim's stride never share a repeat-call key (nor do
    their out= arrays)."""
    from cupyrope.cuda import recipes

    class Fake:
        def __init__(self, shape, strides):
            self.shape, self.strides = shape, strides

    monkeypatch.setattr(recipes, "gpu_array_key",
                        lambda x: ((x.shape, x.strides, "float32", 0, 0), 4096 * id(x) % 2**40)
                        if isinstance(x, Fake) else None)
    options = (10000.0, None, False, None, False, False, None)
    dense, strided_q = Fake((4, 2, 64), (128, 64, 1)), Fake((4, 2, 64), (256, 128, 2))
    keys = [recipes.call_key(q, None, None, None, None, None, options) for q in (dense, strided_q)]
    assert None not in keys and keys[0][0] != keys[1][0]
    outs = [recipes.call_key(dense, None, None, None, None, None, options, (out,))
            for out in (Fake((4, 2, 64), (128, 64, 1)), Fake((4, 2, 64), (256, 128, 2)))]
    assert outs[0][0] != outs[1][0]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", backend_params(["cupy", "torch-cuda"]), indirect=True)
@pytest.mark.parametrize("inplace", [False, True])
def test_repeat_calls_never_replay_a_dense_recipe_for_strided_heads(backend, inplace, rng):
    from cupyrope.cuda.recipes import recipes

    recipes.clear()
    cache = backend.put(cr.cos_sin_cache(4096, D))
    for layout in ("dense", "every_other", "dense", "every_other", "transposed", "dense"):
        q = rng.standard_normal((33, HQ, D)).astype(np.float32)
        positions = rng.integers(0, 4096, 33)
        view = backend.put(q) if layout == "dense" else strided(backend, q, layout)[0]
        out = cr.apply_rope(view, positions=backend.put(positions), cos_sin_cache=cache,
                            inplace=inplace)
        expected = cr.apply_rope(q, positions=positions, cos_sin_cache=cr.cos_sin_cache(4096, D))
        np.testing.assert_allclose(backend.get(out), expected, rtol=1e-6, atol=1e-6)
    vectors = sorted(recipe.spec.vector for recipe in recipes.values())
    assert vectors == [False, False, True]  # dense, every other, transposed: three recipes
