"""Drop-in replacements for the RoPE calls of vLLM / SGLang, Hugging Face and TransformerEngine.

Each function takes the arguments of the call it replaces and gives its results, computed by
:func:`cupyrope.apply_rope` on the caller's tensors (no copies of q, k or t; the layouts map onto
apply_rope's strides and positions). All take torch tensors, CUDA or CPU, and are differentiable
and traceable by ``torch.compile`` like ``apply_rope`` itself.

=====================================  =============================================================
:func:`rotary_embedding`               vLLM ``ops.rotary_embedding`` / SGLang ``rotary_embedding``:
                                       in place, q/k ``[T, H*D]`` or ``[T, H, D]``
:func:`hf_apply_rotary_pos_emb`        Hugging Face ``apply_rotary_pos_emb(q, k, cos, sin, ...)``
                                       of the Llama family (Llama, Mistral, Qwen2/3, Gemma ...)
:func:`patch_hf_model`                 makes a Hugging Face model call the function above
:func:`te_apply_rotary_pos_emb`        TransformerEngine ``apply_rotary_pos_emb(t, freqs, ...)``:
                                       ``sbhd`` / ``bshd`` / ``thd``, ``start_positions``,
                                       context parallelism
=====================================  =============================================================
"""

from __future__ import annotations

from .hf import HFPatch, hf_apply_rotary_pos_emb, patch_hf_model
from .te import te_apply_rotary_pos_emb, te_cos_sin_cache
from .vllm import rotary_embedding

__all__ = [
    "HFPatch",
    "hf_apply_rotary_pos_emb",
    "patch_hf_model",
    "rotary_embedding",
    "te_apply_rotary_pos_emb",
    "te_cos_sin_cache",
]
