"""Shim of the ``vllm`` package for vLLM's kernel tests: the custom ops they call run
cupyrope.compat's vLLM adapters; anything else raises NoAdapter."""

from peer_shim_support import install_missing_module_finder, module_getattr

install_missing_module_finder("vllm", "tests")

from . import _custom_ops  # noqa: E402  registers torch.ops._C / _C_cache_ops, as vllm._C does

__getattr__ = module_getattr("vllm")
