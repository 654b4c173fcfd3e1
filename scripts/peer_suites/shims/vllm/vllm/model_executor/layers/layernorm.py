"""``RMSNorm`` of vLLM's tests, with its torch reference ``forward_native``: normalise in float32,
round to the input's dtype, then multiply by the weight."""

from __future__ import annotations

import torch

from peer_shim_support import NoAdapter, module_getattr


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, var_hidden_size=None,
                 has_weight: bool = True, dtype=None):
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.has_weight = has_weight
        weight = torch.ones(hidden_size, dtype=dtype or torch.get_default_dtype())
        self.weight = torch.nn.Parameter(weight, requires_grad=False) if has_weight else None

    def forward_native(self, x, residual=None):
        if residual is not None:
            raise NoAdapter("vllm RMSNorm.forward_native with residual")
        dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(dim=-1, keepdim=True)
        out = (x32 * torch.rsqrt(variance + self.variance_epsilon)).to(dtype)
        return out * self.weight if self.weight is not None else out

    def forward(self, x, residual=None):
        raise NoAdapter("vllm RMSNorm.forward (the fused RMSNorm kernel)")


__getattr__ = module_getattr("vllm.model_executor.layers.layernorm")
