"""vLLM's ``RotaryEmbedding`` family and ``get_rope`` for its kernel tests.

``forward`` (vLLM's CUDA path) runs the ``rotary_embedding`` op, i.e. cupyrope.compat's
adapter, in place; ``forward_native`` is the torch reference the tests compare it with, written
from vLLM's documented formula: rows ``cos_sin_cache[positions]`` (cos half, sin half) at the
cache's dtype, ``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin`` computed in the input's
dtype, NeoX halves or GPT-J interleaved pairs, dims past ``rotary_dim`` passed through."""

from __future__ import annotations

import torch

from peer_shim_support import NoAdapter, module_getattr
from vllm import _custom_ops as ops


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int,
                 base: float, is_neox_style: bool, dtype: torch.dtype):
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.is_neox_style = is_neox_style
        self.dtype = dtype
        cache = self._compute_cos_sin_cache().to(dtype)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _compute_inv_freq(self, base) -> torch.Tensor:
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim
        return 1.0 / (base ** exponents)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._compute_inv_freq(self.base)
        t = torch.arange(self.max_position_embeddings, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def _match_cos_sin_cache_dtype(self, query: torch.Tensor) -> None:
        if (self.cos_sin_cache.device != query.device
                or self.cos_sin_cache.dtype != query.dtype):
            self.cos_sin_cache = self.cos_sin_cache.to(query.device, dtype=query.dtype)

    def _rotate_native(self, x, cos, sin, num_tokens):
        shape = x.shape
        x = x.reshape(num_tokens, -1, self.head_size)
        rot, passed = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        cos = cos.unsqueeze(-2).to(x.dtype)
        sin = sin.unsqueeze(-2).to(x.dtype)
        if self.is_neox_style:
            x1, x2 = torch.chunk(rot, 2, dim=-1)
        else:
            x1, x2 = rot[..., ::2], rot[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        if self.is_neox_style:
            rot = torch.cat((o1, o2), dim=-1)
        else:
            rot = torch.stack((o1, o2), dim=-1).flatten(-2)
        return torch.cat((rot, passed), dim=-1).reshape(shape)

    def forward_native(self, positions, query, key=None, offsets=None):
        if offsets is not None:
            positions = positions + offsets
        positions = positions.flatten()
        num_tokens = positions.shape[0]
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        query = self._rotate_native(query, cos, sin, num_tokens)
        if key is not None:
            key = self._rotate_native(key, cos, sin, num_tokens)
        return query, key

    def forward_cuda(self, positions, query, key=None, offsets=None):
        self._match_cos_sin_cache_dtype(query)
        if offsets is not None:
            ops.batched_rotary_embedding(positions, query, key, self.head_size,
                                         self.cos_sin_cache, self.is_neox_style,
                                         self.rotary_dim, offsets)
        else:
            ops.rotary_embedding(positions, query, key, self.head_size, self.cos_sin_cache,
                                 self.is_neox_style)
        return query, key

    def forward(self, positions, query, key=None, offsets=None):
        return self.forward_cuda(positions, query, key, offsets)


class LinearScalingRotaryEmbedding(RotaryEmbedding):
    """One table per scaling factor, concatenated (position ``p`` of factor ``f`` at angle
    ``p / f``); ``scaling_factor_to_offset`` gives each table's first row."""

    def __init__(self, head_size, rotary_dim, max_position_embeddings, base, is_neox_style,
                 scaling_factors, dtype):
        if isinstance(scaling_factors, (int, float)):
            scaling_factors = [scaling_factors]
        self.scaling_factors = list(scaling_factors)
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style,
                         dtype)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._compute_inv_freq(self.base)
        tables, offsets, offset = [], {}, 0
        for factor in self.scaling_factors:
            length = int(self.max_position_embeddings * factor)
            t = torch.arange(length, dtype=torch.float) / factor
            freqs = torch.outer(t, inv_freq)
            tables.append(torch.cat((freqs.cos(), freqs.sin()), dim=-1))
            offsets[float(factor)] = offset
            offset += length
        self._scaling_factor_to_offset = offsets
        return torch.cat(tables, dim=0)

    @property
    def scaling_factor_to_offset(self):
        return self._scaling_factor_to_offset


class DynamicNTKScalingRotaryEmbedding(RotaryEmbedding):
    """NTK-aware scaling: base ``* (factor * L / L0 - (factor - 1)) ** (d / (d - 2))`` over
    ``L = L0 * factor`` positions."""

    def __init__(self, head_size, rotary_dim, max_position_embeddings, base, is_neox_style,
                 scaling_factor, dtype):
        self.scaling_factor = scaling_factor
        super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style,
                         dtype)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        length = self.max_position_embeddings * self.scaling_factor
        base = self.base * ((self.scaling_factor * length / self.max_position_embeddings)
                            - (self.scaling_factor - 1)) ** (self.rotary_dim
                                                             / (self.rotary_dim - 2))
        inv_freq = self._compute_inv_freq(base)
        t = torch.arange(int(length), dtype=torch.float)
        freqs = torch.outer(t, inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


_ROPE_CACHE: dict = {}


def _hashable(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


def get_rope(head_size, max_position, is_neox_style=True, rope_parameters=None, dtype=None,
             dual_chunk_attention_config=None):
    """vLLM's ``get_rope``: one module per distinct argument set (kept and returned again)."""
    if dual_chunk_attention_config is not None:
        raise NoAdapter("vllm get_rope(dual_chunk_attention_config=...)")
    if dtype is None:
        dtype = torch.get_default_dtype()
    parameters = dict(rope_parameters or {})
    key = (head_size, max_position, is_neox_style, _hashable(parameters), dtype)
    if key in _ROPE_CACHE:
        return _ROPE_CACHE[key]
    base = parameters.get("rope_theta", 10000)
    rotary_dim = int(head_size * parameters.get("partial_rotary_factor", 1.0))
    rope_type = parameters.get("rope_type", "default")
    if rope_type == "default":
        rope = RotaryEmbedding(head_size, rotary_dim, max_position, base, is_neox_style, dtype)
    elif rope_type == "linear":
        rope = LinearScalingRotaryEmbedding(head_size, rotary_dim, max_position, base,
                                            is_neox_style, parameters["factor"], dtype)
    elif rope_type == "dynamic" and "alpha" not in parameters:
        rope = DynamicNTKScalingRotaryEmbedding(head_size, rotary_dim, max_position, base,
                                                is_neox_style, parameters["factor"], dtype)
    else:
        raise NoAdapter(f"vllm get_rope(rope_type={rope_type!r}) (no reference table here)")
    _ROPE_CACHE[key] = rope
    return rope


__getattr__ = module_getattr("vllm.model_executor.layers.rotary_embedding")
