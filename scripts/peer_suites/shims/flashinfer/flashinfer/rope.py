"""``flashinfer.rope``: cupyrope.compat's FlashInfer adapters under FlashInfer's names."""

from cupyrope import compat
from cupyrope.compat import (apply_llama31_rope, apply_llama31_rope_inplace,  # noqa: F401
                             apply_llama31_rope_pos_ids, apply_llama31_rope_pos_ids_inplace,
                             apply_rope, apply_rope_inplace, apply_rope_pos_ids,
                             apply_rope_pos_ids_inplace, apply_rope_with_cos_sin_cache,
                             mla_rope_quantize_fp8, rope_quantize_fp8)
from peer_shim_support import module_getattr


def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache,
                                          is_neox=True):
    """FlashInfer's signature; the adapter is the one shared with SGLang."""
    compat.apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache,
                                                 is_neox)


def rope_quantize_fp8_append_paged_kv_cache(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache,
                                            pos_ids, paged_kv_cache, kv_indices, kv_indptr,
                                            batch_indices, positions, is_neox=True,
                                            quantize_dtype=None, quant_scale_q=1.0,
                                            quant_scale_kv=1.0, page_size=16, kv_layout="NHD",
                                            q_rope_out=None, q_nope_out=None, enable_pdl=False):
    return compat.rope_quantize_fp8_append_paged_kv_cache(
        q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, paged_kv_cache, kv_indices,
        kv_indptr, batch_indices, positions, is_neox=is_neox, quantize_dtype=quantize_dtype,
        quant_scale_q=quant_scale_q, quant_scale_kv=quant_scale_kv, page_size=page_size,
        kv_layout=kv_layout, q_rope_out=q_rope_out, q_nope_out=q_nope_out,
        enable_pdl=enable_pdl)


__getattr__ = module_getattr("flashinfer.rope")
