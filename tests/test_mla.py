"""The DeepSeek MLA ops (``mla_rope_quantize``, ``mla_rope_and_cache``) against the float64
reference: the rope part (LAST dims of a head) rotated with either pairing, the nope part passed
through, every part stored once in the input dtype or as fp8; the latent cache ``[kv_c | k_pe]``
of vLLM's ``concat_and_cache_mla``; refusals that write nothing. NumPy and torch CPU run here.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupyrope as cr
from reference import reference_rope
from tolerances import assert_bits_equal, assert_rope_close, np_dtype
from test_fused_mla import DEEPSEEK_V3, FP8, FP8_MAX, assert_fp8_close

ROPE = 64
RANK = 512
MAX_POSITION = 4096
# (nope, rope): DeepSeek-V3's q head, the absorbed q of MLA decode, and a nope part that does
# not split into two-access pass-through chunks (mla.cuh: one access an item there).
HEADS = [(128, 64), (512, 64), (136, 64)]
POISON = 7.0  # a value no call writes into a cache


@pytest.fixture(scope="module")
def deepseek_cache() -> np.ndarray:
    return cr.cos_sin_cache(MAX_POSITION, ROPE, theta=10000.0, scaling=DEEPSEEK_V3,
                            dtype="float32")


def exact_rope(x, positions, cache, interleaved):
    return reference_rope(x, positions, cos_sin_cache=cache, interleaved=interleaved)


def check_part(got, exact, x, fmt, scale, *, rotated: bool, interleaved: bool, what: str):
    """One stored part: fp8 ``exact / scale`` rounded once, or the input dtype (rotated within
    the rope tolerance, passed through bit for bit)."""
    if fmt is not None:
        assert got.dtype == np.dtype(getattr(ml_dtypes, fmt)), what
        assert_fp8_close(got, np.asarray(exact, np.float64) / scale, what)
    elif rotated:
        assert_rope_close(got, exact, x, interleaved=interleaved, rotary_dim=x.shape[-1])
    else:
        assert_bits_equal(got, x, what=what)


def _poisoned_cache(dtype, blocks=6, block_size=4, fmt=None):
    if fmt is not None:
        return np.full((blocks, block_size, RANK + ROPE), POISON, np.float32).astype(np_dtype(fmt))
    return np.full((blocks, block_size, RANK + ROPE), POISON, np_dtype(dtype))


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("fmt", [None, *FP8])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("with_k_nope", [False, True])
def test_rope_quantize_separate_parts(rng, randn, deepseek_cache, interleaved, fmt, dtype,
                                      with_k_nope):
    T, H, nope = 13, 8, 128
    q_pe, q_nope = randn((T, H, ROPE), dtype), randn((T, H, nope), dtype)
    k_pe = randn((T, ROPE), dtype)
    k_nope = randn((T, 1, nope), dtype) if with_k_nope else None
    positions = rng.integers(0, MAX_POSITION, T)
    scales = dict(q_scale=0.25, k_scale=0.5) if fmt else {}
    inputs = [a.copy() for a in (q_pe, k_pe, q_nope)]
    q_pe_out, k_pe_out, q_nope_out, k_nope_out = cr.mla_rope_quantize(
        q_pe, k_pe, q_nope, k_nope, positions, cos_sin_cache=deepseek_cache,
        interleaved=interleaved, out_dtype=fmt, **scales)
    for a, b in zip(inputs, (q_pe, k_pe, q_nope)):
        assert_bits_equal(b, a, what="an input after an out-of-place call")
    assert k_pe_out.shape == k_pe.shape and q_pe_out.shape == q_pe.shape
    assert (k_nope_out is None) == (k_nope is None)
    q_scale, k_scale = scales.get("q_scale", 1.0), scales.get("k_scale", 1.0)
    check_part(q_pe_out, exact_rope(q_pe, positions, deepseek_cache, interleaved), q_pe, fmt,
               q_scale, rotated=True, interleaved=interleaved, what="q_pe")
    k3 = k_pe[:, None, :]
    check_part(k_pe_out[:, None, :], exact_rope(k3, positions, deepseek_cache, interleaved), k3,
               fmt, k_scale, rotated=True, interleaved=interleaved, what="k_pe")
    check_part(q_nope_out, q_nope, q_nope, fmt, q_scale, rotated=False, interleaved=interleaved,
               what="q_nope")
    if k_nope is not None:
        check_part(k_nope_out, k_nope, k_nope, fmt, k_scale, rotated=False,
                   interleaved=interleaved, what="k_nope")


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("fmt", [None, "float8_e4m3fn"])
@pytest.mark.parametrize("cache_fmt", [None, "float8_e4m3fn", "uint8-e5m2"])
@pytest.mark.parametrize("joint", [True, False])
def test_rope_and_cache(rng, randn, deepseek_cache, head, interleaved, fmt, cache_fmt, joint):
    nope, _ = head
    T, H, dtype = 11, 4, "bfloat16"
    q = randn((T, H, nope + ROPE), dtype)
    k_pe, kv_c = randn((T, ROPE), dtype), randn((T, RANK), dtype)
    positions = rng.integers(0, MAX_POSITION, T)
    blocks, block_size = 6, 4
    slots = rng.permutation(blocks * block_size)[:T].astype(np.int64)
    slots[[2, 7]] = -1  # padding
    fp8_cache = None if cache_fmt is None else cache_fmt.replace("uint8-e5m2", "float8_e5m2")
    cache = _poisoned_cache(dtype, blocks, block_size, fp8_cache)
    options = {}
    if cache_fmt == "uint8-e5m2":
        cache = cache.view(np.uint8)
        options["cache_dtype"] = "float8_e5m2"
    if fp8_cache is not None:
        options["kv_scale"] = 0.125
    if fmt is not None:
        options.update(out_dtype=fmt, q_scale=0.5, k_scale=2.0)
    before = cache.copy()
    q_in = q if joint else (q[..., :nope], q[..., nope:])
    q_out, k_out, cache_out = cr.mla_rope_and_cache(
        q_in, k_pe, kv_c, positions, cache, slots, cos_sin_cache=deepseek_cache,
        interleaved=interleaved, **options)
    assert cache_out is cache
    if not joint:
        assert q_out[0].shape == (T, H, nope) and q_out[1].shape == (T, H, ROPE)
        q_out = np.concatenate([q_out[0], q_out[1]], axis=-1)
    assert q_out.shape == q.shape
    q_exact = exact_rope(q[..., nope:], positions, deepseek_cache, interleaved)
    check_part(q_out[..., nope:], q_exact, q[..., nope:], fmt, 0.5, rotated=True,
               interleaved=interleaved, what="q rope part")
    check_part(q_out[..., :nope], q[..., :nope], q[..., :nope], fmt, 0.5, rotated=False,
               interleaved=interleaved, what="q nope part")
    k_exact = exact_rope(k_pe[:, None, :], positions, deepseek_cache, interleaved)[:, 0]
    check_part(k_out[:, None, :], k_exact[:, None, :], k_pe[:, None, :], fmt, 2.0, rotated=True,
               interleaved=interleaved, what="k_pe out")
    # The cache: written rows hold [kv_c | rotated k_pe], every other row keeps its poison.
    stored = cache.view(np_dtype(fp8_cache)) if cache_fmt == "uint8-e5m2" else cache
    written = slots >= 0
    blocks_of, rows_of = slots[written] // block_size, slots[written] % block_size
    untouched = np.ones((blocks, block_size), bool)
    untouched[blocks_of, rows_of] = False
    assert_bits_equal(cache[untouched], before[untouched], what="rows of skipped slots")
    rows = stored[blocks_of, rows_of]
    if fp8_cache is None:
        assert_bits_equal(rows[:, :RANK], kv_c[written], what="cached kv_c")
        assert_rope_close(rows[:, None, RANK:], k_exact[written][:, None, :],
                          k_pe[written][:, None, :], interleaved=interleaved, rotary_dim=ROPE)
    else:
        assert_fp8_close(rows[:, :RANK], kv_c[written].astype(np.float64) / 0.125, "kv_c")
        assert_fp8_close(rows[:, RANK:], k_exact[written] / 0.125, "cached k_pe")


@pytest.mark.parametrize("interleaved", [True, False])
def test_computed_deepseek_yarn_angles_match_the_table(rng, randn, deepseek_cache, interleaved):
    """Computed angles under DeepSeek-V3's YaRN (mscale in cos / sin) against the reference fed
    the library's float64 schedule."""
    T, H = 9, 16
    q_pe, k_pe = randn((T, H, ROPE)), randn((T, 1, ROPE))
    positions = rng.integers(0, MAX_POSITION, T)
    inv_freq, factor = cr.rope_frequencies(ROPE, theta=10000.0, scaling=DEEPSEEK_V3)
    q_out, k_out, _, _ = cr.mla_rope_quantize(q_pe, k_pe, positions=positions,
                                              scaling=DEEPSEEK_V3, interleaved=interleaved)
    for x, got in ((q_pe, q_out), (k_pe, k_out)):
        exact = reference_rope(x, positions, inv_freq=inv_freq, attention_factor=factor,
                               interleaved=interleaved)
        assert_rope_close(got, exact, x, interleaved=interleaved, rotary_dim=ROPE,
                          max_angle=float(np.abs(positions).max() * inv_freq.max()))


def test_in_place_rotates_the_rope_parts_only(rng, randn, deepseek_cache):
    T, H, nope = 7, 4, 128
    q = randn((T, H, nope + ROPE), "bfloat16")
    k_pe, kv_c = randn((T, 1, ROPE), "bfloat16"), randn((T, 1, RANK), "bfloat16")
    original_q, original_k = q.copy(), k_pe.copy()
    positions = rng.integers(0, MAX_POSITION, T)
    cache = _poisoned_cache("bfloat16")
    q_out, k_out, _ = cr.mla_rope_and_cache(q, k_pe, kv_c, positions, cache,
                                            np.arange(T, dtype=np.int32),
                                            cos_sin_cache=deepseek_cache, inplace=True)
    assert q_out is q and k_out is k_pe
    assert_bits_equal(q[..., :nope], original_q[..., :nope], what="nope part in place")
    assert_rope_close(q[..., nope:], exact_rope(original_q[..., nope:], positions, deepseek_cache,
                                                True),
                      original_q[..., nope:], interleaved=True, rotary_dim=ROPE)
    rows = cache.reshape(-1, RANK + ROPE)[:T]
    assert_bits_equal(rows[:, RANK:], k_pe[:, 0], what="cached k_pe is the rotated k_pe")
    assert_bits_equal(rows[:, :RANK], kv_c[:, 0], what="cached kv_c")


def test_torch_cpu_matches_numpy(rng, randn, deepseek_cache):
    torch = pytest.importorskip("torch")
    T, H, nope = 10, 4, 512
    q = randn((T, H, nope + ROPE), "bfloat16")
    k_pe, kv_c = randn((T, ROPE), "bfloat16"), randn((T, RANK), "bfloat16")
    positions = rng.integers(0, MAX_POSITION, T)
    slots = np.array([3, -1, 0, 9, 4, 5, 11, 2, 1, 7])
    cache = _poisoned_cache("bfloat16", 3, 4, "float8_e4m3fn")
    expected = cr.mla_rope_and_cache(q, k_pe, kv_c, positions, cache, slots,
                                     cos_sin_cache=deepseek_cache, out_dtype="float8_e4m3fn",
                                     q_scale=0.5, kv_scale=0.25)

    def tensor(a):
        if a.dtype == np_dtype("bfloat16"):
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        if a.dtype.itemsize == 1 and a.dtype.kind == "V" or a.dtype.name.startswith("float8"):
            return torch.from_numpy(a.view(np.uint8)).view(getattr(torch, a.dtype.name))
        return torch.from_numpy(a)

    t_cache = tensor(_poisoned_cache("bfloat16", 3, 4, "float8_e4m3fn"))
    q_out, k_out, _ = cr.mla_rope_and_cache(tensor(q), tensor(k_pe), tensor(kv_c),
                                            tensor(positions), t_cache, tensor(slots),
                                            cos_sin_cache=tensor(deepseek_cache),
                                            out_dtype=torch.float8_e4m3fn, q_scale=0.5,
                                            kv_scale=torch.tensor(0.25))
    assert q_out.dtype == torch.float8_e4m3fn and k_out.dtype == torch.float8_e4m3fn
    for got, want in ((q_out, expected[0]), (k_out, expected[1]), (t_cache, expected[2])):
        assert_bits_equal(got.view(torch.uint8).numpy(), want.view(np.uint8), what="torch CPU")


def _mla_case(randn, rng):
    T, H, nope = 5, 2, 128
    return dict(q=randn((T, H, nope + ROPE), "bfloat16"), k_pe=randn((T, ROPE), "bfloat16"),
                kv_c=randn((T, RANK), "bfloat16"), positions=rng.integers(0, 100, T),
                kv_cache=_poisoned_cache("bfloat16"), slot_mapping=np.arange(5))


@pytest.mark.parametrize("change, error, message", [
    (dict(k_pe=("shape", (5, 32))), ValueError, "kv_cache must be .* 512 \\+ 32.*got shape"),
    (dict(kv_cache=("shape", (6, 4, 575))), ValueError, "kv_cache must be .*got shape \\(6, 4, 575\\)"),
    (dict(kv_c=("shape", (4, RANK))), ValueError, "kv_c must be \\[num_tokens=5.*got shape \\(4, 512\\)"),
    (dict(slot_mapping=("dtype", "float32")), TypeError, "slot_mapping must be int32 or int64, got float32"),
    (dict(slot_mapping=("shape", (4,))), ValueError, "slot_mapping must have shape \\(5,\\).*got \\(4,\\)"),
    (dict(kv_c=("dtype", "float16")), TypeError, "kv_c must have q's dtype bfloat16, got float16"),
    (dict(kv_cache=("dtype", "uint8")), TypeError, "uint8 kv_cache holds fp8 bits"),
    (dict(kv_cache=("dtype", "float32")), TypeError, "kv_cache must have q's dtype bfloat16"),
    (dict(kw=dict(kv_scale=0.5)), ValueError, "kv_scale is only used with an fp8 kv_cache"),
    (dict(kw=dict(q_scale=0.5)), ValueError, "q_scale is only used with an fp8 out_dtype"),
    (dict(kw=dict(out_dtype="int8")), ValueError, "out_dtype must be None or one of"),
    (dict(kw=dict(out_dtype="float8_e4m3fn", inplace=True)), ValueError, "pass inplace=False"),
    (dict(kw=dict(q_scale=-1.0, out_dtype="float8_e4m3fn")), ValueError, "q_scale must be finite and > 0"),
    (dict(kw=dict(cos_sin_cache=np.zeros((10, 32), np.float32))), ValueError, "rope_dim 64"),
    (dict(kw=dict(validate=True), slot_mapping=("values", [0, 1, 1, 2, 3])), ValueError, "slot 1 to tokens \\[1, 2\\]"),
    (dict(kw=dict(validate=True), slot_mapping=("values", [0, 1, 99, 2, 3])), IndexError, "slot_mapping holds 1 slot"),
])
def test_bad_arguments_are_refused_before_anything_is_written(rng, randn, change, error,
                                                              message):
    case = _mla_case(randn, rng)
    kw = dict(change.pop("kw", {}))
    for name, (what, value) in change.items():
        x = case[name]
        if what == "shape":
            case[name] = np.resize(x, value)
        elif what == "dtype":
            case[name] = x.astype(value)
        else:
            case[name] = np.asarray(value, x.dtype)
    before = case["kv_cache"].copy()
    q_before = case["q"].copy()
    with pytest.raises(error, match=message) as raised:
        cr.mla_rope_and_cache(case["q"], case["k_pe"], case["kv_c"], case["positions"],
                              case["kv_cache"], case["slot_mapping"], **kw)
    assert str(raised.value).startswith("mla_rope_and_cache: ")
    assert_bits_equal(case["kv_cache"], before, what="cache after a refused call")
    assert_bits_equal(case["q"], q_before, what="q after a refused call")


def test_rope_quantize_refusals(randn, rng):
    q_pe, k_pe = randn((4, 2, ROPE)), randn((4, ROPE))
    with pytest.raises(ValueError, match="q_nope must have the tokens and heads of its rope part "
                                         "\\(4, 2\\), got shape \\(4, 3, 128\\)"):
        cr.mla_rope_quantize(q_pe, k_pe, randn((4, 3, 128)), None, np.arange(4))
    with pytest.raises(ValueError, match="k_pe must have q's tokens \\(4\\) and rope_dim \\(64\\)"):
        cr.mla_rope_quantize(q_pe, randn((4, 32)), None, None, np.arange(4))
    with pytest.raises(ValueError, match="nope parts|not written in place"):
        cr.mla_rope_quantize(q_pe, k_pe, randn((4, 2, 128)), None, np.arange(4), inplace=True)
    with pytest.raises(TypeError, match="q must be one of"):
        cr.mla_rope_quantize(q_pe.astype(np.float64), k_pe.astype(np.float64),
                             positions=np.arange(4))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("uint8_bits", [False, True])
def test_vllm_concat_and_cache_mla_stores_without_rotating(rng, randn, kv_cache_dtype, uint8_bits):
    torch = pytest.importorskip("torch")
    from cupyrope.compat.vllm import concat_and_cache_mla

    T, n, blocks, block_size = 9, 7, 3, 4  # tokens past n are CUDA-graph padding
    kv_c = torch.from_numpy(randn((T, RANK)))
    k_pe = torch.from_numpy(randn((T, 1, ROPE)))  # vLLM's squeezed or unsqueezed k_pe
    slots = torch.from_numpy(rng.permutation(blocks * block_size)[:n].astype(np.int64))
    slots[3] = -1
    fmt = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[kv_cache_dtype]
    if fmt is None:
        cache = torch.full((blocks, block_size, RANK + ROPE), POISON)
    else:
        cache = torch.full((blocks, block_size, RANK + ROPE), POISON).to(getattr(torch, fmt))
        cache = cache.view(torch.uint8) if uint8_bits else cache
    before = cache.clone()
    scale = torch.tensor([0.5])
    assert concat_and_cache_mla(kv_c, k_pe, cache, slots, kv_cache_dtype, scale) is None
    entries = torch.cat([kv_c, k_pe[:, 0]], dim=-1)[:n].numpy()
    got = cache.view(torch.uint8).numpy().view(np_dtype(fmt)) if fmt else cache.numpy()
    s = slots.numpy()
    for t in range(n):
        block, row = divmod(int(s[t]), block_size)
        if s[t] < 0:
            continue
        if fmt is None:
            assert_bits_equal(got[block, row], entries[t], what="cached row")
        else:
            expected = np.clip(entries[t] / np.float32(0.5), -FP8_MAX[fmt], FP8_MAX[fmt])
            assert_bits_equal(got[block, row], expected.astype(np_dtype(fmt)), what="fp8 row")
    written = np.zeros((blocks, block_size), bool)
    written[s[s >= 0] // block_size, s[s >= 0] % block_size] = True
    assert_bits_equal(cache.view(torch.uint8).numpy()[~written] if fmt else cache.numpy()[~written],
                      before.view(torch.uint8).numpy()[~written] if fmt else before.numpy()[~written],
                      what="rows of skipped slots")


def test_vllm_concat_and_cache_mla_refusals(randn):
    torch = pytest.importorskip("torch")
    from cupyrope.compat.vllm import concat_and_cache_mla

    kv_c, k_pe = torch.from_numpy(randn((4, RANK))), torch.from_numpy(randn((4, ROPE)))
    cache = torch.zeros((2, 4, RANK + ROPE))
    slots = torch.arange(4)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*got 'fp8_ds_mla'"):
        concat_and_cache_mla(kv_c, k_pe, cache, slots, "fp8_ds_mla", torch.tensor(1.0))
    with pytest.raises(TypeError, match="needs a cache of float8_e4m3fn .*got torch.float32"):
        concat_and_cache_mla(kv_c, k_pe, cache, slots, "fp8", torch.tensor(1.0))
    with pytest.raises(ValueError, match="kv_cache must be \\[num_blocks, block_size, "
                                         "kv_lora_rank \\+ rope_dim = 512 \\+ 64\\]"):
        concat_and_cache_mla(kv_c, k_pe, cache[..., :-1], slots, "auto", torch.tensor(1.0))
    assert not cache.any()



def test_launch_parameters_describe_the_plan(rng, randn, deepseek_cache):
    """The host side of the GPU launch (no GPU needed): MlaParams fields from a plan, and 16-byte
    accesses only where every row and stride splits into whole accesses."""
    from cupyrope.core.arrays import describe
    from cupyrope.core.mla import plan_mla
    from cupyrope.cuda.mla_launch import MLA_PARAMS_DTYPE, plan_mla_launch

    assert MLA_PARAMS_DTYPE.itemsize == 480  # static_assert'ed in kernels_cu/mla.cuh
    T, H, nope = 5, 4, 128
    q = randn((T, H, nope + ROPE), "bfloat16")
    k_pe, kv_c = randn((T, 1, ROPE), "bfloat16"), randn((T, RANK), "bfloat16")
    cache = _poisoned_cache("bfloat16", 3, 4, "float8_e4m3fn")
    slots = np.arange(T, dtype=np.int32)

    def launch(q_nope, q_pe, interleaved=True):
        plan = plan_mla("mla_rope_and_cache", q_nope, q_pe, None, k_pe, np.arange(T),
                        rope=dict(cos_sin_cache=deepseek_cache, interleaved=interleaved),
                        kv_c=kv_c, kv_cache=cache, slot_mapping=slots, kv_scale=0.5)
        outs = [describe(np.empty(x.shape, np_dtype("bfloat16")), "out") for x in (q_nope, q_pe)]
        return plan_mla_launch(plan, [*outs, None, describe(np.empty_like(k_pe), "out")])

    spec, p = launch(q[..., :nope], q[..., nope:])
    assert spec.vector and spec.interleaved and spec.dtype == "bfloat16"
    assert int(p["q_pe"]) - int(p["q_nope"]) == nope * 2  # the rope part follows the nope part
    assert tuple(p["q_pe_strides"]) == (H * (nope + ROPE), nope + ROPE)
    assert (int(p["nope_dim"]), int(p["rope_dim"]), int(p["rank"])) == (nope, ROPE, RANK)
    assert (int(p["num_slots"]), int(p["block_size"]), int(p["cache_format"])) == (12, 4, 1)
    assert int(p["slots_int64"]) == 0 and float(p["kv_scale_value"]) == 0.5
    assert int(p["max_position"]) == MAX_POSITION and int(p["rotate"]) == 1
    # One joint cache: no kpe_cache pointer, k_pe's rows take the joint rows' strides.
    assert int(p["kpe_cache"]) == 0
    assert (int(p["kpe_block_stride"]), int(p["kpe_row_stride"])) == (4 * (RANK + ROPE),
                                                                      RANK + ROPE)
    odd = randn((T, H, nope + ROPE + 1), "bfloat16")  # heads 385 wide: no 16-byte alignment
    assert not launch(odd[..., :nope], odd[..., nope:nope + ROPE])[0].vector
    assert not launch(q[..., :nope], q[..., nope:], interleaved=False)[0].interleaved


def test_launch_grid_splits_a_decode_steps_items(rng, randn, deepseek_cache):
    """The host's count of a token's items mirrors kernels_cu/mla.cuh, and the grid gives each
    token a block, or (a few tokens) a token's items several blocks of one item a thread."""
    from cupyrope.core.arrays import describe
    from cupyrope.core.mla import plan_mla
    from cupyrope.cuda.mla_launch import MAX_BLOCKS, mla_grid, mla_token_items, plan_mla_launch

    H, nope = 16, 128

    def launch(T, interleaved=True, with_cache=True, heads=H):
        q = randn((T, heads, nope + ROPE), "bfloat16")
        k_pe, kv_c = randn((T, 1, ROPE), "bfloat16"), randn((T, RANK), "bfloat16")
        extra = {}
        if with_cache:
            extra = dict(kv_c=kv_c, kv_cache=_poisoned_cache("bfloat16", -(-T // 4), 4,
                                                             "float8_e4m3fn"),
                         slot_mapping=np.arange(T, dtype=np.int32), kv_scale=0.5)
        plan = plan_mla("mla_rope_and_cache" if with_cache else "mla_rope_quantize",
                        q[..., :nope], q[..., nope:], None, k_pe, np.arange(T),
                        rope=dict(cos_sin_cache=deepseek_cache, interleaved=interleaved), **extra)
        outs = [describe(np.empty(x.shape, np_dtype("bfloat16")), "out")
                for x in (q[..., :nope], q[..., nope:])]
        return plan_mla_launch(plan, [*outs, None, describe(np.empty_like(k_pe), "out")])

    # DeepSeek-V3 at TP 8, GPT-J pairs: q 16 x (8 nope chunks of 32 bytes + 8 rope chunks of 4
    # pairs), k_pe 8 rope chunks, kv_c 512 / 16 = 32 chunks of 32 bytes: three blocks a token.
    spec, p = launch(5)
    assert mla_token_items(spec, p) == 16 * (8 + 8) + 8 + 32 == 296
    assert mla_grid(spec, p, 132) == (5, 3)
    for tokens, grid in ((44, (44, 3)), (45, (45, 1)), (65536, (65536, 1)),
                         (10**6, (MAX_BLOCKS, 1)), (0, (0, 3))):  # no token: no launch
        p["num_tokens"] = tokens
        assert mla_grid(spec, p, 132) == grid, tokens
    # NeoX: bf16 chunks of 8 elements, rope chunks of 8 pairs (4 a head), one access a copy.
    spec, p = launch(5, interleaved=False)
    assert mla_token_items(spec, p) == 16 * (16 + 4) + 4 + 64
    assert mla_grid(spec, p, 132) == (5, 4)
    # Without the cache write: q and k only.
    spec, p = launch(5, with_cache=False)
    assert mla_token_items(spec, p) == 16 * (8 + 8) + 8
    # DeepSeek-V3 on one GPU: 128 heads, 2088 items; one token on 132 SMs takes 17 blocks.
    spec, p = launch(1, heads=128)
    assert mla_token_items(spec, p) == 128 * 16 + 8 + 32 == 2088
    assert mla_grid(spec, p, 132) == (1, 17)


def test_launch_block_by_tokens(rng, randn, deepseek_cache):
    """Blocks of 128 for a decode step (its items split, mla_grid) and up to ~2000 tokens, 96
    where 64 would leave a thin last wave (4096 tokens on 132 SMs at 40 registers: 1.8 waves of
    17 blocks an SM against 1.2 of 25), 64 from 16384; every block whole warps, none past the
    kernel's bound."""
    from cupyrope.core.arrays import describe
    from cupyrope.core.mla import plan_mla
    from cupyrope.cuda.mla_launch import THREADS, mla_geometry, plan_mla_launch

    T = 8
    q = randn((T, 16, 128 + ROPE), "bfloat16")
    k_pe, kv_c = randn((T, 1, ROPE), "bfloat16"), randn((T, RANK), "bfloat16")
    plan = plan_mla("mla_rope_and_cache", q[..., :128], q[..., 128:], None, k_pe, np.arange(T),
                    rope=dict(cos_sin_cache=deepseek_cache, interleaved=True), kv_c=kv_c,
                    kv_cache=_poisoned_cache("bfloat16", 2, 4, "float8_e4m3fn"),
                    slot_mapping=np.arange(T, dtype=np.int32), kv_scale=0.5)
    outs = [describe(np.empty(x.shape, np_dtype("bfloat16")), "out")
            for x in (q[..., :128], q[..., 128:])]
    spec, p = plan_mla_launch(plan, [*outs, None, describe(np.empty_like(k_pe), "out")])
    for tokens, block, grid in ((1, 128, (1, 3)), (44, 128, (44, 3)), (512, 128, (512, 1)),
                                (1024, 128, (1024, 1)), (4096, 96, (4096, 1)),
                                (16384, 64, (16384, 1)), (65536, 64, (65536, 1))):
        p["num_tokens"] = tokens
        assert mla_geometry(spec, p, 132, 40) == (block, grid), tokens
        assert block % 32 == 0 and block <= THREADS
    p["num_tokens"] = 16384  # 64 registers: 16 blocks of 64 an SM (7.8 waves), still 64
    assert mla_geometry(spec, p, 132, 64)[0] == 64
    # 32 registers (the 32-bit-offset build on sm_90): 96 past the SMs, 128 and the split below.
    for tokens, block, grid in ((44, 128, (44, 3)), (133, 96, (133, 1)), (512, 96, (512, 1)),
                                (4096, 96, (4096, 1)), (65536, 96, (65536, 1))):
        p["num_tokens"] = tokens
        assert mla_geometry(spec, p, 132, 32) == (block, grid), tokens


def test_launch_takes_64_bit_offsets_only_past_32_bit_reach(deepseek_cache):
    """32-bit element offsets (the 16-resident-block kernel on sm_90) unless an array the kernel
    indexes by token, head or slot reaches 2^30 elements: a plan whose cache (or q) is described
    as that large takes the 64-bit kernel (nothing allocated: the launch is only planned)."""
    import dataclasses

    from cupyrope.core.arrays import describe
    from cupyrope.core.mla import plan_mla
    from cupyrope.cuda.mla_launch import plan_mla_launch

    bf16 = np_dtype("bfloat16")
    T, nope, row = 4, 128, RANK + ROPE
    q = np.zeros((T, 16, nope + ROPE), bf16)
    k_pe, kv_c = np.zeros((T, 1, ROPE), bf16), np.zeros((T, RANK), bf16)
    plan = plan_mla("mla_rope_and_cache", q[..., :nope], q[..., nope:], None, k_pe,
                    np.arange(T), rope=dict(cos_sin_cache=deepseek_cache), kv_c=kv_c,
                    kv_cache=np.zeros((2, 4, row), bf16), slot_mapping=np.arange(T, dtype=np.int32))
    outs = [describe(np.empty(x.shape, bf16), "out") for x in (q[..., :nope], q[..., nope:])]
    outs += [None, describe(np.empty_like(k_pe), "out")]

    def spec_of(plan):
        return plan_mla_launch(plan, outs)[0]

    assert not spec_of(plan).wide_index
    assert spec_of(plan).name_expression.endswith(", 0, false>")
    blocks = -(-2**30 // (4 * row))  # a cache of this many blocks reaches past 2^30 elements
    for n, wide in ((blocks - 1, False), (blocks, True)):
        cache = dataclasses.replace(plan.kv_cache, shape=(n, 4, row))
        assert spec_of(dataclasses.replace(plan, kv_cache=cache)).wide_index == wide, n
    far = dataclasses.replace(plan.rope.q, strides=(2**30 // (T - 1) + 1, *plan.rope.q.strides[1:]))
    assert spec_of(dataclasses.replace(plan, rope=dataclasses.replace(plan.rope, q=far))).wide_index


def test_launch_refuses_tokens_past_32_bit_items(deepseek_cache):
    """The kernel counts a token's items in 32 bits: a token of more elements is refused before
    launch (2^24 heads of broadcast memory: nothing allocated)."""
    from cupyrope.core.arrays import describe
    from cupyrope.core.mla import plan_mla
    from cupyrope.cuda.mla_launch import TOKEN_ELEMENTS_MAX, plan_mla_launch

    heads, nope = 2**24, 128
    bf16 = np_dtype("bfloat16")
    one_head = np.zeros(nope + ROPE, bf16)
    q = np.lib.stride_tricks.as_strided(one_head, (1, heads, nope + ROPE), (0, 0, 2))
    k_pe, kv_c = np.zeros((1, 1, ROPE), bf16), np.zeros((1, RANK), bf16)
    plan = plan_mla("mla_rope_and_cache", q[..., :nope], q[..., nope:], None, k_pe, np.arange(1),
                    rope=dict(cos_sin_cache=deepseek_cache), kv_c=kv_c,
                    kv_cache=np.zeros((2, 4, RANK + ROPE), bf16),
                    slot_mapping=np.zeros(1, np.int32))
    outs = [describe(np.lib.stride_tricks.as_strided(one_head, x.shape, (0, 0, 2)), "out")
            for x in (q[..., :nope], q[..., nope:])]
    elements = heads * (nope + ROPE) + ROPE + (RANK + ROPE)
    assert elements > TOKEN_ELEMENTS_MAX
    with pytest.raises(ValueError, match=f"one token's q, k and cache row hold {elements} "
                                         "elements, more than the kernel's 2147483647; split the "
                                         "heads over several calls"):
        plan_mla_launch(plan, [*outs, None, describe(np.empty_like(k_pe), "out")])


# --- GPU: one launch (kernels_cu/mla.cuh) against the float64 reference and the NumPy path ---

def _to_device(framework: str, host: np.ndarray):
    """A host array on the GPU: CuPy (fp8 and bfloat16 as their bits' dtype), or torch CUDA."""
    if framework == "cupy":
        import cupy

        if host.dtype.name.startswith("float8"):
            return cupy.asarray(host.view(np.uint8))
        if host.dtype == np_dtype("bfloat16"):
            return cupy.asarray(host.view(np.uint16)).view(host.dtype)
        return cupy.asarray(host)
    import torch

    if host.dtype.name.startswith("float8"):
        return torch.from_numpy(host.view(np.uint8)).cuda().view(getattr(torch, host.dtype.name))
    if host.dtype == np_dtype("bfloat16"):
        return torch.from_numpy(host.view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(host).cuda()


def _to_host(x, fmt=None) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        import torch

        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(np_dtype("bfloat16"))
        if str(x.dtype).startswith("torch.float8"):
            return x.view(torch.uint8).numpy().view(np_dtype(str(x.dtype)[6:]))
        return x.numpy()
    host = x.get()
    if fmt is not None and host.dtype == np.uint8:
        return host.view(np_dtype(fmt))
    return host


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("fmt", [None, "float8_e4m3fn"])
@pytest.mark.parametrize("cache_fmt", [None, "float8_e4m3fn"])
@pytest.mark.parametrize("source", ["table", "computed"])
@pytest.mark.parametrize("joint", [True, False])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gpu_one_launch_matches_the_reference(rng, randn, deepseek_cache, framework, head,
                                              interleaved, fmt, cache_fmt, source, joint, dtype):
    _check_one_launch(rng, randn, deepseek_cache, framework, head, interleaved, fmt, cache_fmt,
                      source, joint, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("cache_fmt", [None, "float8_e4m3fn"])
@pytest.mark.parametrize("source", ["table", "computed"])
@pytest.mark.parametrize("block", ["split", 64, 96, 128])
@pytest.mark.parametrize("offsets", [32, 64])
def test_gpu_blocks_of_a_token_match_the_reference(monkeypatch, rng, randn, deepseek_cache,
                                                  framework, interleaved, cache_fmt, source,
                                                  block, offsets):
    """301 tokens (skipped slots among them), each a block of 64, 96 or 128 threads (a token's
    items in five, four or three rounds), or each token's items over several blocks (the decode
    steps' grid): forced by a GPU of many SMs, or of one, as the launch sees it; with 32-bit
    element offsets, or 64-bit ones (the kernel of arrays past 2^30 elements, forced)."""
    from cupyrope.cuda import mla_launch

    if offsets == 64:
        monkeypatch.setattr(mla_launch, "INDEX32_LIMIT", 1)
    split = block == "split"
    monkeypatch.setattr(mla_launch, "_multiprocessors", lambda device: 10**6 if split else 1)
    if not split:
        monkeypatch.setattr(mla_launch, "BLOCK_THROUGHPUT", ((block, 1.0),))
        monkeypatch.setattr(mla_launch, "BLOCK_THROUGHPUT_32_REGISTERS", ((block, 1.0),))
    _check_one_launch(rng, randn, deepseek_cache, framework, (128, 64), interleaved,
                      "float8_e4m3fn", cache_fmt, source, True, "bfloat16", tokens=301)


def _check_one_launch(rng, randn, deepseek_cache, framework, head, interleaved, fmt, cache_fmt,
                      source, joint, dtype, tokens=37):
    if framework == "torch":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch has no CUDA here")
    nope, _ = head
    T, H, block_size = tokens, 16, 4
    blocks = max(16, -(-T * 5 // 4) // block_size)
    q = randn((T, H, nope + ROPE), dtype)
    k_pe, kv_c = randn((T, ROPE), dtype), randn((T, RANK), dtype)
    positions = rng.integers(0, MAX_POSITION, T)
    slots = rng.permutation(blocks * block_size)[:T].astype(np.int64)
    slots[[0, 5]] = -1
    cache = _poisoned_cache(dtype, blocks, block_size, cache_fmt)
    before = cache.copy()
    dev = lambda a: _to_device(framework, a)  # noqa: E731
    angles = (dict(cos_sin_cache=dev(deepseek_cache)) if source == "table"
              else dict(scaling=DEEPSEEK_V3))
    options = dict(interleaved=interleaved, **angles)
    if cache_fmt is not None:
        options["kv_scale"] = 0.25
        if framework == "cupy":
            options["cache_dtype"] = cache_fmt
    if fmt is not None:
        options.update(out_dtype=fmt, q_scale=0.5, k_scale=2.0)
    qd = dev(q)
    q_in = qd if joint else (qd[..., :nope], qd[..., nope:])
    cache_d = dev(cache)
    q_out, k_out, _ = cr.mla_rope_and_cache(q_in, dev(k_pe), dev(kv_c), dev(positions), cache_d,
                                            dev(slots), **options)
    q_out = (_to_host(q_out, fmt) if joint
             else np.concatenate([_to_host(q_out[0], fmt), _to_host(q_out[1], fmt)], axis=-1))
    k_out = _to_host(k_out, fmt)
    cache_host = _to_host(cache_d, cache_fmt)
    assert_bits_equal(_to_host(qd), q, what="q after an out-of-place call")
    if source == "table":
        exact = lambda x: exact_rope(x, positions, deepseek_cache, interleaved)  # noqa: E731
        max_angle = 0.0
    else:
        inv_freq, factor = cr.rope_frequencies(ROPE, scaling=DEEPSEEK_V3)
        exact = lambda x: reference_rope(x, positions, inv_freq=inv_freq,  # noqa: E731
                                         attention_factor=factor, interleaved=interleaved)
        max_angle = float(positions.max() * inv_freq.max())
    q_exact, k_exact = exact(q[..., nope:]), exact(k_pe[:, None, :])
    if fmt is None:
        assert_rope_close(q_out[..., nope:], q_exact, q[..., nope:], interleaved=interleaved,
                          rotary_dim=ROPE, max_angle=max_angle)
        assert_bits_equal(q_out[..., :nope], q[..., :nope], what="q nope part")
        assert_rope_close(k_out[:, None, :], k_exact, k_pe[:, None, :], interleaved=interleaved,
                          rotary_dim=ROPE, max_angle=max_angle)
    else:
        assert_fp8_close(q_out[..., nope:], q_exact / 0.5, "q rope part")
        assert_fp8_close(q_out[..., :nope], q[..., :nope].astype(np.float64) / 0.5, "q nope part")
        assert_fp8_close(k_out[:, None, :], k_exact / 2.0, "k_pe out")
    written = slots >= 0
    b, r = slots[written] // block_size, slots[written] % block_size
    untouched = np.ones((blocks, block_size), bool)
    untouched[b, r] = False
    assert_bits_equal(cache_host.view(np.uint8)[untouched], before.view(np.uint8)[untouched],
                      what="rows of skipped slots")
    rows = cache_host[b, r]
    if cache_fmt is None:
        assert_bits_equal(rows[:, :RANK], kv_c[written], what="cached kv_c")
        assert_rope_close(rows[:, None, RANK:], k_exact[written], k_pe[written][:, None, :],
                          interleaved=interleaved, rotary_dim=ROPE, max_angle=max_angle)
    else:
        assert_fp8_close(rows[:, :RANK], kv_c[written].astype(np.float64) / 0.25, "kv_c")
        assert_fp8_close(rows[:, RANK:], k_exact[written][:, 0] / 0.25, "cached k_pe")


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("with_k_nope", [False, True])
def test_gpu_rope_quantize_separate_parts_match_numpy(rng, randn, deepseek_cache, interleaved,
                                                      with_k_nope):
    """FlashInfer's layout on CuPy, odd widths included (the element-wise kernel), against the
    NumPy path: passed-through parts bit for bit, fp8 rotated parts within an fp8 rounding."""
    T, H, nope, fmt = 23, 8, 130, "float8_e5m2"
    q_pe, q_nope = randn((T, H, ROPE), "float16"), randn((T, H, nope), "float16")
    k_pe = randn((T, ROPE), "float16")
    k_nope = randn((T, 1, nope), "float16") if with_k_nope else None
    positions = rng.integers(0, MAX_POSITION, T)
    options = dict(cos_sin_cache=deepseek_cache, interleaved=interleaved, out_dtype=fmt,
                   q_scale=0.5, k_scale=4.0)
    expected = cr.mla_rope_quantize(q_pe, k_pe, q_nope, k_nope, positions, **options)
    dev = lambda a: None if a is None else _to_device("cupy", a)  # noqa: E731
    options["cos_sin_cache"] = dev(deepseek_cache)
    got = cr.mla_rope_quantize(dev(q_pe), dev(k_pe), dev(q_nope), dev(k_nope), dev(positions),
                               **options)
    for name, g, e in zip(("q_pe", "k_pe", "q_nope", "k_nope"), got, expected):
        if e is None:
            assert g is None
            continue
        g = _to_host(g, fmt)
        if "nope" in name:
            assert_bits_equal(g.view(np.uint8), e.view(np.uint8), what=name)
        else:
            ulp_apart = np.abs(g.view(np.uint8).astype(int) - e.view(np.uint8).astype(int))
            assert ulp_apart.max() <= 1, name


@pytest.mark.gpu
def test_gpu_vllm_concat_and_cache_mla_is_exact():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    from cupyrope.compat.vllm import concat_and_cache_mla

    gen = torch.Generator(device="cuda").manual_seed(0)
    T, n = 40, 33
    kv_c = torch.randn(T, RANK, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_pe = torch.randn(T, 1, ROPE, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_pe[3, 0, 1] = float("inf")  # copied exactly: no rotation touches it
    slots = torch.randperm(8 * 16, device="cuda", generator=gen)[:n]
    slots[4] = -1
    for kv_cache_dtype, dtype in (("auto", torch.bfloat16), ("fp8", torch.uint8)):
        cache = torch.zeros(8, 16, RANK + ROPE, device="cuda", dtype=dtype)
        concat_and_cache_mla(kv_c, k_pe, cache, slots, kv_cache_dtype, torch.tensor([0.5],
                                                                                    device="cuda"))
        entries = torch.cat([kv_c, k_pe[:, 0]], dim=-1)[:n]
        if dtype == torch.uint8:
            entries = (entries.float() / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn)
            entries = entries.view(torch.uint8)
        valid = slots >= 0
        flat = cache.view(-1, RANK + ROPE)
        assert torch.equal(flat[slots[valid]], entries[valid])
        mask = torch.ones(flat.shape[0], dtype=torch.bool, device="cuda")
        mask[slots[valid]] = False
        assert not flat[mask].any()


@pytest.mark.parametrize("joint", [True, False])
@pytest.mark.parametrize("fmt", [None, "float8_e4m3fn"])
def test_torch_compile_traces_the_operator(rng, randn, deepseek_cache, joint, fmt):
    """torch.compile (fullgraph) of a model step calling mla_rope_and_cache: the
    ``cupyrope::mla_rope_and_cache`` operator, the same bits as the eager call, the cache
    written through the declared mutation."""
    torch = pytest.importorskip("torch")
    T, H, nope = 6, 4, 128
    q = torch.from_numpy(randn((T, H, nope + ROPE), "float32")).bfloat16()
    k_pe = torch.from_numpy(randn((T, ROPE), "float32")).bfloat16()
    kv_c = torch.from_numpy(randn((T, RANK), "float32")).bfloat16()
    positions = torch.from_numpy(rng.integers(0, MAX_POSITION, T))
    slots = torch.tensor([3, -1, 0, 7, 5, 6])
    table = torch.from_numpy(deepseek_cache)
    options = {} if fmt is None else dict(out_dtype=fmt, q_scale=0.5)

    def step(q, k_pe, kv_c, positions, cache, slots):
        q_in = q if joint else (q[..., :nope], q[..., nope:])
        q_out, k_out, cache = cr.mla_rope_and_cache(q_in, k_pe, kv_c, positions, cache, slots,
                                                    cos_sin_cache=table, **options)
        q_out = q_out if joint else torch.cat(q_out, dim=-1)
        return q_out, k_out

    caches = [torch.full((2, 4, RANK + ROPE), POISON).bfloat16() for _ in range(2)]
    eager = step(q, k_pe, kv_c, positions, caches[0], slots)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    traced = compiled(q, k_pe, kv_c, positions, caches[1], slots)
    assert hasattr(torch.ops.cupyrope, "mla_rope_and_cache")  # fullgraph: traced through it
    for a, b in zip((*eager, caches[0]), (*traced, caches[1])):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b)
    assert not torch.equal(caches[1], torch.full_like(caches[1], POISON))


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("nope", [128, 130])  # 16-byte accesses, and the element-wise kernel
def test_gpu_in_place_with_cache_matches_numpy(rng, randn, deepseek_cache, framework,
                                               interleaved, nope):
    """In place, the k_pe rows rotated in place and cached by one launch: the cache holds k_pe
    rotated once (never the rotation of an already rotated row), as on the NumPy path."""
    if framework == "torch":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch has no CUDA here")
    T, H = 29, 8
    q = randn((T, H, nope + ROPE), "bfloat16")
    k_pe, kv_c = randn((T, ROPE), "bfloat16"), randn((T, RANK), "bfloat16")
    positions = rng.integers(1, MAX_POSITION, T)
    slots = np.arange(T, dtype=np.int64)[::-1].copy()
    host = [q.copy(), k_pe.copy(), _poisoned_cache("bfloat16", 8, 4)]
    cr.mla_rope_and_cache(host[0], host[1], kv_c, positions, host[2], slots,
                          cos_sin_cache=deepseek_cache, interleaved=interleaved, inplace=True)
    dev = lambda a: _to_device(framework, a)  # noqa: E731
    got = [dev(q), dev(k_pe), dev(_poisoned_cache("bfloat16", 8, 4))]
    cr.mla_rope_and_cache(got[0], got[1], dev(kv_c), dev(positions), got[2], dev(slots),
                          cos_sin_cache=dev(deepseek_cache), interleaved=interleaved,
                          inplace=True)
    got = [_to_host(x) for x in got]
    assert_bits_equal(got[0][..., :nope], q[..., :nope], what="nope part in place")
    assert_bits_equal(got[2][..., :RANK], host[2][..., :RANK], what="cached kv_c")
    for g, h, x, what in ((got[0][..., nope:], host[0][..., nope:], q[..., nope:], "q_pe"),
                          (got[1][:, None], host[1][:, None], k_pe[:, None], "k_pe"),
                          (got[2].reshape(-1, RANK + ROPE)[slots][:, None, RANK:],
                           host[2].reshape(-1, RANK + ROPE)[slots][:, None, RANK:],
                           k_pe[:, None], "cached k_pe")):
        exact = exact_rope(x, positions, deepseek_cache, interleaved)
        assert_rope_close(g, exact, x, interleaved=interleaved, rotary_dim=ROPE)
        assert_rope_close(h, exact, x, interleaved=interleaved, rotary_dim=ROPE)


# --- Two caches: kv_c rows in kv_cache, the rotated k_pe in kpe_cache (FlashInfer's layout) ---

def _split_caches(dtype, blocks, block_size, fmt, as_views: bool):
    """Poisoned ``(kv_cache [.., RANK], kpe_cache [.., ROPE])``: two arrays, or the two slices of
    one joint cache (rows of RANK + ROPE entries apart)."""
    joint = _poisoned_cache(dtype, blocks, block_size, fmt)
    if as_views:
        return joint[..., :RANK], joint[..., RANK:]
    return joint[..., :RANK].copy(), joint[..., RANK:].copy()


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("cache_fmt", [None, "float8_e4m3fn", "uint8-e5m2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("as_views", [False, True])
def test_two_caches_hold_the_joint_rows(rng, randn, deepseek_cache, interleaved, cache_fmt,
                                        dtype, as_views):
    """kv_cache [.., kv_lora_rank] and kpe_cache [.., rope_dim] get, slot for slot, the two
    parts of the joint cache's rows (the same bits), and q / k_pe outputs are unchanged."""
    T, H, nope, blocks, block_size = 11, 4, 128, 6, 4
    q = randn((T, H, nope + ROPE), dtype)
    k_pe, kv_c = randn((T, ROPE), dtype), randn((T, RANK), dtype)
    positions = rng.integers(0, MAX_POSITION, T)
    slots = rng.permutation(blocks * block_size)[:T].astype(np.int64)
    slots[[1, 6]] = -1
    slots[3] = blocks * block_size  # past the cache: skipped
    fp8 = None if cache_fmt is None else cache_fmt.replace("uint8-e5m2", "float8_e5m2")
    options = dict(cos_sin_cache=deepseek_cache, interleaved=interleaved,
                   out_dtype="float8_e4m3fn", q_scale=0.5, k_scale=2.0)
    if fp8 is not None:
        options["kv_scale"] = 0.25
    if cache_fmt == "uint8-e5m2":
        options["cache_dtype"] = fp8
    joint = _poisoned_cache(dtype, blocks, block_size, fp8)
    ckv, kpe = _split_caches(dtype, blocks, block_size, fp8, as_views)
    if cache_fmt == "uint8-e5m2":
        joint, ckv, kpe = joint.view(np.uint8), ckv.view(np.uint8), kpe.view(np.uint8)
    expected = cr.mla_rope_and_cache(q, k_pe, kv_c, positions, joint, slots, **options)
    got = cr.mla_rope_and_cache(q, k_pe, kv_c, positions, ckv, slots, kpe_cache=kpe,
                                **options)
    assert got[2] is ckv
    for g, e, what in ((got[0], expected[0], "q_out"), (got[1], expected[1], "k_pe_out"),
                       (ckv, joint[..., :RANK], "kv_cache"), (kpe, joint[..., RANK:],
                                                              "kpe_cache")):
        assert_bits_equal(np.ascontiguousarray(g).view(np.uint8),
                          np.ascontiguousarray(e).view(np.uint8), what=what)
    written = (slots >= 0) & (slots < blocks * block_size)
    stored = kpe.view(np_dtype(fp8)) if cache_fmt == "uint8-e5m2" else kpe
    rows = stored.reshape(-1, ROPE)[slots[written]] if not as_views else \
        stored[slots[written] // block_size, slots[written] % block_size]
    k_exact = exact_rope(k_pe[:, None, :], positions, deepseek_cache, interleaved)[:, 0]
    if fp8 is None:
        assert_rope_close(rows[:, None], k_exact[written][:, None], k_pe[written][:, None],
                          interleaved=interleaved, rotary_dim=ROPE)
    else:
        assert_fp8_close(rows, k_exact[written] / 0.25, "kpe_cache rows")


def test_two_caches_on_the_latent_cache_write(randn):
    """latent_cache_write (no rotation) into two caches: kv_c and k_pe as they are."""
    T = 6
    kv_c, k_pe = randn((T, RANK), "bfloat16"), randn((T, ROPE), "bfloat16")
    ckv, kpe = _split_caches("bfloat16", 3, 4, None, False)
    slots = np.array([5, -1, 0, 11, 2, 7])
    from cupyrope.mla import latent_cache_write

    latent_cache_write(kv_c, k_pe, ckv, slots, kpe_cache=kpe)
    flat_ckv, flat_kpe = ckv.reshape(-1, RANK), kpe.reshape(-1, ROPE)
    written = slots >= 0
    assert_bits_equal(flat_ckv[slots[written]], kv_c[written], what="kv_c rows")
    assert_bits_equal(flat_kpe[slots[written]], k_pe[written], what="k_pe rows")
    others = np.setdiff1d(np.arange(12), slots[written])
    assert (flat_ckv[others].astype(np.float32) == POISON).all()
    assert (flat_kpe[others].astype(np.float32) == POISON).all()


@pytest.mark.parametrize("case, error, message", [
    ("joint_width", ValueError, r"with a kpe_cache, kv_cache must be \[num_blocks, block_size, "
                                r"kv_lora_rank = 512\], got shape \(6, 4, 576\)"),
    ("kpe_width", ValueError, r"kpe_cache must be \[num_blocks, block_size, rope_dim\] = "
                              r"\(6, 4, 64\).*got shape \(6, 4, 32\)"),
    ("kpe_blocks", ValueError, r"kpe_cache must be .*\(6, 4, 64\).*got shape \(5, 4, 64\)"),
    ("kpe_dtype", TypeError, "kpe_cache must have kv_cache's dtype bfloat16, got float32"),
    ("kpe_stride", ValueError, "kpe_cache's last dim must have stride 1"),
    ("kpe_read_only", ValueError, "kpe_cache is read-only"),
    ("kpe_overlaps", ValueError, "kpe_cache shares memory with kv_cache"),
    ("kpe_is_k_pe", ValueError, "kpe_cache shares memory with k_pe"),
    ("kpe_torch", TypeError, "kpe_cache must be the array type and device of q"),
])
def test_two_cache_refusals_write_nothing(rng, randn, case, error, message):
    case_args = _mla_case(randn, rng)
    ckv, kpe = _split_caches("bfloat16", 6, 4, None, False)
    if case == "joint_width":
        ckv = case_args["kv_cache"]
    elif case == "kpe_width":
        kpe = kpe[..., :32]
    elif case == "kpe_blocks":
        kpe = kpe[:5]
    elif case == "kpe_dtype":
        kpe = kpe.astype(np.float32)
    elif case == "kpe_stride":
        kpe = np.repeat(kpe, 2, axis=-1)[..., ::2]
    elif case == "kpe_read_only":
        kpe.flags.writeable = False
    elif case == "kpe_overlaps":
        kpe = ckv[..., 100:100 + ROPE]
    elif case == "kpe_is_k_pe":
        kpe = np.resize(case_args["k_pe"], (6, 4, ROPE))
        case_args["k_pe"] = kpe.reshape(-1, ROPE)[:5]
    elif case == "kpe_torch":
        torch = pytest.importorskip("torch")
        kpe = torch.from_numpy(kpe.view(np.int16)).view(torch.bfloat16)
    def bits(x):
        return _to_host(x) if type(x).__module__.startswith("torch") else x

    before = [ckv.copy(), bits(kpe).copy()]
    with pytest.raises(error, match=message) as raised:
        cr.mla_rope_and_cache(case_args["q"], case_args["k_pe"], case_args["kv_c"],
                              case_args["positions"], ckv, case_args["slot_mapping"],
                              kpe_cache=kpe)
    assert str(raised.value).startswith("mla_rope_and_cache: ")
    assert_bits_equal(ckv, before[0], what="kv_cache after a refused call")
    assert_bits_equal(bits(kpe), before[1], what="kpe_cache after a refused call")


def test_launch_parameters_of_two_caches(rng, randn, deepseek_cache):
    """kpe_cache's pointer and strides in MlaParams; 16-byte accesses only where its rows and
    pointer are aligned too."""
    from cupyrope.core.arrays import describe
    from cupyrope.core.mla import plan_mla
    from cupyrope.cuda.mla_launch import plan_mla_launch

    T, H, nope = 5, 4, 128
    q = randn((T, H, nope + ROPE), "bfloat16")
    k_pe, kv_c = randn((T, 1, ROPE), "bfloat16"), randn((T, RANK), "bfloat16")
    slots = np.arange(T, dtype=np.int32)

    def launch(ckv, kpe):
        plan = plan_mla("mla_rope_and_cache", q[..., :nope], q[..., nope:], None, k_pe,
                        np.arange(T), rope=dict(cos_sin_cache=deepseek_cache), kv_c=kv_c,
                        kv_cache=ckv, slot_mapping=slots, kv_scale=0.5, kpe_cache=kpe)
        outs = [describe(np.empty(x.shape, np_dtype("bfloat16")), "out")
                for x in (q[..., :nope], q[..., nope:])]
        return plan_mla_launch(plan, [*outs, None, describe(np.empty_like(k_pe), "out")])

    ckv, kpe = _split_caches("bfloat16", 3, 4, "float8_e4m3fn", False)
    spec, p = launch(ckv, kpe)
    assert spec.vector
    assert int(p["kv_cache"]) == ckv.ctypes.data and int(p["kpe_cache"]) == kpe.ctypes.data
    assert (int(p["cache_block_stride"]), int(p["cache_row_stride"])) == (4 * RANK, RANK)
    assert (int(p["kpe_block_stride"]), int(p["kpe_row_stride"])) == (4 * ROPE, ROPE)
    assert (int(p["num_slots"]), int(p["block_size"]), int(p["rank"])) == (12, 4, RANK)
    wide = np.full((3, 4, ROPE + 1), POISON, np.float32).astype(np_dtype("float8_e4m3fn"))
    assert not launch(ckv, wide[..., :ROPE])[0].vector  # rows 65 entries apart


@pytest.mark.parametrize("fmt", [None, "float8_e4m3fn"])
def test_torch_compile_traces_two_caches(rng, randn, deepseek_cache, fmt):
    """torch.compile (fullgraph) with kpe_cache: both caches written through the operator's
    declared mutations, the same bits as the eager call."""
    torch = pytest.importorskip("torch")
    T, H, nope = 6, 4, 128
    q = torch.from_numpy(randn((T, H, nope + ROPE), "float32")).bfloat16()
    k_pe = torch.from_numpy(randn((T, ROPE), "float32")).bfloat16()
    kv_c = torch.from_numpy(randn((T, RANK), "float32")).bfloat16()
    positions = torch.from_numpy(rng.integers(0, MAX_POSITION, T))
    slots = torch.tensor([3, -1, 0, 7, 5, 6])
    table = torch.from_numpy(deepseek_cache)
    options = {} if fmt is None else dict(out_dtype=fmt, q_scale=0.5)

    def step(q, k_pe, kv_c, positions, ckv, kpe, slots):
        q_out, k_out, _ = cr.mla_rope_and_cache(q, k_pe, kv_c, positions, ckv, slots,
                                                cos_sin_cache=table, kpe_cache=kpe, **options)
        return q_out, k_out

    caches = [(torch.full((2, 4, RANK), POISON).bfloat16(),
               torch.full((2, 4, ROPE), POISON).bfloat16()) for _ in range(2)]
    eager = step(q, k_pe, kv_c, positions, *caches[0], slots)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    traced = compiled(q, k_pe, kv_c, positions, *caches[1], slots)
    for a, b in zip((*eager, *caches[0]), (*traced, *caches[1])):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b)
    for cache in caches[1]:
        assert not torch.equal(cache, torch.full_like(cache, POISON))


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("cache_fmt", [None, "float8_e4m3fn"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kpe_rows", [ROPE, ROPE + 1])  # 16-byte accesses, element-wise kernel
def test_gpu_two_caches_match_the_joint_cache(rng, randn, deepseek_cache, framework,
                                              interleaved, cache_fmt, dtype, kpe_rows):
    """One launch into two caches on the GPU: the same bits as the joint cache's rows (aligned
    rows: the same vector kernel), within the rope / fp8 bounds of the reference otherwise; rows
    of skipped slots keep their poison."""
    if framework == "torch":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch has no CUDA here")
    T, H, nope, blocks, block_size = 37, 16, 128, 16, 4
    q = randn((T, H, nope + ROPE), dtype)
    k_pe, kv_c = randn((T, ROPE), dtype), randn((T, RANK), dtype)
    positions = rng.integers(0, MAX_POSITION, T)
    slots = rng.permutation(blocks * block_size)[:T].astype(np.int64)
    slots[[0, 5]] = -1
    dev = lambda a: _to_device(framework, a)  # noqa: E731
    options = dict(cos_sin_cache=dev(deepseek_cache), interleaved=interleaved)
    if cache_fmt is not None:
        options["kv_scale"] = 0.25
        if framework == "cupy":
            options["cache_dtype"] = cache_fmt
    joint = dev(_poisoned_cache(dtype, blocks, block_size, cache_fmt))
    ckv_host, _ = _split_caches(dtype, blocks, block_size, cache_fmt, False)
    kpe_wide = np.full((blocks, block_size, kpe_rows), POISON, np.float32).astype(
        np_dtype(cache_fmt or dtype))
    ckv, kpe_d = dev(ckv_host), dev(kpe_wide)
    kpe = kpe_d[..., :ROPE]
    args = (dev(q), dev(k_pe), dev(kv_c), dev(positions))
    expected = cr.mla_rope_and_cache(*args, joint, dev(slots), **options)
    got = cr.mla_rope_and_cache(*args, ckv, dev(slots), kpe_cache=kpe, **options)
    joint_host = _to_host(joint, cache_fmt)
    ckv_got, kpe_got = _to_host(ckv, cache_fmt), _to_host(kpe_d, cache_fmt)
    assert_bits_equal(ckv_got.view(np.uint8), np.ascontiguousarray(
        joint_host[..., :RANK]).view(np.uint8), what="kv_cache")
    if kpe_rows > ROPE:
        assert (kpe_got[..., ROPE:].astype(np.float32) == POISON).all(), "past kpe_cache's rows"
    kpe_got = np.ascontiguousarray(kpe_got[..., :ROPE])
    written = slots >= 0
    b, r = slots[written] // block_size, slots[written] % block_size
    untouched = np.ones((blocks, block_size), bool)
    untouched[b, r] = False
    assert (kpe_got[untouched].astype(np.float32) == POISON).all(), "rows of skipped slots"
    if kpe_rows == ROPE:
        assert_bits_equal(kpe_got.view(np.uint8), np.ascontiguousarray(
            joint_host[..., RANK:]).view(np.uint8), what="kpe_cache")
        for g, e in zip(got[:2], expected[:2]):
            assert_bits_equal(_to_host(g), _to_host(e), what="q / k_pe outputs")
    k_exact = exact_rope(k_pe[:, None, :], positions, deepseek_cache, interleaved)[written]
    if cache_fmt is None:
        assert_rope_close(kpe_got[b, r][:, None], k_exact, k_pe[written][:, None],
                          interleaved=interleaved, rotary_dim=ROPE)
    else:
        assert_fp8_close(kpe_got[b, r], k_exact[:, 0] / 0.25, "kpe_cache rows")
