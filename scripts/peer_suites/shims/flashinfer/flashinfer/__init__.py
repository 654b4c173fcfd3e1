"""Shim of the ``flashinfer`` package for FlashInfer's RoPE tests: its RoPE, page-table and
fused QK-norm RoPE calls run cupyrope.compat's FlashInfer adapters; anything else raises
NoAdapter."""

from peer_shim_support import install_missing_module_finder, module_getattr

install_missing_module_finder("flashinfer")

from . import diffusion_ops, norm, page, rope  # noqa: E402
from .page import get_batch_indices_positions, get_seq_lens  # noqa: E402
from .rope import (apply_llama31_rope, apply_llama31_rope_inplace,  # noqa: E402
                   apply_llama31_rope_pos_ids, apply_llama31_rope_pos_ids_inplace, apply_rope,
                   apply_rope_inplace, apply_rope_pos_ids, apply_rope_pos_ids_inplace,
                   apply_rope_with_cos_sin_cache, apply_rope_with_cos_sin_cache_inplace,
                   mla_rope_quantize_fp8, rope_quantize_fp8,
                   rope_quantize_fp8_append_paged_kv_cache)

__getattr__ = module_getattr("flashinfer")
