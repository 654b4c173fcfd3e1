"""``patch_hf_model`` on whole Hugging Face models (transformers on the CPU; GPU variants marked
``gpu``): what each family's attention layers run, and that it changes nothing but rounding.

- Every family gives the unpatched logits and parameter gradients: float64 within 1e-10; float32
  and bfloat16 no further from the float64 model than the unpatched model in the same dtype is
  (twice its error, plus a few units of the dtype's rounding). The attention layers of Llama,
  Mistral and Qwen2 rotate with one ``apply_rope`` call each; Qwen3, Qwen3-MoE and Gemma 3
  (per-head q/k norms, Gemma's ``(1 + w)``) and OLMo 2 (norms over the whole projection:
  ``norm_over="all_heads"``) with one ``rms_norm_rope`` call each and their q/k norm modules
  never run;
  Phi and GPT-NeoX (partial rotary / fused QKV split inside the forward) keep their forwards and
  rotate through the replaced ``apply_rotary_pos_emb``.
- The fused call's outputs against a float64 reference of Hugging Face's formulas (the layer's
  own weights, eps and offset), within 2 units of the output dtype's rounding of the head's
  largest element plus float32 arithmetic.
- OLMo 2's function returns q and k in their own dtypes (float32 tables in a bfloat16 model): so
  does its replacement.
- What the fused op cannot take as Hugging Face computes it runs the layer's own norms: float64
  models, norm weights of another dtype, hooks on the norms (registered before or after the
  patch).
- ``restore()`` puts back the class forwards and the module functions; a second patch of a
  patched model replaces nothing; ``attention=False`` replaces only the functions.
- The forward reader refuses every shape it does not know.
- A patched Qwen3 decoder layer compiles with ``fullgraph=True``.
"""

from __future__ import annotations

import copy
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cupyrope import compat  # noqa: E402
from cupyrope.compat import hf_attention  # noqa: E402
from tolerances import unit_roundoff  # noqa: E402

TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
LAYERS = TINY["num_hidden_layers"]
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# family -> (model class, config class, config extras, the op each attention layer calls; None:
# the forward is not replaced, the layers call the replaced apply_rotary_pos_emb)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}, "apply_rope"),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"sliding_window": 4}, "apply_rope"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}, "apply_rope"),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", {}, "rms_norm_rope"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 16}, "rms_norm_rope"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", {"head_dim": 16, **MOE},
                  "rms_norm_rope"),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", {"head_dim": 16, "sliding_window": 4},
               "rms_norm_rope"),
    "phi": ("PhiForCausalLM", "PhiConfig", {"partial_rotary_factor": 0.5}, None),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {"rotary_pct": 0.5}, None),
}
QK_NORM = ["qwen3", "qwen3_moe", "gemma3", "olmo2"]
WEIGHT_OFFSET = {"qwen3": 0.0, "qwen3_moe": 0.0, "gemma3": 1.0, "olmo2": 0.0}
NORM_OVER = {"olmo2": "all_heads"}  # the others: "head"


def tiny_model(family, dtype=torch.float32):
    """A 2-layer random model of ``family`` whose norm weights are random too (Gemma's start at
    zero and Qwen's at one, which would hide a q / k weight mix-up)."""
    model_name, config_name, extra, _ = FAMILIES[family]
    config = getattr(transformers, config_name)(**TINY, **extra)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # grouped_mm has no float64
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(torch.rand(parameter.shape, generator=generator) + 0.5)
    return model.to(dtype)


def input_ids(batch=2, seq=9, seed=0):
    return torch.randint(0, TINY["vocab_size"], (batch, seq),
                         generator=torch.Generator().manual_seed(seed))


def logits_and_gradients(model, ids):
    """The logits, then every parameter gradient of the loss, as float64."""
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    return [out.logits.detach().double()] + [p.grad.double() for p in model.parameters()
                                             if p.grad is not None]


def assert_no_worse(got, unpatched, exact, dtype, what):
    """``got`` (patched) is no further from ``exact`` (the float64 model) than twice the unpatched
    model's error in the same dtype, plus 8 units of the dtype's rounding of the largest value
    (cupyrope rounds once where Hugging Face rounds after each op)."""
    assert got.shape == unpatched.shape == exact.shape, what
    scale = exact.abs().max().item()
    allowed = 2 * (unpatched - exact).abs().max().item() + 8 * unit_roundoff(dtype) * scale
    error = (got - exact).abs().max().item()
    assert error <= allowed, f"{what}: error {error:.3g} over {allowed:.3g}"


@pytest.fixture
def spy(monkeypatch):
    """Calls of ``apply_rope`` and ``rms_norm_rope`` made by cupyrope.compat.hf (arguments and
    results), from the moment it is read. q and k (the first two arguments) are recorded as they
    were before the call: an in-place call writes its results into them."""
    calls = {"apply_rope": [], "rms_norm_rope": []}
    for name in calls:
        real = getattr(compat.hf, name)

        def recording(*args, _name=name, _real=real, **kwargs):
            before = tuple(a.detach().clone() if i < 2 and kwargs.get("inplace") else a
                           for i, a in enumerate(args))
            result = _real(*args, **kwargs)
            calls[_name].append((before, kwargs, result))
            return result

        monkeypatch.setattr(compat.hf, name, recording)
    # A QK-norm layer's repeat calls replay through rms_norm_rope_repeat (positional arguments;
    # None when the call must be made in full): recorded as the rms_norm_rope call they stand for.
    repeat = compat.hf.rms_norm_rope_repeat

    def recording_repeat(q, k, q_weight, k_weight, eps, weight_offset, cos, sin, norm_over,
                         inplace):
        before = (q.detach().clone(), k.detach().clone()) if inplace else (q, k)
        result = repeat(q, k, q_weight, k_weight, eps, weight_offset, cos, sin, norm_over,
                        inplace)
        if result is not None:
            kwargs = dict(eps=eps, weight_offset=weight_offset, cos=cos, sin=sin,
                          norm_over=norm_over, inplace=inplace)
            calls["rms_norm_rope"].append(((*before, q_weight, k_weight), kwargs, result))
        return result

    monkeypatch.setattr(compat.hf, "rms_norm_rope_repeat", recording_repeat)
    return calls


@pytest.fixture
def norm_calls(monkeypatch):
    """ids of the RMSNorm modules of the QK-norm families whose forward ran (counted on the
    classes: a hook or a forward set on a module would itself turn the fused op off)."""
    ran = []
    for module_name in ("qwen3", "qwen3_moe", "gemma3", "olmo2"):
        module = sys.modules.get(f"transformers.models.{module_name}.modeling_{module_name}")
        if module is None:
            module = __import__(f"transformers.models.{module_name}.modeling_{module_name}",
                                fromlist=["_"])
        for attr, cls in vars(module).items():
            if isinstance(cls, type) and attr.endswith("RMSNorm"):
                real = cls.forward

                def counting(self, *args, _real=real, **kwargs):
                    ran.append(id(self))
                    return _real(self, *args, **kwargs)

                monkeypatch.setattr(cls, "forward", counting)
    return ran


def qk_norms(model):
    return [m for layer in model.model.layers for m in (layer.self_attn.q_norm,
                                                         layer.self_attn.k_norm)]


def assert_restored(model):
    assert not [name for name, m in model.named_modules() if "forward" in m.__dict__]


# ----------------------------------------------------------------------------------------------
# Whole models: logits and gradients, and what each layer runs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_float64_models_match_unpatched(family, spy):
    """float64: the plain rotation matches to 1e-10. The QK-norm families take the layer's own
    norms (rms_norm_rope has no float64) and then the rotation; those norms compute in float32
    whatever the model's dtype, so a last-bit difference of the rotation's float64 gradient can
    move one of their float32 roundings: within 8 units of float32 rounding there."""
    model = tiny_model(family, torch.float64)
    module = sys.modules[type(model).__module__]
    original = module.apply_rotary_pos_emb
    ids = input_ids()
    expected = logits_and_gradients(model, ids)
    with compat.patch_hf_model(model) as patch:
        op = FAMILIES[family][3]
        assert patch.layers == ({} if op is None else
                                {f"model.layers.{i}.self_attn": op for i in range(LAYERS)})
        spy["apply_rope"].clear()
        got = logits_and_gradients(model, ids)
        assert len(spy["apply_rope"]) == LAYERS and not spy["rms_norm_rope"]
    assert module.apply_rotary_pos_emb is original
    assert_restored(model)
    assert len(got) == len(expected) > 1
    for g, e in zip(got, expected):
        if family in QK_NORM:
            assert (g - e).abs().max() <= 8 * unit_roundoff("float32") * e.abs().max()
        else:
            torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_models_match_unpatched_within_rounding(family, dtype, spy, norm_calls):
    model = tiny_model(family, dtype)
    exact_model = copy.deepcopy(model).double()  # the same (rounded) weights, in float64
    ids = input_ids()
    exact = logits_and_gradients(exact_model, ids)
    unpatched = logits_and_gradients(model, ids)
    op = FAMILIES[family][3]
    with compat.patch_hf_model(model) as patch:
        assert set(patch.layers.values()) == (set() if op is None else {op})
        spy["apply_rope"].clear()
        norm_calls.clear()
        got = logits_and_gradients(model, ids)
        launches = {name: len(calls) for name, calls in spy.items()}
        if op == "rms_norm_rope":  # one fused launch per layer; the q / k norms never ran
            assert launches == {"apply_rope": 0, "rms_norm_rope": LAYERS}
            assert not {id(m) for m in qk_norms(model)} & set(norm_calls)
        else:
            assert launches == {"apply_rope": LAYERS, "rms_norm_rope": 0}
    assert_restored(model)
    assert len(got) == len(unpatched) == len(exact) > 1
    for i, (g, u, e) in enumerate(zip(got, unpatched, exact)):
        assert_no_worse(g, u, e, str(dtype)[6:], f"{family} {'logits' if i == 0 else f'grad {i}'}")


def _norm_rope64(x, weight, eps, weight_offset, cos, sin, norm_over="head"):
    """Hugging Face's per-head RMSNorm (``"all_heads"``: OLMo 2's over the whole projection)
    then ``q * cos + rotate_half(q) * sin``, in float64 on ``[B, S, H, D]`` with ``[B, S, D]``
    tables."""
    x = x.double()
    dims = (-2, -1) if norm_over == "all_heads" else (-1,)
    normed = x * torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
    w = weight.double().reshape(x.shape[-2:]) if norm_over == "all_heads" else weight.double()
    normed = normed * (weight_offset + w)
    half = x.shape[-1] // 2
    rotated = torch.cat((-normed[..., half:], normed[..., :half]), dim=-1)
    return normed * cos.double()[:, :, None] + rotated * sin.double()[:, :, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", QK_NORM)
def test_fused_call_takes_each_layers_weights_eps_and_offset(family, dtype, spy):
    """Each rms_norm_rope call of a patched forward (under no_grad) gets the layer's q_norm and
    k_norm weights, its eps and the family's offset (0 for Qwen3, 1 for Gemma 3), on the
    projections as ``[B, S, H, D]``: its outputs are within 2 units of the output dtype's
    rounding of the float64 value of Hugging Face's formulas (plus float32 arithmetic)."""
    model = tiny_model(family, dtype)
    with torch.no_grad(), compat.patch_hf_model(model):
        model(input_ids())
    calls = spy["rms_norm_rope"]
    assert len(calls) == LAYERS
    for layer, (args, kwargs, outputs) in zip(model.model.layers, calls):
        attention = layer.self_attn
        q, k, q_weight, k_weight = args
        # The layer's own parameters, as they are: under no_grad the repeat-call path takes
        # tensors that require grad as plain arrays (test_recipe_key), no detach a call.
        for given, norm in ((q_weight, attention.q_norm), (k_weight, attention.k_norm)):
            assert given is norm.weight and given.data_ptr() == norm.weight.data_ptr()
        assert q.shape[1:] == (9, TINY["num_attention_heads"], 16)
        assert k.shape[1:] == (9, TINY["num_key_value_heads"], 16)
        assert kwargs["eps"] == model.config.rms_norm_eps
        assert kwargs["weight_offset"] == WEIGHT_OFFSET[family]
        assert kwargs["norm_over"] == NORM_OVER.get(family, "head")
        for x, weight, out in ((q, q_weight, outputs[0]), (k, k_weight, outputs[1])):
            exact = _norm_rope64(x, weight, model.config.rms_norm_eps, WEIGHT_OFFSET[family],
                                 kwargs["cos"], kwargs["sin"], kwargs["norm_over"])
            assert out.dtype == dtype and out.shape == x.shape
            scale = exact.abs().amax(dim=-1, keepdim=True)
            bound = scale * (2 * unit_roundoff(str(dtype)[6:]) + 64 * 2.0 ** -24)
            assert torch.all((out.double() - exact).abs() <= bound)


def test_olmo2_rotation_keeps_the_input_dtypes():
    """OLMo 2's tables are float32 in a bfloat16 model and its function returns q and k in their
    own dtypes (Hugging Face's usual promotion would hand its attention float32 q and k): so does
    what replaces it, within 2 units of bfloat16 rounding of the head's largest element."""
    model = tiny_model("olmo2", torch.bfloat16)
    module = sys.modules[type(model).__module__]
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 5, 16, generator=generator).bfloat16()
    k = torch.randn(2, 2, 5, 16, generator=generator).double()
    angles = torch.rand(2, 5, 8, generator=generator) * 50
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    expected = module.apply_rotary_pos_emb(q, k, cos, sin)
    with compat.patch_hf_model(model):
        assert module.apply_rotary_pos_emb is not compat.hf_apply_rotary_pos_emb
        got = module.apply_rotary_pos_emb(q, k, cos, sin)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        bound = 2 * unit_roundoff(str(e.dtype)[6:]) * e.double().abs().amax(-1, keepdim=True)
        assert torch.all((g.double() - e.double()).abs() <= bound)


# ----------------------------------------------------------------------------------------------
# What the fused op does not take: the layer's own norms


def test_norm_weights_of_another_dtype_run_the_layers_norms(spy, norm_calls):
    """Gemma 3's norm casts back to the input's dtype whatever its weight's: float32 norm weights
    in a bfloat16 model run the layer's norms (Hugging Face's roundings), then one rotation."""
    model = tiny_model("gemma3", torch.bfloat16)
    for norm in qk_norms(model):
        norm.float()
    exact_model = copy.deepcopy(model).double()
    ids = input_ids()
    exact, unpatched = logits_and_gradients(exact_model, ids), logits_and_gradients(model, ids)
    with compat.patch_hf_model(model) as patch:
        assert set(patch.layers.values()) == {"rms_norm_rope"}
        spy["apply_rope"].clear()
        norm_calls.clear()
        got = logits_and_gradients(model, ids)
        assert len(spy["apply_rope"]) == LAYERS and not spy["rms_norm_rope"]
        assert {id(m) for m in qk_norms(model)} <= set(norm_calls)
    for g, u, e in zip(got, unpatched, exact):
        assert_no_worse(g, u, e, "bfloat16", "gemma3 with float32 norm weights")


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "olmo2"])
def test_hooks_on_the_norms_run(family, spy):
    """A hook registered on a q_norm after the patch runs (that layer takes its own norms);
    one registered before leaves Qwen3's and OLMo 2's layer with its norms and the plain
    rotation, and Gemma 3's (which normalises after the transpose) unreplaced."""
    def double_it(module, args, output):
        return output * 2

    model = tiny_model(family)
    ids = input_ids()
    first = model.model.layers[0].self_attn
    handle = first.q_norm.register_forward_hook(double_it)
    expected = model(ids).logits
    handle.remove()
    with compat.patch_hf_model(model):
        handle = first.q_norm.register_forward_hook(double_it)
        spy["rms_norm_rope"].clear()
        got = model(ids).logits
        assert len(spy["rms_norm_rope"]) == LAYERS - 1  # the hooked layer took its own norms
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with compat.patch_hf_model(model) as patch:  # the hook is still there
        layers = patch.layers
        got = model(ids).logits
    handle.remove()
    plain = {"model.layers.0.self_attn": "apply_rope"} if family != "gemma3" else {}
    assert layers == {**plain, "model.layers.1.self_attn": "rms_norm_rope"}
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


REWRITTEN = [family for family, spec in FAMILIES.items() if spec[3] is not None]


def _in_place_flags(spy, op):
    return [kwargs.get("inplace", False) for _, kwargs, _ in spy[op]]


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("family", REWRITTEN)
def test_inference_rotates_the_projections_where_they_are(family, mode, spy):
    """Outside autograd each rewritten layer's one launch (the fused op's too) writes into its
    q and k projections, outputs of plain nn.Linear calls that nothing else holds, with the
    logits of the out-of-place calls; with grad enabled the calls make new arrays."""
    model, ids, op = tiny_model(family), input_ids(), FAMILIES[family][3]
    context = getattr(torch, mode)
    with context():
        expected = model(ids).logits
    with compat.patch_hf_model(model):
        spy[op].clear()
        with context():
            got = model(ids).logits
        assert _in_place_flags(spy, op) == [True] * LAYERS
        spy[op].clear()
        with_grad = model(ids).logits
        assert _in_place_flags(spy, op) == [False] * LAYERS
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(with_grad.detach(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3", "olmo2"])
def test_a_hook_on_a_projection_keeps_its_output_as_it_was(family, spy):
    """A forward hook on a layer's k_proj (which may keep the output, as this one does) makes
    that layer's rotation write new arrays; the kept output is the projection, unrotated."""
    model, ids, op = tiny_model(family), input_ids(), FAMILIES[family][3]
    first = model.model.layers[0].self_attn
    kept = []
    with torch.no_grad():
        expected = model(ids).logits
    with compat.patch_hf_model(model), torch.no_grad():
        handle = first.k_proj.register_forward_hook(
            lambda module, args, output: kept.append((args[0], output, output.clone())))
        spy[op].clear()
        got = model(ids).logits
        handle.remove()
        assert _in_place_flags(spy, op) == [False] + [True] * (LAYERS - 1)
    (hidden, output, copy_at_hook), = kept
    assert torch.equal(output, copy_at_hook)
    torch.testing.assert_close(output, torch.nn.functional.linear(hidden, first.k_proj.weight,
                                                                  first.k_proj.bias))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["forward", "__call__"])
def test_a_projection_of_another_class_is_rotated_into_new_arrays(method, spy):
    """A q_proj that is not an nn.Linear running Linear.forward through nn.Module's call (here
    one whose forward, or __call__, returns a view of its input: in place would write into the
    hidden states) gets new arrays."""
    def passthrough(self, x):
        return x[..., :self.out_features]

    # not this test module's: its apply_rotary_pos_emb samples would be patched too
    Passthrough = type("Passthrough", (torch.nn.Linear,),
                       {method: passthrough, "__module__": "passthrough_projection"})

    model, ids = tiny_model("llama"), input_ids()
    first = model.model.layers[0].self_attn
    first.q_proj = Passthrough(first.q_proj.in_features, first.q_proj.out_features)
    with torch.no_grad():
        expected = model(ids).logits
    with compat.patch_hf_model(model), torch.no_grad():
        spy["apply_rope"].clear()
        got = model(ids).logits
        assert _in_place_flags(spy, "apply_rope") == [False] + [True] * (LAYERS - 1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Restoring


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_restore_puts_everything_back(family):
    model = tiny_model(family)
    module = sys.modules[type(model).__module__]
    original = module.apply_rotary_pos_emb
    ids = input_ids()
    before = model(ids).logits
    outer = compat.patch_hf_model(model)
    inner = compat.patch_hf_model(model)  # everything is replaced already
    assert inner.layers == {} and inner.modules == []
    inner.restore()
    assert len(outer.layers) == LAYERS
    assert all("forward" in layer.self_attn.__dict__ for layer in model.model.layers)
    outer.restore()
    assert outer.layers == {} and outer.modules == []
    assert module.apply_rotary_pos_emb is original
    assert_restored(model)
    assert torch.equal(model(ids).logits, before)


def test_attention_false_replaces_only_the_functions(spy):
    model = tiny_model("qwen3")
    with compat.patch_hf_model(model, attention=False) as patch:
        assert patch.layers == {}
        assert_restored(model)
        spy["apply_rope"].clear()
        model(input_ids())
        assert len(spy["apply_rope"]) == LAYERS and not spy["rms_norm_rope"]


def test_a_forward_set_on_a_layer_is_left_alone():
    """Accelerate's hooks (and an earlier patch) set ``forward`` on the layer: not replaced."""
    model = tiny_model("llama")
    first = model.model.layers[0].self_attn
    wrapped = first.forward
    first.forward = lambda *args, **kwargs: wrapped(*args, **kwargs)
    mine = first.forward
    with compat.patch_hf_model(model) as patch:
        assert list(patch.layers) == ["model.layers.1.self_attn"]
        assert first.forward is mine
    assert first.forward is mine


# ----------------------------------------------------------------------------------------------
# The forward reader


def apply_rotary_pos_emb(q, k, cos, sin):  # the name the forwards below call
    return q, k


class _Heads(torch.nn.Module):
    """Forwards shaped like Hugging Face's (``self.q_proj(x).view(hidden_shape)``)."""

    head_dim = 4

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj = torch.nn.Identity(), torch.nn.Identity()
        self.q_norm, self.k_norm = torch.nn.Identity(), torch.nn.Identity()


class QwenStyle(_Heads):
    def forward(self, hidden_states, position_embeddings):
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return query_states, key_states


class GemmaStyle(_Heads):
    def forward(self, hidden_states, position_embeddings):
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        query_states = self.q_norm(query_states)
        key_states = self.k_norm(key_states)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return query_states, key_states


class OlmoStyle(_Heads):
    def forward(self, hidden_states, position_embeddings):
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states))
        key_states = self.k_norm(self.k_proj(hidden_states))
        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return query_states, key_states


class NormsOnOneProjection(_Heads):
    """q's norm over the projection, k's over each head: no one place, nothing fused."""

    def forward(self, hidden_states, position_embeddings):
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states))
        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return query_states, key_states


class ScaledProjection(_Heads):
    """q is a view of an expression of the projection, not of the call's output."""

    def forward(self, hidden_states, position_embeddings):
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query_states = (self.q_proj(hidden_states) * 2).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).reshape(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return query_states, key_states


class ReadsQBetween(_Heads):
    def forward(self, hidden_states, position_embeddings):
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        query_states = query_states * 2
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return query_states, key_states


class OtherTranspose(_Heads):
    def forward(self, hidden_states, position_embeddings):
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(2, 1)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return query_states, key_states


class RotatesTwice(_Heads):
    def forward(self, hidden_states, position_embeddings):
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return apply_rotary_pos_emb(query_states, key_states, cos, sin)


class KeywordCall(_Heads):
    def forward(self, hidden_states, position_embeddings):
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin=sin)
        return query_states, key_states


class NormsTwice(_Heads):
    def forward(self, hidden_states, position_embeddings):
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        query_states = self.q_norm(query_states)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return query_states, key_states


def _decorated(function):
    return function


class Decorated(_Heads):
    @_decorated
    def forward(self, hidden_states, position_embeddings):
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        return query_states, key_states


def test_forward_reader_knows_the_two_norm_placements():
    qwen = hf_attention.attention_form(QwenStyle.forward)
    gemma = hf_attention.attention_form(GemmaStyle.forward)
    for form, after in ((qwen, False), (gemma, True)):
        assert (form.q_norm, form.k_norm, form.can_fuse) == ("q_norm", "k_norm", True)
        assert form.norms_after_transpose is after
        assert form.names == ("query_states", "key_states", "cos", "sin")


def test_forward_reader_knows_norms_over_the_whole_projection():
    """OLMo 2's placement: ``x = self.norm(<projection>)`` before ``x.view(...).transpose(1,
    2)``; its fused build hands ``rotate`` the unnormalised ``[B, S, H, D]`` projections. A layer
    with q's norm there and k's on each head fuses nothing."""
    form = hf_attention.attention_form(OlmoStyle.forward)
    assert (form.q_norm, form.k_norm, form.can_fuse) == ("q_norm", "k_norm", True)
    assert form.norms_over_projection and not form.norms_after_transpose
    seen = []

    def rotate(attention, q, k, cos, sin):
        seen.append((q, k))
        return q, k  # rotated q and k stay [B, S, H, D]: the forward transposes them

    layer = OlmoStyle()
    layer.q_norm = layer.k_norm = None  # the fused build must not call them
    x = torch.randn(2, 3, 8)
    forward = form.build(rotate, fused=True).__get__(layer)
    forward(x, (None, None))
    q, k = seen[0]
    assert q.shape == k.shape == (2, 3, 2, 4) and torch.equal(q.flatten(-2), x)
    mixed = hf_attention.attention_form(NormsOnOneProjection.forward)
    assert mixed.q.norm_at == "projection" and mixed.k.norm_at == "definition"
    assert not mixed.can_fuse


def test_forward_reader_names_the_projections_q_and_k_are_views_of():
    """AttentionForm.projections: the attributes whose calls' outputs reach the rewritten
    rotation as views (``.view`` / ``.reshape``), or None where anything else does: a norm that
    stays the layer's own (unfused), an expression of the output."""
    from transformers.models.llama import modeling_llama

    read = hf_attention.attention_form
    both = ("q_proj", "k_proj")
    assert read(modeling_llama.LlamaAttention.forward).projections(False) == both
    for cls in (QwenStyle, GemmaStyle, OlmoStyle):
        assert read(cls.forward).projections(True) == both, cls.__name__
        assert read(cls.forward).projections(False) is None, cls.__name__
    assert read(NormsOnOneProjection.forward).projections(False) is None
    scaled = read(ScaledProjection.forward)
    assert scaled is not None and scaled.projections(False) is None
    assert scaled._projection(scaled.k, False) == "k_proj"  # reshape, like view


@pytest.mark.parametrize("cls", [ReadsQBetween, OtherTranspose, RotatesTwice, KeywordCall,
                                 NormsTwice, Decorated])
def test_forward_reader_refuses_other_shapes(cls):
    assert hf_attention.attention_form(cls.forward) is None


def test_rewritten_forward_moves_the_transposes_after_the_rotation():
    """The plain build of a Qwen3-style forward hands ``rotate`` the normalised ``[B, S, H, D]``
    projections; the fused build hands it the projections before the norms."""
    form = hf_attention.attention_form(QwenStyle.forward)
    layer = QwenStyle()
    x = torch.randn(2, 3, 8)
    seen = []

    def rotate(attention, q, k, cos, sin):
        seen.append((attention, q, k, cos, sin))
        return q, k  # rotated q and k stay [B, S, H, D]: the forward transposes them

    for fused in (False, True):
        forward = form.build(rotate, fused=fused)
        assert forward.__qualname__ == QwenStyle.forward.__qualname__
        q, k = forward(layer, x, ("c", "s"))
        attention, q_in, k_in, cos, sin = seen.pop()
        assert attention is layer and (cos, sin) == ("c", "s")
        assert q_in.shape == (2, 3, 2, 4) and torch.equal(q_in, x.view(2, 3, 2, 4))
        assert torch.equal(q, x.view(2, 3, 2, 4).transpose(1, 2))


# ----------------------------------------------------------------------------------------------
# torch.compile


def test_patched_qwen3_layer_compiles_fullgraph():
    """A patched Qwen3 decoder layer (the fused op, forward and backward) compiles without a
    graph break (aot_eager) and gives the eager results."""
    model = tiny_model("qwen3")
    ids = input_ids(1, 6)
    with compat.patch_hf_model(model):
        torch._dynamo.reset()
        layer = model.model.layers[0]
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        hidden = model.model.embed_tokens(ids)
        position_embeddings = model.model.rotary_emb(hidden, torch.arange(6)[None])
        results = []
        for run in (compiled, layer):
            out = run(hidden, position_embeddings=position_embeddings)
            out = out[0] if isinstance(out, tuple) else out
            (grad,) = torch.autograd.grad(out.square().sum(), layer.self_attn.q_norm.weight)
            results.append((out, grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# GPU


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "olmo2", "qwen3", "gemma3"])
def test_gpu_bfloat16_models_match_unpatched(family, spy):
    """bfloat16 on the GPU: logits and gradients no further from the float64 model (on the CPU)
    than the unpatched model's, one launch per layer."""
    device = _cuda()
    model = tiny_model(family, torch.bfloat16)
    exact_model = copy.deepcopy(model).double()
    model = model.to(device)
    ids = input_ids()
    exact = logits_and_gradients(exact_model, ids)
    unpatched = [x.cpu() for x in logits_and_gradients(model, ids.to(device))]
    op = FAMILIES[family][3]
    with compat.patch_hf_model(model):
        spy["apply_rope"].clear()
        got = [x.cpu() for x in logits_and_gradients(model, ids.to(device))]
        assert len(spy[op]) == LAYERS
    for g, u, e in zip(got, unpatched, exact):
        assert_no_worse(g, u, e, "bfloat16", f"{family} on the GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3", "olmo2"])
def test_gpu_decode_steps_with_a_kv_cache(family, spy):
    """Greedy decoding under inference_mode (the repeat-call path from the second step on, each
    layer's launch in place on its projections): the patched model's logits at every step within
    bfloat16 rounding of the unpatched ones."""
    device = _cuda()
    model = tiny_model(family, torch.bfloat16).to(device).eval()
    prompt = input_ids(4, 7).to(device)

    def decode(tokens=None, steps=4):
        """The last position's logits at each step, feeding ``tokens`` (or the argmax)."""
        cache = transformers.DynamicCache()
        logits, chosen, ids = [], [], prompt
        with torch.inference_mode():
            for step in range(steps):
                out = model(ids, past_key_values=cache, use_cache=True)
                logits.append(out.logits[:, -1].float())
                ids = out.logits[:, -1:].argmax(-1) if tokens is None else tokens[step]
                chosen.append(ids)
        return logits, chosen

    expected, tokens = decode()
    op = FAMILIES[family][3]
    with compat.patch_hf_model(model):
        spy[op].clear()
        got, _ = decode(tokens)  # the same tokens: a near tie cannot fork the two runs
        assert _in_place_flags(spy, op) == [True] * (4 * LAYERS)
    for g, e in zip(got, expected):
        scale = e.abs().max()
        assert (g - e).abs().max() <= 16 * unit_roundoff("bfloat16") * scale
