from peer_shim_support import module_getattr

__getattr__ = module_getattr("vllm.model_executor.layers")
