"""``vllm.platforms.current_platform``: the few platform queries vLLM's kernel tests make,
answered from torch (a CUDA device is a CUDA platform)."""

from __future__ import annotations

import random

import numpy as np
import torch

from peer_shim_support import module_getattr


class _Platform:
    @property
    def device_type(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    def is_cuda(self) -> bool:
        return torch.cuda.is_available()

    def is_cuda_alike(self) -> bool:
        return torch.cuda.is_available()

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return not torch.cuda.is_available()

    def fp8_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    def get_device_capability(self, device_id: int = 0):
        return torch.cuda.get_device_capability(device_id) if torch.cuda.is_available() else None

    def has_device_capability(self, capability, device_id: int = 0) -> bool:
        found = self.get_device_capability(device_id)
        if found is None:
            return False
        if isinstance(capability, int):
            return found[0] * 10 + found[1] >= capability
        return tuple(found) >= tuple(capability)

    def seed_everything(self, seed=None) -> None:
        if seed is not None:
            random.seed(seed)
            np.random.seed(seed)
            torch.manual_seed(seed)

    def __getattr__(self, name):
        return module_getattr("vllm.platforms.current_platform")(name)


current_platform = _Platform()

__getattr__ = module_getattr("vllm.platforms")
