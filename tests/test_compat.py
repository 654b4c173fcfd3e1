"""The drop-in adapters of cupyrope.compat against the behaviour they imitate (torch on the CPU), and
the training-layout position helpers (cupyrope.positions).

- Hugging Face: ``hf_apply_rotary_pos_emb`` against transformers' own ``apply_rotary_pos_emb``
  (Llama's, and GPT-NeoX's for partial rotary) in values, dtype and gradients; ``patch_hf_model`` on
  tiny Llama, Mistral, Qwen2, Phi and GPT-NeoX models gives the unpatched logits and parameter
  gradients while every attention layer goes through cupyrope, and refuses the models whose function
  computes something else (GLM, Cohere: interleaved; GPT-J: another signature);
- vLLM / SGLang: ``rotary_embedding`` (in place) against vLLM's ``forward_native`` (transcribed below
  from vllm/model_executor/layers/rotary_embedding/{base,common}.py);
- TransformerEngine: ``te_apply_rotary_pos_emb`` against TE's unfused PyTorch path (transcribed below
  from transformer_engine/pytorch/attention/rope.py): sbhd / bshd / thd, start_positions, context
  parallelism, interleaved, partial rotary; values and gradients;
- ``context_parallel_positions`` / ``te_positions`` against a plain construction, and against the
  adapter's own on-device positions.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupyrope as cr  # noqa: E402
from cupyrope import compat  # noqa: E402
from cupyrope.positions import context_parallel_positions, te_positions, varlen_positions  # noqa: E402
from reference import reference_rope  # noqa: E402
from tolerances import assert_bits_equal, assert_rope_close  # noqa: E402


def randn(shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


# ----------------------------------------------------------------------------------------------------
# Hugging Face


@pytest.fixture(scope="module")
def modeling_llama():
    pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    return modeling_llama


def hf_tables(batch, seq, width, dtype, seed=1):
    angles = torch.rand(batch, seq, width // 2, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(seed)) * 50
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_hf_matches_transformers(layout, dtype, modeling_llama):
    B, S, Hq, Hk, D = 2, 7, 4, 2, 32
    cos, sin = hf_tables(B, S, D, dtype)
    if layout == "bhsd":  # as Llama's attention makes them: transposed views of [B, S, H, D]
        q = randn((B, S, Hq, D), dtype).transpose(1, 2)
        k = randn((B, S, Hk, D), dtype, seed=2).transpose(1, 2)
        unsqueeze_dim = 1
    else:
        q, k = randn((B, S, Hq, D), dtype), randn((B, S, Hk, D), dtype, seed=2)
        unsqueeze_dim = 2
    expected = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    got = compat.hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    # The same computation in float64 (tables as given): what both approximate.
    exact = modeling_llama.apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double(),
                                                unsqueeze_dim=unsqueeze_dim)
    for g, e, x64, x in zip(got, expected, exact, (q, k)):
        assert g.shape == e.shape and g.dtype == e.dtype
        if dtype == torch.float64:
            torch.testing.assert_close(g, e, rtol=1e-13, atol=1e-13)
            continue
        # cupyrope rounds once (the shared tolerance table); Hugging Face rounds after each op:
        # cupyrope is never further from the float64 result than Hugging Face itself.
        heads = 1 if layout == "bhsd" else 2
        assert_rope_close(_np(g.movedim(heads, -2)), x64.movedim(heads, -2).numpy(),
                          _np(x.movedim(heads, -2)), interleaved=False, rotary_dim=D)
        hf_error = (e.double() - x64).abs().max()
        assert (g.double() - x64).abs().max() <= hf_error + 1e-6


def _np(t):
    from tolerances import as_numpy

    return np.ascontiguousarray(as_numpy(t.contiguous()))


def test_hf_gradients_match_transformers(modeling_llama):
    B, S, Hq, Hk, D = 2, 5, 4, 1, 16
    cos, sin = hf_tables(B, S, D, torch.float64)
    q = randn((B, S, Hq, D)).transpose(1, 2).requires_grad_(True)
    k = randn((B, S, Hk, D), seed=3).transpose(1, 2).requires_grad_(True)
    wq, wk = randn((B, Hq, S, D), seed=4), randn((B, Hk, S, D), seed=5)
    grads = []
    for fn in (modeling_llama.apply_rotary_pos_emb, compat.hf_apply_rotary_pos_emb):
        q_out, k_out = fn(q, k, cos, sin)
        grads.append(torch.autograd.grad((q_out * wq).sum() + (k_out * wk).sum(), (q, k)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_hf_dtype_promotion_and_position_ids(modeling_llama):
    """bfloat16 q/k with float32 tables: Hugging Face returns float32 (type promotion)."""
    B, S, H, D = 1, 4, 2, 8
    cos, sin = hf_tables(B, S, D, torch.float32)
    q, k = randn((B, H, S, D), torch.bfloat16), randn((B, H, S, D), torch.bfloat16, seed=2)
    expected = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    got = compat.hf_apply_rotary_pos_emb(q, k, cos, sin, torch.arange(S)[None], unsqueeze_dim=-3)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype == torch.float32
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


def test_hf_partial_rotary_matches_gpt_neox():
    pytest.importorskip("transformers")
    from transformers.models.gpt_neox import modeling_gpt_neox

    B, S, H, D, r = 2, 5, 3, 16, 8
    cos, sin = hf_tables(B, S, r, torch.float64)
    q, k = randn((B, H, S, D)), randn((B, H, S, D), seed=2)
    expected = modeling_gpt_neox.apply_rotary_pos_emb(q, k, cos, sin)
    got = compat.hf_apply_rotary_pos_emb(q, k, cos, sin)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-13, atol=1e-13)


TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
PATCHABLE = [("LlamaForCausalLM", "LlamaConfig", {}),
             ("MistralForCausalLM", "MistralConfig", {}),
             ("Qwen2ForCausalLM", "Qwen2Config", {}),
             ("PhiForCausalLM", "PhiConfig", {"partial_rotary_factor": 0.5}),
             ("GPTNeoXForCausalLM", "GPTNeoXConfig", {"rotary_pct": 0.5})]
REFUSED = [("GlmForCausalLM", "GlmConfig", {}, "does not compute"),
           ("CohereForCausalLM", "CohereConfig", {}, "does not compute"),
           ("GPTJForCausalLM", "GPTJConfig", {"rotary_dim": 8}, "failed on Llama-layout input")]


def tiny_model(model_name, config_name, extra):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, config_name)(**TINY, **extra)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).double()


@pytest.mark.parametrize("model_name, config_name, extra", PATCHABLE)
def test_patch_hf_model_same_logits_and_gradients(model_name, config_name, extra, monkeypatch):
    model = tiny_model(model_name, config_name, extra)
    module = sys.modules[type(model).__module__]  # its modeling_<name> module
    original = module.apply_rotary_pos_emb
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    results = []
    for patched in (False, True):
        model.zero_grad()
        if patched:
            calls = []
            real = compat.hf.apply_rope
            monkeypatch.setattr(compat.hf, "apply_rope", lambda *a, **kw: calls.append(1) or real(*a, **kw))
            with compat.patch_hf_model(model) as patch:
                assert patch.modules == [module.__name__]
                assert module.apply_rotary_pos_emb is compat.hf_apply_rotary_pos_emb
                calls.clear()  # the patch's own check called it too
                out = model(ids, labels=ids)
                out.loss.backward()
                assert len(calls) == TINY["num_hidden_layers"]  # one launch per attention layer
            assert module.apply_rotary_pos_emb is original
        else:
            out = model(ids, labels=ids)
            out.loss.backward()
        results.append([out.logits.detach()] + [p.grad.clone() for p in model.parameters()
                                                if p.grad is not None])
    assert len(results[0]) == len(results[1]) > 1
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("model_name, config_name, extra, match", REFUSED)
def test_patch_hf_model_refuses_other_rope(model_name, config_name, extra, match):
    model = tiny_model(model_name, config_name, extra)
    module = sys.modules[type(model).__module__]
    before = module.apply_rotary_pos_emb
    with pytest.raises(ValueError, match=match):
        compat.patch_hf_model(model)
    assert module.apply_rotary_pos_emb is before


def test_patch_hf_model_without_rope():
    with pytest.raises(ValueError, match="apply_rotary_pos_emb"):
        compat.patch_hf_model(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_patch_and_compile_fullgraph(modeling_llama):
    """A patched model's layer compiles without a graph break (aot_eager)."""
    model = tiny_model("LlamaForCausalLM", "LlamaConfig", {})
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1))
    expected = model(ids).logits
    with compat.patch_hf_model(model):
        torch._dynamo.reset()
        got = torch.compile(model.model.layers[0], fullgraph=True, backend="aot_eager")
        hidden = model.model.embed_tokens(ids)
        position_embeddings = model.model.rotary_emb(hidden, torch.arange(6)[None])
        a = got(hidden, position_embeddings=position_embeddings)
        b = model.model.layers[0](hidden, position_embeddings=position_embeddings)
    a = a[0] if isinstance(a, tuple) else a
    b = b[0] if isinstance(b, tuple) else b
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert expected.shape == (1, 6, 64)


# ----------------------------------------------------------------------------------------------------
# vLLM / SGLang: forward_native, transcribed from vLLM (RotaryEmbedding.forward_native and
# apply_rotary_emb_torch)


def vllm_apply_rotary_emb_torch(x, cos, sin, is_neox_style):
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    if is_neox_style:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1 = x[..., ::2]
        x2 = x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def vllm_forward_native(positions, query, key, head_size, cos_sin_cache, is_neox_style):
    rotary_dim = cos_sin_cache.shape[-1]
    positions = positions.flatten()
    num_tokens = positions.shape[0]
    cos_sin = cos_sin_cache.index_select(0, positions)
    cos, sin = cos_sin.chunk(2, dim=-1)
    out = []
    for x in (query, key):
        if x is None:
            out.append(None)
            continue
        shape = x.shape
        x = x.reshape(num_tokens, -1, head_size)
        x_rot = vllm_apply_rotary_emb_torch(x[..., :rotary_dim], cos, sin, is_neox_style)
        out.append(torch.cat((x_rot, x[..., rotary_dim:]), dim=-1).reshape(shape))
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("layout", ["flat", "heads", "fused_qkv", "batched"])
@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("with_key", [True, False])
def test_vllm_rotary_embedding(dtype, is_neox, layout, rotary_dim, with_key):
    T, Hq, Hk, D, P = 11, 4, 2, 64, 256
    cache = cr.cos_sin_cache(P, rotary_dim, theta=10000.0, like=torch.empty(0)).to(dtype)
    positions = torch.randint(0, P, (T,), generator=torch.Generator().manual_seed(3))
    qkv = None
    if layout == "flat":
        query, key = randn((T, Hq * D), dtype), randn((T, Hk * D), dtype, seed=2)
    elif layout == "heads":
        query, key = randn((T, Hq, D), dtype), randn((T, Hk, D), dtype, seed=2)
    elif layout == "fused_qkv":
        qkv = randn((T, (Hq + 2 * Hk) * D), dtype)
        query, key = qkv[:, :Hq * D], qkv[:, Hq * D:(Hq + Hk) * D]
    else:  # [B, S, H * D] with [B, S] positions
        positions = positions[:10].view(2, 5)
        query, key = randn((2, 5, Hq * D), dtype), randn((2, 5, Hk * D), dtype, seed=2)
    key = key if with_key else None
    expected = vllm_forward_native(positions, query.clone(), None if key is None else key.clone(),
                                   D, cache, is_neox)
    exact = vllm_forward_native(positions, query.double(), None if key is None else key.double(),
                                D, cache.double(), is_neox)
    v_before = None if qkv is None else qkv[:, (Hq + Hk) * D:].clone()
    query_in = query.clone()
    assert compat.rotary_embedding(positions, query, key, D, cache, is_neox) is None
    for got, want, want64, x in zip((query, key), expected, exact, (query_in, None)):
        if got is None:
            continue
        if dtype == torch.float64:
            torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
        else:  # one rounding here, vLLM's native path rounds after each op
            assert (got.double() - want64).abs().max() <= (want.double() - want64).abs().max() + 1e-6
    if v_before is not None:
        assert_bits_equal(qkv[:, (Hq + Hk) * D:], v_before, what="v next to the rotated q and k")


def test_vllm_rotary_embedding_errors():
    q, positions = randn((4, 3 * 8)), torch.arange(4)
    cache = cr.cos_sin_cache(8, 8, like=q)
    with pytest.raises(ValueError, match="multiple of head_size"):
        compat.rotary_embedding(positions, q, None, 5, cache, True)
    with pytest.raises(ValueError, match="head size"):
        compat.rotary_embedding(positions, q.view(4, 3, 8), None, 4, cache, True)
    with pytest.raises(TypeError, match="head_size"):
        compat.rotary_embedding(positions, q, None, 8.0, cache, True)


# ----------------------------------------------------------------------------------------------------
# TransformerEngine: the unfused PyTorch path, transcribed from TE (rope.py)


def te_rotate_half(x, interleaved):
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x_new = torch.stack((-x2, x1), dim=-1)
    return x_new.view(x_new.shape[0], x_new.shape[1], x_new.shape[2], -1)


def te_apply_base(t, freqs, start_positions=None, tensor_format="sbhd", interleaved=False):
    cur_seq_len = t.shape[1] if tensor_format == "bshd" else t.shape[0]
    if start_positions is not None:
        freqs = torch.concatenate([freqs[i:i + cur_seq_len] for i in start_positions], dim=1)
    freqs = freqs[:cur_seq_len]
    if tensor_format == "bshd":
        freqs = freqs.transpose(0, 1)
    cos_ = torch.cos(freqs).to(t.dtype)
    sin_ = torch.sin(freqs).to(t.dtype)
    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    t = (t * cos_) + (te_rotate_half(t, interleaved) * sin_)
    return torch.cat((t, t_pass), dim=-1)


def te_freqs_on_cp_rank(freqs, seqlen, cp_size, cp_rank):
    if cp_size > 1:
        cp_seg = seqlen // 2
        full_seqlen = cp_size * seqlen
        return torch.cat([freqs[cp_rank * cp_seg:(cp_rank + 1) * cp_seg],
                          freqs[full_seqlen - (cp_rank + 1) * cp_seg:full_seqlen - cp_rank * cp_seg]])
    return freqs


def te_reference(t, freqs, tensor_format="sbhd", start_positions=None, interleaved=False,
                 cu_seqlens=None, cp_size=1, cp_rank=0):
    if tensor_format == "thd":
        cu_seqlens = cu_seqlens // cp_size
        seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        return torch.cat([
            te_apply_base(x.unsqueeze(1), te_freqs_on_cp_rank(freqs, x.size(0), cp_size, cp_rank),
                          start_positions=(start_positions[idx:idx + 1]
                                           if start_positions is not None else None),
                          interleaved=interleaved)
            for idx, x in enumerate(torch.split(t, seqlens))
        ]).squeeze(1)
    seqlen = t.size(0) if tensor_format == "sbhd" else t.size(1)
    return te_apply_base(t, te_freqs_on_cp_rank(freqs, seqlen, cp_size, cp_rank), start_positions,
                         tensor_format, interleaved=interleaved)


def te_freqs(max_seq, rotary_dim, interleaved, theta=10000.0):
    """TransformerEngine's RotaryPositionEmbedding(dim)(max_seq): float32 [s2, 1, 1, rotary_dim]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.einsum("i , j -> i j", torch.arange(max_seq, dtype=torch.float32), inv_freq)
    if not interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb.reshape(emb.size(0), 1, 1, emb.size(1))


TE_CASES = [
    pytest.param(dict(tensor_format="sbhd"), id="sbhd"),
    pytest.param(dict(tensor_format="bshd"), id="bshd"),
    pytest.param(dict(tensor_format="sbhd", start_positions=[3, 0, 17]), id="sbhd-start"),
    pytest.param(dict(tensor_format="bshd", start_positions=[5, 1, 0]), id="bshd-start"),
    pytest.param(dict(tensor_format="sbhd", cp_size=2, cp_rank=1), id="sbhd-cp2r1"),
    pytest.param(dict(tensor_format="bshd", cp_size=4, cp_rank=2), id="bshd-cp4r2"),
    pytest.param(dict(tensor_format="thd", cu_seqlens=[0, 5, 12, 16]), id="thd"),
    pytest.param(dict(tensor_format="thd", cu_seqlens=[0, 5, 12, 16], start_positions=[4, 0, 9]),
                 id="thd-start"),
    pytest.param(dict(tensor_format="thd", cu_seqlens=[0, 8, 24, 32], cp_size=2, cp_rank=0),
                 id="thd-cp2r0"),
    pytest.param(dict(tensor_format="thd", cu_seqlens=[0, 16, 24, 48], cp_size=4, cp_rank=3),
                 id="thd-cp4r3"),
]


def te_input(case, dtype, H=3, D=32, B=3, S=8):
    fmt, cp = case["tensor_format"], case.get("cp_size", 1)
    if fmt == "thd":
        shape = (case["cu_seqlens"][-1] // cp, H, D)
    else:
        shape = (S, B, H, D) if fmt == "sbhd" else (B, S, H, D)
    kwargs = {name: torch.tensor(value, dtype=torch.int32) if isinstance(value, list) else value
              for name, value in case.items()}
    return randn(shape, dtype), kwargs


@pytest.mark.parametrize("case", TE_CASES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_te_matches_unfused_reference(case, interleaved, rotary_dim):
    t, kwargs = te_input(case, torch.float64)
    freqs = te_freqs(64, rotary_dim, interleaved)
    expected = te_reference(t, freqs, interleaved=interleaved, **kwargs)
    got = compat.te_apply_rotary_pos_emb(t, freqs, interleaved=interleaved, **kwargs)
    assert got.shape == t.shape and got.dtype == t.dtype
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", TE_CASES[:2] + TE_CASES[6:7])
def test_te_bfloat16_and_views(case):
    """bfloat16 in a strided view (q of a fused projection): one rounding from the float64 result."""
    t0, kwargs = te_input(case, torch.bfloat16, H=6)
    t = t0[..., :3, :]  # heads 0..2 of 6: a view with padded head strides
    freqs = te_freqs(64, 32, False)
    got = compat.te_apply_rotary_pos_emb(t, freqs, **kwargs)
    exact = te_reference(t.double(), freqs, **kwargs)
    heads_last = lambda x: x.reshape(-1, *x.shape[-2:])  # noqa: E731
    assert_rope_close(_np(heads_last(got)), heads_last(exact).numpy(), _np(heads_last(t)),
                      interleaved=False, rotary_dim=32, table_dtype="float32")


@pytest.mark.parametrize("case", [TE_CASES[0], TE_CASES[5], TE_CASES[8]])
def test_te_gradients_match_reference(case):
    t, kwargs = te_input(case, torch.float64)
    freqs = te_freqs(64, 32, True)
    weights = randn(t.shape, seed=7)
    grads = []
    for fn in (te_reference, compat.te_apply_rotary_pos_emb):
        x = t.clone().requires_grad_(True)
        (fn(x, freqs, interleaved=True, **kwargs) * weights).sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-12)


def test_te_compiles_fullgraph():
    torch._dynamo.reset()
    t, kwargs = te_input(TE_CASES[8].values[0], torch.float32)
    freqs = te_freqs(64, 32, False)
    compiled = torch.compile(compat.te_apply_rotary_pos_emb, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(t, freqs, **kwargs),
                               compat.te_apply_rotary_pos_emb(t, freqs, **kwargs), rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(tensor_format="hbsd"), "tensor_format"),
    (dict(tensor_format="thd"), "cu_seqlens"),
    (dict(cp_size=2, cp_rank=2), "cp_rank"),
])
def test_te_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compat.te_apply_rotary_pos_emb(randn((8, 3, 2, 16)), te_freqs(16, 16, False), **kwargs)


# ----------------------------------------------------------------------------------------------------
# position helpers


def brute_force_cp_positions(lengths, cp_size, cp_rank, offsets=None):
    out = []
    for i, length in enumerate(lengths):
        chunks = np.split(np.arange(length), 2 * cp_size)
        mine = np.concatenate([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]])
        out.append(mine + (0 if offsets is None else offsets[i]))
    return np.concatenate(out) if out else np.zeros(0, np.int64)


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("with_offsets", [False, True])
def test_context_parallel_positions(cp_size, with_offsets, rng):
    lengths = rng.integers(0, 5, 6) * 2 * cp_size
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    offsets = rng.integers(0, 100, 6) if with_offsets else None
    for rank in range(cp_size):
        got = context_parallel_positions(cu_seqlens, cp_size, rank, offsets=offsets)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, brute_force_cp_positions(lengths, cp_size, rank, offsets))
    # Every position of every sequence is held by exactly one rank.
    everything = np.sort(np.concatenate([context_parallel_positions(cu_seqlens, cp_size, r)
                                         for r in range(cp_size)]))
    np.testing.assert_array_equal(everything, np.sort(varlen_positions(cu_seqlens)))
    if cp_size == 1:
        np.testing.assert_array_equal(context_parallel_positions(cu_seqlens, 1, 0, offsets=offsets),
                                      varlen_positions(cu_seqlens, offsets))


def test_context_parallel_positions_torch_and_errors():
    cu = torch.tensor([0, 8, 16], dtype=torch.int64)
    got = context_parallel_positions(cu, 2, 1)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.int64
    assert got.tolist() == [2, 3, 4, 5, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="multiple of 2 \\* cp_size"):
        context_parallel_positions(np.array([0, 6]), 2, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        context_parallel_positions(np.array([0, 8]), 2, 2)
    with pytest.raises(TypeError, match="int32 or int64"):
        context_parallel_positions(np.array([0.0, 8.0]), 2, 0)


@pytest.mark.parametrize("case", TE_CASES)
def test_te_positions_host_equals_device_and_rotates_like_te(case):
    t, kwargs = te_input(case, torch.float64)
    host = te_positions(t, **kwargs)
    device = compat.te.positions_on_device(t, kwargs["tensor_format"], kwargs.get("cu_seqlens"),
                                            kwargs.get("start_positions"), kwargs.get("cp_size", 1),
                                            kwargs.get("cp_rank", 0))
    assert isinstance(host, torch.Tensor) and host.dtype == torch.int64
    assert torch.equal(torch.broadcast_to(host, device.shape), device) and host.shape == device.shape
    # apply_rope with those positions and a cos/sin cache of the same angles is TE's rotation.
    freqs = te_freqs(64, 32, False)
    cache = compat.te_cos_sin_cache(freqs)
    got = cr.apply_rope(t, positions=host, cos_sin_cache=cache)
    torch.testing.assert_close(got, te_reference(t, freqs, **kwargs), rtol=1e-12, atol=1e-12)


def test_te_positions_numpy_and_errors():
    t = np.zeros((8, 2, 1, 4))
    positions = te_positions(t, "sbhd", start_positions=np.array([1, 10]))
    assert positions.shape == (8, 2) and positions[:, 1].tolist() == list(range(10, 18))
    ref = reference_rope(np.ones((8, 2, 1, 4)), positions, theta=10000.0)
    assert ref.shape == (8, 2, 1, 4)
    with pytest.raises(ValueError, match="tensor_format"):
        te_positions(t, "sbh")
    with pytest.raises(ValueError, match="cu_seqlens"):
        te_positions(np.zeros((4, 1, 4)), "thd")
    with pytest.raises(ValueError, match="t has 4"):
        te_positions(np.zeros((4, 1, 4)), "thd", cu_seqlens=np.array([0, 6]))
    with pytest.raises(ValueError, match="4 dims"):
        te_positions(np.zeros((4, 1, 4)), "bshd")
    with pytest.raises(ValueError, match="start_positions"):
        te_positions(t, "sbhd", start_positions=np.array([1, 2, 3]))
