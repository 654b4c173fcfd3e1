"""``vllm._custom_ops``: vLLM's RoPE and KV-cache ops registered as torch custom ops under
vLLM's names (``torch.ops._C.rotary_embedding``, ``torch.ops._C_cache_ops.reshape_and_cache_flash``,
...), each running its cupyrope.compat adapter, with the Python wrappers vLLM's tests call.

The ops are real ``torch.library`` ops with vLLM's mutated arguments and no-op fake kernels, so
vLLM's ``opcheck`` (schema, fake tensor and autograd registration checks) runs on them. Other
ops of the two namespaces raise NoAdapter."""

from __future__ import annotations

from typing import Optional

import torch

from cupyrope import compat
from peer_shim_support import NoAdapter, module_getattr

Tensor = torch.Tensor


def _register(name: str, mutates_args: tuple, fn):
    """``fn`` as the torch op ``name`` ("namespace::op") that mutates ``mutates_args`` and
    returns nothing (its fake kernel does nothing, as the op only writes its arguments)."""
    op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
    op.register_fake(lambda *args, **kwargs: None)
    return op


def _rotary_embedding(positions: Tensor, query: Tensor, key: Optional[Tensor], head_size: int,
                      cos_sin_cache: Tensor, is_neox: bool) -> None:
    compat.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


def _batched_rotary_embedding(positions: Tensor, query: Tensor, key: Optional[Tensor],
                              head_size: int, cos_sin_cache: Tensor, is_neox: bool,
                              rot_dim: int, cos_sin_cache_offsets: Tensor) -> None:
    compat.batched_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox,
                                    rot_dim, cos_sin_cache_offsets)


def _fused_qk_norm_rope(qkv: Tensor, num_heads_q: int, num_heads_k: int, num_heads_v: int,
                        head_dim: int, eps: float, q_weight: Tensor, k_weight: Tensor,
                        cos_sin_cache: Tensor, is_neox: bool, position_ids: Tensor) -> None:
    compat.fused_qk_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps,
                              q_weight, k_weight, cos_sin_cache, is_neox, position_ids)


def _fused_qk_norm_rope_kvcache(qkv: Tensor, q_out: Tensor, k_out: Tensor, num_heads_q: int,
                                num_heads_k: int, num_heads_v: int, head_dim: int, eps: float,
                                q_weight: Tensor, k_weight: Tensor, cos_sin_cache: Tensor,
                                is_neox: bool, position_ids: Tensor, key_cache: Tensor,
                                value_cache: Tensor, slot_mapping: Tensor,
                                forced_token_heads_per_warp: int) -> None:
    compat.fused_qk_norm_rope_kvcache(qkv, q_out, k_out, num_heads_q, num_heads_k, num_heads_v,
                                      head_dim, eps, q_weight, k_weight, cos_sin_cache, is_neox,
                                      position_ids, key_cache, value_cache, slot_mapping,
                                      forced_token_heads_per_warp)


def _reshape_and_cache_flash(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                             slot_mapping: Tensor, kv_cache_dtype: str, k_scale: Tensor,
                             v_scale: Tensor) -> None:
    compat.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                                   kv_cache_dtype, k_scale, v_scale)


def _concat_and_cache_mla(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                          kv_cache_dtype: str, scale: Tensor) -> None:
    compat.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale)


_register("_C::rotary_embedding", ("query", "key"), _rotary_embedding)
_register("_C::batched_rotary_embedding", ("query", "key"), _batched_rotary_embedding)
_register("_C::fused_qk_norm_rope", ("qkv",), _fused_qk_norm_rope)
_register("_C::fused_qk_norm_rope_kvcache", ("q_out", "k_out", "key_cache", "value_cache"),
          _fused_qk_norm_rope_kvcache)
_register("_C_cache_ops::reshape_and_cache_flash", ("key_cache", "value_cache"),
          _reshape_and_cache_flash)
_register("_C_cache_ops::concat_and_cache_mla", ("kv_cache",), _concat_and_cache_mla)


def _guard_namespace(namespace: str) -> None:
    """Make ``torch.ops.<namespace>.<op>`` of an op registered nowhere raise NoAdapter (torch
    raises AttributeError) so that those tests count as "no adapter"."""
    ops = getattr(torch.ops, namespace)
    base = type(ops)

    class Guarded(base):
        def __getattr__(self, op_name):
            try:
                return base.__getattr__(self, op_name)
            except AttributeError:
                if op_name.startswith("__"):
                    raise
                raise NoAdapter(f"torch.ops.{namespace}.{op_name}") from None

    ops.__class__ = Guarded


_guard_namespace("_C")
_guard_namespace("_C_cache_ops")


# The Python wrappers of vllm._custom_ops (same names and arguments as vLLM's).

def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    torch.ops._C.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


def batched_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, rot_dim,
                             cos_sin_cache_offsets):
    torch.ops._C.batched_rotary_embedding(positions, query, key, head_size, cos_sin_cache,
                                          is_neox, rot_dim, cos_sin_cache_offsets)


def fused_qk_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight,
                       k_weight, cos_sin_cache, is_neox, position_ids):
    torch.ops._C.fused_qk_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps,
                                    q_weight, k_weight, cos_sin_cache, is_neox, position_ids)


def fused_qk_norm_rope_kvcache(qkv, q_out, k_out, num_heads_q, num_heads_k, num_heads_v,
                               head_dim, eps, q_weight, k_weight, cos_sin_cache, is_neox,
                               position_ids, key_cache, value_cache, slot_mapping,
                               forced_token_heads_per_warp=-1):
    torch.ops._C.fused_qk_norm_rope_kvcache(qkv, q_out, k_out, num_heads_q, num_heads_k,
                                            num_heads_v, head_dim, eps, q_weight, k_weight,
                                            cos_sin_cache, is_neox, position_ids, key_cache,
                                            value_cache, slot_mapping,
                                            forced_token_heads_per_warp)


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                            k_scale, v_scale):
    torch.ops._C_cache_ops.reshape_and_cache_flash(key, value, key_cache, value_cache,
                                                   slot_mapping, kv_cache_dtype, k_scale,
                                                   v_scale)


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale):
    torch.ops._C_cache_ops.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping,
                                                kv_cache_dtype, scale)


__getattr__ = module_getattr("vllm._custom_ops")
