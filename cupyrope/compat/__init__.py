"""Drop-in replacements for the RoPE calls of vLLM, SGLang, FlashInfer, Hugging Face and
TransformerEngine: each function takes the arguments of the call it replaces (torch tensors, CUDA
or CPU) and runs one cupyrope op on the caller's tensors, without copies.

Design notes (the functions and the calls they replace): docs/architecture.md#compat
"""

from __future__ import annotations

from .flashinfer import (apply_llama31_rope, apply_llama31_rope_inplace,
                         apply_llama31_rope_pos_ids, apply_llama31_rope_pos_ids_inplace,
                         apply_rope, apply_rope_inplace, apply_rope_pos_ids,
                         apply_rope_pos_ids_inplace, apply_rope_with_cos_sin_cache,
                         fused_qk_rmsnorm_rope, get_batch_indices_positions, get_seq_lens,
                         mla_rope_quantize_fp8, rope_quantize_fp8,
                         rope_quantize_fp8_append_paged_kv_cache)
from .hf import HFPatch, hf_apply_rotary_pos_emb, patch_hf_model
from .sglang import FusedSetKVBufferArg, apply_rope_with_cos_sin_cache_inplace
from .te import te_apply_fused_qkv_rotary_pos_emb, te_apply_rotary_pos_emb, te_cos_sin_cache
from .vllm import (batched_rotary_embedding, concat_and_cache_mla, fused_qk_norm_rope,
                   fused_qk_norm_rope_kvcache, reshape_and_cache_flash,
                   rope_and_reshape_and_cache_flash, rotary_embedding)

__all__ = [
    "FusedSetKVBufferArg",
    "HFPatch",
    "apply_llama31_rope",
    "apply_llama31_rope_inplace",
    "apply_llama31_rope_pos_ids",
    "apply_llama31_rope_pos_ids_inplace",
    "apply_rope",
    "apply_rope_inplace",
    "apply_rope_pos_ids",
    "apply_rope_pos_ids_inplace",
    "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
    "batched_rotary_embedding",
    "concat_and_cache_mla",
    "fused_qk_norm_rope",
    "fused_qk_norm_rope_kvcache",
    "fused_qk_rmsnorm_rope",
    "get_batch_indices_positions",
    "get_seq_lens",
    "hf_apply_rotary_pos_emb",
    "mla_rope_quantize_fp8",
    "patch_hf_model",
    "reshape_and_cache_flash",
    "rope_and_reshape_and_cache_flash",
    "rope_quantize_fp8",
    "rope_quantize_fp8_append_paged_kv_cache",
    "rotary_embedding",
    "te_apply_fused_qkv_rotary_pos_emb",
    "te_apply_rotary_pos_emb",
    "te_cos_sin_cache",
]
