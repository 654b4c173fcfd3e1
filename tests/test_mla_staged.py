"""The staged MLA kernel (kernels_cu/mla_staged.cuh: token rows moved by bulk copies through
shared-memory stages): the launch rule and geometry (here, no GPU needed) and, on a Hopper GPU,
its outputs against the float64 reference.

The library takes it for launches of many tokens of contiguous rows on Hopper GPUs of fast
memory (the H200: ``mla_launch.mla_staged_applies``). On the GPU every Hopper runs it here: the
device is made to report the H200's memory bandwidth and the rule's token minimum is set to one,
so that few tokens (one a block) and many (each block's stages reused many times) both take it;
every case checks that it ran."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cupyrope as cr
from test_mla import (MAX_POSITION, RANK, ROPE, _check_one_launch, _poisoned_cache, _to_device,
                      _to_host, deepseek_cache)  # noqa: F401 (deepseek_cache: a fixture)
from tolerances import np_dtype

H200 = dict(memory_bandwidth=4.8e12, compute_capability=90)


def _launch(randn, deepseek_cache, T=4096, *, dtype="bfloat16", out="float8_e4m3fn",
            cache_fmt="float8_e4m3fn", interleaved=True, heads=16, nope=128, separate=False,
            k_heads=1, with_cache=True, kpe_cache=False, table=None):
    """plan_mla_launch of an MLA call on host arrays (the launch's host side), DeepSeek-V3 at TP
    8 by default: q [T, 16, 128 + 64] as one array, fp8 outputs, an fp8 joint cache."""
    from cupyrope.core.arrays import describe
    from cupyrope.core.mla import plan_mla
    from cupyrope.cuda.mla_launch import plan_mla_launch

    q = randn((T, heads, nope + ROPE), dtype)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    if separate:  # two arrays: q's rows are not one run of bytes
        q_nope, q_pe = q_nope.copy(), q_pe.copy()
    k_pe, kv_c = randn((T, k_heads, ROPE), dtype), randn((T, RANK), dtype)
    extra = {}
    if with_cache:
        blocks = -(-T // 16)
        if kpe_cache:
            kv_cache = np.zeros((blocks, 16, RANK), np_dtype(cache_fmt or dtype))
            extra["kpe_cache"] = np.zeros((blocks, 16, ROPE), np_dtype(cache_fmt or dtype))
        else:
            kv_cache = _poisoned_cache(dtype, blocks, 16, cache_fmt)
        extra.update(kv_c=kv_c, kv_cache=kv_cache, slot_mapping=np.arange(T, dtype=np.int64))
        if cache_fmt is not None:
            extra["kv_scale"] = 0.5
    plan = plan_mla("mla_rope_and_cache" if with_cache else "mla_rope_quantize", q_nope, q_pe,
                    None, k_pe, np.arange(T),
                    rope=dict(cos_sin_cache=deepseek_cache if table is None else table,
                              interleaved=interleaved),
                    out_dtype=out, q_scale=0.5 if out else None, k_scale=0.5 if out else None,
                    **extra)
    out_dtype = out or dtype
    q_out = np.empty(q.shape, np_dtype(out_dtype))
    outs = [describe(q_out[..., :nope], "out"), describe(q_out[..., nope:], "out")]
    if separate:
        outs = [describe(np.empty(x.shape, np_dtype(out_dtype)), "out") for x in (q_nope, q_pe)]
    return plan_mla_launch(plan, [*outs, None,
                                  describe(np.empty(k_pe.shape, np_dtype(out_dtype)), "out")])


def test_stage_of_the_reference_shape(randn, deepseek_cache):
    """DeepSeek-V3 at TP 8 (fp8 q and k_pe out, fp8 joint cache, float32 table): 6144 + 128 +
    1024 bytes in, a 256-byte cos / sin row, the flag, 3072 + 64 + 576 bytes out, in whole
    128-byte lines; four stages and their barriers under the 48 KB a launch has without opting
    in."""
    from cupyrope.cuda.mla_launch import (_mla_stage_parts, mla_stage_bytes,
                                          mla_staged_shared_bytes)

    spec, p = _launch(randn, deepseek_cache)
    assert _mla_stage_parts(spec, p) == [6144, 128, 1024, 256, 16, 3072, 64, 576]
    assert mla_stage_bytes(spec, p) == 11392 == 89 * 128
    assert mla_staged_shared_bytes(spec, p) == 4 * 11392 + 64 < 48 * 1024
    spec, p = _launch(randn, deepseek_cache, out=None, cache_fmt=None)  # bf16 throughout
    assert _mla_stage_parts(spec, p) == [6144, 128, 1024, 256, 16, 6144, 128, 1152]
    spec, p = _launch(randn, deepseek_cache, with_cache=False)  # q and k only
    assert _mla_stage_parts(spec, p) == [6144, 128, 0, 256, 16, 3072, 64, 0]


def test_rule_takes_the_reference_shape_on_fast_hopper_memory_only(randn, deepseek_cache,
                                                                   monkeypatch):
    from cupyrope.cuda import mla_launch
    from cupyrope.cuda.mla_launch import mla_staged_applies

    spec, p = _launch(randn, deepseek_cache)
    assert mla_staged_applies(spec, p, **H200)
    for capability in (80, 89, 100, 120, 0):  # bulk copies are sm_90+; Blackwell unmeasured
        assert not mla_staged_applies(spec, p, memory_bandwidth=4.8e12,
                                      compute_capability=capability)
    assert not mla_staged_applies(spec, p, memory_bandwidth=3.35e12, compute_capability=90)
    assert not mla_staged_applies(spec, p, memory_bandwidth=0.0, compute_capability=90)
    p["num_tokens"] = mla_launch.MLA_STAGED_MIN_TOKENS - 1  # the item kernel below
    assert not mla_staged_applies(spec, p, **H200)
    p["num_tokens"] = mla_launch.MLA_STAGED_MIN_TOKENS
    assert mla_staged_applies(spec, p, **H200)
    # Every layout the kernel moves as whole rows, both pairings, tables of either dtype.
    for options in (dict(interleaved=False), dict(out=None, cache_fmt=None),
                    dict(with_cache=False), dict(kpe_cache=True), dict(dtype="float16"),
                    dict(nope=512, heads=8),
                    dict(table=deepseek_cache.astype(np_dtype("bfloat16")))):
        assert mla_staged_applies(*_launch(randn, deepseek_cache, **options), **H200), options


@pytest.mark.parametrize("options, why", [
    (dict(dtype="float32"), "16-bit inputs only"),
    (dict(separate=True), "q's nope and rope parts in two arrays: no row a token"),
    (dict(k_heads=2), "two k_pe heads would write one cache row"),
    (dict(heads=17, nope=120), "fp8 q rows of 17 x 184 bytes: not whole 16-byte units"),
    (dict(nope=512), "16 absorbed heads of 512 + 64: a stage of 29 KB, one block an SM"),
])
def test_rule_refuses_what_the_stages_cannot_move(randn, deepseek_cache, options, why):
    from cupyrope.cuda.mla_launch import mla_staged_applies

    if options.get("k_heads") == 2:
        with pytest.raises(ValueError):  # the plan refuses it first; the rule would too
            _launch(randn, deepseek_cache, **options)
        return
    spec, p = _launch(randn, deepseek_cache, **options)
    assert not mla_staged_applies(spec, p, **H200), why


def test_rule_refuses_computed_angles_and_strided_tables(randn, deepseek_cache):
    from cupyrope.cuda.mla_launch import mla_staged_applies
    from cupyrope.core.abi import AngleSource

    spec, p = _launch(randn, deepseek_cache)
    computed = dataclasses.replace(spec, source=AngleSource.COMPUTED)
    assert not mla_staged_applies(computed, p, **H200)
    strided = p.copy()
    strided["table_col_stride"] = 2
    assert not mla_staged_applies(spec, strided, **H200)
    unaligned = p.copy()
    unaligned["table_row_stride"] = ROPE + 2  # 264-byte rows: not 16-byte aligned
    assert not mla_staged_applies(spec, unaligned, **H200)


def test_geometry_is_a_persistent_grid_of_resident_blocks(randn, deepseek_cache):
    """Blocks of 128 consumers and the producer warp; as many blocks as the driver says an SM
    holds (its occupancy, with the stages' shared memory), on every SM, at most one a token."""
    from cupyrope.cuda import compiler
    from cupyrope.cuda.mla_launch import MLA_STAGED_THREADS, mla_staged_geometry

    spec, p = _launch(randn, deepseek_cache)
    assert mla_staged_geometry(p, 5, 132) == (MLA_STAGED_THREADS, 5 * 132) == (160, 660)
    assert mla_staged_geometry(p, 0, 132) == (160, 132)  # never no block
    p["num_tokens"] = 100
    assert mla_staged_geometry(p, 5, 132) == (160, 100)
    staged = dataclasses.replace(spec, wide_index=True, staged=True)
    assert staged in compiler.MLA_SPECIALISATIONS
    assert staged.name_expression == ("cupyrope::mla_staged_kernel<cupyrope::bfloat16_t, float, "
                                      "true>")


# --- GPU: the staged kernel against the float64 reference ------------------------------------


@pytest.fixture
def staged(monkeypatch, hopper_fast_memory):
    """Every MLA launch of the test on the staged kernel where its rule allows (checked after
    the test: at least one launch took it), or skip off Hopper GPUs."""
    pytest.importorskip("cupy")
    from cupyrope.cuda import mla_launch

    hopper_fast_memory(mla_launch, "MLA kernel")
    monkeypatch.setattr(mla_launch, "MLA_STAGED_MIN_TOKENS", 1)
    taken = []
    rule = mla_launch.mla_staged_applies

    def spy(*args, **kwargs):
        taken.append(rule(*args, **kwargs))
        return taken[-1]

    monkeypatch.setattr(mla_launch, "mla_staged_applies", spy)
    yield taken
    assert any(taken), "no launch took the staged kernel"


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("tokens", [7, 37, 3001])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("fmt", [None, "float8_e4m3fn"])
@pytest.mark.parametrize("cache_fmt", [None, "float8_e4m3fn"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_staged_matches_the_reference(staged, rng, randn, deepseek_cache, framework, tokens,
                                          interleaved, fmt, cache_fmt, dtype):
    """q whole as one array (its rows one copy each), skipped slots among the tokens."""
    _check_one_launch(rng, randn, deepseek_cache, framework, (128, 64), interleaved, fmt,
                      cache_fmt, "table", True, dtype, tokens=tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [True, False])
def test_gpu_staged_odd_nope_part(staged, rng, randn, deepseek_cache, interleaved):
    """A nope part of 136 (17 accesses a head, q rows of 6400 bytes)."""
    _check_one_launch(rng, randn, deepseek_cache, "cupy", (136, 64), interleaved,
                      "float8_e4m3fn", "float8_e4m3fn", "table", True, "bfloat16", tokens=301)


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [True, False])
def test_gpu_staged_positions_past_the_table_and_slots_past_the_cache(staged, rng, randn,
                                                                      deepseek_cache,
                                                                      interleaved):
    """A position outside the table rotates to NaN (as the item kernel gives), a slot past the
    cache and a negative one write nothing, and a bf16 table gives the table's values."""
    import cupy

    T, H, nope, block_size, blocks = 700, 16, 128, 16, 50
    q = randn((T, H, nope + ROPE), "bfloat16")
    k_pe, kv_c = randn((T, ROPE), "bfloat16"), randn((T, RANK), "bfloat16")
    positions = rng.integers(0, MAX_POSITION, T)
    positions[[3, 400]] = MAX_POSITION + 7
    slots = rng.permutation(blocks * block_size)[:T].astype(np.int64)
    slots[[0, 9]] = -1
    slots[11] = blocks * block_size + 3
    cache = _poisoned_cache("bfloat16", blocks, block_size)
    before = cache.copy()
    cache_d = _to_device("cupy", cache)
    q_out, k_out, _ = cr.mla_rope_and_cache(
        _to_device("cupy", q), _to_device("cupy", k_pe), _to_device("cupy", kv_c),
        cupy.asarray(positions), cache_d, cupy.asarray(slots), interleaved=interleaved,
        cos_sin_cache=_to_device("cupy", deepseek_cache))
    q_out, k_out, got = _to_host(q_out), _to_host(k_out), _to_host(cache_d)
    bad = positions >= MAX_POSITION
    expected = cr.mla_rope_and_cache(q, k_pe, kv_c, np.where(bad, 0, positions), before.copy(),
                                     slots,
                                     interleaved=interleaved, cos_sin_cache=deepseek_cache,
                                     inplace=False)
    assert np.isnan(q_out[bad][..., nope:].astype(np.float32)).all()
    assert np.isnan(k_out[bad].astype(np.float32)).all()
    np.testing.assert_array_equal(q_out[bad][..., :nope], q[bad][..., :nope])
    from tolerances import assert_rope_close

    good = ~bad
    assert_rope_close(q_out[good][..., nope:], expected[0][good][..., nope:],
                      q[good][..., nope:], interleaved=interleaved, rotary_dim=ROPE)
    written = (slots >= 0) & (slots < blocks * block_size)
    untouched = np.ones((blocks, block_size), bool)
    untouched[slots[written] // block_size, slots[written] % block_size] = False
    assert (got.view(np.uint16)[untouched] == before.view(np.uint16)[untouched]).all()
    rows = got[slots[written] // block_size, slots[written] % block_size]
    np.testing.assert_array_equal(rows[:, :RANK].view(np.uint16),
                                  kv_c[written].view(np.uint16))
