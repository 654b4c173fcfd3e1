"""Hugging Face: ``apply_rotary_pos_emb`` of the Llama family, and patching a model to use it."""

from __future__ import annotations

import sys

import torch

from ..api import apply_rope


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


def _hf_rotate(x, cos, sin, unsqueeze_dim, name):
    heads = _hf_heads_axis(x, cos, unsqueeze_dim, name)
    x = _hf_promoted(x, cos, sin)
    out = apply_rope(x.movedim(heads, -2), cos=cos, sin=sin)
    return out.movedim(-2, heads)


def _hf_rotate_pair(q, k, cos, sin, unsqueeze_dim):
    q_heads = _hf_heads_axis(q, cos, unsqueeze_dim, "q")
    k_heads = _hf_heads_axis(k, cos, unsqueeze_dim, "k")
    q, k = _hf_promoted(q, cos, sin), _hf_promoted(k, cos, sin)
    q_out, k_out = apply_rope(q.movedim(q_heads, -2), k.movedim(k_heads, -2), cos=cos, sin=sin)
    return q_out.movedim(-2, q_heads), k_out.movedim(-2, k_heads)


class HFPatch:
    """What :func:`patch_hf_model` replaced; ``restore()`` (or leaving a ``with`` block) puts the
    original functions back."""

    def __init__(self, originals: dict):
        self.originals = originals  # module -> its original apply_rotary_pos_emb

    @property
    def modules(self) -> list[str]:
        return [module.__name__ for module in self.originals]

    def restore(self) -> None:
        for module, original in self.originals.items():
            if getattr(module, "apply_rotary_pos_emb", None) is hf_apply_rotary_pos_emb:
                module.apply_rotary_pos_emb = original
        self.originals = {}

    def __enter__(self) -> "HFPatch":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def __repr__(self) -> str:
        return f"HFPatch(modules={self.modules})"


def patch_hf_model(model, *, check=True) -> HFPatch:
    """Make a Hugging Face Llama-family model rotate q and k with cupyrope.

    The attention layers of Llama-family models call their modeling module's
    ``apply_rotary_pos_emb(q, k, cos, sin)`` (``transformers.models.llama.modeling_llama`` ...);
    this replaces that function, in every modeling module the model's layers come from, by
    :func:`hf_apply_rotary_pos_emb`. The replacement is process-wide for those modules (every model
    of the same classes uses it) until ``restore()``.

    With ``check=True`` (the default) each original is first compared with the replacement on a
    small random float64 input of the model's head size (and partial rotary width): a module whose
    function computes something else (GPT-J's or Cohere's interleaved pairing, multimodal M-RoPE,
    another signature) raises ValueError and nothing is patched.

    Returns an :class:`HFPatch`; use it as a context manager or call ``restore()``.

    Examples
    --------
    >>> from cupyrope.compat import patch_hf_model                       # doctest: +SKIP
    >>> with patch_hf_model(model):                                      # doctest: +SKIP
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
                 if m.apply_rotary_pos_emb is not hf_apply_rotary_pos_emb}
    if check:
        head_dim, rotary_dim = _hf_head_dims(model)
        for module, original in originals.items():
            _check_equivalent(module.__name__, original, head_dim, rotary_dim)
    for module in originals:
        module.apply_rotary_pos_emb = hf_apply_rotary_pos_emb
    return HFPatch(originals)


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
