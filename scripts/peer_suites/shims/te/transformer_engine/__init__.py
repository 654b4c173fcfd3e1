"""Shim of ``transformer_engine`` for TransformerEngine's RoPE test: the fused RoPE calls run
cupyrope.compat's TE adapters; anything else raises NoAdapter."""

from peer_shim_support import install_missing_module_finder, module_getattr

install_missing_module_finder("transformer_engine", "transformer_engine_torch")

__getattr__ = module_getattr("transformer_engine")
