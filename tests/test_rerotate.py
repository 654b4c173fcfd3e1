"""``rerotate_cache``: cached keys re-rotated in place by a per-slot position delta, against an
independent float64 reference, on every backend (NumPy, torch, JAX, and CuPy / torch CUDA / JAX
GPU marked gpu), every cache format (float16, bfloat16, float32, fp8 e4m3 / e5m2 with a scale),
both layouts and pairings, partial rotary dims, both angle sources; its composition with
``rope_and_cache`` (R(d) R(p) = R(p + d)), the drift of many successive re-rotations, the torch
operator (torch.compile, CUDA graphs), the JAX functional form, and the refusals.

Every check of a re-rotated element is "one rounding to the cache's format plus float32
arithmetic": ``|out - exact| <= ulp(max(|out|, |exact| + t)) / 2 + t`` in stored units, with
``t = (C_COMPUTE * 2^-24 + ANGLE_EPS * max_angle) * (|x1| + |x2|)`` (tests/tolerances.py).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupyrope as cr
from backends import Backend, backend_params
from reference import reference_inv_freq, reference_rope
from tolerances import ANGLE_EPS, C_COMPUTE, assert_bits_equal, np_dtype

BACKENDS = backend_params(["numpy", "torch", "jax", "cupy", "torch-cuda", "jax-gpu"])
MUTABLE = backend_params(["numpy", "torch", "cupy", "torch-cuda"])
GPU = backend_params(["cupy", "torch-cuda", "jax-gpu"])
FORMATS = ["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"]
FP8 = ("float8_e4m3fn", "float8_e5m2")
# (explicit mantissa bits, smallest normal exponent) of each cache format.
FORMAT_BITS = {"float16": (10, -14), "bfloat16": (7, -126), "float32": (23, -126),
               "float8_e4m3fn": (3, -6), "float8_e5m2": (2, -14)}
# fp8 scales that keep N(0, 1) keys well inside each format's normal range.
FP8_SCALE = {"float8_e4m3fn": 1 / 16, "float8_e5m2": 1 / 64}
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}  # their largest finite values
THETA = 10000.0
MAX_POSITION = 512


def _fmt(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name)) if name in FP8 else np_dtype(name)


def ulp(values, name: str) -> np.ndarray:
    """The spacing of format ``name`` at |values| (its subnormal spacing below the normal range)."""
    mantissa, min_exponent = FORMAT_BITS[name]
    a = np.abs(np.asarray(values, np.float64))
    _, e2 = np.frexp(np.where(np.isfinite(a) & (a > 0), a, 0.0))
    exponent = np.where(a > 0, np.maximum(e2 - 1, min_exponent), min_exponent)
    return np.ldexp(1.0, exponent - mantissa)


def assert_one_rounding(got, exact, magnitude, name: str, *, scale: float = 1.0,
                        max_angle: float = 0.0, what: str = "k_cache") -> None:
    """Each stored element within half an ulp of the format (one rounding) of a value within the
    float32 arithmetic's error ``t`` of the exact one; NaN exactly where the exact value is NaN."""
    got = np.asarray(got).astype(np.float64)
    exact = np.asarray(exact, np.float64) / scale
    t = (C_COMPUTE * 2.0 ** -24 + ANGLE_EPS * max_angle) * np.asarray(magnitude) / scale
    nan = np.isnan(exact)
    assert np.array_equal(np.isnan(got), nan), f"{what}: NaN pattern differs from the reference"
    bound = 0.5 * ulp(np.fmax(np.abs(got), np.abs(exact) + t), name) + t
    err = np.where(nan, 0.0, np.abs(got - exact))
    ratio = np.where(nan, 0.0, err / bound)
    worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape) if ratio.size else ()
    assert not ratio.size or ratio[worst] <= 1.0, (
        f"{what}: {int((ratio > 1).sum())} element(s) past one rounding of {name}; worst at "
        f"{worst}: got {got[worst]!r}, exact {exact[worst]!r}, bound {bound[worst]:.3g}")


def pair_magnitude(x, rotary_dim: int, interleaved: bool) -> np.ndarray:
    """|x1| + |x2| of the pair of every rotated element, ``x.shape[:-1] + (rotary_dim,)``."""
    x = np.abs(np.asarray(x, np.float64)[..., :rotary_dim])
    half = rotary_dim // 2
    if interleaved:
        s = x[..., 0::2] + x[..., 1::2]
        return np.repeat(s, 2, axis=-1)
    s = x[..., :half] + x[..., half:]
    return np.concatenate([s, s], axis=-1)


def rotate64(x, cos, sin, rotary_dim: int, interleaved: bool) -> np.ndarray:
    """x ``[n, H, D]`` (float64) with its pairs rotated by cos / sin ``[n, rotary_dim // 2]``."""
    out = np.array(x, np.float64)
    half = rotary_dim // 2
    a = np.arange(0, rotary_dim, 2) if interleaved else np.arange(half)
    b = a + 1 if interleaved else a + half
    c, s = cos[:, None, :], sin[:, None, :]
    out[..., a] = x[..., a] * c - x[..., b] * s
    out[..., b] = x[..., b] * c + x[..., a] * s
    return out


def exact_rows(rows64, delta, rotary_dim, interleaved, table=None):
    """The exact re-rotation of float64 rows ``[n, H, D]`` by per-row deltas: angles delta *
    inv_freq in float64, or the table row of each delta divided by the schedule's attention
    factor that row 0 holds (the keys already carry it)."""
    half = rotary_dim // 2
    delta = np.asarray(delta, np.int64)
    if table is None:
        angles = delta[:, None].astype(np.float64) * reference_inv_freq(rotary_dim, THETA)
        cos, sin = np.cos(angles), np.sin(angles)
    else:
        inside = (delta >= 0) & (delta < table.shape[0])
        rows = np.asarray(table, np.float64)[np.where(inside, delta, 0)]
        factor = np.asarray(table, np.float64)[0, :half]
        cos, sin = rows[:, :half] / factor, rows[:, half:2 * half] / factor
        cos[~inside], sin[~inside] = np.nan, np.nan
    return rotate64(rows64, cos, sin, rotary_dim, interleaved)


# ----------------------------------------------------------------------------------------------
# Caches on every backend


def put_cache(backend: Backend, host: np.ndarray) -> tuple:
    """(cache on the backend, extra kwargs): fp8 as torch's fp8 dtype, CuPy's uint8 bits (with
    cache_dtype), or as it is."""
    name = host.dtype.name
    if name in FP8 and backend.framework == "torch":
        import torch

        return backend.put(host.view(np.uint8)).view(getattr(torch, name)), {}
    if name in FP8 and backend.framework == "cupy":
        return backend.put(host.view(np.uint8)), {"cache_dtype": name}
    return backend.put(host), {}


def get_cache(backend: Backend, cache, name: str) -> np.ndarray:
    """A backend cache's values as NumPy in format ``name`` (fp8 bits viewed back)."""
    if backend.framework == "torch":
        import torch

        cache = cache.detach().cpu()
        if name in FP8 or name == "bfloat16":
            return cache.view(torch.uint8).numpy().view(_fmt(name))
        return cache.numpy()
    host = backend.get(cache)
    return host.view(_fmt(name)) if host.dtype == np.uint8 else host


def slot_rows(cache: np.ndarray, layout: str) -> np.ndarray:
    """``[num_slots, heads, D]`` view of a cache."""
    if layout == "HND":
        cache = np.swapaxes(cache, 1, 2)
    return cache.reshape(-1, *cache.shape[2:])


def make_cache(rng, name, layout, *, num_blocks=6, block_size=4, heads=2, head_dim=64):
    """(stored cache, its exact float64 values as [slot, head, D] rows): N(0, 1) keys (no zeros)
    stored in format ``name`` (fp8: value / scale)."""
    scale = FP8_SCALE.get(name, 1.0)
    values = rng.standard_normal((num_blocks, block_size, heads, head_dim))
    values = np.where(np.abs(values) < 1e-2, np.copysign(0.5, values), values)
    if layout == "HND":
        values = np.ascontiguousarray(np.swapaxes(values, 1, 2))
    stored = (values / scale).astype(np.float32).astype(_fmt(name))
    return stored, slot_rows(stored, layout).astype(np.float64) * scale


# (layout, interleaved, head_dim, rotary_dim, block_size, delta, slots x heads): 16-byte accesses
# at few rows (a pair per thread where angles or fp8 conversions would chain, see
# cupyrope/cuda/launch.py) and at many; the other layout and pairing with partial rotary dims
# and one delta for every slot; a head size whose halves take the scalar path (and one-slot
# blocks, SGLang's token-slot cache).
CASES = [("NHD", False, 64, 64, 4, "array", (24, 2)), ("NHD", False, 64, 64, 16, "array", (576, 8)),
         ("HND", True, 64, 48, 4, "int", (24, 2)), ("NHD", False, 80, 76, 1, "array", (24, 2))]


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("source", ["computed", "cache"])
@pytest.mark.parametrize("case", CASES, ids=["NHD-neox", "NHD-neox-many-rows", "HND-gptj-partial",
                                             "NHD-scalar-path"])
def test_rerotate_matches_the_reference(backend, rng, name, source, case):
    layout, interleaved, head_dim, rotary_dim, block_size, kind, (total, heads) = case
    stored, rows64 = make_cache(rng, name, layout, block_size=block_size, head_dim=head_dim,
                                num_blocks=total // block_size, heads=heads)
    num_slots = rows64.shape[0]
    slots = rng.permutation(num_slots)[:num_slots - 5].astype(np.int64)
    slots[::4] = -1  # skipped
    n = len(slots)
    if source == "computed":
        delta = rng.integers(-100000, 100000, n) if kind == "array" else 12345
        table = None
        kwargs = {"theta": THETA, "rotary_dim": rotary_dim}
    else:
        delta = rng.integers(0, MAX_POSITION, n) if kind == "array" else 77
        table = cr.cos_sin_cache(MAX_POSITION, rotary_dim, theta=THETA, dtype="float32")
        kwargs = {"cos_sin_cache": backend.put(table)}
    cache, extra = put_cache(backend, stored)
    scale = FP8_SCALE.get(name, 1.0)
    if name in FP8:
        kwargs["k_scale"] = scale
    delta_arg = backend.put(np.asarray(delta)) if kind == "array" else delta
    out = cr.rerotate_cache(cache, backend.put(slots), delta_arg, layout=layout,
                            interleaved=interleaved, **kwargs, **extra)
    if backend.mutable:
        assert out is cache, "the cache given is written in place and returned"
    else:
        np.testing.assert_array_equal(get_cache(backend, cache, name).view(np.uint8),
                                      stored.view(np.uint8))  # JAX: a new cache, input untouched
    valid = slots >= 0
    _check_rerotated(slot_rows(get_cache(backend, out, name), layout), stored, rows64,
                     slots[valid], np.broadcast_to(np.asarray(delta), slots.shape)[valid],
                     rotary_dim, interleaved, table, name, layout)


def _check_rerotated(got, stored, rows64, named, deltas, rotary_dim, interleaved, table, name,
                     layout) -> None:
    """The slots ``named`` (re-rotated by ``deltas``) of the cache rows ``got`` within one
    rounding of the exact re-rotation of ``rows64``; dims past rotary_dim and every slot not named
    bit for bit as ``stored``."""
    before = slot_rows(stored, layout)
    exact = exact_rows(rows64[named], deltas, rotary_dim, interleaved, table)
    max_angle = float(np.abs(deltas).max()) if table is None else 0.0
    assert_one_rounding(got[named][..., :rotary_dim], exact[..., :rotary_dim],
                        pair_magnitude(rows64[named], rotary_dim, interleaved), name,
                        scale=FP8_SCALE.get(name, 1.0), max_angle=max_angle)
    # Dims past rotary_dim and every slot not named: bit for bit as they were.
    np.testing.assert_array_equal(got[named][..., rotary_dim:].view(np.uint8),
                                  before[named][..., rotary_dim:].view(np.uint8))
    untouched = np.setdiff1d(np.arange(len(before)), named)
    np.testing.assert_array_equal(got[untouched].view(np.uint8), before[untouched].view(np.uint8))


# The staged re-rotation (kernels_cu/rerotate_staged.cuh: Hopper GPUs of fast memory, from
# launch.RERO_STAGED_MIN_ROWS rows) on caches small enough for every layout it takes: the GPU's
# bandwidth and the threshold set, one SM's blocks so that each block's ring of stages wraps many
# times. (layout, interleaved, head_dim, rotary_dim, heads, block_size): NHD, HND of one-slot
# blocks (a slot's heads side by side there too), GPT-J pairs, partial rotations, heads wider than
# the rotation (bf16 from a table: 15 entries a stage, fewer than the items ask for, to stay
# within launch.RERO_STAGED_MAX_STAGE_BYTES); then the index dtype of slots and deltas and the
# form of delta (an array a slot, an int for every slot, or one element for every slot).
STAGED_CASES = [("NHD", False, 128, 128, 8, 16, "int64", "array"),
                ("HND", False, 128, 128, 8, 1, "int32", "array"),
                ("NHD", True, 128, 128, 8, 16, "int32", "int"),
                ("HND", True, 128, 64, 4, 1, "int64", "one"),
                ("NHD", False, 256, 128, 2, 16, "int32", "array")]
# (cache format, angle source): computed angles, a float32 table, a table of the cache's 16 bits.
STAGED_SOURCES = ([(name, "computed") for name in FORMATS] + [(name, "float32") for name in FORMATS]
                  + [("float16", "float16"), ("bfloat16", "bfloat16")])


def _staged_only(hopper_fast_memory, monkeypatch, multiprocessors):
    from cupyrope.cuda import launch

    hopper_fast_memory(launch, "re-rotation")
    if multiprocessors is not None:
        monkeypatch.setattr(launch, "_multiprocessors", lambda device: multiprocessors)


@pytest.mark.parametrize("backend", backend_params(["cupy", "torch-cuda"]), indirect=True)
@pytest.mark.parametrize("name,source", STAGED_SOURCES, ids=[f"{n}-{s}" for n, s in STAGED_SOURCES])
@pytest.mark.parametrize("case", STAGED_CASES, ids=["NHD-neox", "HND-neox", "NHD-gptj",
                                                    "HND-gptj-partial", "NHD-256-partial"])
def test_staged_rerotation_matches_the_reference(backend, rng, monkeypatch, planned_rerotations,
                                                 hopper_fast_memory, name, source, case):
    """Each named slot's rotated dims within one rounding of the float64 re-rotation (a delta
    outside the table: NaN in its slot's rotated dims), dims past rotary_dim and every other slot
    bit for bit as they were (skipped slots: -1 and one past the cache), through the staged
    kernel, with int32 or int64 slots and deltas, one delta a slot or one for all."""
    from cupyrope.cuda import launch

    _staged_only(hopper_fast_memory, monkeypatch, 1)
    monkeypatch.setattr(launch, "RERO_STAGED_MIN_ROWS", 1)
    layout, interleaved, head_dim, rotary_dim, heads, block_size, index, form = case
    stored, rows64 = make_cache(rng, name, layout, block_size=block_size, head_dim=head_dim,
                                num_blocks=160 // block_size, heads=heads)
    num_slots = rows64.shape[0]
    slots = rng.permutation(num_slots)[:num_slots - 9].astype(index)
    slots[::5] = -1
    slots[7] = num_slots + 3  # past the cache: skipped (validate=True would refuse it)
    n = len(slots)
    scale = FP8_SCALE.get(name, 1.0)
    kwargs = {"k_scale": scale} if name in FP8 else {}
    if source == "computed":
        delta, table = rng.integers(-100000, 100000, n).astype(index), None
        kwargs.update(theta=THETA, rotary_dim=rotary_dim)
    else:
        delta, table = rng.integers(0, MAX_POSITION, n).astype(index), cr.cos_sin_cache(
            MAX_POSITION, rotary_dim, theta=THETA, dtype=source)
        if form == "array":
            delta[[1, 2]] = (MAX_POSITION, MAX_POSITION + 40)  # outside the table: NaN, loudly
        kwargs["cos_sin_cache"] = backend.put(table)
    if form != "array":
        delta[:] = delta[0]
    delta_arg = {"array": lambda: backend.put(delta), "int": lambda: int(delta[0]),
                 "one": lambda: backend.put(delta[:1])}[form]()
    cache, extra = put_cache(backend, stored)
    out = cr.rerotate_cache(cache, backend.put(slots), delta_arg, layout=layout,
                            interleaved=interleaved, **kwargs, **extra)
    (spec,) = planned_rerotations
    assert spec.kernel.staged and spec.grid[0] < -(-n // int(spec.fusion_params["stage_slots"]))
    r = spec.fusion_params
    assert (int(r["slots_are_int64"]), int(r["delta_is_int64"])) == (
        index == "int64", index == "int64" and form != "int")
    assert (int(r["delta"]) == 0) == (form == "int") and (int(r["delta_stride"]) == 0) == (
        form != "array")
    valid = (slots >= 0) & (slots < num_slots)
    _check_rerotated(slot_rows(get_cache(backend, out, name), layout), stored, rows64,
                     slots[valid], delta[valid].astype(np.int64), rotary_dim, interleaved, table,
                     name, layout)


@pytest.mark.parametrize("backend", backend_params(["cupy", "torch-cuda"]), indirect=True)
@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn"])
def test_staged_rerotation_at_its_threshold_equals_the_16_byte_kernel(backend, rng, monkeypatch,
                                                                      planned_rerotations,
                                                                      hopper_fast_memory, name):
    """At launch.RERO_STAGED_MIN_ROWS rows (16384 slots of 8 heads) on the GPU's own grid, the
    staged kernel writes the 16-byte kernel's bytes exactly (the same chunk arithmetic), and one
    slot fewer leaves the launch to the 16-byte kernel."""
    _staged_only(hopper_fast_memory, monkeypatch, None)
    stored, _ = make_cache(rng, name, "NHD", block_size=16, head_dim=128, num_blocks=1100,
                           heads=8)
    table = cr.cos_sin_cache(4096, 128, theta=THETA, dtype="float32")
    slots = rng.permutation(1100 * 16)[:16384]
    delta = rng.integers(0, 4096, 16384)
    kwargs = {"k_scale": FP8_SCALE[name]} if name in FP8 else {}
    caches = []
    for count in (16384, 16383):
        cache, extra = put_cache(backend, stored)
        cr.rerotate_cache(cache, backend.put(slots[:count]), backend.put(delta[:count]),
                          cos_sin_cache=backend.put(table), **kwargs, **extra)
        caches.append(slot_rows(get_cache(backend, cache, name), "NHD").view(np.uint8))
    assert [spec.kernel.staged for spec in planned_rerotations] == [True, False]
    # The slots both kernels re-rotated agree bit for bit; the last one only the first moved.
    np.testing.assert_array_equal(caches[0][slots[:16383]], caches[1][slots[:16383]])
    np.testing.assert_array_equal(caches[1][slots[16383]], slot_rows(stored, "NHD")[
        slots[16383]].view(np.uint8))
    assert not np.array_equal(caches[0][slots[16383]], caches[1][slots[16383]])


@pytest.mark.parametrize("backend", MUTABLE, indirect=True)
@pytest.mark.parametrize("name", ["bfloat16", "float32"])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 256}])
@pytest.mark.parametrize("source", ["computed", "cache"])
def test_rerotation_after_rope_and_cache_is_rope_at_the_shifted_position(backend, rng, name,
                                                                         scaling, source):
    """Keys written by rope_and_cache at positions p, re-rotated by d, are the keys rotated at
    p + d (the schedule's attention factor, which they carry, applied once), within two roundings
    of the format."""
    T, Hk, D, block_size = 13, 2, 64, 4
    dt = np_dtype(name)
    k = rng.standard_normal((T, Hk, D)).astype(dt)
    q = rng.standard_normal((T, 1, D)).astype(dt)
    positions = rng.integers(0, 200, T)
    delta = rng.integers(-positions, 300)  # p + d in [0, 500)
    if source == "cache":
        delta = np.abs(delta)
    slots = rng.permutation(8 * block_size)[:T]
    shape = (8, block_size, Hk, D)
    k_cache, v_cache = backend.put(np.zeros(shape, dt)), backend.put(np.zeros(shape, dt))
    angle = ({"cos_sin_cache": backend.put(cr.cos_sin_cache(512, D, theta=THETA, scaling=scaling))}
             if source == "cache" else {"theta": THETA, "scaling": scaling})
    cr.rope_and_cache(backend.put(q), backend.put(k), backend.put(k), backend.put(positions),
                      k_cache, v_cache, backend.put(slots), **angle)
    cr.rerotate_cache(k_cache, backend.put(slots), backend.put(delta), **angle)
    got = slot_rows(get_cache(backend, k_cache, name), "NHD")[slots].astype(np.float64)
    inv_freq, factor = cr.rope_frequencies(D, theta=THETA, scaling=scaling)
    angles = (positions + delta)[:, None] * inv_freq
    expected = rotate64(k.astype(np.float64), np.cos(angles) * factor, np.sin(angles) * factor, D,
                        False)
    u = 2.0 ** -(FORMAT_BITS[name][0] + 1)
    bound = (2 * u + 2 * C_COMPUTE * 2.0 ** -24) * factor * pair_magnitude(k, D, False)
    err = np.abs(got - expected)
    assert np.all(err <= bound), f"max error {err.max():.3g} past two roundings of {name}"


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0},
                                     {"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}])
@pytest.mark.parametrize("interleaved", [False, True])
def test_computed_angles_are_apply_ropes(rng, scaling, interleaved):
    """With schedules whose attention factor is 1, a re-rotation by d is bit for bit
    ``apply_rope`` at position d on the NumPy path: the same angle machinery."""
    cache = rng.standard_normal((3, 4, 2, 64)).astype(np.float32)
    slots = np.arange(12)
    delta = rng.integers(-2**40, 2**40, 12)
    rows = cache.reshape(12, 2, 64).copy()
    expected = cr.apply_rope(rows, positions=delta, theta=5e5, scaling=scaling,
                             interleaved=interleaved)
    cr.rerotate_cache(cache, slots, delta, theta=5e5, scaling=scaling, interleaved=interleaved)
    np.testing.assert_array_equal(cache.reshape(12, 2, 64), expected)


def test_negative_deltas_undo_positive_ones(rng):
    """Computed angles rotate backwards exactly: +d then -d returns float32 keys to within a few
    float32 ulps of their pair."""
    cache = rng.standard_normal((4, 8, 2, 32)).astype(np.float32)
    before = cache.copy()
    slots, delta = np.arange(32), rng.integers(0, 2**31, 32)
    cr.rerotate_cache(cache, slots, delta)
    assert not np.allclose(cache, before)
    cr.rerotate_cache(cache, slots, -delta)
    magnitude = pair_magnitude(before, 32, False)
    assert np.all(np.abs(cache - before) <= 4 * C_COMPUTE * 2.0 ** -24 * magnitude)


# ----------------------------------------------------------------------------------------------
# Drift: many successive re-rotations against one rotation by their sum

# The drift of n re-rotations: the largest pair error against the exact rotation of the original
# keys by the sum of the deltas, relative to the pair's norm (docs/rerotate.md has the measured
# values and the argument). u is the format's unit roundoff; the float32 arithmetic adds about one
# 2^-24 per step.
# - Random deltas (large angles, both signs): each step's rounding errors are independent, so they
#   add as a random walk: at most DRIFT_BOUND * sqrt(n) * (u + 2^-24) (measured <= 3).
# - Repeated small shifts (the same delta every step, a table's small rows): the errors of
#   successive steps correlate (a pair whose rotation per step is below half an ulp does not
#   rotate at all), so they may add up linearly: never more than (1 + a)^n - 1 with a = sqrt(2) u
#   + 2 C_COMPUTE 2^-24, the most one step can add (one rounding of the pair, float32 arithmetic
#   and cos/sin), compounded.
DRIFT_BOUND = 4.0
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8,
                 "float8_e4m3fn": 2.0 ** -4, "float8_e5m2": 2.0 ** -3}


def random_walk_bound(name: str, steps: int) -> float:
    return DRIFT_BOUND * np.sqrt(steps) * (UNIT_ROUNDOFF[name] + 2.0 ** -24)


def worst_case_bound(name: str, steps: int) -> float:
    step = np.sqrt(2) * UNIT_ROUNDOFF[name] + 2 * C_COMPUTE * 2.0 ** -24
    return float(np.expm1(steps * np.log1p(step)))


def drift(backend: Backend, rng, name: str, steps: int, *, deltas=None, table=False) -> float:
    """The drift (see above) of ``steps`` re-rotations of 64 slots of 8 heads of 128 dims, keys
    of pair norms in [0.5, 2], by ``deltas`` (``[steps, 64]``; default random in [-5000, 5000)),
    with computed angles or the rows of a 64-row table."""
    heads, D, half = 8, 128, 64
    radius = rng.uniform(0.5, 2.0, (16, 4, heads, half))
    phase = rng.uniform(-np.pi, np.pi, radius.shape)
    scale = FP8_SCALE.get(name, 1.0)
    values = np.concatenate([radius * np.cos(phase), radius * np.sin(phase)], axis=-1)
    stored = (values / scale).astype(np.float32).astype(_fmt(name))
    rows64 = slot_rows(stored, "NHD").astype(np.float64) * scale
    if deltas is None:
        deltas = rng.integers(-5000, 5000, (steps, 64))
    rows = cr.cos_sin_cache(64, D, theta=THETA) if table else None
    angle = {"cos_sin_cache": backend.put(rows)} if table else {"theta": THETA}
    cache, extra = put_cache(backend, stored)
    fp8 = {"k_scale": scale} if name in FP8 else {}
    slots = backend.put(np.arange(64))
    for step in deltas:
        cache = cr.rerotate_cache(cache, slots, backend.put(np.asarray(step)), **angle, **extra,
                                  **fp8)
    got = slot_rows(get_cache(backend, cache, name), "NHD").astype(np.float64) * scale
    if rows is None:
        exact = exact_rows(rows64, deltas.sum(axis=0), D, False)
    else:  # the product of the table's rotations (their angles add up past its rows)
        exact = rows64
        for step in deltas:
            exact = exact_rows(exact, step, D, False, rows)
    error = np.hypot(got[..., :half] - exact[..., :half], got[..., half:] - exact[..., half:])
    norm = np.hypot(rows64[..., :half], rows64[..., half:])
    return float((error / norm).max())


DRIFT_BACKENDS = backend_params(["numpy", "cupy", "torch-cuda"])


@pytest.mark.parametrize("backend", DRIFT_BACKENDS, indirect=True)
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("steps", [10, 1000])
def test_drift_of_random_rerotations(backend, rng, name, steps):
    measured = drift(backend, rng, name, steps)
    bound = random_walk_bound(name, steps)
    assert measured <= bound, (f"{name}: {steps} re-rotations by random deltas drift "
                               f"{measured:.3g} of the pair norm, past {bound:.3g}")


@pytest.mark.parametrize("backend", DRIFT_BACKENDS, indirect=True)
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("steps", [10, 1000])
def test_drift_of_repeated_unit_shifts(backend, rng, name, steps):
    """The same shift by one position at every step (a sliding window moving token by token):
    the worst case, within the compounded bound of one step's error."""
    measured = drift(backend, rng, name, steps, deltas=np.ones((steps, 64), np.int64))
    bound = worst_case_bound(name, steps)
    assert measured <= bound, (f"{name}: {steps} shifts by 1 drift {measured:.3g} of the pair "
                               f"norm, past {bound:.3g}")


@pytest.mark.parametrize("backend", backend_params(["numpy", "cupy"]), indirect=True)
@pytest.mark.parametrize("name", ["bfloat16", "float32"])
def test_drift_from_a_table(backend, rng, name):
    measured = drift(backend, rng, name, 100, deltas=rng.integers(0, 64, (100, 64)), table=True)
    assert measured <= worst_case_bound(name, 100)


# ----------------------------------------------------------------------------------------------
# Values checked on the host, and refusals


def _small(rng, dtype=np.float32):
    cache = rng.standard_normal((4, 4, 2, 64)).astype(dtype)
    slots = np.array([3, 7, -1, 12], np.int64)
    return cache, slots


def test_validate_refuses_slots_past_the_cache_and_repeated_slots(rng):
    cache, slots = _small(rng)
    before = cache.copy()
    with pytest.raises(IndexError, match=r"slots holds 1 slot\(s\) >= 16 .*first 40"):
        cr.rerotate_cache(cache, np.array([3, 40]), 5, validate=True)
    with pytest.raises(ValueError, match=r"slots names slot 7 at entries \[1, 3\]"):
        cr.rerotate_cache(cache, np.array([3, 7, -1, 7, -1]), 5, validate=True)
    np.testing.assert_array_equal(cache, before)
    cr.rerotate_cache(cache, np.array([3, 40]), 5)  # without validate slot 40 is skipped
    rows, rows_before = slot_rows(cache, "NHD"), slot_rows(before, "NHD")
    assert not np.array_equal(rows[3], rows_before[3])
    np.testing.assert_array_equal(np.delete(rows, 3, 0), np.delete(rows_before, 3, 0))


def test_table_deltas_must_index_its_rows(rng):
    cache, slots = _small(rng)
    table = cr.cos_sin_cache(100, 64)
    before = cache.copy()
    with pytest.raises(IndexError, match=r"must lie in \[0, 100\), got values in \[-3, -3\]; a "
                                         "table holds no negative angle"):
        cr.rerotate_cache(cache, slots, -3, cos_sin_cache=table)
    with pytest.raises(IndexError, match=r"must lie in \[0, 100\), got values in \[100, 100\]"):
        cr.rerotate_cache(cache, slots, 100, cos_sin_cache=table)
    with pytest.raises(IndexError, match=r"got values in \[-1, 5\]"):
        cr.rerotate_cache(cache, slots, np.array([5, -1, 999, 2]), cos_sin_cache=table,
                          validate=True)  # 999 belongs to a skipped slot
    np.testing.assert_array_equal(cache, before)
    # Without validate a row outside the table is never read: its slot becomes NaN, loudly.
    cr.rerotate_cache(cache, slots, np.array([5, 120, 999, 2]), cos_sin_cache=table)
    rows = slot_rows(cache, "NHD")
    assert np.isnan(rows[7]).all() and np.isfinite(rows[[3, 12]]).all()


@pytest.mark.parametrize("case,error,match", [
    ("cache_dtype", TypeError, r"k_cache must be one of \('float16'.*got float64"),
    ("cache_rank", ValueError, r"k_cache must be 4-d \(\[num_blocks, block_size, num_heads, "
                               r"head_dim\]\), got shape \(16, 2, 64\)"),
    ("layout", ValueError, "layout must be one of \\('NHD', 'HND'\\), got 'NDH'"),
    ("last_stride", ValueError, "k_cache's last dim \\(head_dim\\) must have stride 1"),
    ("read_only", ValueError, "k_cache is read-only"),
    ("aliased", ValueError, "reaches some element from two indices"),
    ("uint8", TypeError, "a uint8 k_cache holds fp8 bits"),
    ("cache_dtype_mismatch", ValueError, "cache_dtype float8_e5m2 but k_cache is float32"),
    ("scale_not_fp8", ValueError, "k_scale is only used with an fp8 cache"),
    ("scale_shape", ValueError, "k_scale must be a number or a 0-d / one-element array"),
    ("scale_value", ValueError, "k_scale must be finite and > 0, got -1.0"),
    ("slots_dtype", TypeError, "slots must be int32 or int64, got float32"),
    ("slots_shape", ValueError, r"slots must have shape \(N,\).*got \(2, 2\)"),
    ("delta_missing", TypeError, "delta is required"),
    ("delta_float", TypeError, "delta must be an int or an int32 / int64 array, got float"),
    ("delta_dtype", TypeError, "delta must be int32 or int64, got float64"),
    ("delta_shape", ValueError, r"delta must be an int or have shape \(4,\).*got \(3,\)"),
    ("delta_range", ValueError, "delta must fit int64"),
    ("table_wide", ValueError, "cos_sin_cache is 128 wide, more than k_cache's head_dim 64"),
    ("table_theta", ValueError, "theta=500000.0 is given with cos_sin_cache"),
    ("rotary_dim", ValueError, "rotary_dim must be even with 2 <= rotary_dim <= head_dim"),
    ("mrope", ValueError, "M-RoPE"),
    ("overlap", ValueError, "k_cache shares memory with delta"),
    ("interleaved", TypeError, "interleaved must be a bool, got int"),
])
def test_refusals_write_nothing(rng, case, error, match):
    cache, slots = _small(rng)
    kwargs: dict = {}
    delta = np.array([1, 2, 3, 4])
    if case == "cache_dtype":
        cache = cache.astype(np.float64)
    elif case == "cache_rank":
        cache = cache.reshape(16, 2, 64)
    elif case == "layout":
        kwargs["layout"] = "NDH"
    elif case == "last_stride":
        cache = np.lib.stride_tricks.as_strided(cache, cache.shape[:3] + (32,),
                                                cache.strides[:3] + (8,))
    elif case == "read_only":
        cache.flags.writeable = False
    elif case == "aliased":
        cache = np.lib.stride_tricks.as_strided(cache, cache.shape, (0,) + cache.strides[1:])
    elif case == "uint8":
        cache = cache.view(np.uint8)[..., :64]
    elif case == "cache_dtype_mismatch":
        kwargs["cache_dtype"] = "float8_e5m2"
    elif case == "scale_not_fp8":
        kwargs["k_scale"] = 2.0
    elif case in ("scale_shape", "scale_value"):
        cache = cache.astype(ml_dtypes.float8_e4m3fn)
        kwargs["k_scale"] = np.ones(2, np.float32) if case == "scale_shape" else -1.0
    elif case == "slots_dtype":
        slots = slots.astype(np.float32)
    elif case == "slots_shape":
        slots = slots.reshape(2, 2)
    elif case == "delta_missing":
        delta = None
    elif case == "delta_float":
        delta = 1.5
    elif case == "delta_dtype":
        delta = delta.astype(np.float64)
    elif case == "delta_shape":
        delta = delta[:3]
    elif case == "delta_range":
        delta = 2**63
    elif case == "table_wide":
        kwargs["cos_sin_cache"] = cr.cos_sin_cache(16, 128)
    elif case == "table_theta":
        kwargs.update(cos_sin_cache=cr.cos_sin_cache(16, 64), theta=5e5)
        delta = 3
    elif case == "rotary_dim":
        kwargs["rotary_dim"] = 66
    elif case == "mrope":
        kwargs["scaling"] = {"rope_type": "default", "mrope_section": [16, 8, 8]}
    elif case == "overlap":
        delta = cache.view(np.int32).reshape(-1)[:4]
    elif case == "interleaved":
        kwargs["interleaved"] = 1
    before = np.array(cache, copy=True)
    with pytest.raises(error, match=match):
        cr.rerotate_cache(cache, slots, delta, **kwargs)
    assert_bits_equal(np.ascontiguousarray(cache), before, what="k_cache after a refusal")


def test_empty_calls_write_nothing(rng):
    cache, _ = _small(rng)
    before = cache.copy()
    assert cr.rerotate_cache(cache, np.zeros(0, np.int64), np.zeros(0, np.int64)) is cache
    cr.rerotate_cache(cache, np.full(3, -1), 7)
    np.testing.assert_array_equal(cache, before)


def test_fp8_bits_in_uint8_with_a_scale_array(rng):
    """A uint8 cache names its format with cache_dtype; the scale may be a one-element float32
    array (what a CUDA graph reads at replay)."""
    stored, rows64 = make_cache(rng, "float8_e4m3fn", "NHD")
    bits = stored.view(np.uint8).copy()
    slots, delta = np.arange(0, 24, 3), rng.integers(-50, 50, 8)
    cr.rerotate_cache(bits, slots, delta, cache_dtype="float8_e4m3fn",
                      k_scale=np.array([FP8_SCALE["float8_e4m3fn"]], np.float32))
    got = slot_rows(bits.view(ml_dtypes.float8_e4m3fn), "NHD")[slots]
    exact = exact_rows(rows64[slots], delta, 64, False)
    assert_one_rounding(got, exact, pair_magnitude(rows64[slots], 64, False), "float8_e4m3fn",
                        scale=FP8_SCALE["float8_e4m3fn"], max_angle=50.0)


# ----------------------------------------------------------------------------------------------
# torch: the operator (in place, version counter, torch.compile, CUDA graphs)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_in_place_and_compiled(rng, device):
    torch = pytest.importorskip("torch")
    cache = torch.from_numpy(rng.standard_normal((4, 4, 2, 64)).astype(np.float32)).to(device)
    slots = torch.tensor([3, 7, -1, 12], device=device)
    delta = torch.tensor([5, -9, 0, 1000], device=device)
    expected = cache.cpu().numpy().copy()
    cr.rerotate_cache(expected, slots.cpu().numpy(), delta.cpu().numpy())
    eager = cache.clone()
    version = eager._version
    assert cr.rerotate_cache(eager, slots, delta) is eager
    assert eager._version > version, "an in-place write bumps the version counter"
    np.testing.assert_allclose(eager.cpu().numpy(), expected, rtol=0, atol=1e-5)

    @torch.compile(fullgraph=True)
    def shift(k_cache, slots, delta):
        cr.rerotate_cache(k_cache, slots, delta)
        return k_cache * 1

    compiled = cache.clone()
    result = shift(compiled, slots, delta)
    np.testing.assert_array_equal(compiled.cpu().numpy(), eager.cpu().numpy())
    np.testing.assert_array_equal(result.cpu().numpy(), eager.cpu().numpy())


def test_torch_refuses_a_cache_that_requires_grad(rng):
    torch = pytest.importorskip("torch")
    cache = torch.zeros(2, 4, 1, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="no gradient for the re-rotation"):
        cr.rerotate_cache(cache, torch.tensor([1]), 3)
    with torch.no_grad():
        cr.rerotate_cache(cache, torch.tensor([1]), 3)


@pytest.mark.parametrize("backend", backend_params(["cupy", "torch-cuda"]), indirect=True)
@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("source", ["computed", "cache"])
def test_repeat_calls_replay_the_first_launch(backend, rng, planned_rerotations, name, source):
    """A call of a layout planned before replays that launch (cupyrope.cuda.recipes.rerotate_key)
    on its own cache, slots and deltas, within one rounding of the float64 re-rotation; an int
    delta or a scale of another value plans again, and so does a cache that another operand
    overlaps, which the full path then refuses, writing nothing. torch: the replay bumps the
    cache's version counter as the full path does."""
    stored, rows64 = make_cache(rng, name, "NHD", block_size=16, head_dim=128, num_blocks=8,
                                heads=4)
    n = 100
    kwargs = {"k_scale": FP8_SCALE[name]} if name in FP8 else {}
    table = None
    if source == "cache":
        table = cr.cos_sin_cache(MAX_POSITION, 128, theta=THETA, dtype="float32")
        kwargs["cos_sin_cache"] = backend.put(table)
    for call in range(3):
        slots = rng.permutation(128)[:n].astype(np.int64)
        delta = rng.integers(0, MAX_POSITION, n)
        cache, extra = put_cache(backend, stored)
        version = cache._version if backend.framework == "torch" else None
        out = cr.rerotate_cache(cache, backend.put(slots), backend.put(delta), **kwargs, **extra)
        assert out is cache
        if version is not None:
            assert cache._version > version
        _check_rerotated(slot_rows(get_cache(backend, out, name), "NHD"), stored, rows64, slots,
                         delta, 128, False, table, name, "NHD")
    assert len(planned_rerotations) == 1, "the second and third calls replay the first launch"
    # An int delta is part of the key: each value plans once.
    for value in (5, 6, 5):
        cache, extra = put_cache(backend, stored)
        cr.rerotate_cache(cache, backend.put(slots), value, **kwargs, **extra)
        _check_rerotated(slot_rows(get_cache(backend, cache, name), "NHD"), stored, rows64, slots,
                         np.full(n, value), 128, False, table, name, "NHD")
    assert len(planned_rerotations) == 3
    if name in FP8:  # a scale of another value: planned again
        cache, extra = put_cache(backend, stored)
        cr.rerotate_cache(cache, backend.put(slots), 5, **{**kwargs, "k_scale": 0.5}, **extra)
        assert len(planned_rerotations) == 4
    # slots inside the cache's own memory: the replay's guard sends the call to the full path,
    # which refuses it before anything is written.
    cache, extra = put_cache(backend, stored)
    if backend.framework == "torch":
        import torch

        as_slots = cache.view(-1).view(torch.uint8)[:8 * n].view(torch.int64)
    else:
        as_slots = cache.reshape(-1).view(np.uint8)[:8 * n].view(np.int64)
    before = get_cache(backend, cache, name).copy()
    planned = len(planned_rerotations)
    with pytest.raises(ValueError, match="k_cache shares memory with slots"):
        cr.rerotate_cache(cache, as_slots, 5, **kwargs, **extra)
    assert len(planned_rerotations) == planned
    np.testing.assert_array_equal(get_cache(backend, cache, name).view(np.uint8),
                                  before.view(np.uint8))


@pytest.mark.gpu
def test_torch_cuda_graph_replays_with_new_deltas(rng):
    """One launch, no allocation or synchronisation: captured after one warm call, a replay
    reads the deltas (and scale) its arrays hold then."""
    torch = pytest.importorskip("torch")
    host = rng.standard_normal((8, 16, 4, 128)).astype(np.float32)
    cache = torch.from_numpy(host).cuda().to(torch.bfloat16)
    slots = torch.randperm(128, device="cuda")[:40]
    delta = torch.zeros(40, dtype=torch.int64, device="cuda")
    cr.rerotate_cache(cache, slots, delta)  # compiles, uploads the frequencies
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cr.rerotate_cache(cache, slots, delta)
    start = cache.clone()
    values = torch.from_numpy(rng.integers(-1000, 1000, 40)).cuda()
    delta.copy_(values)
    graph.replay()
    expected = start.clone()
    cr.rerotate_cache(expected, slots, values)
    torch.cuda.synchronize()
    assert torch.equal(cache, expected)


# ----------------------------------------------------------------------------------------------
# JAX: the functional form


def test_jax_jit_returns_the_new_cache(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    stored, _ = make_cache(rng, "bfloat16", "HND")
    slots, delta = np.array([1, 5, -1, 9]), np.array([3, -4, 0, 70])
    expected = stored.copy()
    cr.rerotate_cache(expected, slots, delta, layout="HND", interleaved=True)
    shift = jax.jit(lambda c, s, d: cr.rerotate_cache(c, s, d, layout="HND", interleaved=True))
    cache = jnp.asarray(stored)
    out = shift(cache, jnp.asarray(slots), jnp.asarray(delta))
    np.testing.assert_array_equal(np.asarray(cache), stored)  # the input stays as it was
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), expected.view(np.uint16))
    batched = jax.vmap(lambda c, d: cr.rerotate_cache(c, jnp.asarray(slots), d, layout="HND",
                                                      interleaved=True))
    outs = batched(jnp.stack([cache, cache]), jnp.asarray(np.stack([delta, -delta])))
    np.testing.assert_array_equal(np.asarray(outs[0]).view(np.uint16), expected.view(np.uint16))
    back = stored.copy()
    cr.rerotate_cache(back, slots, -delta, layout="HND", interleaved=True)
    np.testing.assert_array_equal(np.asarray(outs[1]).view(np.uint16), back.view(np.uint16))
    with pytest.raises(TypeError, match="validate=True reads slots"):
        jax.jit(lambda c, s: cr.rerotate_cache(c, s, 3, validate=True))(cache, jnp.asarray(slots))
    with pytest.raises(ValueError, match="slots names slot 1"):
        cr.rerotate_cache(cache, jnp.asarray([1, 1]), 3, validate=True)


# ----------------------------------------------------------------------------------------------
# The launch, decided without a GPU, and the parameter struct against the CUDA source


def test_launch_plan_without_a_gpu(rng):
    from cupyrope.core.rerotate import plan_rerotate
    from cupyrope.cuda import launch

    cache = np.zeros((100, 16, 8, 128), ml_dtypes.float8_e4m3fn)
    slots = np.arange(1000, dtype=np.int32)
    plan = plan_rerotate(cache, slots, np.arange(1000), k_scale=0.5, theta=1e6)
    spec = launch.plan_rerotate_launch(plan, inv_freq_ptr=4096, num_regs=lambda s: 96,
                                       multiprocessors=132)
    assert spec.kernel.name_expression == (
        "cupyrope::rerotate_cache_kernel<unsigned char, float, true, false, 2, 1>")
    r = spec.fusion_params
    assert (int(r["num_slots"]), int(r["slots_are_int64"]), int(r["delta_is_int64"])) == (
        1000, 0, 1)
    assert (int(r["block_size"]), int(r["cache_slots"]), int(r["num_heads"])) == (16, 1600, 8)
    assert (int(r["block_stride"]), int(r["row_stride"]), int(r["head_stride"])) == (
        16 * 8 * 128, 8 * 128, 128)
    assert float(r["scale_value"]) == 0.5 and int(spec.params["inv_freq"]) == 4096
    assert spec.block[0] == 64 // 16  # lanes: 16 fp8 pairs of each half per 16-byte access
    # At few rows (slots x heads <= 4096) a pair per thread where each 16-byte access would chain
    # computed angles or fp8 conversions; 16-bit elements with a cos / sin table keep the vectors.
    few, table = slots[:512], np.zeros((64, 128), np.float32)
    half = np.zeros((100, 16, 8, 128), np.float16)
    for stored, scale, angles, vector in ((cache, 0.5, {}, False),
                                          (cache, 0.5, {"cos_sin_cache": table}, False),
                                          (half, None, {}, False),
                                          (half, None, {"cos_sin_cache": table}, True)):
        plan = plan_rerotate(stored, few, 3, k_scale=scale, **angles)
        spec = launch.plan_rerotate_launch(plan, inv_freq_ptr=4096, num_regs=lambda s: 64,
                                           multiprocessors=132)
        assert spec.kernel.vector == vector, (stored.dtype, sorted(angles))
    plan = plan_rerotate(cache, slots[:513], 3, k_scale=0.5)
    assert launch.plan_rerotate_launch(plan, inv_freq_ptr=4096, num_regs=lambda s: 64,
                                       multiprocessors=132).kernel.vector
    hnd = np.zeros((100, 8, 16, 80), np.float16)
    for rotary_dim, vector in ((80, True), (76, False)):  # 76: no whole 16-byte accesses
        plan = plan_rerotate(hnd, slots, 3, layout="HND", interleaved=True, rotary_dim=rotary_dim)
        spec = launch.plan_rerotate_launch(plan, num_regs=lambda s: 64, multiprocessors=132)
        assert spec.kernel.vector == vector
    assert int(spec.fusion_params["row_stride"]) == 80 and int(
        spec.fusion_params["head_stride"]) == 16 * 80


def test_fp8_neox_launch_takes_eight_heads_a_thread_from_16384_slots():
    """The fp8 NeoX re-rotation's own throughput curve (launch.RERO_FP8_NEOX_THROUGHPUT_BY_WORK):
    eight heads of 128 a thread (a block of 64 slots) from 16384 slots, where the common curve
    took two (blocks of 16); at 4096 slots both take two. bf16 and GPT-J fp8 caches keep the
    common curve."""
    from cupyrope.core.rerotate import plan_rerotate
    from cupyrope.cuda import launch

    def geometry(dtype, slots, interleaved=False):
        cache = np.zeros((slots // 16, 16, 8, 128), dtype)
        plan = plan_rerotate(cache, np.arange(slots, dtype=np.int32), 3, interleaved=interleaved,
                             k_scale=0.5 if dtype != np.float16 else None)
        spec = launch.plan_rerotate_launch(plan, inv_freq_ptr=4096, num_regs=lambda s: 80,
                                           multiprocessors=132)
        assert spec.kernel.vector
        return spec.block, spec.grid

    fp8 = ml_dtypes.float8_e4m3fn
    assert geometry(fp8, 4096) == ((4, 4, 16), (256, 1))  # two heads a thread
    assert geometry(fp8, 16384) == ((4, 1, 64), (256, 1))  # eight: one head lane
    assert geometry(fp8, 65536) == ((4, 1, 64), (1024, 1))
    for dtype, interleaved in ((np.float16, False), (fp8, True)):
        block, _ = geometry(dtype, 16384, interleaved)
        assert block[1] > 1, (dtype, interleaved)  # more than one head lane: fewer heads a thread


def test_staged_launch_plan_without_a_gpu():
    """The staged re-rotation (launch.rerotate_staged_layout) on a Hopper GPU of fast memory at
    many rows: its stages (items of as many heads as hold 64 bytes of the cache with a table, 128
    with computed angles; entries enough to give each of the 128 consumers one), its persistent
    grid, and the launches it leaves to the 16-byte kernel."""
    from cupyrope.core.rerotate import plan_rerotate
    from cupyrope.cuda import launch

    def planned(cache, slots, *, cc=90, bandwidth=4.8e12, **options):
        plan = plan_rerotate(cache, np.arange(slots, dtype=np.int32), 3, **options)
        return launch.plan_rerotate_launch(plan, inv_freq_ptr=4096, num_regs=lambda s: 64,
                                           multiprocessors=132, memory_bandwidth=bandwidth,
                                           compute_capability=cc)

    fp8 = np.zeros((4096, 16, 8, 128), ml_dtypes.float8_e4m3fn)
    table = np.zeros((4096, 128), np.float32)
    spec = planned(fp8, 65536, k_scale=0.5, cos_sin_cache=table)
    assert spec.kernel.name_expression == (
        "cupyrope::rerotate_staged_kernel<unsigned char, float, false, 0, 1>")
    r = spec.fusion_params
    # fp8 NeoX items take 8 pairs of each half (16 bytes a head): 4 heads, 8 chunks, 2 items a
    # slot x 8 = 16 items a slot, 8 slots a stage.
    assert (int(r["stage_slots"]), int(r["heads_per_item"])) == (8, 4)
    assert (int(r["rows_at"]), int(r["angles_at"])) == (128, 128 + 8 * 1024)
    assert int(r["stage_bytes"]) == 128 + 8 * 1024 + 8 * 512  # whole 128-byte lines
    assert spec.shared_bytes == 4 * int(r["stage_bytes"]) + 64 + 4 * 64
    # Shared memory leaves 4 blocks of 160 an SM (64 registers would leave 6).
    assert spec.block == (160, 1, 1) and spec.grid == (4 * 132, 1)
    computed = planned(fp8, 65536, k_scale=0.5, theta=1e6)
    r = computed.fusion_params
    assert (int(r["stage_slots"]), int(r["heads_per_item"])) == (16, 8)  # 8 items a slot
    assert int(r["angles_at"]) == 16 * 16 + 16 * 1024
    assert computed.shared_bytes == 4 * int(r["stage_bytes"]) + 64  # no table row 0
    bf16_hnd = np.zeros((65536, 8, 1, 128), ml_dtypes.bfloat16)  # one-slot blocks
    r = planned(bf16_hnd, 65536, layout="HND", interleaved=True,
                cos_sin_cache=table).fusion_params
    # 4 interleaved pairs a 16-byte chunk: 16 chunks, 4 heads an item, 32 items a slot.
    assert (int(r["stage_slots"]), int(r["heads_per_item"])) == (4, 4)
    assert int(r["head_stride"]) == 128
    # Two bf16 heads of 256 from a table: 16 items a slot would take 16 entries (24.8 KB), 15 fit.
    wide = planned(np.zeros((4096, 16, 2, 256), ml_dtypes.bfloat16), 65536,
                   cos_sin_cache=table).fusion_params
    assert (int(wide["stage_slots"]), int(wide["stage_bytes"])) == (15, 23296)
    # Left to the 16-byte kernel: another GPU, slower memory, fewer rows, heads of 72 fp8 bytes,
    # HND of 16-slot blocks (a copy a head: 39-76 % of an SM copy where the 16-byte kernel ran
    # 63-87).
    for cache, slots, options in ((fp8, 65536, {"cc": 80}), (fp8, 65536, {"cc": 100}),
                                  (fp8, 65536, {"bandwidth": 3.35e12}), (fp8, 16383, {}),
                                  (np.zeros((1100, 16, 8, 72), ml_dtypes.float8_e4m3fn), 16384,
                                   {"rotary_dim": 64}),
                                  (np.zeros((4096, 8, 16, 128), ml_dtypes.float8_e4m3fn), 65536,
                                   {"layout": "HND"})):
        cc, bandwidth = options.pop("cc", 90), options.pop("bandwidth", 4.8e12)
        spec = planned(cache, slots, k_scale=0.5, cc=cc, bandwidth=bandwidth, **options)
        assert not spec.kernel.staged, (cache.shape, slots, cc, bandwidth)
    assert planned(fp8, 16384, k_scale=0.5).kernel.staged
    # A table of 16-bit entries whose rows are not whole 16-byte units (rotary_dim 56: 56 bytes).
    half = np.zeros((4096, 16, 8, 64), np.float16)
    assert not planned(half, 65536, cos_sin_cache=np.zeros((64, 56), np.float16),
                       rotary_dim=56).kernel.staged
    assert planned(half, 65536, cos_sin_cache=np.zeros((64, 64), np.float16)).kernel.staged


@pytest.mark.nvrtc
def test_params_struct_matches_the_cuda_source():
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cupyrope.core.rerotate import RERO_PARAMS_DTYPE
    from cupyrope.cuda import compiler

    checks = [f"static_assert(sizeof(cupyrope::RerotateParams) == {RERO_PARAMS_DTYPE.itemsize}, "
              "\"size\");"]
    for name in RERO_PARAMS_DTYPE.names:
        checks.append(f"static_assert(__INTADDR__(&((cupyrope::RerotateParams*)0)->{name}) == "
                      f"{RERO_PARAMS_DTYPE.fields[name][1]}, \"offset of {name}\");")
    source = '#include "rerotate.cuh"\n' + "\n".join(checks) + "\n"
    for text, ok in ((source, True), (source.replace("->delta_value) == ", "->delta_value) == 8 + "),
                                      False)):
        program = nvrtc.createProgram(text, "rerotate_abi.cu", [], [])
        try:
            nvrtc.compileProgram(program, list(compiler.compile_options())
                                 + ["--gpu-architecture=sm_80"])
            log = None
        except nvrtc.NVRTCError:
            log = nvrtc.getProgramLog(program)
        finally:
            nvrtc.destroyProgram(program)
        assert (log is None) == ok, log


_FP8_CONVERSIONS = r"""
#include "rerotate.cuh"
template <int FORMAT>
__global__ void decode_all(float* out) {
  const int b = threadIdx.x;  // one thread per pair of codes (b, b ^ 0x80)
  cupyrope::from_fp8x2<FORMAT>(static_cast<unsigned char>(b), static_cast<unsigned char>(b ^ 0x80),
                               out[2 * b], out[2 * b + 1]);
}
template <int FORMAT>
__global__ void encode(const float* in, unsigned char* out, long long n) {
  const long long i = blockIdx.x * 256LL + threadIdx.x;
  if (2 * i + 1 >= n) return;
  const float v[2] = {in[2 * i], in[2 * i + 1]};
  cupyrope::store_cache_values<unsigned char, false, FORMAT>(out, 2 * i, v, 1.0f);
}
"""


@pytest.mark.gpu
@pytest.mark.parametrize("name", FP8)
def test_software_fp8_conversions_match_the_hardware(rng, name):
    """GPUs below compute capability 8.9 convert fp8 in software (rerotate.cuh): built both ways
    on this GPU, every code decodes to the same value and values around every code, their
    midpoints (ties), the saturation range, zeros, infinities, NaN and random magnitudes encode
    to the same bytes."""
    cupy = pytest.importorskip("cupy")
    from cupyrope.cuda import compiler

    if int(cupy.cuda.Device().compute_capability) < 89:
        pytest.skip("the hardware conversions need compute capability 8.9")
    fmt = _fmt(name)
    fmt_id = {"float8_e4m3fn": 1, "float8_e5m2": 2}[name]
    codes = np.arange(256, dtype=np.uint8).view(fmt).astype(np.float32)
    finite = np.sort(codes[np.isfinite(codes)])
    mids = ((finite[1:].astype(np.float64) + finite[:-1]) / 2).astype(np.float32)
    values = np.concatenate([
        finite, mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, -np.float32(np.inf)),
        rng.standard_normal(1 << 16).astype(np.float32)
        * np.float32(2.0) ** rng.integers(-30, 30, 1 << 16).astype(np.float32),
        np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30, 3e38, -3e38])])
    values = np.concatenate([values, values[:1]]) if values.size % 2 else values
    results = []
    for software in (False, True):
        options = compiler.compile_options() + (("-DCUPYROPE_FP8_SOFTWARE",) if software else ())
        module = cupy.RawModule(code=_FP8_CONVERSIONS, options=options,
                                name_expressions=(f"decode_all<{fmt_id}>", f"encode<{fmt_id}>"))
        decoded = cupy.empty(256, cupy.float32)
        module.get_function(f"decode_all<{fmt_id}>")((1,), (128,), (decoded,))
        encoded = cupy.empty(values.size, cupy.uint8)
        module.get_function(f"encode<{fmt_id}>")(((values.size // 2 + 255) // 256,), (256,),
                                                  (cupy.asarray(values), encoded,
                                                   np.int64(values.size)))
        results.append((decoded.get(), encoded.get()))
    (hw_dec, hw_enc), (sw_dec, sw_enc) = results
    np.testing.assert_array_equal(sw_dec.view(np.uint32)[~np.isnan(hw_dec)],
                                  hw_dec.view(np.uint32)[~np.isnan(hw_dec)])
    np.testing.assert_array_equal(np.isnan(sw_dec), np.isnan(hw_dec))
    nan = np.isnan(hw_enc.view(fmt).astype(np.float32))
    np.testing.assert_array_equal(np.isnan(sw_enc.view(fmt).astype(np.float32)), nan)
    np.testing.assert_array_equal(sw_enc[~nan], hw_enc[~nan])
    expected = np.clip(values, -float(FP8_MAX[name]), float(FP8_MAX[name])).astype(fmt)
    np.testing.assert_array_equal(sw_enc[~nan], expected.view(np.uint8)[~nan])

