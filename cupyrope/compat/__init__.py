"""Drop-in replacements for the RoPE calls of vLLM, SGLang, FlashInfer, Hugging Face and
TransformerEngine.

Each function takes the arguments of the call it replaces and gives its results, computed by one
cupyrope op (:func:`cupyrope.apply_rope`, :func:`cupyrope.rms_norm_rope` or
:func:`cupyrope.rope_and_cache`) on the caller's tensors (no copies of q, k, v or t; the layouts
map onto strides and positions). All take torch tensors, CUDA or CPU. The plain rotations are
differentiable and traceable by ``torch.compile`` like ``apply_rope`` itself; the serving
adapters of the fused ops (vLLM's fused and cache ops, SGLang, FlashInfer) are inference ops, with
what the fused op they call supports.

=============================================  =================================================
:func:`rotary_embedding`                       vLLM ``ops.rotary_embedding`` / SGLang
                                               ``rotary_embedding``: in place, q/k ``[T, H*D]``
                                               or ``[T, H, D]``
:func:`fused_qk_norm_rope`                     vLLM ``fused_qk_norm_rope``: QK-RMSNorm + RoPE in
                                               place on the fused ``qkv`` buffer (v untouched)
:func:`rope_and_reshape_and_cache_flash`       vLLM ``rotary_embedding`` +
                                               ``reshape_and_cache_flash``: in place, then the
                                               paged KV-cache write (fp8 caches too)
:func:`apply_rope_with_cos_sin_cache_inplace`  SGLang (sgl-kernel), with
                                               ``fused_set_kv_buffer_arg``
                                               (:class:`FusedSetKVBufferArg`): the token-slot
                                               KV-buffer write
:func:`rope_quantize_fp8`                      FlashInfer ``rope_quantize_fp8`` (and
                                               :func:`mla_rope_quantize_fp8`): RoPE + fp8 of the
                                               rope and nope parts (MLA, GQA, MHA)
:func:`hf_apply_rotary_pos_emb`                Hugging Face ``apply_rotary_pos_emb(q, k, cos,
                                               sin, ...)`` of the Llama family (Llama, Mistral,
                                               Qwen2/3, Gemma ...)
:func:`patch_hf_model`                         makes a Hugging Face model call the function above
:func:`te_apply_rotary_pos_emb`                TransformerEngine ``apply_rotary_pos_emb(t, freqs,
                                               ...)``: ``sbhd`` / ``bshd`` / ``thd``,
                                               ``start_positions``, context parallelism
=============================================  =================================================
"""

from __future__ import annotations

from .flashinfer import mla_rope_quantize_fp8, rope_quantize_fp8
from .hf import HFPatch, hf_apply_rotary_pos_emb, patch_hf_model
from .sglang import FusedSetKVBufferArg, apply_rope_with_cos_sin_cache_inplace
from .te import te_apply_rotary_pos_emb, te_cos_sin_cache
from .vllm import fused_qk_norm_rope, rope_and_reshape_and_cache_flash, rotary_embedding

__all__ = [
    "FusedSetKVBufferArg",
    "HFPatch",
    "apply_rope_with_cos_sin_cache_inplace",
    "fused_qk_norm_rope",
    "hf_apply_rotary_pos_emb",
    "mla_rope_quantize_fp8",
    "patch_hf_model",
    "rope_and_reshape_and_cache_flash",
    "rope_quantize_fp8",
    "rotary_embedding",
    "te_apply_rotary_pos_emb",
    "te_cos_sin_cache",
]
