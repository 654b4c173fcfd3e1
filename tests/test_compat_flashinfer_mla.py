"""cupyrope.compat's ``rope_quantize_fp8_append_paged_kv_cache`` in its MLA form (2-d k_rope,
``paged_kv_cache=(ckv_cache, kpe_cache)``) against a float64 torch reading of FlashInfer's
documented semantics written here: q_rope rotated and q_nope passed through, both stored as
fp8(value * quant_scale_q); k_nope into ckv_cache and the rotated k_rope into kpe_cache as
fp8(value * quant_scale_kv), token ``t`` at entry ``kv_indptr[b] * page_size + positions[t]`` of
request ``b = batch_indices[t]``'s pages (page ``kv_indices[entry // page_size]``, row ``entry %
page_size``), padding (``b < 0``) not written. One cupyrope launch; refusals write nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupyrope as cr  # noqa: E402
from backends import Backend, backend_params  # noqa: E402
from cupyrope import compat  # noqa: E402
from cupyrope.compat import flashinfer  # noqa: E402
from reference import reference_rope  # noqa: E402
from test_compat_flashinfer import (PAGED_APPENDED, PAGED_LENGTHS, page_table,  # noqa: E402
                                    reference_batch_positions)
from test_fused_mla import FP8 as FP8_FORMATS  # noqa: E402
from test_fused_mla import assert_fp8_close, host_values, put_fp8  # noqa: E402
from tolerances import assert_bits_equal, np_dtype  # noqa: E402

TORCH = backend_params(["torch", "torch-cuda"])
SHAPES = {"small": dict(H=4, R=32, N=96), "deepseek": dict(H=16, R=64, N=512),
          "no_nope": dict(H=4, R=32, N=0)}


def rotate_as_flashinfer(x: torch.Tensor, table: torch.Tensor, pos_ids: torch.Tensor,
                         is_neox: bool) -> torch.Tensor:
    """float64 RoPE of ``x [nnz, heads, rope_dim]`` with cos_sin_cache rows ``[cos | sin]``:
    NeoX pairs ``(j, j + rope_dim / 2)``, else interleaved ``(2j, 2j + 1)``."""
    half = x.shape[-1] // 2
    rows = table.double()[pos_ids.long()]
    cos, sin = rows[:, None, :half], rows[:, None, half:]
    first, second = ((slice(0, half), slice(half, None)) if is_neox
                     else (slice(0, None, 2), slice(1, None, 2)))
    x = x.double()
    out = torch.empty_like(x)
    out[..., first] = x[..., first] * cos - x[..., second] * sin
    out[..., second] = x[..., second] * cos + x[..., first] * sin
    return out


def flashinfer_mla_append(q_rope, k_rope, q_nope, k_nope, table, pos_ids, kv_indices, kv_indptr,
                          batch_indices, positions, page_size, num_pages, is_neox, scale_q,
                          scale_kv):
    """The exact (float64) values FlashInfer's MLA append stores, before the fp8 rounding:
    ``(q_rope_out, q_nope_out, ckv_cache, kpe_cache)``, rows no token writes NaN."""
    nnz, rank, rope_dim = k_rope.shape[0], k_nope.shape[-1], k_rope.shape[-1]
    q_rope_out = rotate_as_flashinfer(q_rope, table, pos_ids, is_neox) * scale_q
    k_rotated = rotate_as_flashinfer(k_rope[:, None], table, pos_ids, is_neox)[:, 0]
    ckv = torch.full((num_pages, page_size, rank), float("nan"), dtype=torch.float64)
    kpe = torch.full((num_pages, page_size, rope_dim), float("nan"), dtype=torch.float64)
    for t in range(nnz):
        b = int(batch_indices[t])
        if b < 0:
            continue
        entry = int(kv_indptr[b]) * page_size + int(positions[t])
        page, row = int(kv_indices[entry // page_size]), entry % page_size
        ckv[page, row] = k_nope[t].double() * scale_kv
        kpe[page, row] = k_rotated[t] * scale_kv
    return q_rope_out, q_nope.double() * scale_q, ckv, kpe


def mla_case(backend, rng, randn, shape, page_size, fmt):
    """FlashInfer's MLA inputs on the backend (host copies too), the page table (scattered pages,
    requests appended to existing KV, padding tokens at the end) and NaN-poisoned caches."""
    H, R, N = shape["H"], shape["R"], shape["N"]
    kv_indptr, kv_indices, _, num_pages = page_table(rng, page_size, PAGED_LENGTHS)
    append_indptr = np.cumsum([0, *PAGED_APPENDED])
    nnz = int(append_indptr[-1]) + 3
    batch, position = reference_batch_positions(append_indptr, PAGED_LENGTHS, nnz)
    host = dict(q_rope=randn((nnz, H, R), "bfloat16"), k_rope=randn((nnz, R), "bfloat16"),
                q_nope=randn((nnz, H, N), "bfloat16"), k_nope=randn((nnz, N), "bfloat16"))
    inputs = {name: backend.put(x) for name, x in host.items()}
    caches = [put_fp8(backend, np.full((num_pages, page_size, dim), np.nan, np.float32)
                      .astype(np_dtype(fmt))) for dim in (N, R)]
    table = dict(kv_indices=np.asarray(kv_indices, np.int32), kv_indptr=kv_indptr,
                 batch_indices=batch.astype(np.int32), positions=position.astype(np.int32))
    return host, inputs, caches, table, num_pages


@pytest.fixture
def mla_launches(monkeypatch):
    """The cupyrope launches the adapter makes: MLA calls, and any GQA ones (none expected)."""
    seen = []

    def counting(name, launch):
        def call(*args, **kwargs):
            seen.append(name)
            return launch(*args, **kwargs)
        return call

    monkeypatch.setattr(flashinfer, "mla_rope_and_cache",
                        counting("mla", flashinfer.mla_rope_and_cache))
    monkeypatch.setattr(flashinfer, "rope_and_cache", counting("gqa", flashinfer.rope_and_cache))
    return seen


@pytest.mark.parametrize("backend", TORCH, indirect=True)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("with_out", [False, True])
def test_mla_append_is_flashinfers(backend, rng, randn, mla_launches, shape, fmt, is_neox,
                                   page_size, with_out):
    host, inputs, caches, table, num_pages = mla_case(backend, rng, randn, SHAPES[shape],
                                                      page_size, fmt)
    nnz, R = host["k_rope"].shape
    pos_ids = rng.integers(0, 512, nnz)
    cos_sin = cr.cos_sin_cache(512, R, dtype="float32")
    no_nope = SHAPES[shape]["N"] == 0
    nopes = [None, None] if no_nope else [inputs["q_nope"], inputs["k_nope"]]
    outs = [None, None]
    if with_out:
        outs = [put_fp8(backend, np.full(host[name].shape, np.nan, np.float32)
                        .astype(np_dtype(fmt))) for name in ("q_rope", "q_nope")]
    before = {name: host_values(backend, x).copy() for name, x in inputs.items()}
    scale_kv = (torch.tensor([0.5], device=inputs["q_rope"].device) if page_size == 4
                else 0.5)  # a one-element tensor or a number, multiplied in
    result = compat.rope_quantize_fp8_append_paged_kv_cache(
        inputs["q_rope"], inputs["k_rope"], *nopes, None, backend.put(cos_sin),
        backend.put(pos_ids), tuple(caches), *(backend.put(x) for x in table.values()),
        is_neox=is_neox, quantize_dtype=None if with_out else getattr(torch, fmt),
        quant_scale_q=2.0, quant_scale_kv=scale_kv, page_size=page_size,
        q_rope_out=outs[0], q_nope_out=outs[1])
    assert mla_launches == ["mla"]
    assert isinstance(result, tuple) and len(result) == 2
    if with_out:
        assert result[0] is outs[0] and result[1] is outs[1]
    as_torch = {name: torch.from_numpy(x.astype(np.float32)) for name, x in host.items()}
    expected = flashinfer_mla_append(
        as_torch["q_rope"], as_torch["k_rope"], as_torch["q_nope"], as_torch["k_nope"],
        torch.from_numpy(cos_sin), torch.from_numpy(pos_ids),
        *(torch.from_numpy(np.asarray(x)) for x in table.values()), page_size, num_pages,
        is_neox, 2.0, 0.5)
    # The reading of FlashInfer's rotation agrees with the float64 reference.
    np.testing.assert_allclose(
        expected[0].numpy() / 2.0, reference_rope(host["q_rope"], pos_ids, cos_sin_cache=cos_sin,
                                                  interleaved=not is_neox), rtol=0, atol=1e-12)
    got = [host_values(backend, x) for x in (*result, *caches)]
    assert got[0].dtype.name == fmt and got[1].shape == host["q_nope"].shape
    for g, e, what in zip(got, expected, ("q_rope_out", "q_nope_out", "ckv_cache",
                                          "kpe_cache")):
        e = e.numpy()
        written = ~np.isnan(e)
        assert (np.isnan(g.astype(np.float32)) == ~written).all(), f"{what}: rows written"
        if written.any():
            assert_fp8_close(g[written], e[written], what)
    for name, x in inputs.items():
        assert_bits_equal(host_values(backend, x), before[name], what=f"{name} after the call")


def test_mla_append_into_a_prefilled_cache_keeps_other_rows(rng, randn):
    """A decode step after a prefill: the prefill's rows keep their bits, padding tokens
    (batch index -1, as get_batch_indices_positions gives CUDA-graph padding) write nothing."""
    backend, page_size, R, N, H = Backend("torch"), 16, 64, 512, 8
    lengths = [30, 50, 70]
    pages = [-(-n // page_size) for n in lengths]
    kv_indptr = torch.tensor(np.cumsum([0, *pages, 0, 0]), dtype=torch.int32)
    num_pages = sum(pages) + 4
    kv_indices = torch.arange(num_pages, dtype=torch.int32)
    ckv = torch.from_numpy(randn((num_pages, page_size, N))).to(torch.float8_e4m3fn)
    kpe = torch.from_numpy(randn((num_pages, page_size, R))).to(torch.float8_e4m3fn)
    snapshot = [ckv.clone(), kpe.clone()]
    qo_indptr = torch.tensor([0, 1, 2, 3, 3, 3], dtype=torch.int32)
    seq_lens = torch.tensor([*lengths, 0, 0], dtype=torch.int32)
    batch, position = compat.get_batch_indices_positions(qo_indptr, seq_lens, 5)
    assert batch.tolist() == [0, 1, 2, -1, -1]
    pos_ids = torch.tensor([n - 1 for n in lengths] + [0, 0])
    cos_sin = torch.from_numpy(cr.cos_sin_cache(256, R, dtype="float32"))
    q_rope = backend.put(randn((5, H, R), "bfloat16"))
    q_nope = backend.put(randn((5, H, N), "bfloat16"))
    k_rope, k_nope = backend.put(randn((5, R), "bfloat16")), backend.put(randn((5, N),
                                                                            "bfloat16"))
    compat.rope_quantize_fp8_append_paged_kv_cache(
        q_rope, k_rope, q_nope, k_nope, None, cos_sin, pos_ids, (ckv, kpe), kv_indices,
        kv_indptr, batch, position, is_neox=False, page_size=page_size, kv_layout="HND")
    written = np.zeros((num_pages, page_size), bool)
    for b, n in enumerate(lengths):
        entry = int(kv_indptr[b]) * page_size + n - 1
        written[int(kv_indices[entry // page_size]), entry % page_size] = True
    for cache, before, k in ((ckv, snapshot[0], k_nope), (kpe, snapshot[1], None)):
        bits, old = cache.view(torch.uint8).numpy(), before.view(torch.uint8).numpy()
        assert_bits_equal(bits[~written], old[~written], what="rows of the prefill")
        if k is not None:  # the latent as it is (fp8 of bfloat16, scale 1)
            assert_bits_equal(bits[written], k[:3].float().to(torch.float8_e4m3fn)
                              .view(torch.uint8).numpy(), what="the decode tokens' kv_c")


def _mla_args(rng, randn, **change):
    backend = Backend("torch")
    host, inputs, caches, table, _ = mla_case(backend, rng, randn, SHAPES["small"], 4,
                                              "float8_e4m3fn")
    nnz = host["k_rope"].shape[0]
    args = dict(q_rope=inputs["q_rope"], k_rope=inputs["k_rope"], q_nope=inputs["q_nope"],
                k_nope=inputs["k_nope"], v=None,
                cos_sin_cache=torch.from_numpy(cr.cos_sin_cache(64, 32)),
                pos_ids=torch.zeros(nnz, dtype=torch.int64), paged_kv_cache=tuple(caches),
                **{name: torch.from_numpy(np.asarray(x)) for name, x in table.items()},
                page_size=4)
    args.update(change)
    return args, caches


@pytest.mark.parametrize("case, error, match", [
    ("v", ValueError, r"MLA \(2-d k_rope\) takes no v"),
    ("one_cache", TypeError, r"paged_kv_cache must be a tuple \(ckv_cache, kpe_cache\)"),
    ("ckv_dtype", TypeError, "ckv_cache must have quantize_dtype torch.float8_e5m2"),
    ("ckv_width", ValueError, r"ckv_cache must be \(max_pages, page_size=4, kv_lora_rank=96\)"),
    ("kpe_pages", ValueError, r"kpe_cache must be \(max_pages, page_size=8, rope_dim=32\)"),
    ("kpe_count", ValueError, "ckv_cache and kpe_cache must have the same pages"),
    ("k_nope", ValueError, "q_nope and k_nope must have one no_rope_dim, got 96 and 95"),
    ("k_rope", ValueError, r"k_rope must be \(nnz=\d+, num_kv_heads, rope_dim=32\)"),
    ("layout", ValueError, "kv_layout must be 'NHD' or 'HND', got 'NDH'"),
    ("pos_ids", ValueError, r"pos_ids must have shape \(\d+,\)"),
    ("batch_indices", ValueError, r"batch_indices must have shape \(\d+,\) \(one per token\)"),
    ("q_nope_out", ValueError, r"q_nope_out must have its input's shape"),
    ("scale", ValueError, "quant_scale_kv must be finite and > 0"),
])
def test_mla_append_refusals_write_nothing(rng, randn, case, error, match):
    args, caches = _mla_args(rng, randn)
    nnz = args["q_rope"].shape[0]
    if case == "v":
        args["v"] = torch.zeros(nnz, 1, 128, dtype=torch.bfloat16)
    elif case == "one_cache":
        args["paged_kv_cache"] = caches[0]
    elif case == "ckv_dtype":
        args["quantize_dtype"] = torch.float8_e5m2
        args["paged_kv_cache"] = (caches[0], caches[1].view(torch.float8_e5m2))
    elif case == "ckv_width":
        args["paged_kv_cache"] = (caches[0][..., :95], caches[1])
    elif case == "kpe_pages":
        args["page_size"] = 8
        args["paged_kv_cache"] = (caches[0].reshape(-1, 8, 96), caches[1])
    elif case == "kpe_count":
        args["paged_kv_cache"] = (caches[0], caches[1][:-1])
    elif case == "k_nope":
        args["k_nope"] = args["k_nope"][:, :95]
    elif case == "k_rope":
        args["k_rope"] = args["k_rope"][:, :31]
    elif case == "layout":
        args["kv_layout"] = "NDH"
    elif case == "pos_ids":
        args["pos_ids"] = torch.zeros(nnz - 1, dtype=torch.int64)
    elif case == "batch_indices":
        args["batch_indices"] = args["batch_indices"][:-1]
    elif case == "q_nope_out":
        args["q_nope_out"] = torch.zeros(nnz, 4, 95, dtype=torch.float8_e4m3fn)
    elif case == "scale":
        args["quant_scale_kv"] = float("inf")
    before = [c.view(torch.uint8).numpy().copy() for c in caches]
    with pytest.raises(error, match=f"^rope_quantize_fp8_append_paged_kv_cache: {match}"):
        compat.rope_quantize_fp8_append_paged_kv_cache(**args)
    for cache, bits in zip(caches, before):
        assert_bits_equal(cache.view(torch.uint8).numpy(), bits, what="cache after a refusal")
