"""Launch geometry: every head and chunk is covered, decode gives each head its own thread,
and the lanes are not padded to a power of two (but for plain in-place launches of uneven
lanes). (No GPU needed: the SM count is given.)"""

import ml_dtypes
import numpy as np
import pytest

import cupyrope as cr
from cupyrope.cuda import launch
from cupyrope.core.abi import access_layout
from cupyrope.core.plan import plan_rope


@pytest.fixture(autouse=True)
def h200_like(monkeypatch):
    monkeypatch.setattr(launch, "_multiprocessors", lambda device: 132)


def _geometry(T, D=128, hq=32, hk=8, rotary_dim=None, dtype="float32", inplace=False,
              plain=False, memory_bandwidth=0.0):
    q = np.zeros((T, hq, D), dtype=dtype)
    k = np.zeros((T, hk, D), dtype=dtype)
    plan = plan_rope(q, k, rotary_dim=rotary_dim, inplace=inplace)
    access, pairs = access_layout(q.itemsize, True, False)
    copy_pass = not inplace and plan.rotary_dim < D
    return launch.launch_geometry(plan, access, pairs, copy_pass, num_regs=61, plain=plain,
                                  memory_bandwidth=memory_bandwidth), plan


@pytest.mark.parametrize("T", [1, 7, 32, 512, 4096, 16384, 65536, 1 << 20])
def test_every_token_and_head_is_covered_within_limits(T):
    (lanes, block_y, tokens), (grid_x, grid_y) = _geometry(T)[0]
    assert lanes * block_y * tokens <= launch.THREADS_PER_BLOCK
    assert grid_x * tokens >= T  # the kernel also strides over tokens, but no more is needed
    assert grid_y * block_y >= 1
    assert lanes == 16  # float32, D=128: 64 pairs in 16-byte accesses of 4 pairs


def test_decode_gives_each_head_its_own_thread():
    (lanes, block_y, tokens), (grid_x, grid_y) = _geometry(1)[0]
    assert block_y * grid_y >= 40 and tokens == 1


def test_many_tokens_reuse_cos_sin_across_heads():
    (lanes, block_y, tokens), (grid_x, grid_y) = _geometry(1 << 20)[0]
    assert grid_y == 1 and block_y <= 10  # several heads per thread


def test_lanes_match_the_rotary_chunks_exactly():
    ((lanes, _, _), _), _ = _geometry(4096, D=80, dtype="float32")  # 40 pairs / 4 = 10 chunks
    assert lanes == 10
    # Partial rotary: the rotary chunks set the lanes; the same lanes then copy the rest.
    ((lanes, _, _), _), _ = _geometry(4096, D=128, rotary_dim=64)  # 32 pairs / 4 = 8 chunks
    assert lanes == 8


@pytest.mark.parametrize("D,chunks", [(80, 5), (96, 6)])
def test_plain_launches_of_uneven_lanes_keep_heads_within_a_warp_in_place(D, chunks):
    """bf16 heads of 80 / 96 dims take 5 / 6 lanes: in place, the lanes padded to 8 so that a
    warp holds whole heads, and at most two heads a thread (launch.UNEVEN_LANES_MAX_HEADS); out
    of place, the wave model's choice."""
    T, heads = 65536, 40
    ((lanes, block_y, tokens), (grid_x, grid_y)), _ = _geometry(
        T, D=D, dtype="float16", inplace=True, plain=True)
    assert lanes == 8 and -(-heads // (block_y * grid_y)) <= launch.UNEVEN_LANES_MAX_HEADS
    assert grid_x * tokens >= T and lanes * block_y * tokens <= launch.THREADS_PER_BLOCK
    out_of_place = _geometry(T, D=D, dtype="float16", plain=True)[0]
    assert out_of_place == _geometry(T, D=D, dtype="float16")[0]
    assert _geometry(T, D=D, dtype="float16")[0][0][0] == chunks
    # Even lanes (D = 128: 8) keep the wave model's choice, in place or not.
    assert _geometry(T, D=128, dtype="float16", inplace=True, plain=True)[0] == _geometry(
        T, D=128, dtype="float16", inplace=True)[0]


@pytest.mark.parametrize("hk", [2, 4, 8, 32])
@pytest.mark.parametrize("T", [1, 512, 65536])
def test_in_place_uneven_lanes_fill_whole_warps(T, hk):
    """q 32 heads and k 4 of 80 dims take 2 heads a thread over 20 head lanes of 8 (160 threads, 5
    whole warps of 4 heads each), not 18 (144 threads: a warp with 2 heads and 16 idle lanes)."""
    ((lanes, block_y, tokens), (grid_x, grid_y)), _ = _geometry(
        T, D=80, hk=hk, dtype="float16", inplace=True, plain=True)
    assert lanes == 8 and (lanes * block_y) % 32 == 0
    assert block_y * grid_y >= -(-(32 + hk) // launch.UNEVEN_LANES_MAX_HEADS)
    assert lanes * block_y * tokens <= launch.THREADS_PER_BLOCK and grid_x * tokens >= T
    if T == 65536 and hk == 4:
        assert (block_y, grid_y) == (20, 1)


def test_in_place_uneven_lanes_without_whole_warps(monkeypatch):
    """The rule is a switch (UNEVEN_LANES_WHOLE_WARPS) for A / B runs: off, 36 heads take 18."""
    monkeypatch.setattr(launch, "UNEVEN_LANES_WHOLE_WARPS", False)
    ((lanes, block_y, _), (_, grid_y)), _ = _geometry(
        65536, D=80, hk=4, dtype="float16", inplace=True, plain=True)
    assert (lanes, block_y, grid_y) == (8, 18, 1)


H200, H100 = 4.8e12, 3.35e12  # memory bandwidth, bytes per second


@pytest.mark.parametrize("hq,hk", [(32, 4), (32, 8), (32, 32), (16, 16), (64, 8)])
def test_in_place_odd_lanes_on_fast_memory_take_unpadded_lanes_in_whole_warps(hq, hk):
    """On FAST_MEMORY, 5 lanes a head in place take blocks of 5 x 32 (five whole warps), one
    token a block and every head by the kernel's loop over head lanes (one block row a head
    lane: 36 heads in two rounds); the H100's memory and fewer tokens keep the padded launch, and
    so do out of place and partial rotation."""
    T, uneven = 65536, dict(D=80, hq=hq, hk=hk, dtype="float16", plain=True)
    ((lanes, block_y, tokens), (grid_x, grid_y)), _ = _geometry(
        T, inplace=True, memory_bandwidth=H200, **uneven)
    assert (lanes, block_y, tokens) == (5, launch.UNEVEN_ODD_LANES_HEAD_LANES, 1)
    assert (grid_x, grid_y) == (T, 1) and lanes * block_y <= launch.THREADS_PER_BLOCK
    assert _geometry(T, inplace=True, memory_bandwidth=H100, **uneven)[0] == _geometry(
        T, inplace=True, **uneven)[0]
    assert _geometry(T, inplace=True, **uneven)[0][0][0] == 8
    assert _geometry(T, memory_bandwidth=H200, **uneven)[0] == _geometry(T, **uneven)[0]
    few = launch.UNEVEN_LANES_FAST_MEMORY_MIN_TOKENS - 1
    assert _geometry(few, inplace=True, memory_bandwidth=H200, **uneven)[0][0][0] == 8
    ((lanes, _, _), _), _ = _geometry(T, D=128, hq=hq, hk=hk, rotary_dim=80, dtype="float16",
                                      inplace=True, plain=True, memory_bandwidth=H200)
    assert lanes == 8  # partial rotation: not measured, the padded launch


@pytest.mark.parametrize("D,hq,hk,block", [
    (80, 4, 1, (5, 5, 5)), (80, 8, 1, (5, 9, 2)), (80, 8, 2, (5, 10, 2)), (80, 16, 2, (5, 18, 1)),
    (80, 16, 8, (5, 24, 1)), (96, 4, 1, (6, 5, 4)), (96, 8, 1, (6, 9, 2)),
    (96, 8, 4, None), (96, 16, 8, None), (96, 32, 8, None)])
def test_in_place_uneven_lanes_of_few_heads_on_fast_memory(D, hq, hk, block):
    """On FAST_MEMORY, fewer heads than a block's 32 rows (tensor-parallel shards) take every head
    a block row and whole tokens, ~128 threads a block; 6 lanes only while a token's heads take at
    most 64 lanes, then (None) the padded launch, as for 6 lanes and many heads."""
    T, shape = 65536, dict(D=D, hq=hq, hk=hk, dtype="float16", inplace=True, plain=True)
    (got, (grid_x, grid_y)), _ = _geometry(T, memory_bandwidth=H200, **shape)
    if block is None:
        assert (got, (grid_x, grid_y)) == _geometry(T, **shape)[0] and got[0] == 8
        return
    assert got == block and grid_y == 1 and grid_x * block[2] >= T > (grid_x - 1) * block[2]
    assert got[1] == hq + hk and got[0] * got[1] * got[2] <= launch.THREADS_PER_BLOCK
    assert _geometry(T, **shape)[0][0][0] == 8  # unknown memory: the padded launch


def test_offsets_past_the_int32_headroom_take_the_64_bit_kernels():
    small = np.zeros((4, 2, 8), dtype=np.float32)
    plan = plan_rope(small)
    assert not launch.needs_wide_index(plan, [plan.q])
    # A view whose token stride reaches past 2^30 elements (no memory behind it is touched).
    far = np.lib.stride_tricks.as_strided(small, shape=(2, 2, 8), strides=(2**31 * 4, 32, 4))
    plan = plan_rope(far)
    assert launch.needs_wide_index(plan, [plan.q])


def _lean(plan, **overrides):
    args = dict(vector=True, wide_index=False, token_ndim=1, table_vector_ok=True)
    args.update(overrides)
    return launch.lean_kernel_applies(plan, **args)


def test_lean_kernel_takes_the_common_case_only():
    q = np.zeros((16, 4, 128), dtype=np.float32)
    cache = np.zeros((64, 128), dtype=np.float32)
    positions = np.arange(16)
    plan = plan_rope(q, None, positions, cos_sin_cache=cache)
    assert _lean(plan)
    assert not _lean(plan, vector=False)  # scalar accesses: general kernel
    assert not _lean(plan, wide_index=True)  # 64-bit offsets: general kernel
    assert not _lean(plan, token_ndim=2)  # token dims that do not merge: general kernel
    assert not _lean(plan, table_vector_ok=False)  # strided or misaligned cache rows
    computed = plan_rope(q, None, positions)
    assert _lean(computed, table_vector_ok=False)  # computed angles read no table
    mrope = plan_rope(q, None, np.zeros((3, 16), dtype=np.int64),
                      scaling={"rope_type": "default", "mrope_section": [16, 24, 24]})
    assert mrope.mrope_mode and not _lean(mrope, table_vector_ok=False)



def test_lean_fused_kernel_takes_whole_rotated_heads_only():
    q = np.zeros((16, 4, 128), dtype=np.float32)
    cache = np.zeros((64, 128), dtype=np.float32)
    positions = np.arange(16)
    args = dict(vector=True, wide_index=False, token_ndim=1, pairs=4, table_vector_ok=True)
    plan = plan_rope(q, None, positions, cos_sin_cache=cache)
    assert launch.fused_lean_applies(plan, **args)
    for override in ({"vector": False}, {"wide_index": True}, {"token_ndim": 2},
                     {"table_vector_ok": False}):  # as the lean rope kernel
        assert not launch.fused_lean_applies(plan, **{**args, **override})
    # M-RoPE: the lean fused kernel's own specialisation (the lean rope kernel refuses it).
    mrope = plan_rope(q, None, np.zeros((3, 16), dtype=np.int64), cos_sin_cache=cache,
                      scaling={"rope_type": "default", "mrope_section": [16, 24, 24]})
    assert mrope.mrope_mode and launch.fused_lean_applies(mrope, **args)
    assert not launch.lean_kernel_applies(mrope, **{k: v for k, v in args.items() if k != "pairs"})
    # Dims past rotary_dim (normalised, quantised or cached with the rest): the lean kernel's
    # partial specialisation where NeoX pairs tile the head in blocks of rotary_dim, else the
    # general kernel.
    partial = plan_rope(q, None, positions, cos_sin_cache=cache[:, :64])
    assert partial.rotary_dim == 64 and launch.fused_lean_applies(partial, **args)
    uneven = plan_rope(q, None, positions, cos_sin_cache=cache[:, :96])
    assert uneven.rotary_dim == 96 and not launch.fused_lean_applies(uneven, **args)
    uneven = plan_rope(q, None, positions, cos_sin_cache=cache[:, :96], interleaved=True)
    assert launch.fused_lean_applies(uneven, **{**args, "pairs": 2})
    # More chunks than the 32 lanes of a head: general kernel (it loops over a head's chunks).
    wide = plan_rope(np.zeros((16, 4, 512), dtype=np.float32), None, positions)
    assert launch.fused_lean_applies(wide, **{**args, "pairs": 8})
    assert not launch.fused_lean_applies(wide, **args)  # 256 pairs / 4 = 64 chunks

def test_shared_angle_bytes_only_for_lean_computed_angles():
    from cupyrope.core.abi import AngleSource
    from cupyrope.cuda.compiler import KernelSpec

    q = np.zeros((16, 4, 128), dtype=np.float32)
    plan = plan_rope(q, None, np.arange(16))
    lean = KernelSpec("float32", "float32", True, False, AngleSource.COMPUTED, False, True)
    # 3 tokens a block x (cos + sin) x 64 pairs x float32.
    assert launch.shared_angle_bytes(plan, lean, (16, 5, 3)) == 3 * 2 * 64 * 4
    general = KernelSpec("float32", "float32", True, False, AngleSource.COMPUTED, False, False)
    assert launch.shared_angle_bytes(plan, general, (16, 5, 3)) == 0
    cache = KernelSpec("float32", "float32", True, False, AngleSource.CACHE_TABLE, False, True)
    assert launch.shared_angle_bytes(plan, cache, (16, 5, 3)) == 0
    q64 = plan_rope(np.zeros((16, 4, 128)), None, np.arange(16))  # float64 computes in float64
    lean64 = KernelSpec("float64", "float32", True, False, AngleSource.COMPUTED, False, True)
    assert launch.shared_angle_bytes(q64, lean64, (16, 5, 3)) == 3 * 2 * 64 * 8


@pytest.mark.parametrize("D, heads, applies", [(128, (32, 8), True), (64, (14, 2), True),
                                               (80, (7, 1), True), (80, (40, 8), False),
                                               (96, (3, 0), True)])
def test_computed_decode_blocks_are_whole_warps(monkeypatch, D, heads, applies):
    """Computed angles on the decode kernel: each warp computes its token's angles, so a block is
    whole warps (heads padded up to that) with shared memory for every warp's cos and sin; where
    the padding passes the block limit the lean kernel runs instead."""
    hq, hk = heads
    q = np.zeros((3, hq, D), dtype=np.float16)
    k = np.zeros((3, hk, D), dtype=np.float16) if hk else None
    plan = plan_rope(q, k, np.arange(3), inplace=True)
    access, pairs = access_layout(q.itemsize, True, False)
    assert launch.decode_kernel_applies(plan, lean=True, copy_pass=False, pairs=pairs,
                                        angle_arithmetic="float64") is applies
    (chunks, block_y, one), (tokens, grid_y) = launch.decode_geometry(plan, pairs)
    assert chunks == D // 2 // pairs and one == 1 and tokens == 3
    assert block_y * grid_y >= hq + hk and (chunks * block_y) % 32 == 0
    if applies:
        assert chunks * block_y <= launch.THREADS_PER_BLOCK
        warps = chunks * block_y // 32
        assert launch.decode_shared_angle_bytes(plan, (chunks, block_y, 1)) == warps * D * 4
    cache = np.zeros((8, D), dtype=np.float32)  # a table: no padding, as before
    table_plan = plan_rope(q, k, np.arange(3), cos_sin_cache=cache, inplace=True)
    _, block_y = launch.decode_geometry(table_plan, pairs)[0][:2]
    assert block_y == -(-(hq + hk) // grid_y) or (hq + hk) * chunks > launch.THREADS_PER_BLOCK


def test_computed_decode_only_where_it_pays():
    """The decode kernel takes computed angles with float64 angle arithmetic, up to
    DECODE_MAX_COMPUTED_TOKENS tokens of 16- or 32-bit floats (measured faster there only)."""

    def applies(T, dtype=np.float32, arithmetic="float64"):
        q = np.zeros((T, 4, 64), dtype=dtype)
        plan = plan_rope(q, positions=np.arange(T), inplace=True)
        pairs = access_layout(q.itemsize, True, False)[1]
        return launch.decode_kernel_applies(plan, lean=True, copy_pass=False, pairs=pairs,
                                            angle_arithmetic=arithmetic)

    limit = launch.DECODE_MAX_COMPUTED_TOKENS
    assert applies(1) and applies(limit) and not applies(limit + 1)
    assert not applies(1, np.float64)
    assert not applies(1, arithmetic="float-float") and not applies(1, arithmetic=None)


def _fused_launch(op, T, D=128, hq=32, hk=8, dtype=np.float32, positions=None,
                  weight_dtype=None, memory_bandwidth=0.0, compute_capability=0, layout="NHD",
                  q=None, resident_blocks=None, **rope):
    """plan_launch of a fused call on NumPy arrays (host addresses stand in for device ones):
    ``op`` "norm", "cache", "norm+cache" or "fp8" (fp8 outputs); norm weights of
    ``weight_dtype`` (default q's), on a device of ``memory_bandwidth`` bytes per second."""
    from cupyrope.core.arrays import describe
    from cupyrope.core.fused_plan import plan_fused

    q = np.zeros((T, hq, D), dtype) if q is None else q
    k = np.zeros((T, hk, D), dtype)
    fusion = {}
    if "norm" in op:
        w_dtype = dtype if weight_dtype is None else weight_dtype
        fusion.update(norm=True, q_weight=np.ones(D, w_dtype), k_weight=np.ones(D, w_dtype),
                      eps=1e-6)
    if "cache" in op:
        shape = (64, 16, hk, D) if layout == "NHD" else (64, hk, 16, D)
        fusion.update(v=np.zeros((T, hk, D), dtype), k_cache=np.zeros(shape, dtype),
                      v_cache=np.zeros(shape, dtype), slot_mapping=np.arange(T), layout=layout)
    if op == "fp8":
        fusion.update(out_dtype="float8_e4m3fn")
    rope = rope or dict(cos_sin_cache=np.zeros((4096, D), np.float32))
    plan = plan_fused("rms_norm_rope" if op == "norm" else "rope_and_cache", q, k,
                      np.arange(T) if positions is None else positions, validate=False,
                      rope=dict(rope, inplace=False), fusion=fusion)
    outputs = [describe(np.zeros(q.shape, dtype), "q_out"), describe(np.zeros(k.shape, dtype),
                                                                     "k_out")]
    return launch.plan_launch(plan, outputs, num_regs=lambda spec: 64, multiprocessors=132,
                              angle_arithmetic="float64", memory_bandwidth=memory_bandwidth,
                              compute_capability=compute_capability,
                              resident_blocks=resident_blocks), plan


@pytest.mark.parametrize("op", ["norm", "norm+cache"])
def test_staged_kernel_takes_the_norm_past_decode_on_fast_hopper_memory(op):
    """On a Hopper GPU of fast memory (the H200) the norm's launches past the fused decode
    kernel run the staged kernel (rows by bulk copies through shared memory): with the cache
    write up to STAGED_CACHE_MAX_TOKENS, the norm alone up to STAGED_NORM_MAX_TOKENS. Every other
    device, layout or store keeps the lean fused kernel, and each staged launch is a
    specialisation the CPU suite compiles."""
    from cupyrope.cuda import compiler

    bf16 = ml_dtypes.bfloat16
    hopper = dict(memory_bandwidth=launch.FAST_MEMORY, compute_capability=90, dtype=bf16)
    first = launch.FUSED_DECODE_FAST_MEMORY_MAX_NORM_TOKENS + 1
    last = launch.STAGED_NORM_MAX_TOKENS if op == "norm" else launch.STAGED_CACHE_MAX_TOKENS
    for T in (first, last):
        spec, plan = _fused_launch(op, T, **hopper)
        assert spec.kernel.staged and spec.kernel.norm, (op, T, spec.kernel)
        assert spec.kernel.cache == ("cache" in op)
        assert spec.kernel in compiler.ALL_SPECIALISATIONS
        assert "rope_fused_staged_kernel" in spec.kernel.name_expression
        assert spec.shared_bytes == launch.staged_shared_bytes(plan)
    decode, _ = _fused_launch(op, first - 1, **hopper)
    assert decode.kernel.decode and not decode.kernel.staged
    past, _ = _fused_launch(op, last + 1, **hopper)
    assert past.kernel.lean and not past.kernel.staged
    hnd, _ = _fused_launch(op, first, layout="HND", **hopper)
    assert hnd.kernel.staged
    padded = np.zeros((first, 32, 136), bf16)[..., :128]  # heads 136 apart: no one-row copy
    refused = [
        dict(hopper, compute_capability=80), dict(hopper, compute_capability=100),
        dict(hopper, compute_capability=0), dict(hopper, memory_bandwidth=launch.FAST_MEMORY / 2),
        dict(hopper, dtype=np.float32), dict(hopper, weight_dtype=np.float32),
        dict(hopper, theta=10000.0),  # computed angles
        dict(hopper, q=padded),
    ]
    for kwargs in refused:
        spec, _ = _fused_launch(op, first, **kwargs)
        assert not spec.kernel.staged, kwargs


@pytest.mark.parametrize("op", ["norm", "cache", "norm+cache"])
def test_staged_kernel_takes_mrope_and_partial_rotations_from_a_few_hundred_tokens(op):
    """M-RoPE (sectioned and interleaved) and partial rotations run the staged kernel on a
    Hopper GPU of fast memory from STAGED_LAYOUT_MIN_TOKENS, with no upper bound but for
    sectioned M-RoPE's cache write without the norm (up to STAGED_CACHE_MAX_TOKENS), with the
    norm, the cache write or both: specialisations of their own. A stage holds the three position
    components' cos / sin rows for interleaved M-RoPE, one row otherwise (sectioned M-RoPE's runs
    copied into it: each run a whole number of 16-byte units, else the lean kernel). Full
    rotations without the norm keep the lean and decode kernels."""
    from cupyrope.cuda import compiler

    bf16 = ml_dtypes.bfloat16
    hopper = dict(memory_bandwidth=launch.FAST_MEMORY, compute_capability=90, dtype=bf16)
    least = launch.STAGED_LAYOUT_MIN_TOKENS

    def mrope(T, sections=(16, 24, 24), interleaved=False, **kwargs):
        scaling = {"rope_type": "default", "mrope_section": list(sections),
                   "mrope_interleaved": interleaved}
        return _fused_launch(op, T, positions=np.zeros((3, T), np.int64), scaling=scaling,
                             cos_sin_cache=np.zeros((4096, 128), np.float32), **kwargs)

    def partial(T, **kwargs):
        return _fused_launch(op, T, cos_sin_cache=np.zeros((4096, 64), np.float32), **kwargs)

    for T in (least, 65536):
        for (spec, plan), kind in ((mrope(min(T, launch.STAGED_CACHE_MAX_TOKENS), **hopper),
                                    "mrope"),
                                   (mrope(T, interleaved=True, **hopper), "mrope"),
                                   (partial(T, **hopper), "partial")):
            assert spec.kernel.staged and getattr(spec.kernel, kind), (op, T, spec.kernel)
            assert (spec.kernel.norm, spec.kernel.cache) == ("norm" in op, "cache" in op)
            assert spec.kernel in compiler.ALL_SPECIALISATIONS
            assert spec.shared_bytes == launch.staged_shared_bytes(plan)
    # Stage bytes: q, k (and v) heads of 128 bf16 dims, then fp32 cos / sin rows of 64 pairs.
    heads = (32 + 8 + (8 if "cache" in op else 0)) * 128 * 2
    _, sectioned = mrope(least, **hopper)
    _, interleaved = mrope(least, interleaved=True, **hopper)
    assert launch.staged_stage_bytes(sectioned) == -(-(heads + 512) // 128) * 128
    assert launch.staged_stage_bytes(interleaved) == -(-(heads + 3 * 512) // 128) * 128
    # A partial rotation's norm takes lanes for every dim; without it, the rotated chunks'.
    spec, _ = partial(least, **hopper)
    assert spec.block[0] == (8 if "norm" in op else 4)  # bf16 NeoX lanes: 8 pairs each
    spec, _ = partial(least, D=256, hq=16, hk=2, **hopper)  # Qwen3-Next: 64 of 256 dims
    assert spec.kernel.staged and spec.block[0] == (16 if "norm" in op else 4)
    for spec, _ in (mrope(least - 1, **hopper), partial(least - 1, **hopper),
                    mrope(least, sections=(10, 27, 27), **hopper),  # runs of 40 / 108 bytes
                    mrope(least, **dict(hopper, compute_capability=80)),
                    partial(least, **dict(hopper, memory_bandwidth=launch.FAST_MEMORY / 2))):
        assert not spec.kernel.staged and spec.kernel.lean, (op, spec.kernel)
    past, _ = mrope(launch.STAGED_CACHE_MAX_TOKENS + 1, **hopper)
    assert past.kernel.staged == (op != "cache"), (op, past.kernel)
    if op == "cache":  # a full rotation with the cache write alone: lean or decode kernels
        for T in (least, 65536):
            spec, _ = _fused_launch(op, T, **hopper)
            assert not spec.kernel.staged, T


def _rope_launch(T, D, hq, hk, *, inplace=True, dtype=ml_dtypes.bfloat16, **device):
    """plan_launch of apply_rope on NumPy arrays (host addresses stand in for device ones)."""
    from cupyrope.core.arrays import describe

    q, k = np.zeros((T, hq, D), dtype), np.zeros((T, hk, D), dtype)
    plan = plan_rope(q, k, np.arange(T), cos_sin_cache=np.zeros((4096, D), np.float32),
                     inplace=inplace)
    outputs = [plan.q, plan.k] if inplace else [describe(np.zeros_like(q), "q_out"),
                                                describe(np.zeros_like(k), "k_out")]
    return launch.plan_launch(plan, outputs, num_regs=lambda spec: 56, multiprocessors=132,
                              **device), plan


def test_staged_kernel_takes_apply_rope_in_place_of_many_uneven_heads():
    """apply_rope in place of bf16 heads of 80 or 96 (5 or 6 lanes), at least
    PLAIN_STAGED_MIN_HEADS a token and PLAIN_STAGED_MIN_TOKENS tokens, runs the staged kernel with
    neither norm nor cache write on a Hopper GPU of fast memory; out of place, fewer heads
    (tensor-parallel shards), heads of 128, fewer tokens, slower memory or another GPU keep the
    lean launches."""
    from cupyrope.cuda import compiler

    hopper = dict(memory_bandwidth=launch.FAST_MEMORY, compute_capability=90)
    least = launch.PLAIN_STAGED_MIN_TOKENS
    for D, hq, hk in ((80, 32, 4), (96, 32, 8), (80, 16, 4)):
        spec, plan = _rope_launch(least, D, hq, hk, **hopper)
        assert spec.kernel.staged and spec.kernel.fused, (D, hq, hk, spec.kernel)
        assert not (spec.kernel.norm or spec.kernel.cache or spec.kernel.mrope)
        assert spec.kernel in compiler.ALL_SPECIALISATIONS
        assert spec.shared_bytes == launch.staged_shared_bytes(plan)
        assert spec.fusion_params is not None and not spec.fusion_params.tobytes().strip(b"\0")
        assert spec.block[0] == 8 and spec.block[0] * spec.block[1] <= launch.STAGED_MAX_THREADS
    assert launch.staged_stage_bytes(plan) == 28 * 128  # 16 / 4 heads of 80 and the angles: 3520
    for spec, _ in (_rope_launch(least, 80, 32, 4, inplace=False, **hopper),
                    _rope_launch(least, 80, 16, 2, **hopper),  # 18 heads
                    _rope_launch(least, 80, 8, 1, **hopper),
                    _rope_launch(least, 128, 32, 8, **hopper),
                    _rope_launch(least - 1, 80, 32, 4, **hopper),
                    _rope_launch(least, 80, 32, 4, dtype=np.float32, **hopper),
                    _rope_launch(least, 80, 32, 4, **dict(hopper, compute_capability=80)),
                    _rope_launch(least, 80, 32, 4,
                                 **dict(hopper, memory_bandwidth=launch.FAST_MEMORY / 2))):
        assert not spec.kernel.staged, spec.kernel


def test_staged_geometry_is_whole_warps_and_a_persistent_grid():
    """A staged block: lanes a head (a power of two), thread rows in whole warps for the rotated
    heads up to STAGED_MAX_THREADS - 32 threads, then the producer warp's rows; a grid of the
    blocks that registers and the stages' shared memory leave resident (4 of 192 threads with 4
    stages of 12.8 KB: the reference shape), at most one a token."""
    bf16 = ml_dtypes.bfloat16
    hopper = dict(memory_bandwidth=launch.FAST_MEMORY, compute_capability=90, dtype=bf16)
    spec, plan = _fused_launch("norm+cache", launch.STAGED_CACHE_MAX_TOKENS, **hopper)
    assert spec.block == (8, 24, 1) and spec.grid == (4 * 132, 1)
    # On a GPU the driver's count of resident blocks decides (launch.occupancy_blocks), asked for
    # the staged specialisation, the block's threads and the stages' shared memory.
    asked = []

    def driver(kernel_spec, threads, shared_bytes):
        asked.append((kernel_spec, threads, shared_bytes))
        return 3

    spec, plan = _fused_launch("norm+cache", launch.STAGED_CACHE_MAX_TOKENS,
                               resident_blocks=driver, **hopper)
    assert spec.grid == (3 * 132, 1)
    assert asked == [(spec.kernel, 192, launch.staged_shared_bytes(plan))]
    assert launch.staged_stage_bytes(plan) == 48 * 128 * 2 + 2 * 64 * 4  # whole 128-byte lines
    for D, hq, hk in ((64, 40, 8), (128, 5, 3), (256, 12, 4), (128, 8, 1)):
        for T in (2049, 3001, launch.STAGED_NORM_MAX_TOKENS):
            spec, plan = _fused_launch("norm", T, D=D, hq=hq,
                                       hk=hk, cos_sin_cache=np.zeros((4096, D), np.float32),
                                       **hopper)
            assert spec.kernel.staged
            lanes, rows, depth = spec.block
            chunks = D // 2 // 8
            assert lanes == 1 << (chunks - 1).bit_length() and depth == 1
            assert lanes * rows <= launch.STAGED_MAX_THREADS and (lanes * rows) % 32 == 0
            consumers = rows - 32 // lanes
            assert consumers > 0 and (lanes * consumers) % 32 == 0
            assert consumers >= min(hq + hk, (launch.STAGED_MAX_THREADS - 32) // lanes) - 32 // lanes
            assert spec.grid[0] <= plan.num_tokens and spec.grid[1] == 1


@pytest.mark.parametrize("op", ["norm", "cache", "norm+cache", "fp8"])
def test_fast_memory_moves_the_fused_launches_of_many_tokens(op):
    """On memory of FAST_MEMORY bytes per second and more the fused decode kernel
    runs the cache write up to FUSED_DECODE_FAST_MEMORY_MAX_CACHE_TOKENS tokens, fp8 outputs at
    any T and the norm up to FUSED_DECODE_FAST_MEMORY_MAX_NORM_TOKENS; past that the norm alone
    takes a persistent grid of the lean kernel, the norm with the cache write its own (the same
    on any memory). Computed angles and slower or unknown memory keep the decode kernel to
    FUSED_DECODE_MAX_TOKENS (FUSED_DECODE_MAX_NORM_TOKENS with the norm)."""
    fast = launch.FAST_MEMORY
    if "norm" in op:
        most = launch.FUSED_DECODE_FAST_MEMORY_MAX_NORM_TOKENS
        for T, decodes in ((most, True), (most + 1, False)):
            spec, _ = _fused_launch(op, T, memory_bandwidth=fast)
            assert spec.kernel.decode is decodes and spec.kernel.norm, (op, T)
            for other in ({"memory_bandwidth": fast / 2}, {"memory_bandwidth": fast,
                                                           "theta": 10000.0}):
                slow, _ = _fused_launch(op, T, **other)
                assert slow.kernel.lean and not slow.kernel.decode, (op, T, other)
    for T in (launch.FUSED_DECODE_MAX_TOKENS + 1, launch.FUSED_DECODE_FAST_MEMORY_MAX_CACHE_TOKENS,
              launch.FUSED_DECODE_FAST_MEMORY_MAX_CACHE_TOKENS + 1, 200000):
        slow, _ = _fused_launch(op, T, memory_bandwidth=fast / 2)
        assert slow.kernel.lean and not slow.kernel.decode, (op, T)
        if op in ("norm", "fp8"):  # one block per token group (the norm + cache: persistent)
            assert slow.grid[0] == min(-(-T // slow.block[2]), launch.MAX_GRID_X), (op, T)
        spec, _ = _fused_launch(op, T, memory_bandwidth=fast)
        blocks = -(-T // spec.block[2])
        if op == "fp8" or (op == "cache"
                           and T <= launch.FUSED_DECODE_FAST_MEMORY_MAX_CACHE_TOKENS):
            assert spec.kernel.decode and spec.kernel.fused and spec.grid[0] == T, (op, T)
            computed, _ = _fused_launch(op, T, memory_bandwidth=fast,
                                        theta=10000.0)
            assert computed.kernel.lean and not computed.kernel.decode, (op, T)
        elif "norm" in op:
            assert spec.kernel.lean and not spec.kernel.decode and spec.kernel.norm
            assert spec.grid[0] < blocks, (op, T, spec.grid)  # persistent
        else:
            assert spec.kernel.lean and not spec.kernel.decode, (op, T)
            assert spec.grid[0] == min(blocks, launch.MAX_GRID_X), (op, T)


@pytest.mark.parametrize("op", ["norm", "cache", "norm+cache"])
def test_fast_memory_puts_sectioned_mrope_on_a_persistent_grid(op):
    """Sectioned M-RoPE (Qwen2-VL) runs the lean kernel on a persistent grid on fast memory;
    interleaved M-RoPE (Qwen3-VL), partial rotations and slower memory keep a block per token
    group (the norm with the cache write too, where M-RoPE is concerned)."""
    T, fast = 65536, launch.FAST_MEMORY
    positions = np.zeros((3, T), np.int64)
    table = dict(cos_sin_cache=np.zeros((4096, 128), np.float32))
    for interleaved in (False, True):
        scaling = {"rope_type": "default", "mrope_section": [16, 24, 24],
                   "mrope_interleaved": interleaved}
        for bandwidth in (fast, fast / 2):
            spec, plan = _fused_launch(op, T, positions=positions, scaling=scaling,
                                       memory_bandwidth=bandwidth, **table)
            assert spec.kernel.lean and spec.kernel.mrope and plan.mrope_mode
            blocks = -(-T // spec.block[2])
            persistent = bandwidth == fast and not interleaved
            assert (spec.grid[0] < blocks) is persistent, (op, interleaved, bandwidth, spec.grid)
    partial, _ = _fused_launch(op, T, memory_bandwidth=fast,
                               cos_sin_cache=np.zeros((4096, 64), np.float32))
    assert partial.kernel.partial
    assert partial.grid[0] == min(-(-T // partial.block[2]), launch.MAX_GRID_X)


@pytest.mark.parametrize("op", ["norm", "cache", "norm+cache"])
def test_fused_decode_kernel_takes_few_tokens_of_the_lean_fused_layout(op):
    """The fused ops run the fused decode kernel up to FUSED_DECODE_MAX_TOKENS tokens
    (FUSED_DECODE_MAX_NORM_TOKENS with the norm), one thread row per q, k and v head, with its
    compact parameters; more tokens take the lean fused kernel."""
    most = launch.FUSED_DECODE_MAX_NORM_TOKENS if "norm" in op else launch.FUSED_DECODE_MAX_TOKENS
    v_heads = 8 if "cache" in op else 0
    for T in (1, most):
        spec, plan = _fused_launch(op, T)
        assert spec.kernel.decode and spec.kernel.fused and spec.kernel.lean, T
        assert "rope_fused_decode_kernel" in spec.kernel.name_expression
        assert (spec.kernel.norm, spec.kernel.cache) == ("norm" in op, "cache" in op)
        (chunks, block_y, one), (tokens, grid_y) = spec.block, spec.grid
        assert chunks == 16 and one == 1 and tokens == T  # float32: 64 pairs, 4 a chunk
        assert block_y * grid_y >= 32 + 8 + v_heads and chunks * block_y <= 256
        assert spec.params.dtype == launch.DECODE_PARAMS_DTYPE
        assert spec.fusion_params.dtype == launch.FUSED_DECODE_PARAMS_DTYPE
        f = spec.fusion_params
        assert int(f["num_v_heads"]) == v_heads and float(f["eps"]) == (
            np.float32(1e-6) if "norm" in op else 0.0)
        if "cache" in op:
            assert int(f["k_cache"]) == plan.fusion.k_cache.ptr and int(f["block_size"]) == 16
            assert int(f["k_cache_slot_stride"]) == 8 * 128  # NHD: a slot's heads side by side
    spec, _ = _fused_launch(op, most + 1)
    assert spec.kernel.lean and not spec.kernel.decode


@pytest.mark.parametrize("op", ["norm", "norm+cache"])
def test_fused_decode_kernel_reads_norm_weights_of_q_dtype(op):
    """The fused decode kernel reads the norm weights as q's dtype; weights of another dtype
    (float32 weights with bfloat16 q) take the lean fused kernel, which converts any."""
    bf16 = np.dtype(ml_dtypes.bfloat16)
    spec, _ = _fused_launch(op, 1, dtype=bf16)
    assert spec.kernel.decode and spec.kernel.norm
    for q_dtype, w_dtype in ((bf16, np.float32), (bf16, np.float16), (np.float32, bf16)):
        spec, _ = _fused_launch(op, 1, dtype=q_dtype, weight_dtype=w_dtype)
        assert spec.kernel.lean and spec.kernel.norm and not spec.kernel.decode, (q_dtype, w_dtype)
    spec, _ = _fused_launch("cache", 1, dtype=bf16, weight_dtype=np.float32)  # no norm: no weights
    assert spec.kernel.decode


@pytest.mark.parametrize("op", ["norm", "cache", "norm+cache"])
def test_partial_rotation_takes_the_lean_fused_kernel_with_lanes_for_the_other_dims(op):
    """rotary_dim < head_dim runs the lean fused kernel's partial specialisation at any T (not
    the decode kernel): a lane per 2 * pairs dims of the whole head (bfloat16 NeoX: 16), the
    rotated chunks' first. NeoX needs head_dim a multiple of rotary_dim (its other dims come in
    blocks of rotary_dim), interleaved pairs only whole lanes; anything else takes the general
    fused kernel."""
    bf16 = np.dtype(ml_dtypes.bfloat16)
    for T in (1, 5000):
        spec, plan = _fused_launch(op, T, D=256, dtype=bf16,
                                   cos_sin_cache=np.zeros((4096, 64), np.float32))
        assert plan.rotary_dim == 64 and plan.head_dim == 256
        assert spec.kernel.lean and spec.kernel.partial and not spec.kernel.decode, T
        assert "false, true>" in spec.kernel.name_expression
        assert spec.block[0] == 16 and int(spec.params["copy_pass_through"]) == 1
    spec, _ = _fused_launch(op, 7, D=128, dtype=bf16, cos_sin_cache=np.zeros((4096, 96), np.float32))
    assert not spec.kernel.lean  # NeoX: 128 is no multiple of 96
    spec, _ = _fused_launch(op, 7, D=128, dtype=bf16, interleaved=True,
                            cos_sin_cache=np.zeros((4096, 96), np.float32))
    assert spec.kernel.lean and spec.kernel.partial and spec.block[0] == 16  # 8 bf16 a lane
    spec, _ = _fused_launch(op, 7, D=128, dtype=bf16)
    assert not spec.kernel.partial  # every dim rotated: the common kernels


def test_fused_decode_kernel_needs_a_power_of_two_of_chunks_and_no_mrope():
    """Heads of 96 float32 dims (12 chunks: the norm's shuffles need a power of two) and M-RoPE
    positions stay on the lean fused kernel at any T."""
    spec, _ = _fused_launch("norm", 4, D=96)
    assert spec.kernel.lean and not spec.kernel.decode
    spec, plan = _fused_launch("cache", 4, positions=np.zeros((3, 4), np.int64),
                               cos_sin_cache=np.zeros((4096, 128), np.float32),
                               scaling={"rope_type": "default", "mrope_section": [16, 24, 24]})
    assert plan.mrope_mode and spec.kernel.lean and spec.kernel.mrope and not spec.kernel.decode


@pytest.mark.parametrize("T", [4096, 16384, 65536, 200000])
def test_lean_norm_and_cache_write_runs_on_a_persistent_grid(T):
    """The lean kernel with the norm and the cache write loops over its tokens on one wave of
    resident blocks (FUSED_LEAN_PERSISTENT_WAVES), the tokens spread evenly; the norm alone, the
    cache write alone and a partial rotation keep one block per token group."""
    spec, _ = _fused_launch("norm+cache", T)
    assert spec.kernel.lean and spec.kernel.norm and spec.kernel.cache and not spec.kernel.decode
    (lanes, rows, tokens), (grid_x, grid_y) = spec.block, spec.grid
    wave = launch._resident_blocks(lanes * rows * tokens, 64) * 132 // grid_y
    blocks = -(-T // tokens)  # one block per token group
    assert grid_x <= wave * launch.FUSED_LEAN_PERSISTENT_WAVES < blocks
    per_block = -(-blocks // grid_x)
    assert (per_block - 1) * grid_x < blocks <= per_block * grid_x  # no block idle, none 2x
    for op in ("norm", "cache"):
        alone, _ = _fused_launch(op, T)
        assert alone.kernel.lean and alone.grid[0] == min(-(-T // alone.block[2]),
                                                          launch.MAX_GRID_X), op
    # A partial rotation's kernel (not measured on a persistent grid) keeps one block a group.
    partial, _ = _fused_launch("norm+cache", T, cos_sin_cache=np.zeros((4096, 64), np.float32))
    assert partial.kernel.partial and partial.kernel.norm and partial.kernel.cache
    assert partial.grid[0] == min(-(-T // partial.block[2]), launch.MAX_GRID_X)


def test_persistent_token_grid_leaves_small_grids_alone():
    """Up to ``waves`` waves the grid is returned as it is; past them ceil(n / ceil(n / wave))
    blocks, at most a wave."""
    block = (8, 12, 2)
    wave = launch._resident_blocks(192, 64) * 132
    for blocks in (1, wave, 2 * wave):
        assert launch.persistent_token_grid((blocks, 1), block, 64, 132, 2) == (blocks, 1)
    for blocks in (2 * wave + 1, 7 * wave - 3, 100 * wave + 17):
        grid_x, grid_y = launch.persistent_token_grid((blocks, 1), block, 64, 132, 2)
        assert grid_y == 1 and grid_x <= wave and blocks <= grid_x * -(-blocks // grid_x)
        assert -(-blocks // grid_x) == -(-blocks // wave)  # as few tokens a block as a wave allows


def test_occupancy_is_the_drivers_asked_once_a_kernel_and_size(monkeypatch):
    """launch.occupancy_blocks: the driver's count (cuOccupancyMaxActiveBlocksPerMultiprocessor),
    asked once per kernel, block size and shared memory; past 48 KB the launch's shared memory is
    allowed first (else the driver counts no block)."""
    import types

    calls = []
    driver = types.SimpleNamespace(
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES=8,
        funcSetAttribute=lambda ptr, attribute, value: calls.append(("allow", ptr, value)),
        occupancyMaxActiveBlocksPerMultiprocessor=lambda ptr, threads, shared: (
            calls.append(("ask", ptr, threads, shared)) or 4))
    runtime = types.SimpleNamespace(
        getDeviceProperties=lambda device: {"sharedMemPerBlockOptin": 227 * 1024})
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(driver=driver, runtime=runtime))
    monkeypatch.setattr(launch, "cupy_module", lambda: fake)
    monkeypatch.setattr(launch, "_occupancies", {})
    monkeypatch.setattr(launch, "_shared_opt_ins", {})
    kernel = types.SimpleNamespace(ptr=0xABC)
    assert launch.occupancy_blocks(kernel, 0, 160, 45632, "op") == 4
    assert launch.occupancy_blocks(kernel, 0, 160, 45632, "op") == 4
    assert calls == [("ask", 0xABC, 160, 45632)]
    calls.clear()
    assert launch.occupancy_blocks(kernel, 0, 160, 60 * 1024, "op") == 4
    assert calls == [("allow", 0xABC, 60 * 1024), ("ask", 0xABC, 160, 60 * 1024)]


def test_shared_memory_opt_in_is_only_ever_raised(monkeypatch):
    """A kernel's bound on dynamic shared memory is one attribute: launches of a size opted in
    before must still find it after a smaller launch of the same kernel opted in (a bound
    lowered under them failed with CUDA_ERROR_INVALID_VALUE: the staged kernels take stages of
    different sizes by shape)."""
    import types

    allowed = {}
    driver = types.SimpleNamespace(
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES=8,
        funcSetAttribute=lambda ptr, attribute, value: allowed.__setitem__(ptr, value))
    runtime = types.SimpleNamespace(
        getDeviceProperties=lambda device: {"sharedMemPerBlockOptin": 227 * 1024})
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(driver=driver, runtime=runtime))
    monkeypatch.setattr(launch, "cupy_module", lambda: fake)
    monkeypatch.setattr(launch, "_shared_opt_ins", {})
    kernel, other = types.SimpleNamespace(ptr=0xABC), types.SimpleNamespace(ptr=0xDEF)
    for nbytes in (60 * 1024, 50 * 1024, 60 * 1024, 49 * 1024):
        launch.allow_shared_bytes(kernel, 0, nbytes, "op")
        assert allowed[0xABC] >= nbytes
    assert allowed == {0xABC: 60 * 1024}
    launch.allow_shared_bytes(other, 0, 52 * 1024, "op")
    launch.allow_shared_bytes(kernel, 0, 90 * 1024, "op")
    assert allowed == {0xABC: 90 * 1024, 0xDEF: 52 * 1024}
    with pytest.raises(ValueError, match="more than this GPU's"):
        launch.allow_shared_bytes(kernel, 0, 228 * 1024, "op")
    # What holds the memory, and what to do: the norm's weights, or the staged kernels' stages.
    with pytest.raises(ValueError, match="norm_over='all_heads'.*normalise with fewer heads"):
        launch.allow_shared_bytes(kernel, 0, 228 * 1024, "op", all_heads=True)
    with pytest.raises(ValueError, match="ring of stages.*pass fewer heads a call"):
        launch.allow_shared_bytes(kernel, 0, 228 * 1024, "op")
    assert allowed == {0xABC: 90 * 1024, 0xDEF: 52 * 1024}  # nothing opted in on a refusal
