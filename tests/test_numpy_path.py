"""The NumPy (CPU) path of cupyrope.apply_rope and its helpers against the float64 reference.

Every comparison goes through tolerances.assert_rope_close (the one dtype-keyed tolerance table);
the expected values come from tests/reference.py, which does not import cupyrope.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupyrope as cr
from backends import angle_source, reference_tables
from reference import (
    default_positions,
    reference_angles,
    reference_cos_sin_cache,
    reference_inv_freq,
    reference_rope,
    round_to_dtype,
)
from tolerances import (
    ANGLE_EPS,
    C_COMPUTE,
    as_numpy,
    assert_bits_equal,
    assert_rope_close,
    compute_eps,
    max_abs_angle,
    np_dtype,
    ulp,
    unit_roundoff,
)

DTYPES = ["float16", "bfloat16", "float32", "float64"]
TABLE_DTYPES = ["float32", "float64", "float16", "bfloat16"]
SOURCES = ["cache", "tables_half", "tables_full", "computed"]
HEAD_DIMS = [2, 6, 64, 80, 96, 120, 128, 256]
THETA = 10000.0
MAX_POSITION = 4096


# ----------------------------------------------------------------------------------------------------
# helpers


def snapshot(*arrays):
    return [None if a is None else np.array(a, copy=True) for a in arrays]


def check_fresh_output(out, x):
    """Out-of-place results: a new C-contiguous NumPy array of x's dtype and shape."""
    assert type(out) is np.ndarray, type(out)
    assert out.dtype == x.dtype and out.shape == x.shape, (out.dtype, out.shape, x.dtype, x.shape)
    assert out.flags.c_contiguous
    assert not np.shares_memory(out, x)


def run_and_check(q, k, source, rotary_dim, *, interleaved, positions=None, table_dtype="float32",
                  theta=THETA, inverse=False, inplace=False, pass_rotary_dim=True,
                  max_position=MAX_POSITION):
    """Call apply_rope, check the result against the reference, check the inputs / in-place contract."""
    token_shape = q.shape[:-2]
    lib, ref_kw, check = angle_source(source, token_shape, positions, rotary_dim, interleaved=interleaved,
                                      theta=theta, table_dtype=table_dtype, max_position=max_position,
                                      pass_rotary_dim=pass_rotary_dim)
    q0, k0 = snapshot(q, k)
    lib_snap = {name: np.array(v, copy=True) for name, v in lib.items() if isinstance(v, np.ndarray)}
    result = cr.apply_rope(q, k, interleaved=interleaved, inverse=inverse, inplace=inplace, **lib)

    if k is None:
        assert isinstance(result, np.ndarray), type(result)
        outs = [result]
    else:
        assert isinstance(result, tuple) and len(result) == 2, type(result)
        outs = list(result)

    for out, x, x0 in zip(outs, [q, k], [q0, k0]):
        if inplace:
            assert out is x, "inplace=True must return the input objects"
        else:
            check_fresh_output(out, x)
            assert_bits_equal(x, x0, what="input after an out-of-place call")
        ref = reference_rope(x0, interleaved=interleaved, inverse=inverse, **ref_kw)
        assert_rope_close(out, ref, x0, interleaved=interleaved, rotary_dim=rotary_dim, **check)
    for name, before in lib_snap.items():
        assert_bits_equal(lib[name], before, what=f"{name} after the call")
    return outs, (q0, k0)


# ----------------------------------------------------------------------------------------------------
# dtypes x pairings x angle sources x head dims


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_pairing_source_head_dim(dtype, interleaved, source, head_dim, randn, rng):
    T = 13
    q = randn((T, 4, head_dim), dtype)
    k = randn((T, 2, head_dim), dtype)
    positions = rng.integers(0, MAX_POSITION, size=T, dtype=np.int64)
    run_and_check(q, k, source, head_dim, interleaved=interleaved, positions=positions,
                  pass_rotary_dim=False)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("table_dtype", TABLE_DTYPES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_library_cache_against_exact_angles(dtype, table_dtype, interleaved, randn, rng):
    """cos_sin_cache + apply_rope end to end against exact angles: only the table rounding is allowed."""
    T, D = 17, 64
    q = randn((T, 3, D), dtype)
    positions = rng.integers(0, MAX_POSITION, size=T, dtype=np.int64)
    positions[:2] = [0, MAX_POSITION - 1]
    cache = cr.cos_sin_cache(MAX_POSITION, D, theta=THETA, dtype=table_dtype)
    assert cache.dtype == np_dtype(table_dtype) and cache.shape == (MAX_POSITION, D)
    out = cr.apply_rope(q, positions=positions, cos_sin_cache=cache, interleaved=interleaved)
    ref = reference_rope(q, positions, theta=THETA, interleaved=interleaved)
    inv = reference_inv_freq(D, THETA)
    assert_rope_close(out, ref, q, interleaved=interleaved, rotary_dim=D, table_dtype=table_dtype,
                      max_angle=max_abs_angle(positions, inv))


@pytest.mark.parametrize("table_dtype", TABLE_DTYPES)
@pytest.mark.parametrize("source", ["tables_half", "tables_full"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_user_table_dtypes(dtype, source, table_dtype, randn, rng):
    T, D = 9, 32
    q = randn((T, 2, D), dtype)
    k = randn((T, 1, D), dtype)
    positions = rng.integers(0, MAX_POSITION, size=T)
    run_and_check(q, k, source, D, interleaved=False, positions=positions, table_dtype=table_dtype)


# ----------------------------------------------------------------------------------------------------
# partial rotary, heads, k=None


@pytest.mark.parametrize("head_dim, rotary_dim", [(128, 64), (80, 32), (6, 2), (120, 60), (256, 128),
                                                  (64, 2), (96, 94)])
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_partial_rotary(dtype, interleaved, source, head_dim, rotary_dim, randn, rng):
    T = 11
    q = randn((T, 4, head_dim), dtype)
    k = randn((T, 2, head_dim), dtype)
    positions = rng.integers(0, MAX_POSITION, size=T)
    # full-width tables infer rotary_dim from their width; the others get it explicitly
    run_and_check(q, k, source, rotary_dim, interleaved=interleaved, positions=positions,
                  pass_rotary_dim=(source != "tables_full"))


@pytest.mark.parametrize("num_q_heads, num_k_heads", [(8, 2), (8, 1), (1, 1), (3, 5)])
@pytest.mark.parametrize("source", SOURCES)
def test_gqa_mqa(num_q_heads, num_k_heads, source, randn, rng):
    T, D = 10, 64
    q = randn((T, num_q_heads, D), "bfloat16")
    k = randn((T, num_k_heads, D), "bfloat16")
    positions = rng.integers(0, MAX_POSITION, size=T)
    run_and_check(q, k, source, D, interleaved=False, positions=positions)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_k_none_returns_one_array(source, interleaved, randn, rng):
    T, D = 7, 64
    q = randn((T, 4, D), "float32")
    positions = rng.integers(0, MAX_POSITION, size=T)
    outs, _ = run_and_check(q, None, source, D, interleaved=interleaved, positions=positions)
    assert isinstance(outs[0], np.ndarray)


# ----------------------------------------------------------------------------------------------------
# layouts and positions


@pytest.mark.parametrize("pos_kind", ["S", "BS", "none", "1S"])
@pytest.mark.parametrize("source", ["cache", "computed", "tables_full"])
@pytest.mark.parametrize("pos_dtype", ["int32", "int64"])
def test_bshd_positions(pos_kind, source, pos_dtype, randn, rng):
    B, S, D = 3, 9, 64
    q = randn((B, S, 4, D), "float32")
    k = randn((B, S, 2, D), "float32")
    positions = {
        "S": rng.integers(0, MAX_POSITION, size=S),
        "BS": rng.integers(0, MAX_POSITION, size=(B, S)),
        "1S": rng.integers(0, MAX_POSITION, size=(1, S)),
        "none": None,
    }[pos_kind]
    if positions is not None:
        positions = positions.astype(pos_dtype)
    run_and_check(q, k, source, D, interleaved=False, positions=positions)


@pytest.mark.parametrize("source", ["cache", "computed"])
def test_bshd_default_positions_are_arange_of_s(source, randn):
    """positions=None means arange along axis -3 (S of [B, S, H, D]) for every batch row."""
    B, S, D = 2, 6, 32
    q = randn((B, S, 2, D), "float64")
    lib, _, _ = angle_source(source, (B, S), None, D, interleaved=False)
    out = cr.apply_rope(q, **lib)
    explicit = np.broadcast_to(np.arange(S, dtype=np.int64), (B, S))
    _, ref_kw, check = angle_source(source, (B, S), explicit, D, interleaved=False)
    ref = reference_rope(q, **ref_kw)
    assert_rope_close(out, ref, q, interleaved=False, rotary_dim=D, **check)
    # and not the identity: position 1..S-1 rotate
    assert not np.allclose(out[:, 1:], q[:, 1:])


@pytest.mark.parametrize("source", ["cache", "computed"])
def test_single_token_hd(source, randn, rng):
    """q of shape [H, D] is one token at the position given (shape ()); without positions it has
    no token dim to number, which is refused rather than rotating by position 0."""
    D = 64
    q = randn((4, D), "float32")
    k = randn((2, D), "float32")
    run_and_check(q, k, source, D, interleaved=False, positions=np.array(1234, dtype=np.int64))
    with pytest.raises(ValueError, match=r"no token dim.*\[tokens, heads, head_dim\]"):
        run_and_check(q, k, source, D, interleaved=False, positions=None)


@pytest.mark.parametrize("table_shape", ["S_w", "BS_w", "1S_w", "B1_w"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_tables_broadcast(table_shape, interleaved, randn, rng):
    B, S, H, D = 2, 5, 3, 64
    q = randn((B, S, H, D), "float32")
    k = randn((B, S, 1, D), "float32")
    shape = {"S_w": (S,), "BS_w": (B, S), "1S_w": (1, S), "B1_w": (B, 1)}[table_shape]
    pos = rng.integers(0, MAX_POSITION, size=shape)
    c, s = reference_tables(pos, D, width="full", interleaved=interleaved)
    out_q, out_k = cr.apply_rope(q, k, cos=c, sin=s, interleaved=interleaved)
    for out, x in ((out_q, q), (out_k, k)):
        ref = reference_rope(x, cos=c, sin=s, interleaved=interleaved)
        assert_rope_close(out, ref, x, interleaved=interleaved, rotary_dim=D)


# ----------------------------------------------------------------------------------------------------
# strides: transposed views, fused QKV, padded heads


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("source", SOURCES)
def test_transposed_bhsd_view(source, inplace, randn, rng):
    B, H, S, D = 2, 4, 7, 64
    storage_q = randn((B, H, S, D), "bfloat16")
    storage_k = randn((B, 2, S, D), "bfloat16")
    q = storage_q.transpose(0, 2, 1, 3)  # [B, S, H, D] view, not contiguous
    k = storage_k.transpose(0, 2, 1, 3)
    assert not q.flags.c_contiguous
    positions = rng.integers(0, MAX_POSITION, size=(B, S))
    outs, (q0, k0) = run_and_check(q, k, source, D, interleaved=False, positions=positions, inplace=inplace)
    if inplace:  # the writes landed in the [B, H, S, D] storage
        assert_bits_equal(storage_q.transpose(0, 2, 1, 3), outs[0], what="storage_q")


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("source", SOURCES)
def test_padded_head_and_token_strides(source, inplace, randn, rng):
    T, H, D, pad = 6, 3, 80, 16
    buf = randn((T + 1, H + 1, D + pad), "float32")
    before = np.array(buf, copy=True)
    q = buf[:T, :H, :D]  # padded heads, padded tokens, one spare head
    kbuf = randn((T, 2, 2 * D), "float32")
    k = kbuf[:, :, D:]  # k starts mid-row
    positions = rng.integers(0, MAX_POSITION, size=T)
    run_and_check(q, k, source, D, interleaved=True, positions=positions, inplace=inplace)
    untouched = np.ones(buf.shape, dtype=bool)
    untouched[:T, :H, :D] = False
    assert_bits_equal(buf[untouched], before[untouched], what="padding of the q buffer")


@pytest.mark.parametrize("variant", ["positions_column", "positions_reversed", "positions_0d", "cache_padded_rows",
                                     "cache_fortran", "tables_transposed", "tables_broadcast", "q_reversed"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_strided_angle_inputs(variant, interleaved, randn, rng):
    """Positions, caches and tables given as non-contiguous views are read through their strides."""
    T, H, D, max_position = 8, 3, 64, 300
    q = randn((T, H, D), "float32")
    positions = rng.integers(0, max_position, size=T)
    lib = {"positions": positions}
    ref_kw = {"positions": positions}
    check = {"max_angle": max_abs_angle(np.array([max_position]), reference_inv_freq(D, THETA))}
    if variant == "positions_column":
        positions = rng.integers(0, max_position, size=(T, 3))[:, 1]
        lib = ref_kw = {"positions": positions}
    elif variant == "positions_reversed":
        lib = ref_kw = {"positions": positions[::-1]}
    elif variant == "positions_0d":
        lib = ref_kw = {"positions": np.array(123, dtype=np.int32)}
    elif variant in ("cache_padded_rows", "cache_fortran"):
        cache = cr.cos_sin_cache(max_position, D, theta=THETA)
        if variant == "cache_padded_rows":
            padded = np.full((max_position, D + 16), np.nan, dtype=np.float32)
            padded[:, :D] = cache
            cache = padded[:, :D]
        else:
            cache = np.asfortranarray(cache)
        lib = {"positions": positions, "cos_sin_cache": cache}
        ref_kw = dict(lib)
        check = {}
    elif variant == "tables_transposed":
        angles = rng.uniform(-4, 4, size=(D // 2, T))  # [w, T] storage, used as [T, w]
        c, s = np.cos(angles).astype(np.float32).T, np.sin(angles).astype(np.float32).T
        lib = ref_kw = {"cos": c, "sin": s, "rotary_dim": D}
        check = {}
    elif variant == "tables_broadcast":
        angles = rng.uniform(-4, 4, size=(1, D // 2))
        c = np.broadcast_to(np.cos(angles), (T, D // 2))
        s = np.broadcast_to(np.sin(angles), (T, D // 2))
        lib = ref_kw = {"cos": c, "sin": s, "rotary_dim": D}
        check = {}
    elif variant == "q_reversed":
        q = q[::-1]
    q0 = np.array(q, copy=True)
    out = cr.apply_rope(q, interleaved=interleaved, **lib)
    check_fresh_output(out, q)
    ref = reference_rope(q0, interleaved=interleaved, **ref_kw)
    assert_rope_close(out, ref, q0, interleaved=interleaved, rotary_dim=D, **check)
    out = cr.apply_rope(q, interleaved=interleaved, inplace=True, **lib)
    assert out is q
    assert_rope_close(q, ref, q0, interleaved=interleaved, rotary_dim=D, **check)


# ----------------------------------------------------------------------------------------------------
# positions: large, negative, int32 / int64


@pytest.mark.parametrize("pos_dtype", ["int32", "int64"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_computed_large_positions(dtype, interleaved, pos_dtype, randn, rng):
    """Up to 2^24, the accuracy contract's range."""
    T, D = 64, 128
    positions = rng.integers(0, 2**24, size=T)
    positions[:5] = [2**24 - 1, 2**24, 2**20, 131071, 2**24 - 2**20 + 1]
    positions = positions.astype(pos_dtype)
    q = randn((T, 2, D), dtype)
    k = randn((T, 1, D), dtype)
    for theta in (THETA, 500000.0):
        run_and_check(q, k, "computed", D, interleaved=interleaved, positions=positions, theta=theta)


@pytest.mark.parametrize("source", ["tables_half", "tables_full"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_tables_near_2p24(source, interleaved, randn, rng):
    """Per-token tables at positions up to +-2^24 (their float64 angles rounded once)."""
    T, D = 48, 64
    positions = np.concatenate([[2**24, 2**24 - 1, -(2**24), 1 - 2**24],
                                rng.integers(-(2**24), 2**24 + 1, size=T - 4)])
    q = randn((T, 2, D), "float32")
    k = randn((T, 1, D), "float32")
    run_and_check(q, k, source, D, interleaved=interleaved, positions=positions)


@pytest.mark.parametrize("pos_dtype", ["int32", "int64"])
def test_cache_large_positions(pos_dtype, randn, rng):
    """A 2^20 + 1 row cache: rows near 2^20 are as accurate as row 0. (Its rows are the float64
    cos/sin of test_tables_near_2p24, rounded once; a 2^24 + 1 row cache takes 1.5 GB and seconds
    to build on the CPU, so test_gpu_angles.py reads one on the GPU.)"""
    max_position, r, D = 2**20 + 1, 16, 24
    cache = cr.cos_sin_cache(max_position, r, theta=THETA, dtype="float32")
    positions = rng.integers(0, max_position, size=40)
    positions[:2] = [2**20, 2**20 - 1]
    positions = positions.astype(pos_dtype)
    # the rows used are the float64 values rounded once
    rows_ref = reference_cos_sin_cache(max_position, r, THETA, positions=positions)
    assert_rounded_once(cache[positions.astype(np.int64)], rows_ref, positions, reference_inv_freq(r, THETA))
    q = randn((40, 2, D), "float32")
    out = cr.apply_rope(q, positions=positions, cos_sin_cache=cache)
    ref = reference_rope(q, positions, theta=THETA, rotary_dim=r)
    assert_rope_close(out, ref, q, interleaved=False, rotary_dim=r, table_dtype="float32",
                      max_angle=max_abs_angle(positions, reference_inv_freq(r, THETA)))


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_computed_negative_positions(dtype, interleaved, randn, rng):
    T, D = 32, 64
    positions = rng.integers(-(2**24), 2**24, size=T)
    positions[:3] = [-1, -(2**24), -(2**20)]
    q = randn((T, 4, D), dtype)
    k = randn((T, 4, D), dtype)
    outs, (q0, _) = run_and_check(q, k, "computed", D, interleaved=interleaved, positions=positions)
    max_angle = max_abs_angle(positions, reference_inv_freq(D, THETA))
    # inverse=True at p is the forward rotation at -p
    inv = cr.apply_rope(q0, positions=positions, interleaved=interleaved, inverse=True)
    ref = reference_rope(q0, -positions, interleaved=interleaved)
    assert_rope_close(inv, ref, q0, interleaved=interleaved, rotary_dim=D, max_angle=max_angle)
    # and rotating the output by -p brings q back
    back = cr.apply_rope(outs[0], positions=-positions, interleaved=interleaved)
    extra = 2.0 * np.sqrt(2.0) * unit_roundoff(dtype) + C_COMPUTE * compute_eps(dtype) + ANGLE_EPS * max_angle
    assert_rope_close(back, q0.astype(np.float64), q0, interleaved=interleaved, rotary_dim=D,
                      max_angle=max_angle, extra_pair_rel=extra)


# ----------------------------------------------------------------------------------------------------
# inverse, in place, empty


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_inverse_matches_reference(dtype, interleaved, source, randn, rng):
    T, D = 12, 96
    q = randn((T, 2, D), dtype)
    k = randn((T, 1, D), dtype)
    positions = rng.integers(0, MAX_POSITION, size=T)
    run_and_check(q, k, source, D, interleaved=interleaved, positions=positions, inverse=True)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_inplace(dtype, interleaved, source, randn, rng):
    T, D = 10, 64
    q = randn((T, 4, D), dtype)
    k = randn((T, 2, D), dtype)
    positions = rng.integers(0, MAX_POSITION, size=T)
    outs, (q0, _) = run_and_check(q, k, source, D, interleaved=interleaved, positions=positions,
                                  inplace=True)
    assert outs[0] is q and outs[1] is k
    assert not np.array_equal(q, q0), "inplace=True left q unchanged"


@pytest.mark.parametrize("empty_kind", ["fresh", "sliced"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_empty(dtype, source, inplace, empty_kind, randn):
    """T = 0 works. NumPy 2 gives a freshly made empty array all-zero strides, a sliced one keeps them."""
    D = 64
    if empty_kind == "fresh":
        q = randn((0, 4, D), dtype)
        k = np.empty((0, 2, D), dtype=np_dtype(dtype))
    else:
        q = randn((3, 4, D), dtype)[:0]
        k = randn((3, 2, D), dtype)[:0]
    positions = np.zeros((0,), dtype=np.int64)
    outs, _ = run_and_check(q, k, source, D, interleaved=False, positions=positions, inplace=inplace)
    assert outs[0].shape == (0, 4, D) and outs[1].shape == (0, 2, D)
    # an empty S dim of [B, S, H, D]
    q2 = randn((2, 0, 3, D), dtype) if empty_kind == "fresh" else randn((2, 4, 3, D), dtype)[:, :0]
    out2 = cr.apply_rope(q2, positions=np.zeros((2, 0), dtype=np.int32), theta=THETA, inplace=inplace)
    assert out2.shape == (2, 0, 3, D) and out2.dtype == q2.dtype


# ----------------------------------------------------------------------------------------------------
# cache rows out of range


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cache_out_of_range_gives_nan_in_rotated_dims(dtype, interleaved, inplace, randn, rng):
    T, D, r, max_position = 10, 96, 64, 256
    cache = cr.cos_sin_cache(max_position, r, theta=THETA, dtype="float32")
    positions = rng.integers(0, max_position, size=T).astype(np.int64)
    positions[[1, 4, 7, 8]] = [-1, max_position, max_position + 1000, 2**40]
    q = randn((T, 3, D), dtype)
    q0 = np.array(q, copy=True)
    out = cr.apply_rope(q, positions=positions, cos_sin_cache=cache, interleaved=interleaved, inplace=inplace)
    ref = reference_rope(q0, positions, cos_sin_cache=cache, interleaved=interleaved)
    bad = np.array([1, 4, 7, 8])
    assert np.all(np.isnan(ref[bad, :, :r])) and not np.any(np.isnan(ref[:, :, r:]))
    assert_rope_close(out, ref, q0, interleaved=interleaved, rotary_dim=r)  # NaN exactly there


@pytest.mark.parametrize("bad_position", [-1, 256, 2**31 - 1])
def test_validate_raises_index_error(bad_position, randn, rng):
    max_position, D = 256, 64
    cache = cr.cos_sin_cache(max_position, D, theta=THETA)
    positions = rng.integers(0, max_position, size=8).astype(np.int64)
    positions[5] = bad_position
    q = randn((8, 2, D), "float32")
    q0 = np.array(q, copy=True)
    with pytest.raises(IndexError, match="positions"):
        cr.apply_rope(q, positions=positions, cos_sin_cache=cache, validate=True, inplace=True)
    assert_bits_equal(q, q0, what="q after a failed validate")
    # in range: validate=True changes nothing
    positions[5] = max_position - 1
    out = cr.apply_rope(q, positions=positions, cos_sin_cache=cache, validate=True)
    assert_rope_close(out, reference_rope(q0, positions, cos_sin_cache=cache), q0, interleaved=False,
                      rotary_dim=D)


# ----------------------------------------------------------------------------------------------------
# scaling and helpers


@pytest.mark.parametrize("scaling, factor", [
    ({"rope_type": "linear", "factor": 4.0}, 4.0),
    ({"type": "linear", "factor": 2.0}, 2.0),  # legacy key
    ({"rope_type": "linear", "factor": 0.5}, 0.5),
    ({"rope_type": "default"}, 1.0),
    (None, 1.0),
])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_linear_scaling(scaling, factor, interleaved, randn, rng):
    T, D = 16, 64
    positions = rng.integers(0, 2**17, size=T)
    q = randn((T, 2, D), "float32")
    k = randn((T, 1, D), "float32")
    inv = reference_inv_freq(D, 500000.0, factor)
    max_angle = max_abs_angle(positions, inv)

    out_q, out_k = cr.apply_rope(q, k, positions, theta=500000.0, scaling=scaling, interleaved=interleaved)
    for out, x in ((out_q, q), (out_k, k)):
        ref = reference_rope(x, positions, theta=500000.0, linear_factor=factor, interleaved=interleaved)
        assert_rope_close(out, ref, x, interleaved=interleaved, rotary_dim=D, max_angle=max_angle)

    cache = cr.cos_sin_cache(2**17, D, theta=500000.0, scaling=scaling, dtype="float32")
    out = cr.apply_rope(q, positions=positions, cos_sin_cache=cache, interleaved=interleaved)
    ref = reference_rope(q, positions, theta=500000.0, linear_factor=factor, interleaved=interleaved)
    assert_rope_close(out, ref, q, interleaved=interleaved, rotary_dim=D, table_dtype="float32",
                      max_angle=max_angle)


@pytest.mark.parametrize("scaling, factor", [(None, 1.0), ({"rope_type": "linear", "factor": 8.0}, 8.0),
                                             ({"type": "linear", "factor": 3.0}, 3.0)])
@pytest.mark.parametrize("theta", [10000.0, 500000.0, 1e6, 10.0])
@pytest.mark.parametrize("rotary_dim", [2, 6, 64, 80, 128, 256])
def test_rope_frequencies(rotary_dim, theta, scaling, factor):
    inv_freq, attention_factor = cr.rope_frequencies(rotary_dim, theta=theta, scaling=scaling)
    assert isinstance(inv_freq, np.ndarray) and inv_freq.dtype == np.float64
    assert inv_freq.shape == (rotary_dim // 2,)
    assert attention_factor == 1.0
    ref = reference_inv_freq(rotary_dim, theta, factor)
    # float64 pow is within an ulp or so; a float32 computation would be off by ~1e-8
    np.testing.assert_array_less(np.abs(inv_freq - ref), 4 * ulp(ref, "float64"))


def assert_rounded_once(table, ref64, positions, inv_freq):
    """``table`` (a table dtype) equals the float64 reference rounded once to that dtype.

    The reference itself is only known to ~2 ulps (cos/sin) plus the angle's uncertainty, so where it
    lies that close to a rounding boundary either neighbour is accepted.
    """
    table = as_numpy(table)
    dtype = table.dtype
    angles = np.abs(np.asarray(positions, dtype=np.float64))[..., None] * np.max(inv_freq)
    err = 2 * ulp(ref64, "float64") + ANGLE_EPS * angles
    ok = np.zeros(table.shape, dtype=bool)
    for candidate in (ref64, ref64 - err, ref64 + err):
        rounded = round_to_dtype(candidate, dtype)
        ok |= table.view(f"u{dtype.itemsize}") == rounded.view(f"u{dtype.itemsize}")
    if not ok.all():
        idx = tuple(np.argwhere(~ok)[0])
        raise AssertionError(
            f"{np.count_nonzero(~ok)} {dtype} table entries are not the float64 value rounded once; "
            f"first at {idx}: got {table[idx]!r}, float64 reference {ref64[idx]!r}, "
            f"correctly rounded {round_to_dtype(ref64[idx], dtype)!r}"
        )


@pytest.mark.parametrize("scaling, factor", [(None, 1.0), ({"rope_type": "linear", "factor": 4.0}, 4.0)])
@pytest.mark.parametrize("rotary_dim", [2, 64, 128])
def test_cos_sin_cache_float64(rotary_dim, scaling, factor):
    max_position, theta = 4096, 500000.0
    cache = cr.cos_sin_cache(max_position, rotary_dim, theta=theta, scaling=scaling, dtype="float64")
    assert isinstance(cache, np.ndarray) and cache.dtype == np.float64
    assert cache.shape == (max_position, rotary_dim)
    ref = reference_cos_sin_cache(max_position, rotary_dim, theta, linear_factor=factor)
    half = rotary_dim // 2
    assert_bits_equal(cache[0], np.concatenate([np.ones(half), np.zeros(half)]), what="row 0")
    # small positions: ~1e-15
    np.testing.assert_array_less(np.abs(cache[:8] - ref[:8]), 2e-15)
    # any position: 2 ulps plus the float64 angle uncertainty (a float32 angle would be ~1e-4 off here)
    angles = np.arange(max_position, dtype=np.float64)[:, None] * reference_inv_freq(rotary_dim, theta, factor)[0]
    bound = 2 * ulp(ref, "float64") + ANGLE_EPS * angles
    err = np.abs(cache - ref)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert err[worst] <= bound[worst], f"row {worst}: got {cache[worst]!r}, reference {ref[worst]!r}"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cos_sin_cache_rounded_once(dtype):
    max_position, rotary_dim, theta = 4096, 128, 10000.0
    cache = cr.cos_sin_cache(max_position, rotary_dim, theta=theta, dtype=dtype)
    assert isinstance(cache, np.ndarray) and cache.dtype == np_dtype(dtype)
    assert cache.shape == (max_position, rotary_dim)
    ref = reference_cos_sin_cache(max_position, rotary_dim, theta)
    positions = np.arange(max_position)
    assert_rounded_once(cache, ref, positions, reference_inv_freq(rotary_dim, theta))


def test_cos_sin_cache_like_numpy():
    like = np.zeros((1,), dtype=np.float32)
    cache = cr.cos_sin_cache(16, 8, like=like)
    assert type(cache) is np.ndarray and cache.dtype == np.float32 and cache.shape == (16, 8)


# ----------------------------------------------------------------------------------------------------
# varlen positions


def expected_varlen_positions(cu_seqlens, offsets):
    out = []
    for i in range(len(cu_seqlens) - 1):
        start = 0 if offsets is None else int(offsets[i])
        for t in range(int(cu_seqlens[i + 1]) - int(cu_seqlens[i])):
            out.append(start + t)
    return out


@pytest.mark.parametrize("with_offsets", [False, True])
@pytest.mark.parametrize("int_dtype", ["int32", "int64"])
def test_varlen_positions(int_dtype, with_offsets, randn, rng):
    lengths = [3, 0, 5, 1, 7]
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(int_dtype)
    offsets = rng.integers(0, 1000, size=len(lengths)).astype(int_dtype) if with_offsets else None
    positions = cr.varlen_positions(cu_seqlens, offsets)
    assert isinstance(positions, np.ndarray) and positions.dtype == np.dtype(int_dtype)
    expected = expected_varlen_positions(cu_seqlens, offsets)
    assert positions.tolist() == expected

    # and used on a packed [T, H, D] batch
    T, D = int(cu_seqlens[-1]), 64
    q = randn((T, 4, D), "float32")
    k = randn((T, 1, D), "float32")
    run_and_check(q, k, "cache", D, interleaved=False, positions=positions)
    run_and_check(q, k, "computed", D, interleaved=False, positions=positions)


def test_varlen_positions_empty():
    positions = cr.varlen_positions(np.array([0], dtype=np.int64))
    assert positions.shape == (0,) and positions.dtype == np.int64
