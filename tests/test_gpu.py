"""Every GPU kernel path of ``cupyrope.apply_rope`` on CuPy arrays, against the float64 reference.

Each test builds its inputs on the host (fresh N(0, 1) data, never zeros), computes the reference from
those host copies (``reference.reference_rope``), runs the kernel and compares with
``tolerances.assert_rope_close``: rotated dims within the dtype-keyed bound, NaN exactly where the
reference has NaN, pass-through dims bit-identical to the input.

Outputs are poisoned before every call. In place, the input is the output and the reference was taken
from a copy first. Out of place, the library allocates its outputs from CuPy's memory pool, so
``poison_pool`` leaves a NaN-filled (0xFF bytes) free block at the front of the pool right before the
call: an element the kernel forgets to write comes out as NaN where the reference is finite, which
``assert_rope_close`` reports. Memory around strided views (padding, the v part of a fused QKV buffer,
the element before a misaligned view) is filled with NaN or random data and checked bit for bit.

Compile budget: every distinct (dtype, table dtype, vector, pairing, source) is one NVRTC compile
(~0.5 s cold, then cached), so the sweeps are split by axis rather than multiplied out; the whole module
uses about fifty specialisations.

Set CUPYROPE_TEST_NO_POOL=1 to turn CuPy's memory pool off (one cudaMalloc per array, as
compute-sanitizer memcheck wants to see them); ``poison_pool`` is then a no-op.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import numpy as np
import pytest

import cupyrope as cr
from reference import (
    default_positions,
    reference_cos_sin_cache,
    reference_inv_freq,
    reference_rope,
    round_to_dtype,
)
from tolerances import (
    ANGLE_EPS,
    assert_bits_equal,
    assert_rope_close,
    max_abs_angle,
    np_dtype,
    ulp,
    unit_roundoff,
)

cp = pytest.importorskip("cupy")

pytestmark = pytest.mark.gpu

NO_POOL = os.environ.get("CUPYROPE_TEST_NO_POOL", "") not in ("", "0")
if NO_POOL:
    cp.cuda.set_allocator(None)

DTYPES = ("float16", "bfloat16", "float32", "float64")
BF16 = "bfloat16"

# A shape with odd token count, GQA and the most common head_dim.
T, HQ, HK, D = 67, 4, 2, 128
MAX_POSITION = 4096


# --------------------------------------------------------------------------------------------------
# Host <-> device, bit for bit (bfloat16 included: CuPy 14 holds ml_dtypes.bfloat16 arrays; moving
# the raw bits as unsigned ints needs no dtype-specific CuPy kernel).


def _bits(dtype) -> np.dtype:
    return np.dtype(f"u{np.dtype(dtype).itemsize}")


def to_gpu(host: np.ndarray):
    host = np.ascontiguousarray(host)
    return cp.asarray(host.view(_bits(host.dtype))).view(host.dtype)


def to_host(dev) -> np.ndarray:
    return dev.view(_bits(dev.dtype)).get().view(dev.dtype)


def random_host(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """N(0, 1) rounded to ``dtype``, with no exact zeros (as conftest's ``randn``)."""
    values = rng.standard_normal(shape)
    values = np.where(np.abs(values) < 1e-3, np.copysign(0.5, values), values)
    return values.astype(np_dtype(dtype))


def random_positions(rng, shape, dtype="int64", low=0, high=MAX_POSITION) -> np.ndarray:
    return rng.integers(low, high, size=shape, dtype=np.int64).astype(dtype)


def poison_pool(nbytes: int) -> None:
    """Make the next CuPy allocations of this stream (up to ``nbytes``) start as NaN.

    Frees every unused block of the pool, then allocates one block a little larger than ``nbytes``,
    fills it with 0xFF bytes (NaN in every float dtype) and frees it again: the pool splits that block
    for the outputs the library allocates next.
    """
    if NO_POOL:
        return
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    block = cp.empty(int(nbytes) + 8192, dtype=cp.uint8)
    block.fill(0xFF)
    del block


def nan_fill(host: np.ndarray) -> None:
    """Set every element of a host array (or a view into one) to NaN, in place."""
    host[...] = np.nan


# --------------------------------------------------------------------------------------------------
# Angle sources: what apply_rope gets (device arrays) and what the reference gets (host arrays).


@dataclass
class Angles:
    call: dict  # keyword arguments of cr.apply_rope
    ref: dict  # keyword arguments of reference_rope
    max_angle: float = 0.0  # computed angles: largest |position * inv_freq|
    table_dtype: str | None = None  # set when the reference saw exact cos/sin but the kernel a table
    name: str = field(default="")


def cache_angles(q, positions, rotary_dim, *, table_dtype="float32", max_position=MAX_POSITION,
                 theta=10000.0) -> Angles:
    """The library's own vLLM-layout cache on q's device; the reference reads the same rows."""
    cache = cr.cos_sin_cache(max_position, rotary_dim, theta=theta, dtype=table_dtype, like=q)
    assert isinstance(cache, cp.ndarray) and cache.dtype == np_dtype(table_dtype)
    assert cache.shape == (max_position, rotary_dim) and cache.device.id == q.device.id
    return Angles(
        call=dict(positions=None if positions is None else to_gpu(positions), cos_sin_cache=cache),
        ref=dict(positions=positions, cos_sin_cache=to_host(cache)),
        name="cache",
    )


def exact_cos_sin(positions, rotary_dim, theta=10000.0):
    """float64 cos and sin, shape positions.shape + (rotary_dim // 2,)."""
    rows = reference_cos_sin_cache(0, rotary_dim, theta=theta, positions=positions)
    half = rotary_dim // 2
    return rows[..., :half], rows[..., half:]


def table_angles(positions, rotary_dim, *, interleaved, full_width, table_dtype="float32",
                 theta=10000.0) -> Angles:
    """Per-token cos/sin tables of ``positions`` (shape positions.shape + (w,)), rounded once to
    ``table_dtype``; the reference reads the rounded values."""
    cos, sin = exact_cos_sin(positions, rotary_dim, theta)
    if full_width:  # Hugging Face layout: halves repeated (NeoX) or pairs repeated (interleaved)
        if interleaved:
            cos, sin = np.repeat(cos, 2, axis=-1), np.repeat(sin, 2, axis=-1)
        else:
            cos, sin = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)
    cos_t = round_to_dtype(cos, np_dtype(table_dtype))
    sin_t = round_to_dtype(sin, np_dtype(table_dtype))
    return Angles(
        call=dict(cos=to_gpu(cos_t), sin=to_gpu(sin_t)),
        ref=dict(cos=cos_t.astype(np.float64), sin=sin_t.astype(np.float64)),
        name="tables_full" if full_width else "tables_half",
    )


def computed_angles(positions, rotary_dim, token_shape, *, theta=10000.0,
                    linear_factor=None) -> Angles:
    scaling = None if linear_factor is None else {"rope_type": "linear", "factor": linear_factor}
    factor = 1.0 if linear_factor is None else linear_factor
    used = default_positions(token_shape) if positions is None else positions
    return Angles(
        call=dict(positions=None if positions is None else to_gpu(positions), theta=theta,
                  scaling=scaling),
        ref=dict(positions=positions, theta=theta, linear_factor=factor),
        max_angle=max_abs_angle(used, reference_inv_freq(rotary_dim, theta, factor)),
        name="computed",
    )


def make_angles(source, q_host_shape, positions, rotary_dim, *, q, interleaved,
                table_dtype="float32") -> Angles:
    """One of the angle sources by name, for q of shape ``q_host_shape`` ([T, H, D]-like)."""
    token_shape = tuple(q_host_shape[:-2])
    if source == "cache":
        return cache_angles(q, positions, rotary_dim, table_dtype=table_dtype)
    if source in ("tables_half", "tables_full"):
        table_positions = default_positions(token_shape) if positions is None else positions
        return table_angles(np.broadcast_to(table_positions, token_shape), rotary_dim,
                            interleaved=interleaved, full_width=source == "tables_full",
                            table_dtype=table_dtype)
    if source == "computed":
        return computed_angles(positions, rotary_dim, token_shape)
    if source == "computed_linear":
        return computed_angles(positions, rotary_dim, token_shape, theta=500000.0,
                               linear_factor=4.0)
    raise ValueError(source)


# --------------------------------------------------------------------------------------------------
# One call, fully checked.


def rope_and_check(q, k, angles: Angles, *, rotary_dim, interleaved=False, inplace=False,
                   inverse=False, pass_rotary_dim=True, validate=False):
    """Run apply_rope on device arrays q (and k) and check everything against the reference.

    ``rotary_dim`` is the number of rotated dims the reference uses; it is passed to apply_rope only
    with ``pass_rotary_dim`` (otherwise the library's default must find the same value).
    Returns the outputs (the inputs themselves in place).
    """
    inputs = [q] if k is None else [q, k]
    hosts = [to_host(a) for a in inputs]  # taken before the call: the reference sees these
    refs = [reference_rope(x, **angles.ref, interleaved=interleaved, rotary_dim=rotary_dim,
                           inverse=inverse) for x in hosts]
    if not inplace:
        poison_pool(sum(a.nbytes for a in inputs))
    result = cr.apply_rope(q, k, **angles.call, interleaved=interleaved,
                           rotary_dim=rotary_dim if pass_rotary_dim else None, inverse=inverse,
                           inplace=inplace, validate=validate)
    if k is None:
        assert isinstance(result, cp.ndarray), f"k=None must return one array, got {type(result)}"
        outs = [result]
    else:
        assert isinstance(result, tuple) and len(result) == 2, f"expected (q_out, k_out), got {result!r}"
        outs = list(result)
    for name, out, inp, x, ref in zip(("q", "k"), outs, inputs, hosts, refs):
        if inplace:
            assert out is inp, f"inplace=True must return {name} itself"
        else:
            assert isinstance(out, cp.ndarray), f"{name}_out is {type(out)}, not a CuPy array"
            assert out is not inp and out.data.ptr != inp.data.ptr or out.size == 0
            assert out.shape == inp.shape and out.dtype == inp.dtype
            assert out.flags.c_contiguous, f"{name}_out must be a new contiguous array"
            assert out.device.id == inp.device.id
            assert_bits_equal(to_host(inp), x, what=f"{name} after an out-of-place call")
        assert_rope_close(to_host(out), ref, x, interleaved=interleaved, rotary_dim=rotary_dim,
                          table_dtype=angles.table_dtype, max_angle=angles.max_angle)
    return outs


def make_qk(rng, dtype, token_shape=(T,), hq=HQ, hk=HK, d=D):
    q = to_gpu(random_host(rng, tuple(token_shape) + (hq, d), dtype))
    k = None if hk is None else to_gpu(random_host(rng, tuple(token_shape) + (hk, d), dtype))
    return q, k


# --------------------------------------------------------------------------------------------------
# Dtypes x angle sources x pairings (16-byte vector path: D = 128, contiguous, aligned)

SOURCES = ("cache", "tables_half", "tables_full", "computed", "computed_linear")


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("few_tokens", [True, False], ids=["decode", "lean"])
def test_dtypes_and_angle_sources(rng, monkeypatch, few_tokens, dtype, source, interleaved):
    from cupyrope.cuda import launch

    # T tokens are "few" (the decode kernel) or not (the lean kernel).
    monkeypatch.setattr(launch, "DECODE_MAX_TOKENS", T if few_tokens else T - 1)
    q, k = make_qk(rng, dtype)
    positions = random_positions(rng, (T,))
    angles = make_angles(source, q.shape, positions, D, q=q, interleaved=interleaved)
    rope_and_check(q, k, angles, rotary_dim=D, interleaved=interleaved)


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kernel", ["decode", "lean", "general"])
def test_decode_lean_and_general_kernels(rng, monkeypatch, kernel, dtype, source, interleaved,
                                         inplace):
    """The common case runs the decode kernel with few tokens and the lean kernel with more; the
    general kernel, forced onto the same case, gives results within the same bounds (it is the
    one every other layout takes)."""
    from cupyrope.cuda import launch
    from cupyrope.cuda.compiler import angle_arithmetic
    from cupyrope.core.plan import plan_rope
    from cupyrope.cuda.recipes import recipes

    # T tokens are "few" for the decode case, and many for the others.
    monkeypatch.setattr(launch, "DECODE_MAX_TOKENS", T if kernel == "decode" else T - 1)
    if kernel == "general":
        monkeypatch.setattr(launch, "lean_kernel_applies", lambda *args, **kwargs: False)
    recipes.clear()
    q, k = make_qk(rng, dtype)
    positions = random_positions(rng, (T,))
    angles = make_angles(source, q.shape, positions, D, q=q, interleaved=interleaved)
    rope_and_check(q, k, angles, rotary_dim=D, interleaved=interleaved, inplace=inplace)
    (recipe,) = recipes.values()
    # Interleaved full-width (HF) tables repeat each angle twice: every other entry is read, a
    # strided row that only the general kernel loads.
    common = not (source == "tables_full" and interleaved)
    assert recipe.spec.lean is (kernel != "general" and common)
    # Computed angles take the decode kernel with float64 angle arithmetic (H100 / H200 ...).
    computed_decodes = ("computed" not in source
                        or launch.computed_decode_pays(
                            plan_rope(q), angle_arithmetic(recipe.device)))
    assert recipe.spec.decode is (kernel == "decode" and common and computed_decodes)


# The decode kernel's own layouts: one thread per (token, head, chunk), heads split over blocks.
DECODE_CASES = {
    # name: (tokens, q heads, k heads, head_dim, dtype, source, interleaved, inverse, positions)
    "uneven_head_split": (5, 33, 8, 128, BF16, "cache", False, False, "int64"),  # 41 over 2 x 21
    "q_only": (3, 8, None, 128, "float16", "cache", False, False, "int64"),
    "implicit_positions": (9, 4, 2, 128, BF16, "cache", False, False, None),
    "mqa_inverse_tables": (6, 8, 1, 64, "float32", "tables_half", False, True, "int64"),
    "d80_int32_positions": (4, 4, 2, 80, BF16, "cache", False, False, "int32"),
    "float64": (7, 4, 2, 64, "float64", "cache", False, False, "int64"),
    "interleaved_d256": (2, 4, 2, 256, BF16, "cache", True, False, "int64"),
    "interleaved_tables": (7, 4, 2, 128, "float16", "tables_half", True, False, "int64"),
    "most_tokens": (512, 4, 2, 128, BF16, "cache", False, False, "int64"),
    # Computed angles (each warp computes its token's angles; blocks padded to whole warps).
    "computed_uneven_heads": (5, 33, 8, 128, BF16, "computed", False, False, "int64"),  # 2 x 24
    "computed_d80_padded_warps": (4, 4, 2, 80, BF16, "computed", False, False, "int32"),
    "computed_linear_inverse_interleaved": (3, 8, 1, 64, "float32", "computed_linear", True,
                                            True, "int64"),
    "computed_implicit_positions": (9, 4, 2, 128, "float16", "computed", False, False, None),
    "computed_q_only": (2, 6, None, 128, BF16, "computed", False, False, "int64"),
    "computed_most_tokens": (512, 4, 2, 128, BF16, "computed", False, False, "int64"),
}


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_kernel_layouts(rng, case, inplace):
    from cupyrope.cuda import launch
    from cupyrope.cuda.recipes import recipes

    t, hq, hk, d, dtype, source, interleaved, inverse, positions_dtype = DECODE_CASES[case]
    assert t <= launch.DECODE_MAX_TOKENS
    recipes.clear()
    q, k = make_qk(rng, dtype, (t,), hq=hq, hk=hk, d=d)
    positions = None if positions_dtype is None else random_positions(rng, (t,), positions_dtype)
    angles = make_angles(source, q.shape, positions, d, q=q, interleaved=interleaved)
    rope_and_check(q, k, angles, rotary_dim=d, interleaved=interleaved, inverse=inverse,
                   inplace=inplace)
    (recipe,) = recipes.values()
    if "computed" in source:  # computed angles: where they pay (float64 angle arithmetic)
        from cupyrope.cuda.compiler import angle_arithmetic
        from cupyrope.core.plan import plan_rope

        assert t <= launch.DECODE_MAX_COMPUTED_TOKENS
        if not launch.computed_decode_pays(plan_rope(q), angle_arithmetic(recipe.device)):
            assert not recipe.spec.decode
            return
    assert recipe.spec.decode, f"{case}: ran {recipe.spec.name_expression}"


@pytest.mark.parametrize("source", ["cache", "computed", "tables_full"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_inplace_dtypes(rng, dtype, source):
    q, k = make_qk(rng, dtype)
    positions = random_positions(rng, (T,), "int32")
    angles = make_angles(source, q.shape, positions, D, q=q, interleaved=False)
    rope_and_check(q, k, angles, rotary_dim=D, inplace=True)


# Cache / table dtypes other than float32, for the common q dtypes.
TABLE_CASES = [
    ("bfloat16", "float16", "cache"),
    ("bfloat16", "bfloat16", "cache"),
    ("bfloat16", "float64", "cache"),
    ("bfloat16", "bfloat16", "tables_full"),
    ("float16", "float16", "tables_half"),
    ("float32", "float16", "cache"),
    ("float32", "bfloat16", "cache"),
    ("float32", "float64", "cache"),
    ("float64", "bfloat16", "cache"),
]


@pytest.mark.parametrize("dtype,table_dtype,source", TABLE_CASES)
def test_table_dtypes(rng, dtype, table_dtype, source):
    q, k = make_qk(rng, dtype)
    positions = random_positions(rng, (T,))
    angles = make_angles(source, q.shape, positions, D, q=q, interleaved=False,
                         table_dtype=table_dtype)
    rope_and_check(q, k, angles, rotary_dim=D)


@pytest.mark.parametrize("table_dtype", DTYPES)
def test_cos_sin_cache_on_gpu_matches_host_and_exact(table_dtype):
    """cos_sin_cache(like=cupy array) is the host cache, bit for bit, on q's device, and within one
    ulp of the table dtype of the exact float64 values (plus the float64 angle's own few ulps,
    which only float64 tables resolve)."""
    like = cp.empty((1, 1, 64), dtype=cp.float32)
    dev = cr.cos_sin_cache(1000, 64, theta=10000.0, dtype=table_dtype, like=like)
    host = cr.cos_sin_cache(1000, 64, theta=10000.0, dtype=table_dtype)
    assert isinstance(dev, cp.ndarray) and dev.dtype == np_dtype(table_dtype)
    assert_bits_equal(to_host(dev), host, what="device cache vs host cache")
    exact = reference_cos_sin_cache(1000, 64)
    err = np.abs(host.astype(np.float64) - exact)
    bound = ulp(exact, table_dtype) + ANGLE_EPS * 999.0  # largest angle: position 999 * inv_freq 1
    assert np.all(err <= bound), f"max error {err.max():.3e}"


# --------------------------------------------------------------------------------------------------
# head_dim sweep: vector and scalar paths, both pairings

HEAD_DIMS = (2, 6, 64, 80, 96, 120, 128, 256)
HEAD_DIM_CASES = [("bfloat16", "cache"), ("bfloat16", "computed"), ("float32", "cache")]


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype,source", HEAD_DIM_CASES)
def test_head_dims(rng, dtype, source, head_dim, interleaved):
    q, k = make_qk(rng, dtype, (33,), hq=3, hk=1, d=head_dim)
    positions = random_positions(rng, (33,))
    angles = make_angles(source, q.shape, positions, head_dim, q=q, interleaved=interleaved)
    rope_and_check(q, k, angles, rotary_dim=head_dim, interleaved=interleaved)


@pytest.mark.parametrize("hk", [4, 8])
@pytest.mark.parametrize("head_dim", [80, 96])
def test_in_place_uneven_lanes_in_whole_warps(rng, head_dim, hk):
    """In place, heads of 5 / 6 lanes padded to 8, two heads a thread, blocks rounded up to whole
    warps (launch.UNEVEN_LANES_MAX_HEADS, UNEVEN_LANES_WHOLE_WARPS): 36 heads over 20 head lanes,
    40 over 20."""
    q, k = make_qk(rng, BF16, (600,), hq=32, hk=hk, d=head_dim)
    positions = random_positions(rng, (600,))
    angles = make_angles("cache", q.shape, positions, head_dim, q=q, interleaved=False)
    rope_and_check(q, k, angles, rotary_dim=head_dim, inplace=True)


@pytest.mark.parametrize("head_dim,hq,hk,block", [
    (80, 32, 4, (5, 32, 1)), (80, 64, 8, (5, 32, 1)), (80, 8, 1, (5, 9, 2)), (96, 4, 1, (6, 5, 4))])
def test_in_place_uneven_lanes_on_fast_memory(rng, monkeypatch, planned_launches, head_dim, hq,
                                              hk, block):
    """FAST_MEMORY's in-place launches of unpadded uneven lanes (forced here on any GPU: launch.
    UNEVEN_LANES_FAST_MEMORY_MIN_TOKENS): 5 lanes in blocks of 32 head lanes, every head by the
    kernel's loop over head lanes (36 heads in rounds of 32 and 4, 72 in 32, 32 and 8); few heads
    a block row each, whole tokens a block. (Hopper GPUs take the many heads' launches onto the
    staged kernel, tests/test_fused_staged.py; kept off here, as on GPUs without it.)"""
    from cupyrope.cuda import launch

    monkeypatch.setattr(launch, "_memory_bandwidth", lambda device: launch.FAST_MEMORY)
    monkeypatch.setattr(launch, "PLAIN_STAGED_LANES", frozenset())
    T = launch.UNEVEN_LANES_FAST_MEMORY_MIN_TOKENS + 1  # a last block of one token
    q, k = make_qk(rng, BF16, (T,), hq=hq, hk=hk, d=head_dim)
    positions = random_positions(rng, (T,))
    angles = make_angles("cache", q.shape, positions, head_dim, q=q, interleaved=False)
    rope_and_check(q, k, angles, rotary_dim=head_dim, inplace=True)
    (spec,) = planned_launches
    assert spec.block == block and spec.grid == (-(-T // block[2]), 1)


# --------------------------------------------------------------------------------------------------
# Partial rotary: dims >= rotary_dim pass through bit for bit (copied out of place, untouched in place)


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("source", ["cache", "tables_full", "computed"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(128, 64), (64, 24)])
def test_partial_rotary(rng, head_dim, rotary_dim, source, interleaved, inplace):
    q, k = make_qk(rng, BF16, (41,), hq=4, hk=2, d=head_dim)
    positions = random_positions(rng, (41,))
    angles = make_angles(source, q.shape, positions, rotary_dim, q=q, interleaved=interleaved)
    # The cache width and the Hugging Face full-width tables imply rotary_dim: let the library
    # find it (computed angles need it spelled out).
    rope_and_check(q, k, angles, rotary_dim=rotary_dim, interleaved=interleaved, inplace=inplace,
                   pass_rotary_dim=source == "computed")


# --------------------------------------------------------------------------------------------------
# Head counts: GQA, MQA, no k


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("hq,hk", [(32, 8), (32, 1), (8, None)], ids=["gqa", "mqa", "k_none"])
def test_head_counts(rng, hq, hk, inplace):
    q, k = make_qk(rng, BF16, (29,), hq=hq, hk=hk)
    positions = random_positions(rng, (29,))
    angles = cache_angles(q, positions, D)
    rope_and_check(q, k, angles, rotary_dim=D, inplace=inplace)


# --------------------------------------------------------------------------------------------------
# Layouts: strided views are honoured as given, memory around them is never touched


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("pad", [8, 1], ids=["pad8_vector", "pad1_scalar"])
def test_padded_head_stride(rng, pad, inplace):
    """Heads strided wider than head_dim; the padding holds NaN that must never leak or change."""
    t, hq, hk, d = 37, 4, 2, 128
    q_before = random_host(rng, (t, hq, d + pad), BF16)
    k_before = random_host(rng, (t, hk, d + pad), BF16)
    nan_fill(q_before[..., d:])
    nan_fill(k_before[..., d:])
    q_buf, k_buf = to_gpu(q_before), to_gpu(k_before)
    q, k = q_buf[..., :d], k_buf[..., :d]
    positions = random_positions(rng, (t,))
    rope_and_check(q, k, computed_angles(positions, d, (t,)), rotary_dim=d, inplace=inplace)
    for name, buf, before in (("q", q_buf, q_before), ("k", k_buf, k_before)):
        assert_bits_equal(to_host(buf)[..., d:], before[..., d:], what=f"{name} head padding")


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("layout", ["S", "BS", "none", "ABS_int32"])
def test_batched_positions(rng, layout, inplace):
    """[B, S, H, D] with positions [S], [B, S] or None (arange over S); [A, B, S, H, D] with
    int32 positions [S] (the two leading dims merge, positions broadcast over them)."""
    lead = (2, 3) if layout == "ABS_int32" else (3,)
    s = 37
    token_shape = lead + (s,)
    q, k = make_qk(rng, BF16, token_shape, hq=4, hk=2, d=64)
    if layout == "S":
        positions = random_positions(rng, (s,))
    elif layout == "BS":
        positions = random_positions(rng, (lead[0], s))
    elif layout == "ABS_int32":
        positions = random_positions(rng, (s,), "int32")
    else:
        positions = None
    angles = cache_angles(q, positions, 64)
    rope_and_check(q, k, angles, rotary_dim=64, inplace=inplace)


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("positions_kind", ["S", "BS"])
def test_transposed_bhsd_storage(rng, positions_kind, inplace):
    """[B, H, S, D] storage viewed as [B, S, H, D] (a transpose, no copy)."""
    b, h, hk, s, d = 2, 4, 2, 45, 128
    q_base = to_gpu(random_host(rng, (b, h, s, d), BF16))
    k_base = to_gpu(random_host(rng, (b, hk, s, d), BF16))
    q, k = q_base.transpose(0, 2, 1, 3), k_base.transpose(0, 2, 1, 3)
    assert q.data.ptr == q_base.data.ptr and not q.flags.c_contiguous
    positions = random_positions(rng, (s,) if positions_kind == "S" else (b, s))
    outs = rope_and_check(q, k, cache_angles(q, positions, d), rotary_dim=d, inplace=inplace)
    if inplace:
        assert_bits_equal(to_host(q_base).transpose(0, 2, 1, 3), to_host(outs[0]), what="q storage")


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_misaligned_pointer(rng, dtype, interleaved, inplace):
    """Views that start one element into a buffer: not 16-byte aligned, so the scalar path runs."""
    t, hq, hk, d = 23, 4, 2, 128
    item = np.dtype(np_dtype(dtype)).itemsize
    hosts = []
    for heads in (hq, hk):
        flat = random_host(rng, (t * heads * d + 1,), dtype)
        nan_fill(flat[:1])
        hosts.append(flat)
    q_flat, k_flat = to_gpu(hosts[0]), to_gpu(hosts[1])
    q = q_flat[1:].reshape(t, hq, d)
    k = k_flat[1:].reshape(t, hk, d)
    assert q.data.ptr == q_flat.data.ptr + item and q.data.ptr % 16 != 0
    positions = random_positions(rng, (t,))
    angles = make_angles("cache", q.shape, positions, d, q=q, interleaved=interleaved)
    rope_and_check(q, k, angles, rotary_dim=d, interleaved=interleaved, inplace=inplace)
    for name, flat, host in (("q", q_flat, hosts[0]), ("k", k_flat, hosts[1])):
        assert_bits_equal(to_host(flat[:1]), host[:1], what=f"element before the {name} view")


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
def test_odd_strides(rng, inplace):
    """Odd head and token strides (q: heads padded by one element, k: every second token of a
    buffer with odd padding)."""
    t, hq, hk, d = 19, 3, 2, 64
    q_before = random_host(rng, (t, hq + 1, d + 1), BF16)
    k_before = random_host(rng, (2 * t, hk, d + 3), BF16)
    q_buf, k_buf = to_gpu(q_before), to_gpu(k_before)
    q = q_buf[:, :hq, :d]
    k = k_buf[::2, :, :d]
    assert q.strides[1] // 2 == d + 1 and k.strides[0] // 2 == 2 * hk * (d + 3)
    positions = random_positions(rng, (t,))
    rope_and_check(q, k, cache_angles(q, positions, d), rotary_dim=d, inplace=inplace)
    q_after, k_after = to_host(q_buf), to_host(k_buf)
    assert_bits_equal(q_after[:, hq:, :], q_before[:, hq:, :], what="q padding head")
    assert_bits_equal(q_after[:, :, d:], q_before[:, :, d:], what="q padding dim")
    assert_bits_equal(k_after[1::2], k_before[1::2], what="k tokens between the strided ones")
    assert_bits_equal(k_after[:, :, d:], k_before[:, :, d:], what="k padding dims")


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
def test_strided_and_broadcast_tables(rng, interleaved):
    """cos/sin as column slices of one buffer (row stride 2w), and [S, w] tables broadcast over the
    batch of a [B, S, H, D] q."""
    s, b, d = 29, 2, 64
    positions = random_positions(rng, (s,))
    cos, sin = exact_cos_sin(positions, d)
    if interleaved:
        cos, sin = np.repeat(cos, 2, -1), np.repeat(sin, 2, -1)
    else:
        cos, sin = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)
    both = np.concatenate([cos, sin], -1).astype(np.float32)  # [S, 2w]
    both_dev = to_gpu(both)
    cos_dev, sin_dev = both_dev[:, :d], both_dev[:, d:]
    assert cos_dev.strides[0] == 2 * d * 4
    angles = Angles(call=dict(cos=cos_dev, sin=sin_dev),
                    ref=dict(cos=both[:, :d].astype(np.float64), sin=both[:, d:].astype(np.float64)))
    q, k = make_qk(rng, BF16, (b, s), hq=4, hk=2, d=d)
    rope_and_check(q, k, angles, rotary_dim=d, interleaved=interleaved, pass_rotary_dim=False)


# --------------------------------------------------------------------------------------------------
# Positions: int32 / int64, up to 2^20, negative (computed angles)


@pytest.fixture(scope="module")
def cache_2p20():
    """A float32 [2^20, 128] cache (512 MB) built on the device from float64 angles."""
    rotary_dim = 128
    inv_freq = cp.asarray(reference_inv_freq(rotary_dim))
    angles = cp.arange(2**20, dtype=cp.float64)[:, None] * inv_freq[None, :]
    cache = cp.concatenate([cp.cos(angles), cp.sin(angles)], axis=1).astype(cp.float32)
    del angles
    yield cache
    del cache
    cp.get_default_memory_pool().free_all_blocks()


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("positions_dtype", ["int32", "int64"])
def test_cache_positions_up_to_2p20(rng, cache_2p20, positions_dtype, dtype, interleaved):
    """Random positions in [0, 2^20) (plus both ends) into a 2^20-row cache, checked end to end
    against exact float64 angles (the cache's float32 rounding is the table term)."""
    t = 1024
    positions = random_positions(rng, (t,), positions_dtype, 0, 2**20)
    positions[:2] = [0, 2**20 - 1]
    q, k = make_qk(rng, dtype, (t,), hq=4, hk=1, d=128)
    cos, sin = exact_cos_sin(positions, 128)
    angles = Angles(call=dict(positions=to_gpu(positions), cos_sin_cache=cache_2p20),
                    ref=dict(cos=cos, sin=sin), table_dtype="float32")
    rope_and_check(q, k, angles, rotary_dim=128, interleaved=interleaved, pass_rotary_dim=False)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
@pytest.mark.parametrize("positions_dtype", ["int32", "int64"])
def test_computed_large_and_negative_positions(rng, positions_dtype, dtype, interleaved):
    t = 512
    positions = random_positions(rng, (t,), positions_dtype, -(2**20), 2**20 + 1)
    positions[:4] = [-(2**20), -1, 2**20, 131071]
    q, k = make_qk(rng, dtype, (t,), hq=4, hk=2, d=128)
    angles = computed_angles(positions, 128, (t,), theta=10000.0)
    rope_and_check(q, k, angles, rotary_dim=128, interleaved=interleaved)


# --------------------------------------------------------------------------------------------------
# Empty inputs


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("t,hq,hk", [(0, 4, 2), (5, 4, 0), (0, 0, 0)], ids=["T0", "Hk0", "all0"])
def test_empty(rng, t, hq, hk, inplace):
    q, k = make_qk(rng, BF16, (t,), hq=hq, hk=hk, d=64)
    positions = random_positions(rng, (t,))
    rope_and_check(q, k, cache_angles(q, positions, 64), rotary_dim=64, inplace=inplace)


# --------------------------------------------------------------------------------------------------
# Positions outside the cache: NaN in the rotated dims only; validate=True raises first


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("positions_dtype", ["int32", "int64"])
def test_out_of_range_cache_positions(rng, positions_dtype, inplace):
    t, d, r, max_position = 24, 128, 64, 100
    positions = random_positions(rng, (t,), positions_dtype, 0, max_position)
    info = np.iinfo(positions_dtype)
    bad = [-1, -7, max_position, max_position + 1, info.min, info.max]
    positions[: len(bad)] = bad
    q, k = make_qk(rng, BF16, (t,), hq=4, hk=2, d=d)
    q_before, k_before = to_host(q), to_host(k)
    angles = cache_angles(q, positions, r, max_position=max_position)

    with pytest.raises(IndexError):
        cr.apply_rope(q, k, **angles.call, inplace=inplace, validate=True)
    assert_bits_equal(to_host(q), q_before, what="q after a call that raised")
    assert_bits_equal(to_host(k), k_before, what="k after a call that raised")

    # Without validation: the bad rows come out NaN in the rotated dims, pass-through dims intact
    # (the reference has NaN exactly there, and assert_rope_close checks the pattern).
    outs = rope_and_check(q, k, angles, rotary_dim=r, inplace=inplace, pass_rotary_dim=False)
    rows = np.isin(np.arange(t), np.arange(len(bad)))
    q_out = to_host(outs[0]).astype(np.float64)
    assert np.isnan(q_out[rows, :, :r]).all() and not np.isnan(q_out[~rows]).any()


def test_validate_accepts_positions_inside_the_cache(rng):
    q, k = make_qk(rng, BF16, (T,))
    positions = random_positions(rng, (T,), "int64", 0, 100)
    positions[:2] = [0, 99]
    angles = cache_angles(q, positions, D, max_position=100)
    rope_and_check(q, k, angles, rotary_dim=D, validate=True)


# --------------------------------------------------------------------------------------------------
# inverse


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("source", ["cache", "tables_half", "computed"])
def test_inverse_is_rotation_by_minus_angle(rng, source, inplace):
    q, k = make_qk(rng, BF16)
    positions = random_positions(rng, (T,))
    angles = make_angles(source, q.shape, positions, D, q=q, interleaved=False)
    rope_and_check(q, k, angles, rotary_dim=D, inverse=True, inplace=inplace)


# --------------------------------------------------------------------------------------------------
# CuPy's current stream


_SPIN_SOURCE = r"""
extern "C" __global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) { }
}
"""


def test_runs_on_cupy_current_stream(rng):
    """Inputs are written on a non-blocking stream after ~0.1 s of GPU work; the kernel must run on
    that stream (CuPy's current one) to see them. Run elsewhere, it would read the NaN poison."""
    spin = cp.RawKernel(_SPIN_SOURCE, "spin")
    spin((1,), (1,), (np.int64(0),))  # compile it now, not while the stream test runs
    q_src, k_src = make_qk(rng, BF16)
    positions = random_positions(rng, (T,))
    angles = cache_angles(q_src, positions, D)
    cp.cuda.Device().synchronize()
    x_q, x_k = to_host(q_src), to_host(k_src)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        q = cp.empty_like(q_src)
        k = cp.empty_like(k_src)
        q.view(cp.uint16).fill(0xFFFF)
        k.view(cp.uint16).fill(0xFFFF)
        # Before the spin: freeing pool blocks (cudaFree) waits for the whole device.
        poison_pool(q.nbytes + k.nbytes)
        # From here to apply_rope nothing may synchronise or allocate.
        spin((1,), (1,), (np.int64(200_000_000),))
        q.data.copy_from_device_async(q_src.data, q.nbytes, stream)
        k.data.copy_from_device_async(k_src.data, k.nbytes, stream)
        q_out, k_out = cr.apply_rope(q, k, **angles.call)
        q_in, k_in = cr.apply_rope(q, k, **angles.call, inplace=True)  # after the first, same stream
    stream.synchronize()
    for out, x in ((q_out, x_q), (k_out, x_k), (q_in, x_q), (k_in, x_k)):
        ref = reference_rope(x, **angles.ref)
        assert_rope_close(to_host(out), ref, x, interleaved=False, rotary_dim=D)


# --------------------------------------------------------------------------------------------------
# More than 2^31 elements in one tensor (64-bit indexing)


def test_tensor_over_2p31_elements(rng):
    hq, hk, d = 32, 8, 128
    t = 2**31 // (hq * d) + 1  # q has 2^31 + 4096 elements (4.3 GB in bfloat16)
    need = 2 * (t * (hq + hk) * d * 2) + (1 << 30)  # q, k, their outputs, slack
    free, _ = cp.cuda.runtime.memGetInfo()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    pool = cp.get_default_memory_pool()
    try:
        q = cp.empty((t, hq, d), dtype=np_dtype(BF16))
        k = cp.empty((t, hk, d), dtype=np_dtype(BF16))
        assert q.size > 2**31
        # Fill with a repeated random block (one broadcast copy), then a distinct last token.
        block = 1024
        for dev, heads in ((q, hq), (k, hk)):
            bits = dev.view(cp.uint16)
            tile = cp.asarray(random_host(rng, (block, heads, d), BF16).view(np.uint16))
            bits[: t - 1].reshape((t - 1) // block, block, heads, d)[...] = tile[None]
            bits[t - 1] = cp.asarray(random_host(rng, (heads, d), BF16).view(np.uint16))
        positions_host = random_positions(rng, (t,), "int64")
        positions = to_gpu(positions_host)
        cache = cr.cos_sin_cache(MAX_POSITION, d, like=q)
        cache_host = to_host(cache)

        # Tokens to check: both ends, the ones whose q elements cross 2^31, and a random few.
        crossing = 2**31 // (hq * d)
        sample = np.unique(np.concatenate([
            np.arange(8), np.arange(crossing - 4, min(crossing + 4, t)), np.arange(t - 8, t),
            rng.integers(0, t, 16),
        ]))
        sample_dev = cp.asarray(sample)

        def take(a):
            return a.view(cp.uint16)[sample_dev].get().view(np_dtype(BF16))

        x_q, x_k = take(q), take(k)
        ref_kwargs = dict(positions=positions_host[sample], cos_sin_cache=cache_host)
        ref_q, ref_k = reference_rope(x_q, **ref_kwargs), reference_rope(x_k, **ref_kwargs)

        poison_pool(q.nbytes + k.nbytes)
        q_out, k_out = cr.apply_rope(q, k, positions, cos_sin_cache=cache)
        assert_rope_close(take(q_out), ref_q, x_q, interleaved=False, rotary_dim=d)
        assert_rope_close(take(k_out), ref_k, x_k, interleaved=False, rotary_dim=d)
        assert_bits_equal(take(q), x_q, what="q after an out-of-place call")
        q_out = k_out = None  # free 5 GB before the in-place call

        q_in, k_in = cr.apply_rope(q, k, positions, cos_sin_cache=cache, inplace=True)
        assert q_in is q and k_in is k
        assert_rope_close(take(q), ref_q, x_q, interleaved=False, rotary_dim=d)
        assert_rope_close(take(k), ref_k, x_k, interleaved=False, rotary_dim=d)
    finally:
        q = k = q_out = k_out = q_in = k_in = None  # drop the arrays before freeing the pool
        cp.cuda.Device().synchronize()
        pool.free_all_blocks()


# --------------------------------------------------------------------------------------------------
# Many threads making their first call at once; warmup


@pytest.fixture
def compiled_specs(monkeypatch):
    """Forget every compiled kernel, then record each specialisation compiled from here on."""
    from cupyrope.cuda import compiler

    cr.clear_cache()
    compiled = []
    real_compile = compiler._compile

    def counting_compile(spec, device_id, *args):
        compiled.append(spec)
        return real_compile(spec, device_id, *args)

    monkeypatch.setattr(compiler, "_compile", counting_compile)
    return compiled


def test_threads_first_call_compile_once(rng, monkeypatch, compiled_specs):
    """Eight threads call a specialisation that is not compiled yet, at the same moment: it compiles
    once and every thread gets correct results."""
    # Force a real NVRTC compile (CuPy's disk cache would otherwise hand back the binary).
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")
    compiled = compiled_specs

    n = 8
    d = 6  # float16, NeoX, half = 3: the scalar path; float64 table: a specialisation used nowhere else
    qs, ks = [], []
    for _ in range(n):
        q, k = make_qk(rng, "float16", (45,), hq=4, hk=2, d=d)
        qs.append(q)
        ks.append(k)
    positions = random_positions(rng, (45,))
    angles = cache_angles(qs[0], positions, d, table_dtype="float64")
    cp.cuda.Device().synchronize()

    barrier = threading.Barrier(n)
    results: list = [None] * n
    errors: list = [None] * n

    def worker(i):
        try:
            barrier.wait(timeout=60)
            results[i] = cr.apply_rope(qs[i], ks[i], **angles.call)
            cp.cuda.get_current_stream().synchronize()
        except BaseException as exc:  # reported below, with the thread's index
            errors[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    failed = [(i, repr(e)) for i, e in enumerate(errors) if e is not None]
    assert not failed, f"threads raised: {failed}"
    assert len(compiled) == 1, f"compiled {len(compiled)} times: {compiled}"
    cp.cuda.Device().synchronize()
    for i in range(n):
        for out, inp in zip(results[i], (qs[i], ks[i])):
            x = to_host(inp)
            assert_rope_close(to_host(out), reference_rope(x, **angles.ref), x, interleaved=False,
                              rotary_dim=d)


def test_warmup_counts_and_precompiles(rng, compiled_specs):
    compiled = compiled_specs

    count = cr.warmup(dtypes=("float16",), table_dtypes=("float32",), sources=("cache", "computed"),
                      interleaved=(False, True), vector=(True,))
    # {cache, computed} x {NeoX, interleaved} x {decode, lean, general}
    assert count == 12
    assert len(compiled) == 12
    assert sum(spec.lean and not spec.decode for spec in compiled) == 4
    assert sum(spec.decode for spec in compiled) == 4
    assert cr.warmup(dtypes=("float16",), sources=(cr.AngleSource.CACHE_TABLE,),
                     interleaved=(False,), vector=(True,)) == 3
    assert cr.warmup(dtypes=()) == 0
    assert len(compiled) == 12, "warmup recompiled a specialisation it already had"

    # The calls after warmup use what it compiled, and are correct.
    q, k = make_qk(rng, "float16")
    positions = random_positions(rng, (T,))
    for source, interleaved in (("cache", False), ("computed", True)):
        angles = make_angles(source, q.shape, positions, D, q=q, interleaved=interleaved)
        rope_and_check(q, k, angles, rotary_dim=D, interleaved=interleaved)
    assert len(compiled) == 12, f"a call after warmup compiled again: {compiled[12:]}"
