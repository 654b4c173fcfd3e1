"""Rough edges a first-time user meets, each refused with a message that says what to do: q with no
token dims and no positions, repeated cache slots, errors of the fused ops named after the op that
was called, odd head_dim, a cache in the other layout, bad dtype arguments, an empty cos/sin cache.
NumPy path and torch CPU tensors."""

from __future__ import annotations

import re

import numpy as np
import pytest

import cupyrope as cr
from reference import reference_rope

T, HQ, HK, D, MAX_POSITION = 6, 4, 2, 64, 128


def _frameworks():
    """Array constructors: NumPy, and torch CPU tensors when torch is installed."""
    makers = [pytest.param(lambda x: x, id="numpy")]
    try:
        import torch
    except ImportError:
        return makers
    return makers + [pytest.param(lambda x: torch.from_numpy(np.ascontiguousarray(x)),
                                  id="torch-cpu")]


FRAMEWORKS = _frameworks()


# ------------------------------------------------------------------------------------------------
# q without token dims


@pytest.mark.parametrize("put", FRAMEWORKS)
@pytest.mark.parametrize("source", ["computed", "cache"])
def test_q_without_token_dims_needs_positions(put, source, rng):
    """[heads, head_dim] with positions=None has no token to number: refused, not rotated by 0."""
    q = rng.standard_normal((8, D)).astype(np.float32)
    kwargs = {"cos_sin_cache": put(cr.cos_sin_cache(MAX_POSITION, D))} if source == "cache" else {}
    before = q.copy()
    with pytest.raises(ValueError) as info:
        cr.apply_rope(put(q), **kwargs)
    message = str(info.value)
    assert message.startswith("apply_rope: ")
    assert "(8, 64)" in message and "[tokens, heads, head_dim]" in message
    assert "positions" in message
    np.testing.assert_array_equal(q, before)
    with pytest.raises(ValueError, match=r"^apply_rope: .*\[tokens, heads, head_dim\]"):
        cr.apply_rope(put(q), inplace=True, **kwargs)
    np.testing.assert_array_equal(q, before)


@pytest.mark.parametrize("source", ["computed", "cache"])
def test_q_without_token_dims_works_with_positions_or_tables(source, rng):
    """What stays legitimate: [H, D] with explicit positions (one token), [H, D] with per-token
    cos/sin tables, and [T, H, D] with positions=None (arange over T)."""
    q = rng.standard_normal((8, D)).astype(np.float32)
    kwargs = {"cos_sin_cache": cr.cos_sin_cache(MAX_POSITION, D)} if source == "cache" else {}
    one = cr.apply_rope(q, positions=np.array(5), **kwargs)
    np.testing.assert_allclose(one, cr.apply_rope(q[None], positions=np.array([5]), **kwargs)[0],
                               rtol=0, atol=0)
    assert not np.allclose(one, q)
    angles = 5 * cr.rope_frequencies(D)[0]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    np.testing.assert_allclose(cr.apply_rope(q, cos=cos, sin=sin, rotary_dim=D), one, atol=1e-5)
    q3 = rng.standard_normal((T, 2, D)).astype(np.float32)
    np.testing.assert_allclose(cr.apply_rope(q3, **kwargs),
                               cr.apply_rope(q3, positions=np.arange(T), **kwargs), rtol=0, atol=0)


def test_fused_q_without_token_dims_is_refused_by_its_name(rng):
    q = rng.standard_normal((8, D)).astype(np.float32)
    with pytest.raises(ValueError, match=r"^rms_norm_rope: .*\[tokens, heads, head_dim\]"):
        cr.rms_norm_rope(q, None, np.ones(D, np.float32), None, eps=1e-6)
    out = cr.rms_norm_rope(q, None, np.ones(D, np.float32), None, np.array(3), eps=1e-6)
    assert out.shape == q.shape


# ------------------------------------------------------------------------------------------------
# repeated slots


def _cache_call(rng, slots, *, layout="NHD", num_blocks=4, block_size=4, head_dim=D,
                positions=None, put=lambda x: x, **kwargs):
    n = len(slots)
    q = rng.standard_normal((n, HQ, head_dim)).astype(np.float32)
    k = rng.standard_normal((n, HK, head_dim)).astype(np.float32)
    v = rng.standard_normal((n, HK, head_dim)).astype(np.float32)
    shape = ((num_blocks, block_size, HK, head_dim) if layout == "NHD"
             else (num_blocks, HK, block_size, head_dim))
    arrays = dict(q=q, k=k, v=v, kc=np.zeros(shape, np.float32), vc=np.zeros(shape, np.float32))
    before = {name: x.copy() for name, x in arrays.items()}
    call = lambda **more: cr.rope_and_cache(  # noqa: E731
        put(q), put(k), put(v), None if positions is None else put(positions), put(arrays["kc"]),
        put(arrays["vc"]), put(np.asarray(slots, np.int64)), **kwargs, **more)
    return call, arrays, before


@pytest.mark.parametrize("put", FRAMEWORKS)
def test_repeated_slots_are_refused_with_validate(put, rng):
    slots = [0, 3, 7, -1, 7, -1, 3]
    call, arrays, before = _cache_call(rng, slots, put=put)
    with pytest.raises(ValueError) as info:
        call(validate=True)
    message = str(info.value)
    assert message.startswith("rope_and_cache: slot_mapping")
    assert "slot 3" in message and "tokens [1, 6]" in message  # token 1 is the first that shares
    for name, x in arrays.items():
        np.testing.assert_array_equal(x, before[name], err_msg=f"{name} after a refused call")


def test_repeated_padding_slots_are_fine(rng):
    slots = [-1, 0, -1, 5, -1, 2]
    call, arrays, before = _cache_call(rng, slots)
    call(validate=True)
    k = before["k"]  # rope_and_cache rotates k in place
    rows = arrays["kc"].reshape(-1, HK, D)
    np.testing.assert_allclose(rows[5], reference_rope(k, np.arange(6))[3], atol=1e-5)


def test_repeated_slots_without_validate_keep_the_last_token_on_the_host(rng):
    """Documented in rope_and_cache: without validate nothing is checked; the NumPy path keeps the
    last token's row (on the GPU the winner is unspecified)."""
    call, arrays, before = _cache_call(rng, [2, 2, 2])
    call()
    np.testing.assert_array_equal(arrays["vc"].reshape(-1, HK, D)[2], before["v"][2])
    assert "distinct" in cr.rope_and_cache.__doc__ and "validate=True" in cr.rope_and_cache.__doc__
    assert re.search(r"last token", cr.rope_and_cache.__doc__)


# ------------------------------------------------------------------------------------------------
# errors of the fused ops name the op that was called


def _fused_error(op, case, rng, put):
    """Call ``op`` with one bad argument (``case``); returns the exception raised."""
    head_dim = 63 if case == "odd_head_dim" else D
    positions = np.arange(T)
    kwargs = {}
    if case == "float_positions":
        positions = positions.astype(np.float64)
    elif case == "out_of_range":
        positions = np.where(np.arange(T) == 2, MAX_POSITION, positions)
        kwargs = dict(cos_sin_cache=put(cr.cos_sin_cache(MAX_POSITION, D)), validate=True)
    if op == "rms_norm_rope":
        q = rng.standard_normal((T, HQ, head_dim)).astype(np.float32)
        k = rng.standard_normal((T, HK, head_dim)).astype(np.float32)
        w = np.ones(head_dim, np.float32)
        with pytest.raises(Exception) as info:
            cr.rms_norm_rope(put(q), put(k), put(w), put(w), put(positions), eps=1e-6, **kwargs)
        return info.value
    call, _, _ = _cache_call(rng, np.arange(T), num_blocks=2, head_dim=head_dim,
                             positions=positions, put=put, **kwargs)
    with pytest.raises(Exception) as info:
        call()
    return info.value


@pytest.mark.parametrize("put", FRAMEWORKS)
@pytest.mark.parametrize("op", ["rms_norm_rope", "rope_and_cache"])
@pytest.mark.parametrize("case,error,words", [
    ("odd_head_dim", ValueError, "head_dim must be even"),
    ("float_positions", TypeError, "positions must be int32 or int64"),
    ("out_of_range", IndexError, "positions must lie in"),
])
def test_fused_errors_name_the_op_called(put, op, case, error, words, rng):
    raised = _fused_error(op, case, rng, put)
    assert isinstance(raised, error), repr(raised)
    assert str(raised).startswith(f"{op}: "), str(raised)
    assert words in str(raised)


def test_fused_errors_name_the_op_under_torch_autograd(rng):
    """Tensors that require grad take the torch operators: the same names there."""
    torch = pytest.importorskip("torch")
    q = torch.randn(T, HQ, 63, requires_grad=True)
    w = torch.ones(63)
    with pytest.raises(ValueError, match=r"^rms_norm_rope: head_dim must be even"):
        cr.rms_norm_rope(q, None, w, None, torch.arange(T), eps=1e-6)
    q = torch.randn(T, HQ, D, requires_grad=True)
    with pytest.raises(TypeError, match=r"^rms_norm_rope: positions must be int32 or int64"):
        cr.rms_norm_rope(q, None, torch.ones(D), None, torch.arange(T, dtype=torch.float32),
                         eps=1e-6)


# ------------------------------------------------------------------------------------------------
# odd head_dim, the other cache layout


def test_odd_head_dim_is_named_as_head_dim(rng):
    q = rng.standard_normal((T, HQ, 63)).astype(np.float32)
    with pytest.raises(ValueError, match=r"^apply_rope: head_dim must be even") as info:
        cr.apply_rope(q)
    assert "63" in str(info.value) and "rotary_dim=" in str(info.value)
    # a rotary_dim the user passed is still named as such
    with pytest.raises(ValueError, match=r"^apply_rope: rotary_dim must be even .* got 63"):
        cr.apply_rope(q, rotary_dim=63)
    # an even rotary_dim rotates part of an odd head
    out = cr.apply_rope(q, positions=np.arange(T), rotary_dim=62)
    np.testing.assert_array_equal(out[..., 62:], q[..., 62:])


@pytest.mark.parametrize("given,fits", [("NHD", "HND"), ("HND", "NHD")])
def test_cache_in_the_other_layout_is_named(given, fits, rng):
    call, arrays, before = _cache_call(rng, np.arange(T), layout=fits, block_size=8, num_blocks=2)
    with pytest.raises(ValueError, match=f'^rope_and_cache: k_cache .* pass layout="{fits}"'):
        call(layout=given)
    for name, x in arrays.items():
        np.testing.assert_array_equal(x, before[name], err_msg=f"{name} after a refused call")
    call(layout=fits)  # with the layout it suggests, the call works
    # caches that fit neither layout get no suggestion
    q, k = (rng.standard_normal((T, h, D)).astype(np.float32) for h in (HQ, HK))
    caches = np.zeros((2, 8, 3, D), np.float32), np.zeros((2, 8, 3, D), np.float32)
    with pytest.raises(ValueError, match="does not hold 2 heads") as info:
        cr.rope_and_cache(q, k, k.copy(), None, *caches, np.arange(T), layout=given)
    assert "pass layout=" not in str(info.value)


# ------------------------------------------------------------------------------------------------
# dtype arguments: a name (or dtype) that is not accepted is a ValueError, another type a TypeError


@pytest.mark.parametrize("value,error", [
    ("bf16", ValueError), ("int32", ValueError), (np.int32, ValueError), (np.dtype("int8"), ValueError),
    (5, TypeError), (["float32"], TypeError), (1.5, TypeError),
])
def test_cos_sin_cache_dtype_rule(value, error):
    with pytest.raises(error, match=r"^cos_sin_cache: dtype must be one of"):
        cr.cos_sin_cache(8, D, dtype=value)


@pytest.mark.parametrize("value,error", [
    ("bf16", ValueError), ("int8", ValueError), (np.int8, ValueError), (np.dtype("float16"), ValueError),
    (5, TypeError), (["float8_e4m3fn"], TypeError), (1.5, TypeError),
])
def test_fp8_dtype_arguments_rule(value, error, rng):
    q = rng.standard_normal((T, HQ, D)).astype(np.float32)
    with pytest.raises(error, match=r"^apply_rope: out_dtype must be None or one of"):
        cr.apply_rope(q, positions=np.arange(T), out_dtype=value)
    w = np.ones(D, np.float32)
    with pytest.raises(error, match=r"^rms_norm_rope: out_dtype must be None or one of"):
        cr.rms_norm_rope(q, None, w, None, np.arange(T), eps=1e-6, out_dtype=value)
    call, _, _ = _cache_call(rng, np.arange(T), num_blocks=2, cache_dtype=value)
    with pytest.raises(error, match=r"^rope_and_cache: cache_dtype must be None or one of"):
        call()


def test_fp8_dtype_arguments_rule_torch(rng):
    torch = pytest.importorskip("torch")
    q = torch.randn(T, HQ, D)
    with pytest.raises(ValueError, match="out_dtype must be None or one of"):
        cr.apply_rope(q, positions=torch.arange(T), out_dtype=torch.float16)
    with pytest.raises(TypeError, match="out_dtype must be None or one of"):
        cr.apply_rope(q, positions=torch.arange(T), out_dtype=5)
    q.requires_grad_(True)
    with pytest.raises(TypeError, match="out_dtype must be None or one of"):
        cr.rms_norm_rope(q, None, torch.ones(D), None, torch.arange(T), eps=1e-6, out_dtype=5)


# ------------------------------------------------------------------------------------------------
# an empty cos/sin cache


@pytest.mark.parametrize("max_position", [0, -1])
def test_cos_sin_cache_needs_a_row(max_position):
    with pytest.raises(ValueError, match=rf"^cos_sin_cache: max_position must be >= 1, got "
                                         rf"{max_position}"):
        cr.cos_sin_cache(max_position, D)
    assert cr.cos_sin_cache(1, D).shape == (1, D)
