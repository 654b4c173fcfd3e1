"""cupyrope.compat's adapters of FlashInfer's plain RoPE calls (flashinfer/rope.py) against a
float64 reference written here from FlashInfer's documented semantics (torch CPU; the torch-cuda
variants are marked gpu):

- ``apply_rope`` / ``apply_llama31_rope`` and their ``_inplace`` twins: ragged batches, token ``i``
  of request ``b`` at position ``offsets[b] + (i - indptr[b])``;
- the ``_pos_ids`` forms: one position per token;
- ``rope_scale`` divides every frequency (FlashInfer's kernel multiplies by ``1 / rope_scale``);
  Llama 3.1: ``f -> (1 - s) f / rope_scale + s f`` with
  ``s = clip((old_context_len * f / (2 pi) - low) / (high - low), 0, 1)`` (include/flashinfer/
  pos_enc.cuh), checked against cupyrope's ``llama3`` schedule as well;
- ``interleave=True`` pairs dims ``2j`` and ``2j + 1``, False ``j`` and ``j + rotary_dim // 2``;
- ``apply_rope_with_cos_sin_cache``: flat ``[nnz, H * head_size]`` in, the same shapes out.

Out of place leaves the inputs bit for bit as they were; in place returns None and writes q and k,
and nothing next to them (v of a fused qkv buffer). Every refusal leaves q and k untouched.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupyrope as cr  # noqa: E402
from backends import Backend, backend_params  # noqa: E402
from cupyrope import compat  # noqa: E402
from cupyrope.compat import flashinfer  # noqa: E402
from reference import reference_inv_freq, reference_rope  # noqa: E402
from test_fused_mla import FP8 as FP8_FORMATS  # noqa: E402
from test_fused_mla import assert_fp8_close, host_values, put_fp8  # noqa: E402
from tolerances import assert_bits_equal, assert_rope_close, max_abs_angle, np_dtype  # noqa: E402

TORCH = backend_params(["torch", "torch-cuda"])
HQ, HK, D = 4, 2, 64
# Five requests, one of no token; the offsets far apart (a long context among short ones).
LENGTHS = [3, 0, 5, 1, 4]
OFFSETS = [7, 50, 0, 100_003, 2_000]
LLAMA31 = dict(rope_scale=8.0, rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0,
               old_context_len=8192)


@pytest.fixture
def launches(monkeypatch):
    """The positions of every cupyrope launch the adapters make (one per call expected)."""
    seen = []

    def counting(q, k, positions, **kwargs):
        seen.append(positions)
        return cr.apply_rope(q, k, positions, **kwargs)

    monkeypatch.setattr(flashinfer, "cupyrope_apply_rope", counting)
    return seen


def ragged_positions(lengths, offsets) -> np.ndarray:
    """FlashInfer's ragged positions, token by token."""
    return np.array([offsets[b] + i for b, n in enumerate(lengths) for i in range(n)],
                    dtype=np.int64)


def llama31_inv_freq(rotary_dim, rope_scale, rope_theta, low_freq_factor, high_freq_factor,
                     old_context_len) -> np.ndarray:
    """Llama 3.1 frequencies as FlashInfer's kernel writes them (one clamped blend), in float64."""
    f = reference_inv_freq(rotary_dim, rope_theta)
    smooth = np.clip((old_context_len * f / (2 * math.pi) - low_freq_factor)
                     / (high_freq_factor - low_freq_factor), 0.0, 1.0)
    return (1 - smooth) * f / rope_scale + smooth * f


def fused_qk(backend, randn, nnz, dtype):
    """q ``(nnz, HQ, D)`` and k ``(nnz, HK, D)`` as views of one fused qkv buffer (v after them)."""
    qkv = backend.put(randn((nnz, (HQ + 2 * HK) * D), dtype))
    q = qkv[:, :HQ * D].unflatten(-1, (HQ, D))
    k = qkv[:, HQ * D:(HQ + HK) * D].unflatten(-1, (HK, D))
    return qkv, q, k


def check_rotation(backend, call, qkv, q, k, *, inplace, interleave, rotary_dim, inv_freq,
                   positions):
    """Run ``call()`` and check it against the float64 reference and the in/out-of-place
    contract."""
    before = backend.get(qkv).copy()
    q0, k0 = backend.get(q).copy(), backend.get(k).copy()
    result = call()
    if inplace:
        assert result is None
        outs = (q, k)
        assert_bits_equal(backend.get(qkv)[:, (HQ + HK) * D:], before[:, (HQ + HK) * D:],
                          what="v next to q and k")
    else:
        assert isinstance(result, tuple) and len(result) == 2
        outs = result
        assert_bits_equal(backend.get(qkv), before, what="inputs after an out-of-place call")
        for out, x in zip(outs, (q, k)):
            assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
            assert out.data_ptr() != x.data_ptr()
    r = D if rotary_dim is None else rotary_dim
    for out, x0 in zip(outs, (q0, k0)):
        ref = reference_rope(x0, positions, inv_freq=inv_freq, interleaved=interleave,
                             rotary_dim=r)
        assert_rope_close(backend.get(out), ref, x0, interleaved=interleave, rotary_dim=r,
                          max_angle=max_abs_angle(positions, inv_freq))


# ----------------------------------------------------------------------------------------------
# apply_rope / apply_rope_pos_ids and their in-place twins


@pytest.mark.parametrize("backend", TORCH, indirect=True)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 32])
@pytest.mark.parametrize("rope_scale", [1, 2.5])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_apply_rope_ragged(backend, randn, launches, dtype, interleave, rotary_dim, rope_scale,
                           inplace, index_dtype):
    indptr = backend.put(np.cumsum([0, *LENGTHS]).astype(index_dtype))
    offsets = backend.put(np.array(OFFSETS, dtype=index_dtype))
    positions = ragged_positions(LENGTHS, OFFSETS)
    qkv, q, k = fused_qk(backend, randn, len(positions), dtype)
    fn = compat.apply_rope_inplace if inplace else compat.apply_rope
    check_rotation(backend, lambda: fn(q, k, indptr, offsets, rotary_dim, interleave, rope_scale,
                                       500.0),
                   qkv, q, k, inplace=inplace, interleave=interleave, rotary_dim=rotary_dim,
                   inv_freq=reference_inv_freq(rotary_dim or D, 500.0, rope_scale),
                   positions=positions)
    assert len(launches) == 1
    np.testing.assert_array_equal(launches[0].cpu().numpy(), positions)


@pytest.mark.parametrize("backend", TORCH, indirect=True)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 48])
@pytest.mark.parametrize("rope_scale", [1, 0.5, 4])
@pytest.mark.parametrize("inplace", [False, True])
def test_apply_rope_pos_ids(backend, rng, randn, launches, dtype, interleave, rotary_dim,
                            rope_scale, inplace):
    positions = rng.integers(-40, 1 << 17, 13)  # negative positions rotate backwards
    pos_ids = backend.put(positions.astype("int32" if inplace else "int64"))
    qkv, q, k = fused_qk(backend, randn, len(positions), dtype)
    fn = compat.apply_rope_pos_ids_inplace if inplace else compat.apply_rope_pos_ids
    check_rotation(backend,
                   lambda: fn(q, k, pos_ids, rotary_dim=rotary_dim, interleave=interleave,
                              rope_scale=rope_scale),
                   qkv, q, k, inplace=inplace, interleave=interleave, rotary_dim=rotary_dim,
                   inv_freq=reference_inv_freq(rotary_dim or D, 1e4, rope_scale),
                   positions=positions)
    assert len(launches) == 1 and launches[0] is pos_ids


def test_ragged_positions_are_varlen_positions(launches, randn):
    """The adapter's on-device positions are cupyrope.varlen_positions(indptr, offsets), for
    int32 indptr with int64 offsets too, and past 2**31."""
    lengths, starts = [2, 0, 3], [5, 1, (1 << 31) + 7]
    indptr = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)
    offsets = torch.tensor(starts, dtype=torch.int64)
    q, k = torch.from_numpy(randn((5, 2, 8))), torch.from_numpy(randn((5, 1, 8)))
    compat.apply_rope(q, k, indptr, offsets)
    expected = ragged_positions(lengths, starts)
    np.testing.assert_array_equal(cr.varlen_positions(indptr, offsets).numpy(), expected)
    np.testing.assert_array_equal(launches[0].numpy(), expected)


def test_defaults_are_flashinfers(randn):
    """rotary_dim None (head_dim), interleave False, rope_scale 1 and rope_theta 1e4; Llama 3.1:
    rope_scale 8, rope_theta 5e5, low 1, high 4, old_context_len 8192."""
    indptr, offsets = torch.tensor([0, 4, 6]), torch.tensor([3, 9000])
    positions = ragged_positions([4, 2], [3, 9000])
    q, k = torch.from_numpy(randn((6, 3, 32))), torch.from_numpy(randn((6, 1, 32)))
    plain = reference_inv_freq(32, 1e4)
    llama = llama31_inv_freq(32, **LLAMA31)
    for got, inv_freq in ((compat.apply_rope(q, k, indptr, offsets), plain),
                          (compat.apply_rope_pos_ids(q, k, torch.from_numpy(positions)), plain),
                          (compat.apply_llama31_rope(q, k, indptr, offsets), llama),
                          (compat.apply_llama31_rope_pos_ids(q, k, torch.from_numpy(positions)),
                           llama)):
        for out, x in zip(got, (q, k)):
            ref = reference_rope(x.numpy(), positions, inv_freq=inv_freq)
            assert_rope_close(out, ref, x, interleaved=False, rotary_dim=32,
                              max_angle=max_abs_angle(positions, inv_freq))


# ----------------------------------------------------------------------------------------------
# Llama 3.1


LLAMA31_CASES = [
    (128, LLAMA31),
    (64, dict(rope_scale=32.0, rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0,
              old_context_len=8192)),
    (96, dict(rope_scale=4.0, rope_theta=1e4, low_freq_factor=2.0, high_freq_factor=8.5,
              old_context_len=4096)),
]


@pytest.mark.parametrize("rotary_dim, args", LLAMA31_CASES)
def test_llama31_frequencies_are_the_llama3_schedules(rotary_dim, args):
    """FlashInfer's clamped blend and Hugging Face's three bands (cupyrope's llama3 schedule,
    the dict the adapter builds) give the same float64 frequencies, and every band is used."""
    expected = llama31_inv_freq(rotary_dim, **args)
    scaling = {"rope_type": "llama3", "factor": args["rope_scale"],
               "low_freq_factor": args["low_freq_factor"],
               "high_freq_factor": args["high_freq_factor"],
               "original_max_position_embeddings": args["old_context_len"]}
    assert flashinfer._llama31_scaling(args["rope_scale"], args["low_freq_factor"],
                                       args["high_freq_factor"], args["old_context_len"],
                                       "test") == scaling
    inv_freq, attention_factor = cr.rope_frequencies(rotary_dim, theta=args["rope_theta"],
                                                     scaling=scaling)
    np.testing.assert_allclose(inv_freq, expected, rtol=1e-14, atol=0)
    assert attention_factor == 1.0
    plain = reference_inv_freq(rotary_dim, args["rope_theta"])
    kept, divided = expected == plain, np.isclose(expected, plain / args["rope_scale"],
                                                  rtol=1e-15)
    assert kept.any() and divided.any() and (~kept & ~divided).any()


@pytest.mark.parametrize("backend", TORCH, indirect=True)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("rotary_dim, args", [(None, LLAMA31), (48, LLAMA31_CASES[2][1])])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("ragged", [True, False])
def test_apply_llama31_rope(backend, rng, randn, launches, dtype, interleave, rotary_dim, args,
                            inplace, ragged):
    if ragged:
        positions = ragged_positions(LENGTHS, OFFSETS)
        where = (backend.put(np.cumsum([0, *LENGTHS])), backend.put(np.array(OFFSETS)))
        fn = compat.apply_llama31_rope_inplace if inplace else compat.apply_llama31_rope
    else:
        positions = rng.integers(0, 1 << 17, 11)
        where = (backend.put(positions),)
        fn = (compat.apply_llama31_rope_pos_ids_inplace if inplace
              else compat.apply_llama31_rope_pos_ids)
    qkv, q, k = fused_qk(backend, randn, len(positions), dtype)
    check_rotation(backend, lambda: fn(q, k, *where, rotary_dim, interleave, **args),
                   qkv, q, k, inplace=inplace, interleave=interleave, rotary_dim=rotary_dim,
                   inv_freq=llama31_inv_freq(rotary_dim or D, **args), positions=positions)
    assert len(launches) == 1


# ----------------------------------------------------------------------------------------------
# apply_rope_with_cos_sin_cache


@pytest.mark.parametrize("backend", TORCH, indirect=True)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("layout", ["flat", "heads", "fused_qkv"])
def test_apply_rope_with_cos_sin_cache(backend, rng, randn, launches, dtype, is_neox, rotary_dim,
                                       layout):
    nnz, max_position = 9, 4096
    cache = backend.put(cr.cos_sin_cache(max_position, rotary_dim, dtype="float32"))
    positions = rng.integers(0, max_position, nnz)
    pos = backend.put(positions)
    qkv, q, k = fused_qk(backend, randn, nnz, dtype)
    if layout == "flat":
        query, key = q.flatten(1).clone(), k.flatten(1).clone()
    elif layout == "heads":
        query, key = q.clone(), k.clone()
    else:  # [nnz, H * head_size] slices of the fused buffer
        query, key = qkv[:, :HQ * D], qkv[:, HQ * D:(HQ + HK) * D]
    q0, k0 = backend.get(query).copy(), backend.get(key).copy()
    query_out, key_out = compat.apply_rope_with_cos_sin_cache(pos, query, key, D, cache, is_neox)
    assert len(launches) == 1
    for out, x, x0, heads in ((query_out, query, q0, HQ), (key_out, key, k0, HK)):
        assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
        assert_bits_equal(backend.get(x), x0, what="input after an out-of-place call")
        x3 = x0.reshape(nnz, heads, D)
        ref = reference_rope(x3, positions, cos_sin_cache=backend.get(cache),
                             interleaved=not is_neox)
        assert_rope_close(backend.get(out).reshape(nnz, heads, D), ref, x3,
                          interleaved=not is_neox, rotary_dim=rotary_dim)
    # The in-place twin computes the same bits.
    compat.apply_rope_with_cos_sin_cache_inplace(pos, query, key, D, cache, is_neox)
    assert_bits_equal(backend.get(query), backend.get(query_out), what="in-place query")
    assert_bits_equal(backend.get(key), backend.get(key_out), what="in-place key")


# ----------------------------------------------------------------------------------------------
# Refusals: raised before anything is written


def _ragged_call(fn, **change):
    def call(q, k):
        args = dict(indptr=torch.tensor([0, 2, 5]), offsets=torch.tensor([4, 0]))
        args.update(change)
        return fn(q, k, **args)
    return call


def _pos_ids_call(fn, **change):
    def call(q, k):
        args = dict(pos_ids=torch.arange(5))
        args.update(change)
        return fn(q, k, **args)
    return call


REFUSALS = [
    ("rope_scale_zero", _ragged_call(compat.apply_rope_inplace, rope_scale=0), ValueError,
     r"^apply_rope_inplace: rope_scale must be finite and > 0"),
    ("rope_scale_nan", _pos_ids_call(compat.apply_rope_pos_ids, rope_scale=float("nan")),
     ValueError, r"^apply_rope_pos_ids: rope_scale must be finite and > 0"),
    ("rope_scale_text", _ragged_call(compat.apply_rope, rope_scale="8"), TypeError,
     "rope_scale must be a number"),
    ("rope_theta", _pos_ids_call(compat.apply_rope_pos_ids_inplace, rope_theta=-1.0), ValueError,
     r"^apply_rope_pos_ids_inplace: rope_theta must be finite and > 0"),
    ("interleave_int", _ragged_call(compat.apply_rope_inplace, interleave=1), TypeError,
     "interleave must be a bool"),
    ("rotary_dim_odd", _ragged_call(compat.apply_rope_inplace, rotary_dim=7), ValueError,
     r"rotary_dim must be even with 2 <= rotary_dim <= head_dim \(16\), got 7"),
    ("rotary_dim_wide", _pos_ids_call(compat.apply_rope_pos_ids_inplace, rotary_dim=32),
     ValueError, r"rotary_dim must be even with 2 <= rotary_dim <= head_dim \(16\), got 32"),
    ("indptr_float", _ragged_call(compat.apply_rope_inplace, indptr=torch.tensor([0., 2, 5])),
     TypeError, "indptr must be int32 or int64, got torch.float32"),
    ("offsets_2d", _ragged_call(compat.apply_rope_inplace, offsets=torch.tensor([[4, 0]])),
     ValueError, r"offsets must be 1-d, got shape \(1, 2\)"),
    ("indptr_length", _ragged_call(compat.apply_rope_inplace, indptr=torch.tensor([0, 5])),
     ValueError, r"indptr must have shape \(batch_size \+ 1,\) = \(3,\) for offsets of shape "
                 r"\(2,\), got \(2,\)"),
    ("no_request", _ragged_call(compat.apply_rope_inplace, indptr=torch.tensor([0]),
                                offsets=torch.tensor([], dtype=torch.int64)),
     ValueError, "describe no request but q has 5 tokens"),
    ("offsets_not_tensor", _ragged_call(compat.apply_llama31_rope_inplace, offsets=[4, 0]),
     TypeError, "offsets must be a torch tensor, got list"),
    ("pos_ids_short", _pos_ids_call(compat.apply_rope_pos_ids_inplace,
                                    pos_ids=torch.arange(1)),
     ValueError, r"pos_ids must have shape \(5,\) \(one per token\), got \(1,\)"),
    ("pos_ids_float", _pos_ids_call(compat.apply_llama31_rope_pos_ids_inplace,
                                    pos_ids=torch.zeros(5)),
     TypeError, "pos_ids must be int32 or int64, got torch.float32"),
    ("low_ge_high", _ragged_call(compat.apply_llama31_rope_inplace, low_freq_factor=4.0),
     ValueError, "low_freq_factor must be < high_freq_factor, got 4.0 and 4"),
    ("low_zero", _pos_ids_call(compat.apply_llama31_rope_pos_ids_inplace, low_freq_factor=0),
     ValueError, "low_freq_factor must be finite and > 0"),
    ("llama_scale", _ragged_call(compat.apply_llama31_rope_inplace, rope_scale=-8), ValueError,
     "rope_scale must be finite and > 0"),
    ("old_context_fraction", _ragged_call(compat.apply_llama31_rope_inplace,
                                          old_context_len=8192.5),
     ValueError, r"old_context_len must be a positive integer .*call "
                 r"apply_rope_with_cos_sin_cache\), got 8192.5"),
    ("old_context_zero", _pos_ids_call(compat.apply_llama31_rope_pos_ids_inplace,
                                       old_context_len=0),
     ValueError, "old_context_len must be a positive integer"),
]


@pytest.mark.parametrize("case, call, error, match", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_refusals_write_nothing(randn, case, call, error, match):
    q, k = torch.from_numpy(randn((5, 3, 16))), torch.from_numpy(randn((5, 1, 16)))
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(error, match=match):
        call(q, k)
    assert_bits_equal(q, q0, what="q after a refused call")
    assert_bits_equal(k, k0, what="k after a refused call")


@pytest.mark.parametrize("q_shape, k_shape, match", [
    ((5, 3, 2, 16), (5, 1, 16),
     r"q must be \(nnz, num_q_heads, head_dim\), got shape \(5, 3, 2, 16\)"),
    ((5, 48), (5, 1, 16), r"q must be \(nnz, num_q_heads, head_dim\), got shape \(5, 48\)"),
    ((5, 3, 16), (5, 16), r"k must be \(nnz, num_k_heads, head_dim\), got shape \(5, 16\)"),
    ((5, 3, 16), (5, 1, 8), r"k must have q's nnz 5 and head_dim 16, got shape \(5, 1, 8\)"),
    ((5, 3, 16), (4, 1, 16), r"k must have q's nnz 5 and head_dim 16, got shape \(4, 1, 16\)"),
])
@pytest.mark.parametrize("fn", [compat.apply_rope, compat.apply_llama31_rope_pos_ids_inplace])
def test_q_and_k_shapes_are_flashinfers(randn, q_shape, k_shape, match, fn):
    q, k = torch.from_numpy(randn(q_shape)), torch.from_numpy(randn(k_shape))
    where = ((torch.tensor([0, 5]), torch.tensor([0])) if fn is compat.apply_rope
             else (torch.arange(5),))
    with pytest.raises(ValueError, match=f"^{fn.__name__}: {match}"):
        fn(q, k, *where)


def test_cos_sin_cache_refusals_leave_the_inputs(randn):
    op = "apply_rope_with_cos_sin_cache"
    query, key = torch.from_numpy(randn((5, 3 * 16))), torch.from_numpy(randn((5, 16)))
    cache, positions = cr.cos_sin_cache(64, 16, like=query), torch.arange(5)
    cases = [
        (dict(positions=torch.arange(4)), ValueError,
         r"positions must have shape \(5,\) \(one per token\), got \(4,\)"),
        (dict(positions=torch.zeros(5)), TypeError, "positions must be int32 or int64"),
        (dict(head_size=0), ValueError, "head_size must be >= 1, got 0"),
        (dict(head_size=16.0), TypeError, "head_size must be an int"),
        (dict(head_size=7), ValueError, r"query's last dim 48 is not a multiple of head_size=7"),
        (dict(is_neox=1), TypeError, "is_neox must be a bool"),
        (dict(key=None), TypeError, "key must be a torch tensor, got NoneType"),
        (dict(query=query[0]), ValueError, r"query must be \(nnz, num_q_heads \* head_size\)"),
    ]
    for change, error, match in cases:
        args = dict(positions=positions, query=query, key=key, head_size=16,
                    cos_sin_cache=cache, is_neox=True)
        args.update(change)
        before = (query.clone(), key.clone())
        with pytest.raises(error, match=f"^{op}: {match}"):
            compat.apply_rope_with_cos_sin_cache(**args)
        assert_bits_equal(query, before[0], what="query")
        assert_bits_equal(key, before[1], what="key")


# ----------------------------------------------------------------------------------------------
# rope_quantize_fp8's backend argument


def test_rope_quantize_fp8_backends_compute_the_same_bits(rng, randn):
    put = Backend("torch").put
    q_rope, k_rope = put(randn((6, 4, 32), "bfloat16")), put(randn((6, 32), "bfloat16"))
    q_nope, k_nope = put(randn((6, 4, 16), "bfloat16")), put(randn((6, 16), "bfloat16"))
    table = cr.cos_sin_cache(64, 32, like=q_rope)
    pos = torch.from_numpy(rng.integers(0, 64, 6))
    results = [compat.rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, table, pos, False,
                                        backend=backend) for backend in ("cuda", "cutile")]
    default = compat.rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, table, pos, False)
    for got in results:
        for a, b in zip(got, default):
            assert_bits_equal(fp8_bits(a), fp8_bits(b), what="backend result")


@pytest.mark.parametrize("backend, match", [
    ("triton", "backend must be 'cuda' or 'cutile' .*got 'triton'"),
    (None, "backend must be 'cuda' or 'cutile' .*got None"),
])
def test_rope_quantize_fp8_refuses_other_backends(randn, backend, match):
    q = Backend("torch").put(randn((3, 2, 16), "bfloat16"))
    with pytest.raises(ValueError, match=f"^rope_quantize_fp8: {match}"):
        compat.rope_quantize_fp8(q, q[:, 0], None, None, cr.cos_sin_cache(8, 16, like=q),
                                 torch.arange(3), backend=backend)


def fp8_bits(x):
    return x.view(torch.uint8).numpy()


# ----------------------------------------------------------------------------------------------
# FlashInfer's page table: get_seq_lens, get_batch_indices_positions, and the paged append


def page_table(rng, page_size, lengths, spare_pages=3):
    """A FlashInfer page table for requests of KV ``lengths``: (kv_indptr, kv_indices,
    kv_last_page_len, num_pages) with the pages scattered over a cache of ``num_pages``."""
    pages = [-(-n // page_size) for n in lengths]
    kv_indptr = np.cumsum([0, *pages])
    num_pages = kv_indptr[-1] + spare_pages
    kv_indices = rng.permutation(num_pages)[:kv_indptr[-1]]
    last = [n - (p - 1) * page_size if p else 0 for n, p in zip(lengths, pages)]
    return kv_indptr, kv_indices, np.array(last), num_pages


def reference_batch_positions(append_indptr, seq_lens, nnz):
    """FlashInfer's rule, token by token: request b appends the last ``append_indptr[b + 1] -
    append_indptr[b]`` positions of its ``seq_lens[b]``; tokens past the last request: -1, 0."""
    batch, position = np.full(nnz, -1), np.zeros(nnz, dtype=np.int64)
    for b in range(len(seq_lens)):
        for t in range(append_indptr[b], append_indptr[b + 1]):
            batch[t], position[t] = b, t + seq_lens[b] - append_indptr[b + 1]
    return batch, position


def test_page_helpers_are_flashinfers(rng):
    """get_seq_lens and get_batch_indices_positions against the rule written token by token,
    FlashInfer's docstring example included, with and without the output buffers."""
    append_indptr = torch.tensor([0, 1, 3, 6, 10], dtype=torch.int32)
    batch, position = compat.get_batch_indices_positions(append_indptr, torch.tensor([5] * 4), 10)
    assert batch.dtype == position.dtype == torch.int32
    assert batch.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert position.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4]

    kv_indptr, _, last, _ = page_table(rng, 16, [40, 0, 16, 7, 33])
    seq_lens = compat.get_seq_lens(torch.from_numpy(kv_indptr), torch.from_numpy(last), 16)
    assert seq_lens.tolist() == [40, 0, 16, 7, 33]
    appended = [3, 0, 16, 1, 9]
    append_indptr = np.cumsum([0, *appended])
    nnz = append_indptr[-1] + 2  # two padding tokens
    outs = (torch.full((nnz,), 99, dtype=torch.int32), torch.full((nnz,), 99, dtype=torch.int32))
    got = compat.get_batch_indices_positions(torch.from_numpy(append_indptr), seq_lens, int(nnz),
                                             *outs)
    assert got[0] is outs[0] and got[1] is outs[1]
    expected = reference_batch_positions(append_indptr, seq_lens.numpy(), nnz)
    for tensor, want in zip(got, expected):
        np.testing.assert_array_equal(tensor.numpy(), want)


def reference_slots(kv_indptr, kv_indices, batch, position, page_size):
    """The cache slot (page * page_size + row) FlashInfer's kernel writes each token to, -1 for
    padding."""
    slots = np.full(len(batch), -1)
    for t, (b, p) in enumerate(zip(batch, position)):
        if b >= 0:
            entry = kv_indptr[b] * page_size + p
            slots[t] = kv_indices[entry // page_size] * page_size + entry % page_size
    return slots


PAGED_LENGTHS = [9, 20, 1, 0, 14]  # KV lengths after the append
PAGED_APPENDED = [2, 11, 1, 0, 5]


def paged_case(backend, rng, randn, parts, page_size, layout, fmt, Hq=4, Hk=2, R=32, N=48):
    """Host (q, k, v) heads, the inputs as FlashInfer takes them, the page table, slots, and
    NaN-poisoned fp8 caches in ``layout``."""
    D = R + (N if parts != "no_nope" else 0)
    kv_indptr, kv_indices, last, num_pages = page_table(rng, page_size, PAGED_LENGTHS)
    append_indptr = np.cumsum([0, *PAGED_APPENDED])
    nnz = append_indptr[-1] + 3  # padding tokens (batch index -1) at the end
    batch, position = reference_batch_positions(append_indptr, PAGED_LENGTHS, nnz)
    q, k, v = randn((nnz, Hq, D), "bfloat16"), randn((nnz, Hk, D), "bfloat16"), randn(
        (nnz, Hk, D), "bfloat16")
    if parts == "joined":  # the two slices of one tensor each
        qb, kb = backend.put(q), backend.put(k)
        inputs = [qb[..., :R], kb[..., :R], qb[..., R:], kb[..., R:]]
    elif parts == "separate":
        inputs = [backend.put(np.ascontiguousarray(x[..., s])) for s in (slice(None, R),
                                                                         slice(R, None))
                  for x in (q, k)]
        inputs = [inputs[0], inputs[1], inputs[2], inputs[3]]
    else:
        inputs = [backend.put(q), backend.put(k), None, None]
    shape = ((num_pages, page_size, Hk, D) if layout == "NHD"
             else (num_pages, Hk, page_size, D))
    nan = np.full(shape, np.nan, np.float32).astype(np_dtype(fmt))
    caches = [put_fp8(backend, nan) for _ in range(2)]
    table = [backend.put(x) for x in (np.asarray(kv_indices, np.int32), np.asarray(kv_indptr),
                                      batch.astype(np.int32), position.astype(np.int32))]
    slots = reference_slots(kv_indptr, kv_indices, batch, position, page_size)
    return (q, k, v), inputs, backend.put(v), caches, table, slots


def cache_rows(backend, cache, layout):
    """A fp8 cache's rows as ``[num_pages * page_size, heads, dim]`` (host, fp8 dtype)."""
    values = host_values(backend, cache)
    if layout == "HND":
        values = values.transpose(0, 2, 1, 3)
    return values.reshape(-1, *values.shape[2:])


@pytest.fixture
def fused_launches(monkeypatch):
    """How many cupyrope rope_and_cache launches the FlashInfer adapters make."""
    seen = []

    def counting(*args, **kwargs):
        seen.append(args[0].shape)
        return cr.rope_and_cache(*args, **kwargs)

    monkeypatch.setattr(flashinfer, "rope_and_cache", counting)
    return seen


@pytest.mark.parametrize("backend", TORCH, indirect=True)
@pytest.mark.parametrize("parts, launches_made", [("joined", 1), ("separate", 2),
                                                  ("no_nope", 1)])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("with_out", [False, True])
def test_rope_quantize_fp8_append_paged_kv_cache(backend, rng, randn, fused_launches, parts,
                                                 launches_made, layout, fmt, is_neox, with_out):
    page_size, R = 4, 32
    (q, k, v), inputs, v_in, caches, table, slots = paged_case(backend, rng, randn, parts,
                                                               page_size, layout, fmt)
    positions = rng.integers(0, 512, q.shape[0])
    cos_sin = cr.cos_sin_cache(512, R, dtype="float32")
    outs = [None, None]
    if with_out:
        outs = [put_fp8(backend, np.full(x.shape, np.nan, np.float32).astype(np_dtype(fmt)))
                for x in (q[..., :R], q[..., R:])]
    inputs_before = [None if x is None else host_values(backend, x).copy() for x in inputs]
    scale_kv = torch.tensor([0.5], device=v_in.device)  # a one-element tensor, multiplied in
    result = compat.rope_quantize_fp8_append_paged_kv_cache(
        *inputs, v_in, backend.put(cos_sin), backend.put(positions), tuple(caches), *table,
        is_neox=is_neox, quantize_dtype=None if with_out else getattr(torch, fmt),
        quant_scale_q=2.0, quant_scale_kv=scale_kv, page_size=page_size, kv_layout=layout,
        q_rope_out=outs[0], q_nope_out=outs[1])
    assert len(fused_launches) == launches_made
    assert isinstance(result, tuple) and len(result) == 2
    if with_out:
        assert result[0] is outs[0] and result[1] is outs[1]
    exact = [reference_rope(x, positions, cos_sin_cache=cos_sin, interleaved=not is_neox,
                            rotary_dim=R) for x in (q, k)]
    q_rope_out, q_nope_out = (host_values(backend, x) for x in result)
    assert q_rope_out.dtype.name == fmt and q_nope_out.shape == (*q.shape[:2], q.shape[2] - R)
    assert_fp8_close(q_rope_out, exact[0][..., :R] * 2.0, "q_rope_out")
    if q_nope_out.size:
        assert_fp8_close(q_nope_out, exact[0][..., R:] * 2.0, "q_nope_out")
    written = slots >= 0
    for cache, want, name in ((caches[0], exact[1], "k"), (caches[1], v.astype(np.float64),
                                                          "v")):
        rows = cache_rows(backend, cache, layout)
        assert_fp8_close(rows[slots[written]], want[written] * 0.5, f"{name} cache rows")
        untouched = np.setdiff1d(np.arange(rows.shape[0]), slots[written])
        assert np.isnan(rows[untouched].astype(np.float32)).all(), f"{name} cache: stray write"
    for x, before in zip(inputs, inputs_before):
        if x is not None:
            assert_bits_equal(host_values(backend, x), before, what="input")


def _paged_args(rng, randn, **change):
    backend = Backend("torch")
    (_, _, _), inputs, v, caches, table, _ = paged_case(backend, rng, randn, "separate", 4,
                                                        "NHD", "float8_e4m3fn")
    args = dict(q_rope=inputs[0], k_rope=inputs[1], q_nope=inputs[2], k_nope=inputs[3], v=v,
                cos_sin_cache=torch.from_numpy(cr.cos_sin_cache(64, 32)),
                pos_ids=torch.zeros(inputs[0].shape[0], dtype=torch.int64),
                paged_kv_cache=tuple(caches), kv_indices=table[0], kv_indptr=table[1],
                batch_indices=table[2], positions=table[3], page_size=4)
    args.update(change)
    return args, caches


@pytest.mark.parametrize("case, error, match", [
    ("mla", ValueError, r"MLA \(2-d k_rope\) takes no v"),
    ("page_size", ValueError, r"k_cache of shape \(\d+, 4, 2, 80\) has pages of 4 entries in "
                              r"layout NHD, but page_size=8"),
    ("cache_dtype", TypeError, "v_cache must have quantize_dtype torch.float8_e5m2"),
    ("layout", ValueError, "kv_layout must be 'NHD' or 'HND', got 'NDH'"),
    ("v_shape", ValueError, r"v must be \(nnz, num_kv_heads, rope_dim \+ no_rope_dim\)"),
    ("batch_indices", ValueError, r"batch_indices must have shape \(\d+,\) \(one per token\)"),
    ("positions_dtype", TypeError, "positions must be int32 or int64, got torch.float32"),
    ("one_cache", TypeError, "paged_kv_cache must be a tuple"),
    ("pos_ids", ValueError, r"pos_ids must have shape"),
    ("enable_pdl", TypeError, "enable_pdl must be a bool"),
    ("q_rope_out", TypeError, "q_rope_out must have quantize_dtype"),
])
def test_paged_append_refusals_write_nothing(rng, randn, case, error, match):
    args, caches = _paged_args(rng, randn)
    nnz = args["q_rope"].shape[0]
    if case == "mla":
        args["k_rope"], args["k_nope"] = args["k_rope"][:, 0], args["k_nope"][:, 0]
    elif case == "page_size":
        args["page_size"] = 8
    elif case == "cache_dtype":
        args["quantize_dtype"] = torch.float8_e5m2
        args["paged_kv_cache"] = (caches[0].view(torch.float8_e5m2), caches[1])
        args["paged_kv_cache"] = (args["paged_kv_cache"][0],
                                  caches[1].view(torch.float8_e4m3fn))
    elif case == "layout":
        args["kv_layout"] = "NDH"
    elif case == "v_shape":
        args["v"] = args["v"][..., :32]
    elif case == "batch_indices":
        args["batch_indices"] = args["batch_indices"][:-1]
    elif case == "positions_dtype":
        args["positions"] = args["positions"].float()
    elif case == "one_cache":
        args["paged_kv_cache"] = caches[0]
    elif case == "pos_ids":
        args["pos_ids"] = torch.zeros(nnz - 1, dtype=torch.int64)
    elif case == "enable_pdl":
        args["enable_pdl"] = 0
    elif case == "q_rope_out":
        args["q_rope_out"] = torch.zeros(args["q_rope"].shape, dtype=torch.float8_e5m2)
        args["quantize_dtype"] = torch.float8_e4m3fn
    before = [fp8_bits(c).copy() for c in caches]
    with pytest.raises(error, match=f"^rope_quantize_fp8_append_paged_kv_cache: {match}"):
        compat.rope_quantize_fp8_append_paged_kv_cache(**args)
    for cache, bits in zip(caches, before):
        assert_bits_equal(fp8_bits(cache), bits, what="cache after a refusal")


def test_paged_append_skips_entries_outside_the_page_table(rng, randn):
    """A token whose entry lies past kv_indices, or at a negative position, is not written
    (FlashInfer would read past the page table); the others are."""
    args, caches = _paged_args(rng, randn)
    batch, position = args["batch_indices"], args["positions"].clone()
    slots = reference_slots(args["kv_indptr"].numpy(), args["kv_indices"].numpy(),
                            batch.numpy(), position.numpy(), 4)
    first = int(torch.nonzero(batch >= 0)[0])
    position[first] = 10_000  # far past the page table
    position[first + 1] = -1
    slots[first:first + 2] = -1
    args["positions"] = position
    compat.rope_quantize_fp8_append_paged_kv_cache(**args)
    rows = cache_rows(Backend("torch"), caches[0], "NHD").astype(np.float32)
    written = slots[slots >= 0]
    assert not np.isnan(rows[written]).any()
    assert np.isnan(np.delete(rows, written, axis=0)).all()


# ----------------------------------------------------------------------------------------------
# fused_qk_rmsnorm_rope: QK-RMSNorm over all heads, 3D RoPE, v copied


VIDEO = dict(ppf=2, pph=3, ppw=5, num_frame_channels=16, num_height_channels=24,
             num_width_channels=24)


def video_reference(x, weight, *, is_qk_norm, interleave, base, factor, low, high,
                    attention_factor, round_norm, eps=1e-6, video=VIDEO):
    """FlashInfer's fused_qk_rmsnorm_rope on ``x [batch, seq_len, H, D]`` in float64: RMSNorm over
    all H * D values of a token (rounded to bfloat16 when ``round_norm``, as FlashInfer's kernel
    does before RoPE), then pair j (dims 2j, 2j+1 interleaved; j, j + D/2 NeoX) turned by the
    frame / height / width position that channel 2j falls in, at frequency base^(-2i/C) of its
    index i within its group of C channels (YaRN-blended), times attention_factor."""
    x = np.asarray(x, dtype=np.float64)
    batch, seq_len, heads, D = x.shape
    if is_qk_norm:
        flat = x.reshape(batch, seq_len, heads * D)
        flat = flat / np.sqrt(np.mean(flat * flat, -1, keepdims=True) + eps) * np.asarray(
            weight, np.float64).reshape(-1)
        if round_norm:
            flat = flat.astype(np_dtype("bfloat16")).astype(np.float64)
        x = flat.reshape(x.shape)
    channels = [video[f"num_{p}_channels"] for p in ("frame", "height", "width")]
    if abs(low - high) <= 1e-6:
        high += 0.001
    freqs, group = [], []
    for g, size in enumerate(channels):
        i = np.arange(size // 2)
        f = base ** (-2.0 * i / size)
        if factor != 1.0:
            ramp = np.clip((i - low) / (high - low), 0, 1)
            f = f / factor * ramp + f * (1 - ramp)
        freqs.append(f)
        group += [g] * (size // 2)
    s = np.arange(seq_len)
    hw = video["pph"] * video["ppw"]
    where = np.stack([s // hw, s // video["ppw"] % video["pph"], s % video["ppw"]])
    angles = where[np.array(group)].T * np.concatenate(freqs)  # [seq_len, D / 2]
    cos = np.cos(angles)[None, :, None] * attention_factor
    sin = np.sin(angles)[None, :, None] * attention_factor
    out = x.copy()
    for j in range(D // 2):
        a, b = (2 * j, 2 * j + 1) if interleave else (j, j + D // 2)
        out[..., a] = x[..., a] * cos[..., j] - x[..., b] * sin[..., j]
        out[..., b] = x[..., b] * cos[..., j] + x[..., a] * sin[..., j]
    return out


def fp8_ulp(values):
    """The e4m3 spacing at each value (subnormals below 2**-6)."""
    return 2.0 ** (np.floor(np.log2(np.maximum(np.abs(values), 2.0**-6))) - 3)


@pytest.fixture
def video_launches(monkeypatch):
    seen = []
    for name in ("rms_norm_rope", "cupyrope_apply_rope"):
        real = getattr(flashinfer, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            seen.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(flashinfer, name, counting)
    return seen


@pytest.fixture
def past_flashinfers_limits(monkeypatch):
    """The adapter's computation where FlashInfer's kernel stops (the CPU, 40 heads): its
    FlashInfer refusals lifted, every other check and launch as called."""
    monkeypatch.setattr(flashinfer, "_refuse_beyond_flashinfer", lambda *args: None)


@pytest.mark.parametrize("backend", TORCH, indirect=True)
@pytest.mark.parametrize("heads", [(4, 4, 4), (4, 2, 3)])
@pytest.mark.parametrize("rank", [3, 2])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("yarn", [None, (4.0, 2.0, 9.0, 1.25)])
@pytest.mark.parametrize("is_qk_norm", [True, False])
@pytest.mark.parametrize("output_fp8", [False, True])
def test_fused_qk_rmsnorm_rope(request, backend, rng, randn, video_launches, heads, rank,
                               interleave, yarn, is_qk_norm, output_fp8):
    """On CUDA through FlashInfer's checks; on the CPU (which FlashInfer refuses) with them
    lifted."""
    if not backend.on_gpu:
        request.getfixturevalue("past_flashinfers_limits")
    Hq, Hk, Hv = heads
    D, batch, seq_len = 64, 2, VIDEO["ppf"] * VIDEO["pph"] * VIDEO["ppw"]
    rows = randn((batch, seq_len, (Hq + Hk + Hv) * D), "bfloat16") * 3
    weights = [rng.uniform(0.5, 1.5, h * D).astype(np_dtype("bfloat16")) for h in (Hq, Hk)]
    qkv = backend.put(rows if rank == 3 else rows.reshape(batch * seq_len, -1))
    factor, low, high, attention_factor = yarn or (1.0, 0.0, 0.0, 1.0)
    out_dtype = "float8_e4m3fn" if output_fp8 else "bfloat16"
    shapes = [(batch, seq_len, h, D) if rank == 3 else (batch * seq_len, h, D)
              for h in (Hq, Hk, Hv)]
    outs = [put_fp8(backend, np.full(s, np.nan, np.float32).astype(np_dtype(out_dtype)))
            if output_fp8 else backend.put(np.full(s, np.nan, np_dtype(out_dtype)))
            for s in shapes]
    got = compat.fused_qk_rmsnorm_rope(
        qkv, *(backend.put(w) for w in weights), **VIDEO, num_heads_q=Hq, num_heads_k=Hk,
        num_heads_v=Hv, head_dim=D, interleave=interleave, factor=factor, low=low, high=high,
        attention_factor=attention_factor, is_qk_norm=is_qk_norm, output_fp8=output_fp8,
        output_quant_scale=2.0, v_quant_scale=0.5, q_out=outs[0], k_out=outs[1],
        v_out=outs[2])
    assert all(g is o for g, o in zip(got, outs))
    assert_bits_equal(host_values(backend, qkv).reshape(rows.shape), rows, what="qkv")
    # q and k: one launch (the norm over all heads fused with the rotation, or the rotation
    # alone); v: a copy, or an fp8 quantisation of its own
    assert video_launches == (["rms_norm_rope" if is_qk_norm else "cupyrope_apply_rope"]
                              + ["cupyrope_apply_rope"] * output_fp8)
    ends = np.cumsum([0, Hq * D, Hk * D, Hv * D])
    parts = [rows[..., lo:hi].reshape(batch, seq_len, -1, D) for lo, hi in zip(ends, ends[1:])]
    for at, (out, x) in enumerate(zip(got, parts)):
        values = host_values(backend, out).reshape(x.shape)
        if at == 2:
            if output_fp8:
                assert_fp8_close(values, x.astype(np.float64) * 0.5, "v_out")
            else:
                assert_bits_equal(values, x, what="v_out")
            continue
        exact = video_reference(x, weights[at], is_qk_norm=is_qk_norm, interleave=interleave,
                                base=1e4, factor=factor, low=low, high=high,
                                attention_factor=attention_factor,
                                round_norm=not output_fp8)
        if output_fp8:  # an fp8 ulp, and half a bfloat16 ulp of the head (the norm's rounding)
            error = np.abs(values.astype(np.float64) - exact * 2.0)
            magnitude = np.abs(exact * 2.0).max(axis=-1, keepdims=True)
            bad = error > fp8_ulp(exact * 2.0) + 2.0**-8 * magnitude
            assert not bad.any(), (f"part {at}: {int(bad.sum())} fp8 values off, e.g. "
                                   f"{values[bad][:3]} for {exact[bad][:3] * 2.0}")
        else:  # one bfloat16 rounding of the exact value, give or take the norm's own rounding
            magnitude = np.abs(exact).max(axis=(-2, -1), keepdims=True)
            error = np.abs(values.astype(np.float64) - exact) / magnitude
            assert error.max() <= 4 * 2.0**-8, f"part {at}: error {error.max():.3g} x max"


@pytest.mark.parametrize("backend", TORCH, indirect=True)
def test_fused_qk_rmsnorm_rope_at_wan_sizes(backend, rng, randn, past_flashinfers_limits):
    """Wan 2.1 14B's attention: 40 heads of 128 (the norm spans 5120 values; past FlashInfer's
    32, which the adapter refuses as FlashInfer does: see the refusals below), channels 44 / 42
    / 42, NeoX and interleaved alike; the v heads copied bit for bit."""
    video = dict(ppf=3, pph=4, ppw=6, num_frame_channels=44, num_height_channels=42,
                 num_width_channels=42)
    H, D, seq_len = 40, 128, 3 * 4 * 6
    rows = randn((1, seq_len, 3 * H * D), "bfloat16")
    weights = [rng.uniform(0.5, 1.5, H * D).astype(np_dtype("bfloat16")) for _ in range(2)]
    for interleave in (True, False):
        got = compat.fused_qk_rmsnorm_rope(
            backend.put(rows), *(backend.put(w) for w in weights), **video, num_heads_q=H,
            num_heads_k=H, num_heads_v=H, head_dim=D, interleave=interleave)
        for at, out in enumerate(got):
            x = rows[..., at * H * D:(at + 1) * H * D].reshape(1, seq_len, H, D)
            values = host_values(backend, out)
            if at == 2:
                assert_bits_equal(values, x, what="v_out")
                continue
            exact = video_reference(x, weights[at], is_qk_norm=True, interleave=interleave,
                                    base=1e4, factor=1.0, low=0.0, high=0.0,
                                    attention_factor=1.0, round_norm=True, video=video)
            magnitude = np.abs(exact).max(axis=(-2, -1), keepdims=True)
            error = np.abs(values.astype(np.float64) - exact) / magnitude
            assert error.max() <= 4 * 2.0**-8, f"part {at}: error {error.max():.3g} x max"


def test_fused_qk_rmsnorm_rope_defaults_and_returns_new_tensors(rng, randn,
                                                                past_flashinfers_limits):
    """FlashInfer's defaults (eps 1e-6, base 1e4, interleaved, no YaRN, norm on, bfloat16 out);
    without outputs given, new tensors [num_tokens, H, D] for a 2-d qkv."""
    Hq = Hk = Hv = 2
    D, seq_len = 64, VIDEO["ppf"] * VIDEO["pph"] * VIDEO["ppw"]
    rows = randn((seq_len, 3 * Hq * D), "bfloat16")
    weights = [np.ones(Hq * D, np_dtype("bfloat16"))] * 2
    put = Backend("torch").put
    q_out, k_out, v_out = compat.fused_qk_rmsnorm_rope(
        put(rows), put(weights[0]), put(weights[1]), **VIDEO, num_heads_q=Hq, num_heads_k=Hk,
        num_heads_v=Hv, head_dim=D)
    assert q_out.shape == k_out.shape == v_out.shape == (seq_len, Hq, D)
    assert q_out.dtype == torch.bfloat16
    exact = video_reference(rows[:, :Hq * D].reshape(1, seq_len, Hq, D), weights[0],
                            is_qk_norm=True, interleave=True, base=1e4, factor=1.0, low=0.0,
                            high=0.0, attention_factor=1.0, round_norm=True)
    error = np.abs(q_out.double().numpy() - exact[0]) / np.abs(exact).max()
    assert error.max() <= 4 * 2.0**-8


@pytest.mark.parametrize("change, error, match", [
    (dict(num_width_channels=25), ValueError, "must be even and add up to head_dim"),
    (dict(num_frame_channels=8), ValueError, r"add up to head_dim \(64\), got \[8, 24, 24\]"),
    (dict(ppw=4), ValueError, r"qkv's seq_len 30 != ppf \* pph \* ppw = 24"),
    (dict(attention_factor=1.5), ValueError, "attention_factor must be 1 when factor is 1"),
    (dict(q_weight="short"), ValueError, "q_weight must have num_heads \\* head_dim = 128"),
    (dict(q_out="wrong"), ValueError, r"q_out must be a torch.bfloat16 tensor of shape "
                                      r"\(1, 30, 2, 64\)"),
    (dict(interleave=1), TypeError, "interleave must be a bool"),
    (dict(num_heads_v=-1), ValueError, "num_heads_v must be >= 0"),
    (dict(base=0.0), ValueError, "base must be finite and > 0"),
])
def test_fused_qk_rmsnorm_rope_refusals_write_nothing(randn, change, error, match):
    D, seq_len = 64, 30
    qkv = torch.from_numpy(randn((1, seq_len, 3 * 2 * D)))
    qkv = qkv.to(torch.bfloat16)
    args = dict(qkv=qkv, q_weight=torch.ones(2 * D, dtype=torch.bfloat16),
                k_weight=torch.ones(2 * D, dtype=torch.bfloat16), **VIDEO, num_heads_q=2,
                num_heads_k=2, num_heads_v=2, head_dim=D,
                q_out=torch.full((1, seq_len, 2, D), float("nan"), dtype=torch.bfloat16))
    args.update(change)
    if isinstance(args["q_weight"], str):
        args["q_weight"] = torch.ones(D, dtype=torch.bfloat16)
    if isinstance(args["q_out"], str):
        args["q_out"] = torch.full((1, seq_len, 2, D + 2), float("nan"), dtype=torch.bfloat16)
    out_before, qkv_before = args["q_out"].clone(), qkv.clone()
    with pytest.raises(error, match=f"^fused_qk_rmsnorm_rope: .*{match}"):
        compat.fused_qk_rmsnorm_rope(**args)
    assert_bits_equal(args["q_out"], out_before, what="q_out")
    assert_bits_equal(qkv, qkv_before, what="qkv")


def wan_call(randn, *, head_dim=128, heads=(24, 24, 24), dtype=torch.bfloat16,
             weight_dtype=torch.bfloat16, device="cpu", seq_len=5 * 6 * 4):
    """The arguments of a Wan 2.2 5B call (FlashInfer's own error tests), on ``device``."""
    Hq, Hk, Hv = heads
    third = 2 * (head_dim // 6)
    rows = torch.from_numpy(randn((1, seq_len, (Hq + Hk + Hv) * head_dim)))
    return dict(qkv=rows.to(device=device, dtype=dtype),
                q_weight=torch.ones(Hq * head_dim, dtype=weight_dtype, device=device),
                k_weight=torch.ones(Hk * head_dim, dtype=weight_dtype, device=device),
                ppf=5, pph=6, ppw=4, num_frame_channels=head_dim - 2 * third,
                num_height_channels=third, num_width_channels=third, num_heads_q=Hq,
                num_heads_k=Hk, num_heads_v=Hv, head_dim=head_dim)


@pytest.mark.parametrize("backend", TORCH, indirect=True)
@pytest.mark.parametrize("change, match", [
    (dict(head_dim=96), r"head_dim must be 64, 128, or 256, got 96"),
    (dict(head_dim=32), r"head_dim must be 64, 128, or 256, got 32"),
    (dict(heads=(40, 40, 40)),
     r"max\(num_heads_q, num_heads_k, num_heads_v\) must be <= 32, got 40"),
    (dict(heads=(8, 8, 33)), r"max\(.*\) must be <= 32, got 33"),
    (dict(dtype=torch.float16), r"qkv must be bfloat16, got torch.float16"),
    (dict(dtype=torch.float32, weight_dtype=torch.float32), r"qkv must be bfloat16"),
    (dict(weight_dtype=torch.float32), r"q_weight and k_weight must be bfloat16"),
    ("strided qkv", r"qkv must be contiguous"),
    ("strided weight", r"k_weight must be contiguous"),
    ("strided v_out", r"v_out must be contiguous"),
])
def test_fused_qk_rmsnorm_rope_refuses_what_flashinfer_refuses(backend, randn, change, match):
    """FlashInfer's checks (flashinfer/norm's ``_check_fused_qk_rmsnorm_rope`` and the call's
    own) raise ValueError for these; so does the adapter, before any launch, naming the cupyrope
    calls that take them. Nothing is written."""
    device = "cuda" if backend.on_gpu else "cpu"
    args = wan_call(randn, device=device, **(change if isinstance(change, dict) else {}))
    if change == "strided qkv":  # every row one element longer than the heads it holds
        wide = torch.cat([args["qkv"], args["qkv"][..., :1]], dim=-1)
        args["qkv"] = wide[..., :-1]
    if change == "strided weight":
        args["k_weight"] = torch.stack([args["k_weight"]] * 2, dim=-1)[:, 0]
    if change == "strided v_out":
        shape = (1, 120, 24, 128)
        args["v_out"] = torch.full((*shape[:-1], 2 * shape[-1]), float("nan"),
                                   dtype=torch.bfloat16, device=device)[..., ::2]
    qkv_before = args["qkv"].clone()
    with pytest.raises(ValueError, match=f"^fused_qk_rmsnorm_rope: {match}.*"
                                         r"cupyrope\.rms_norm_rope.*cupyrope\.apply_rope"):
        compat.fused_qk_rmsnorm_rope(**args)
    assert_bits_equal(args["qkv"], qkv_before, what="qkv")
    if "v_out" in args:
        assert torch.isnan(args["v_out"].float()).all()


def test_fused_qk_rmsnorm_rope_refuses_the_cpu(randn):
    """FlashInfer's kernel is CUDA only (its check: ValueError); FlashInfer's own test."""
    with pytest.raises(ValueError, match=r"^fused_qk_rmsnorm_rope: qkv must be a CUDA tensor, "
                                         r"got one on cpu; .*cupyrope\.rms_norm_rope"):
        compat.fused_qk_rmsnorm_rope(**wan_call(randn))


@pytest.mark.parametrize("backend", TORCH, indirect=True)
@pytest.mark.parametrize("output_fp8", [False, True])
@pytest.mark.parametrize("is_qk_norm", [True, False])
@pytest.mark.parametrize("given", [False, True])
def test_fused_qk_rmsnorm_rope_is_not_differentiable(request, backend, randn, output_fp8,
                                                     is_qk_norm, given):
    """As FlashInfer's kernel: weights that require grad (``nn.RMSNorm``'s parameters) are only
    read, with grad mode on; no result requires grad, and the values are those of detached
    weights, bit for bit."""
    if not backend.on_gpu:
        request.getfixturevalue("past_flashinfers_limits")
    device = "cuda" if backend.on_gpu else "cpu"
    args = wan_call(randn, head_dim=64, heads=(2, 2, 2), device=device)
    norms = [torch.nn.RMSNorm(2 * 64, eps=1e-6).to(device=device, dtype=torch.bfloat16)
             for _ in range(2)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(1.0 + 0.1 * torch.from_numpy(randn((2 * 64,))))
    options = dict(is_qk_norm=is_qk_norm, output_fp8=output_fp8, output_quant_scale=2.0)
    out_dtype = torch.float8_e4m3fn if output_fp8 else torch.bfloat16

    def outs():
        if not given:
            return {}
        return {name: torch.zeros((1, 120, 2, 64), dtype=out_dtype, device=device)
                for name in ("q_out", "k_out", "v_out")}

    args.update(q_weight=norms[0].weight, k_weight=norms[1].weight)
    assert torch.is_grad_enabled() and args["q_weight"].requires_grad
    got = compat.fused_qk_rmsnorm_rope(**args, **options, **outs())
    args.update(q_weight=norms[0].weight.detach(), k_weight=norms[1].weight.detach())
    expected = compat.fused_qk_rmsnorm_rope(**args, **options, **outs())
    for name, g, e in zip(("q_out", "k_out", "v_out"), got, expected):
        assert not g.requires_grad and g.grad_fn is None, name
        assert g.dtype == out_dtype and g.shape == (1, 120, 2, 64), name
        assert_bits_equal(g.view(torch.uint8) if output_fp8 else g,
                          e.view(torch.uint8) if output_fp8 else e, what=name)


@pytest.mark.parametrize("backend", TORCH, indirect=True)
@pytest.mark.parametrize("rank", [3, 2])
@pytest.mark.parametrize("output_fp8", [False, True])
@pytest.mark.parametrize("is_qk_norm", [True, False])
def test_fused_qk_rmsnorm_rope_of_no_tokens(request, backend, rank, output_fp8, is_qk_norm):
    """No sequence at all (FlashInfer's kernel aborts the process there): empty outputs."""
    if not backend.on_gpu:
        request.getfixturevalue("past_flashinfers_limits")
    D, seq_len = 64, VIDEO["ppf"] * VIDEO["pph"] * VIDEO["ppw"]
    shape = (0, seq_len, 6 * D) if rank == 3 else (0, 6 * D)
    device = "cuda" if backend.on_gpu else "cpu"
    w = torch.ones(2 * D, dtype=torch.bfloat16, device=device)
    got = compat.fused_qk_rmsnorm_rope(
        torch.empty(shape, dtype=torch.bfloat16, device=device), w, w, **VIDEO, num_heads_q=2,
        num_heads_k=2, num_heads_v=2, head_dim=D, is_qk_norm=is_qk_norm, output_fp8=output_fp8)
    for out in got:
        assert out.shape == shape[:-1] + (2, D)
        assert out.dtype == (torch.float8_e4m3fn if output_fp8 else torch.bfloat16)
