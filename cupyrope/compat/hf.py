"""Hugging Face: ``apply_rotary_pos_emb`` of the Llama family, and patching a model so that each
attention layer rotates q and k (after its per-head QK-RMSNorm, in the QK-norm models) in one
cupyrope launch."""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass

import torch

from ..api import apply_rope, rms_norm_rope, rms_norm_rope_repeat
from .hf_attention import attention_form


def hf_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Hugging Face's ``apply_rotary_pos_emb`` (Llama family), through one cupyrope launch.

    ``q_embed = q * cos + rotate_half(q) * sin`` with ``cos`` / ``sin`` unsqueezed at
    ``unsqueeze_dim`` to broadcast against q and k (``[B, S, D]`` tables for ``[B, H, S, D]`` q and
    k with ``unsqueeze_dim=1``, for ``[B, S, H, D]`` with ``unsqueeze_dim=2``). ``position_ids``
    is ignored, as in Hugging Face. Tables narrower than q rotate the first ``cos.shape[-1]`` dims
    and pass the rest through (partial rotary).

    Returns ``(q_embed, k_embed)`` with Hugging Face's values, shapes and dtype (the type
    promotion of q and cos). They are views with the heads axis moved back into place: for the
    usual ``[B, H, S, D]`` views of a ``[B, S, H, D]`` projection their memory is ``[B, S, H, D]``.
    Gradients flow to q and k (not to cos and sin).
    """
    del position_ids
    if q.dtype != k.dtype:  # one launch needs one dtype
        return (_hf_rotate(q, cos, sin, unsqueeze_dim, "q"),
                _hf_rotate(k, cos, sin, unsqueeze_dim, "k"))
    return _hf_rotate_pair(q, k, cos, sin, unsqueeze_dim)


def _hf_apply_rotary_pos_emb_in_input_dtypes(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """:func:`hf_apply_rotary_pos_emb` for the modules whose function returns q and k in their
    own dtypes (OLMo, OLMo 2, ModernBERT: ``q_embed.to(q.dtype)`` after computing in the type
    promotion with float32 tables): one launch in q's dtype, the tables as they are (cupyrope
    computes in float32, float64 for float64 q, and rounds once)."""
    del position_ids
    if q.dtype != k.dtype:
        return (_hf_rotate(q, cos, sin, unsqueeze_dim, "q", promote=False),
                _hf_rotate(k, cos, sin, unsqueeze_dim, "k", promote=False))
    return _hf_rotate_pair(q, k, cos, sin, unsqueeze_dim, promote=False)


def _hf_heads_axis(x, cos, unsqueeze_dim: int, name: str) -> int:
    """The axis of x that ``cos.unsqueeze(unsqueeze_dim)`` broadcasts over (the heads)."""
    rank = cos.dim() + 1
    axis = unsqueeze_dim + rank if unsqueeze_dim < 0 else unsqueeze_dim
    if not 0 <= axis < rank - 1:
        raise ValueError(
            f"apply_rotary_pos_emb: unsqueeze_dim={unsqueeze_dim} must name a dim before the last "
            f"of cos.unsqueeze(unsqueeze_dim) (cos has shape {tuple(cos.shape)})"
        )
    heads = x.dim() - rank + axis
    if heads < 0:
        raise ValueError(f"apply_rotary_pos_emb: {name} of shape {tuple(x.shape)} has fewer dims "
                         f"than cos.unsqueeze({unsqueeze_dim})")
    return heads


def _hf_promoted(x, cos, sin):
    dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    return x if x.dtype == dtype else x.to(dtype)


def _hf_rotate(x, cos, sin, unsqueeze_dim, name, promote=True):
    heads = _hf_heads_axis(x, cos, unsqueeze_dim, name)
    if promote:
        x = _hf_promoted(x, cos, sin)
    out = apply_rope(x.movedim(heads, -2), cos=cos, sin=sin)
    return out.movedim(-2, heads)


def _hf_rotate_pair(q, k, cos, sin, unsqueeze_dim, promote=True):
    q_heads = _hf_heads_axis(q, cos, unsqueeze_dim, "q")
    k_heads = _hf_heads_axis(k, cos, unsqueeze_dim, "k")
    if promote:
        q, k = _hf_promoted(q, cos, sin), _hf_promoted(k, cos, sin)
    q_out, k_out = apply_rope(q.movedim(q_heads, -2), k.movedim(k_heads, -2), cos=cos, sin=sin)
    return q_out.movedim(-2, q_heads), k_out.movedim(-2, k_heads)


class HFPatch:
    """What :func:`patch_hf_model` replaced; ``restore()`` (or leaving a ``with`` block) puts the
    original functions and attention forwards back."""

    def __init__(self, originals: dict, layers: dict | None = None,
                 replacements: dict | None = None):
        self.originals = originals  # module -> its original apply_rotary_pos_emb
        # module -> the function put in its place (hf_apply_rotary_pos_emb unless given)
        self._replacements = dict(replacements or {})
        # qualified name -> (attention layer, the forward set on it, the op it calls)
        self._layers = dict(layers or {})

    @property
    def modules(self) -> list[str]:
        return [module.__name__ for module in self.originals]

    @property
    def layers(self) -> dict[str, str]:
        """The attention layers whose forward the patch replaced, by qualified name, with the
        cupyrope op each calls: ``"rms_norm_rope"`` (QK-norm and rotation in one launch) or
        ``"apply_rope"``."""
        return {name: op for name, (_, _, op) in self._layers.items()}

    def restore(self) -> None:
        for layer, forward, _ in self._layers.values():
            if layer.__dict__.get("forward") is forward:
                del layer.forward  # the class's own forward again
        self._layers = {}
        for module, original in self.originals.items():
            replacement = self._replacements.get(module, hf_apply_rotary_pos_emb)
            if getattr(module, "apply_rotary_pos_emb", None) is replacement:
                module.apply_rotary_pos_emb = original
        self.originals = {}
        self._replacements = {}

    def __enter__(self) -> "HFPatch":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def __repr__(self) -> str:
        ops = list(self.layers.values())
        counts = {op: ops.count(op) for op in sorted(set(ops))}
        return f"HFPatch(modules={self.modules}, layers per op={counts})"


def patch_hf_model(model, *, check=True, attention=True) -> HFPatch:
    """Make a Hugging Face Llama-family model rotate q and k with cupyrope.

    The attention layers of Llama-family models call their modeling module's
    ``apply_rotary_pos_emb(q, k, cos, sin)`` (``transformers.models.llama.modeling_llama`` ...);
    this replaces that function, in every modeling module the model's layers come from, by
    :func:`hf_apply_rotary_pos_emb`. The replacement is process-wide for those modules (every model
    of the same classes uses it) until ``restore()``.

    With ``attention=True`` (the default) the attention layers of this model whose ``forward``
    has the usual shape (q and k projected, viewed as ``[B, S, H, D]``, transposed to ``[B, H, S,
    D]``, then rotated: Llama, Mistral, Qwen2, OLMo 2 ...) also get a copy of their class's
    forward, set on the layer, that rotates the projections before that transpose: one launch
    with no layout work around it. In the QK-norm models whose q_norm / k_norm are per-head
    RMSNorms (Qwen3, Qwen3-MoE: ``w * x``; Gemma 3: ``(1 + w) * x``) that launch is
    :func:`cupyrope.rms_norm_rope`: the norm and the rotation in one pass, forward and backward;
    OLMo 2, whose norms cover the whole projection before it is split into heads, runs it with
    ``norm_over="all_heads"``. Every other statement of the forward is the class's own code.
    Calls that the fused op cannot take as Hugging Face computes them (mixed dtypes, float64,
    hooks on the norms) run the layer's norms and then the rotation. Modules whose function
    returns q and k in their own dtypes rather than promoted with the tables (OLMo, OLMo 2,
    ModernBERT: float32 tables in a bfloat16 model) get a replacement that does the same.

    With ``check=True`` (the default) each original function is first compared with the
    replacement on a small random float64 input of the model's head size (and partial rotary
    width): a module whose function computes something else (GPT-J's or Cohere's interleaved
    pairing, multimodal M-RoPE, another signature) raises ValueError and nothing is patched. A
    norm is fused only after a float32 copy of it has computed ``x * rsqrt(mean(x**2) + eps) *
    (offset + w)`` over the last dim (offset 0 or 1) on random input, whatever ``check`` is.

    Returns an :class:`HFPatch` (``layers`` lists the replaced forwards and the op each calls);
    use it as a context manager or call ``restore()``.

    Examples
    --------
    >>> from cupyrope.compat import patch_hf_model                       # doctest: +SKIP
    >>> with patch_hf_model(model) as patch:                             # doctest: +SKIP
    ...     loss = model(input_ids, labels=input_ids).loss
    """
    modules = []
    for layer in model.modules():
        module = sys.modules.get(type(layer).__module__)
        if (module is not None and module not in modules
                and callable(getattr(module, "apply_rotary_pos_emb", None))):
            modules.append(module)
    if not modules:
        raise ValueError(
            f"patch_hf_model: no modeling module of {type(model).__name__} defines "
            "apply_rotary_pos_emb; only models whose attention calls it can be patched"
        )
    originals = {m: m.apply_rotary_pos_emb for m in modules
                 if m.apply_rotary_pos_emb not in _ROTATIONS}
    if check:
        head_dim, rotary_dim = _hf_head_dims(model)
        for module, original in originals.items():
            _check_equivalent(module.__name__, original, head_dim, rotary_dim)
    replacements = {m: _replacement_for(original) for m, original in originals.items()}
    installed = {m: replacements.get(m, m.apply_rotary_pos_emb) for m in modules}
    layers = _attention_forwards(model, installed) if attention else {}
    for module, replacement in replacements.items():
        module.apply_rotary_pos_emb = replacement
    for layer, forward, _ in layers.values():
        layer.forward = forward
    return HFPatch(originals, layers, replacements)


def _replacement_for(original):
    """What replaces ``original``: :func:`hf_apply_rotary_pos_emb` (Hugging Face's type
    promotion of q and the tables), or, for a function that returns q and k in their own dtypes
    (asked on float32 q and k with float64 tables; OLMo 2), the variant that does too."""
    q, k, cos, sin = _sample(8, 8)
    try:
        with torch.no_grad():
            result = original(q.float(), k.float(), cos, sin)
        keeps = all(isinstance(x, torch.Tensor) and x.dtype == torch.float32 for x in result)
    except Exception:  # a function the sample does not suit: Hugging Face's usual promotion
        keeps = False
    return _hf_apply_rotary_pos_emb_in_input_dtypes if keeps else hf_apply_rotary_pos_emb


# ----------------------------------------------------------------------------------------------
# Attention forwards that rotate (and QK-normalise) in one launch


def _rotate_heads_last(attention, q, k, cos, sin, in_place=False):
    """The rotation of a rewritten forward (cupyrope.compat.hf_attention) of ``attention``, a
    layer with no QK-norm, or one whose norms stay its own: q and k are the ``[B, S, H, D]``
    projections, ``cos`` / ``sin`` Hugging Face's ``[B, S, D]`` tables; returns the rotated q and
    k, still ``[B, S, H, D]`` (the forward transposes them after the call, as the layer's own
    code did before it). One dtype throughout: one launch on the projections as they are
    (written in place with ``in_place``: see :func:`_owned_projections`); otherwise Hugging
    Face's type promotion, through :func:`hf_apply_rotary_pos_emb` on the transposed views."""
    if q.dtype == k.dtype == cos.dtype == sin.dtype and q.dim() == 4 and cos.dim() == 3:
        return apply_rope(q, k, cos=cos, sin=sin, inplace=in_place)
    return _heads_last(*hf_apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin))


def _rotate_heads_last_in_input_dtypes(attention, q, k, cos, sin, in_place=False):
    """:func:`_rotate_heads_last` for the modules whose rotation keeps q's and k's dtypes (OLMo
    2, whose tables are float32 in a bfloat16 model): one launch whatever the tables' dtype."""
    if q.dtype == k.dtype and q.dim() == 4 and cos.dim() == 3:
        return apply_rope(q, k, cos=cos, sin=sin, inplace=in_place)
    return _heads_last(*_hf_apply_rotary_pos_emb_in_input_dtypes(
        q.transpose(1, 2), k.transpose(1, 2), cos, sin))


def _heads_last(q, k):
    """``[B, H, S, D]`` q and k as ``[B, S, H, D]`` views (what a rotation of a rewritten
    forward returns; the forward transposes them back)."""
    return q.transpose(1, 2), k.transpose(1, 2)


# What a patch puts in place of a module's apply_rotary_pos_emb -> the rotation its layers'
# rewritten forwards call.
_ROTATIONS = {hf_apply_rotary_pos_emb: _rotate_heads_last,
              _hf_apply_rotary_pos_emb_in_input_dtypes: _rotate_heads_last_in_input_dtypes}


@dataclass(frozen=True)
class _RMSNormForm:
    """What a per-head RMSNorm class computes, found on a float32 copy of one of its modules:
    ``x * rsqrt(mean(x**2) + eps) * (weight_offset + weight)`` over the last dim, with ``eps``
    in the attribute ``eps_name``."""

    eps_name: str
    weight_offset: float


_RMS_NORM_FORMS: dict = {}  # norm class -> its _RMSNormForm, or None
_FUSED_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32))
_EPS_NAMES = ("variance_epsilon", "eps", "epsilon")


def _rms_norm_form(norm) -> _RMSNormForm | None:
    """The :class:`_RMSNormForm` of a norm module's class, or None when a float32 copy of the
    module computes something else (or cannot be made). Memoised per class."""
    cls = type(norm)
    if cls not in _RMS_NORM_FORMS:
        _RMS_NORM_FORMS[cls] = _probe_rms_norm(norm)
    return _RMS_NORM_FORMS[cls]


def _probe_rms_norm(norm) -> _RMSNormForm | None:
    weight = norm._parameters.get("weight")
    eps_name = next((name for name in _EPS_NAMES
                     if isinstance(norm.__dict__.get(name), float)), None)
    if (weight is None or weight.dim() != 1 or eps_name is None
            or len(list(norm.parameters())) != 1 or len(list(norm.buffers())) != 0):
        return None
    eps = norm.__dict__[eps_name]
    width = weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    # A float32 copy (Hugging Face's norms compute in float32 whatever the input) on inputs of
    # the size of sqrt(eps), so that a wrong eps shows as plainly as a wrong formula.
    weight64 = torch.rand(width, dtype=torch.float64, generator=generator) + 0.5
    x64 = torch.randn(2, 3, width, dtype=torch.float64, generator=generator)
    x64 = x64 * max(eps, 1e-12) ** 0.5
    try:
        probe = copy.deepcopy(norm).to_empty(device="cpu").to(torch.float32)
        with torch.no_grad():
            probe.weight.copy_(weight64)
            got = probe(x64.float())
    except Exception:  # a norm that cannot be copied to the CPU or run there: not fused
        return None
    if not (isinstance(got, torch.Tensor) and got.dtype == torch.float32
            and got.shape == x64.shape):
        return None
    normed = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps)
    for offset in (0.0, 1.0):
        want = normed * (offset + weight64)
        if torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item()):
            return _RMSNormForm(eps_name, offset)
    return None


_MODULE_HOOKS = torch.nn.modules.module  # the global hook registries live there
_grad_enabled = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling
_LINEAR_FORWARD = torch.nn.Linear.forward
_MODULE_CALL = torch.nn.Module.__call__
_TENSOR = torch.Tensor


def _runs_plainly(*modules) -> bool:
    """Whether calling each of ``modules`` runs nothing but its class's forward (no hooks, no
    forward set on the module itself): then the fused op may stand in for it."""
    if _MODULE_HOOKS._global_forward_hooks or _MODULE_HOOKS._global_forward_pre_hooks:
        return False
    for module in modules:
        state = module.__dict__  # (items of it cost less than attributes of the module)
        if (state["_forward_hooks"] or state["_forward_pre_hooks"] or state["_backward_hooks"]
                or state["_backward_pre_hooks"] or "forward" in state):
            return False
    return True


def _owned_projections(attention, projections, q, k) -> bool:
    """Whether a rewritten forward's rotation may write q and k where they are: outside autograd
    and compilation, plain tensors that are views of the outputs of ``attention``'s
    ``projections`` (q's and k's attributes, as AttentionForm.projections reads them from the
    forward), each module an ``nn.Linear`` whose call runs nothing but ``Linear.forward``
    (nn.Module's ``__call__``, no hooks, which could keep the output): F.linear returns a new
    tensor that only this forward holds. Saves the outputs' allocations: a decode step's rotation
    then costs the host time of ``apply_rope`` in place, not out of place (H100: 12.7 against
    18.7 µs; docs/training.md)."""
    if projections is None or _grad_enabled() or _compiling():
        return False
    if type(q) is not _TENSOR or type(k) is not _TENSOR:
        return False
    submodules = attention._modules
    q_proj, k_proj = submodules.get(projections[0]), submodules.get(projections[1])
    q_class, k_class = type(q_proj), type(k_proj)
    return (q_proj is not None and k_proj is not None and q_class.forward is _LINEAR_FORWARD
            and k_class.forward is _LINEAR_FORWARD and q_class.__call__ is _MODULE_CALL
            and k_class.__call__ is _MODULE_CALL and _runs_plainly(q_proj, k_proj))


def _heads_last_rotation(rotary, projections):
    """The rotation of a rewritten forward without a fused norm: :data:`_ROTATIONS`'s for
    ``rotary``, in place where :func:`_owned_projections` allows."""
    rotation = _ROTATIONS[rotary]
    if projections is None:
        return rotation

    def rotate(attention, q, k, cos, sin):
        return rotation(attention, q, k, cos, sin,
                        _owned_projections(attention, projections, q, k))

    return rotate


def _norm_rotation(q_attr: str, k_attr: str, norms_after_transpose: bool, rotary,
                   over_projection: bool = False, projections=None):
    """The rotation of a rewritten QK-norm forward: q and k arrive as the ``[B, S, H, D]``
    projections before their norms (``self.<q_attr>``, ``self.<k_attr>``) and leave normalised
    and rotated, still ``[B, S, H, D]`` (the forward transposes them after the call), through
    one :func:`cupyrope.rms_norm_rope` launch (``over_projection``: the norm of each whole
    projection, all heads together, as OLMo 2's); its repeat calls through
    :func:`cupyrope.api.rms_norm_rope_repeat`.
    Calls the fused op cannot take as Hugging Face computes them run the layer's own norms, in
    the layer's own order (before or after the transpose, or on the projection), then
    ``rotary`` (what replaced the module's apply_rotary_pos_emb). ``projections``: the modules
    whose outputs q and k are (AttentionForm.projections), written in place where
    :func:`_owned_projections` allows."""
    # Rotations that return q's and k's own dtypes (OLMo 2's) round once to q's dtype whatever
    # the tables' dtype, as the fused op does; the others promote to the tables' dtype.
    any_tables = rotary is _hf_apply_rotary_pos_emb_in_input_dtypes
    norm_over = "all_heads" if over_projection else "head"

    def rotate(attention, q, k, cos, sin):
        submodules = attention._modules  # nn.Module.__getattr__ costs more than the checks
        q_norm, k_norm = submodules.get(q_attr), submodules.get(k_attr)
        form = _RMS_NORM_FORMS.get(type(q_norm))
        dtype, tables = q.dtype, cos.dtype  # (torch's dtypes are singletons: `is` compares)
        if (form is not None and type(k_norm) is type(q_norm) and dtype in _FUSED_DTYPES
                and k.dtype is dtype and sin.dtype is tables
                and (tables is dtype or any_tables and tables in _FUSED_DTYPES)
                and q.dim() == 4 and cos.dim() == 3 and _runs_plainly(q_norm, k_norm)):
            q_weight = q_norm._parameters.get("weight")
            k_weight = k_norm._parameters.get("weight")
            eps_name = form.eps_name
            eps = q_norm.__dict__.get(eps_name)
            if (q_weight is not None and k_weight is not None and q_weight.dtype is dtype
                    and k_weight.dtype is dtype and k_norm.__dict__.get(eps_name) == eps
                    and (not over_projection
                         or (q_weight.numel() == q.shape[-2] * q.shape[-1]
                             and k_weight.numel() == k.shape[-2] * k.shape[-1]))):
                in_place = _owned_projections(attention, projections, q, k)
                rotated = rms_norm_rope_repeat(q, k, q_weight, k_weight, eps, form.weight_offset,
                                               cos, sin, norm_over, in_place)
                if rotated is not None:
                    return rotated
                return rms_norm_rope(q, k, q_weight, k_weight, eps=eps,
                                     weight_offset=form.weight_offset, cos=cos, sin=sin,
                                     norm_over=norm_over, inplace=in_place)
        q_norm, k_norm = getattr(attention, q_attr), getattr(attention, k_attr)
        if over_projection:  # the layer's norms on the whole projections, then the heads
            q = q_norm(q.flatten(-2)).view(q.shape).transpose(1, 2)
            k = k_norm(k.flatten(-2)).view(k.shape).transpose(1, 2)
        elif norms_after_transpose:
            q, k = q_norm(q.transpose(1, 2)), k_norm(k.transpose(1, 2))
        else:
            q, k = q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2)
        return _heads_last(*rotary(q, k, cos, sin))

    return rotate


_FORWARDS: dict = {}  # (class forward, fused, rotary) -> its rewritten copy


def _rewritten(form, fused: bool, rotary):
    """The rewritten copy of ``form``'s forward (memoised): ``rotary`` is the function in place
    of its module's apply_rotary_pos_emb."""
    key = (form.function, fused, rotary)
    if key not in _FORWARDS:
        projections = form.projections(fused)
        rotate = (_norm_rotation(form.q_norm, form.k_norm, form.norms_after_transpose, rotary,
                                 form.norms_over_projection, projections)
                  if fused else _heads_last_rotation(rotary, projections))
        _FORWARDS[key] = form.build(rotate, fused=fused)
    return _FORWARDS[key]


def _attention_forwards(model, installed: dict) -> dict:
    """The attention layers of ``model`` to give a rewritten forward: qualified name -> (layer,
    bound forward, op). Only layers whose class's forward comes from a module of ``installed``
    (module -> the function the patch puts, or has put, in place of its checked
    ``apply_rotary_pos_emb``), has the shape :func:`cupyrope.compat.hf_attention.attention_form`
    reads, and is not already replaced on the layer (by an earlier patch, or by hooks such as
    Accelerate's)."""
    layers = {}
    for name, layer in model.named_modules():
        forward = type(layer).forward
        rotary = installed.get(sys.modules.get(getattr(forward, "__module__", None)))
        if "forward" in layer.__dict__ or rotary not in _ROTATIONS:
            continue
        form = attention_form(forward)
        if form is None:
            continue
        fused = form.can_fuse and _fusable_norms(layer, form)
        if form.norms_after_transpose and not fused:
            continue  # the norms would see [B, S, H, D]: only a known per-head norm may
        rewritten = _rewritten(form, fused, rotary)
        op = "rms_norm_rope" if fused else "apply_rope"
        layers[name] = (layer, rewritten.__get__(layer, type(layer)), op)
    return layers


def _fusable_norms(layer, form) -> bool:
    """Whether ``layer``'s q and k norms are RMSNorms of one class (and eps) that
    :func:`cupyrope.rms_norm_rope` computes, over the layer's ``head_dim`` (or, on the whole
    projections, over whole heads of it), with no hooks."""
    q_norm, k_norm = layer._modules.get(form.q_norm), layer._modules.get(form.k_norm)
    head_dim = getattr(layer, "head_dim", None)
    if (q_norm is None or type(k_norm) is not type(q_norm) or not isinstance(head_dim, int)
            or not _runs_plainly(q_norm, k_norm)):
        return False
    for norm in (q_norm, k_norm):
        weight = norm._parameters.get("weight")
        if weight is None or weight.dim() != 1:
            return False
        # per head: head_dim weights; over the whole projection: whole heads of them
        width = weight.shape[0]
        if (width % head_dim != 0) if form.norms_over_projection else (width != head_dim):
            return False
    norm_form = _rms_norm_form(q_norm)
    return (norm_form is not None and q_norm.__dict__.get(norm_form.eps_name)
            == k_norm.__dict__.get(norm_form.eps_name))


def _hf_head_dims(model) -> tuple[int, int]:
    config = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    factor = getattr(config, "partial_rotary_factor", None)
    parameters = getattr(config, "rope_parameters", None)
    if factor is None and isinstance(parameters, dict):
        factor = parameters.get("partial_rotary_factor")
    rotary_dim = int(head_dim * factor) if factor else head_dim
    return head_dim, rotary_dim - rotary_dim % 2


def _check_equivalent(name: str, original, head_dim: int, rotary_dim: int) -> None:
    """Raise ValueError unless ``original`` matches :func:`hf_apply_rotary_pos_emb` on random
    float64 input: q and k ``head_dim`` wide with ``rotary_dim``-wide tables (models that split
    the rotated part off inside the function, or with no partial rotary) and, with partial rotary,
    q and k ``rotary_dim`` wide too (models whose attention splits it off before the call). It
    must accept at least one of the two and agree wherever it does."""
    widths = [head_dim] + ([rotary_dim] if rotary_dim < head_dim else [])
    accepted, failure = 0, None
    for width in widths:
        q, k, cos, sin = _sample(width, rotary_dim)
        try:
            with torch.no_grad():
                expected = original(q, k, cos, sin)
        except Exception as exc:  # e.g. a table narrower than q it does not split itself
            failure = exc
            continue
        accepted += 1
        with torch.no_grad():
            got = hf_apply_rotary_pos_emb(q, k, cos, sin)
        same = (isinstance(expected, (tuple, list)) and len(expected) == 2
                and all(isinstance(e, torch.Tensor) and e.shape == g.shape
                        and torch.allclose(e, g, rtol=1e-10, atol=1e-12)
                        for e, g in zip(expected, got)))
        if not same:
            raise ValueError(
                f"patch_hf_model: {name}.apply_rotary_pos_emb does not compute Llama-family RoPE "
                f"(NeoX pairing, tables unsqueezed at dim 1) on q of width {width} with "
                f"{rotary_dim}-wide tables; not patched"
            )
    if not accepted:
        raise ValueError(
            f"patch_hf_model: {name}.apply_rotary_pos_emb(q, k, cos, sin) failed on Llama-layout "
            f"input ({type(failure).__name__}: {failure}); it is not a Llama-family function"
        ) from failure


def _sample(width: int, rotary_dim: int):
    generator = torch.Generator().manual_seed(0)
    batch, seq, num_heads, num_kv_heads = 2, 5, 3, 1
    q = torch.randn(batch, num_heads, seq, width, dtype=torch.float64, generator=generator)
    k = torch.randn(batch, num_kv_heads, seq, width, dtype=torch.float64, generator=generator)
    angles = torch.rand(batch, seq, rotary_dim // 2, dtype=torch.float64, generator=generator) * 6
    angles = torch.cat((angles, angles), dim=-1)  # Hugging Face's full-width tables
    return q, k, angles.cos(), angles.sin()
