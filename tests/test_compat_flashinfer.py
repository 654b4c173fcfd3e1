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
from backends import Backend, backend_params, require  # noqa: E402
from cupyrope import compat  # noqa: E402
from cupyrope.compat import flashinfer  # noqa: E402
from reference import reference_inv_freq, reference_rope  # noqa: E402
from tolerances import assert_bits_equal, assert_rope_close, max_abs_angle  # noqa: E402

TORCH = backend_params(["torch", "torch-cuda"])
HQ, HK, D = 4, 2, 64
# Five requests, one of no token; the offsets far apart (a long context among short ones).
LENGTHS = [3, 0, 5, 1, 4]
OFFSETS = [7, 50, 0, 100_003, 2_000]
LLAMA31 = dict(rope_scale=8.0, rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0,
               old_context_len=8192)


@pytest.fixture
def backend(request) -> Backend:
    b = Backend(request.param)
    require(b)
    return b


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
