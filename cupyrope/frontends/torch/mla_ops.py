"""The ``torch.library`` operator of :func:`cupyrope.mla_rope_and_cache`,
``cupyrope::mla_rope_and_cache``: what ``torch.compile`` traces (and CUDA graphs capture). It
returns new q and k_pe outputs and writes the latent cache (or its two caches) in place (a
declared mutation), so that the traced graph orders the cache's readers after it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...core.mla import plan_mla
from ...core.scaling import scaling_from_op_args, scaling_op_args
from ...core.validators import check_bool
from ...cuda.mla_launch import described_output, run_mla
from .ops import NAMESPACE, _HAS_CUSTOM_OPS, _check_tensor, _number, _optional_int, _scale_args

MLA_SCHEMA = (
    "(Tensor q_nope, Tensor q_pe, Tensor k_pe, Tensor kv_c, Tensor? positions, "
    "Tensor(a!) kv_cache, Tensor slot_mapping, Tensor? cos_sin_cache, float theta, str? scaling, "
    "float[]? scaling_numbers, bool interleaved, str? out_dtype, Tensor? q_scale_tensor, "
    "float? q_scale, Tensor? k_scale_tensor, float? k_scale, Tensor? kv_scale_tensor, "
    "float? kv_scale, str? cache_dtype, SymInt? seq_len, Tensor(b!)? kpe_cache) -> "
    "(Tensor, Tensor)")


def mla_rope_and_cache(q_nope: Tensor, q_pe: Tensor, k_pe: Tensor, kv_c: Tensor, positions,
                       kv_cache: Tensor, slot_mapping: Tensor, *, cos_sin_cache=None,
                       theta=10000.0, scaling=None, interleaved=True, out_dtype=None,
                       q_scale=None, k_scale=None, kv_scale=None, cache_dtype=None,
                       seq_len=None, kpe_cache=None) -> tuple[Tensor, Tensor]:
    """:func:`cupyrope.mla_rope_and_cache` through the operator (out of place, torch tensors;
    ``q_nope`` of width 0 for q heads without nope dims, ``k_pe`` ``[T, 1, rope_dim]``). Returns
    ``(q_out [T, H, nope + rope], k_pe_out)``."""
    op_name = "mla_rope_and_cache"
    for x, name in ((q_nope, "q_nope"), (q_pe, "q_pe"), (k_pe, "k_pe"), (kv_c, "kv_c"),
                    (kv_cache, "kv_cache"), (slot_mapping, "slot_mapping")):
        _check_tensor(x, name, op_name)
    if kpe_cache is not None:
        _check_tensor(kpe_cache, "kpe_cache", op_name)
    scaling_text, scaling_numbers = scaling_op_args(scaling, op_name)
    scales = {**_scale_args(q_scale, "q_scale", op_name),
              **_scale_args(k_scale, "k_scale", op_name),
              **_scale_args(kv_scale, "kv_scale", op_name)}
    if any(key.endswith("_rows") for key in scales):
        raise ValueError(f"{op_name}: the MLA ops take one fp8 scale per tensor")
    text = None if out_dtype is None else str(out_dtype).removeprefix("torch.")
    cache_text = None if cache_dtype is None else str(cache_dtype).removeprefix("torch.")
    return getattr(torch.ops, NAMESPACE).mla_rope_and_cache(
        q_nope, q_pe, k_pe, kv_c, positions, kv_cache, slot_mapping, cos_sin_cache,
        _number(theta, "theta", op_name), scaling_text, scaling_numbers,
        check_bool(interleaved, "interleaved", op_name), text, scales["q_scale_tensor"],
        scales["q_scale"], scales["k_scale_tensor"], scales["k_scale"],
        scales["kv_scale_tensor"], scales["kv_scale"], cache_text,
        _optional_int(seq_len, "seq_len", op_name), kpe_cache)


def _scale(tensor, value):
    return tensor if tensor is not None else value


def _implementation(q_nope, q_pe, k_pe, kv_c, positions, kv_cache, slot_mapping, cos_sin_cache,
                    theta, scaling, scaling_numbers, interleaved, out_dtype, q_scale_tensor,
                    q_scale, k_scale_tensor, k_scale, kv_scale_tensor, kv_scale, cache_dtype,
                    seq_len, kpe_cache):
    op_name = "mla_rope_and_cache"
    nope = q_nope.shape[-1]
    mla = plan_mla(op_name, q_nope if nope else None, q_pe, None, k_pe, positions,
                   rope=dict(cos_sin_cache=cos_sin_cache, theta=theta,
                             scaling=scaling_from_op_args(scaling, scaling_numbers),
                             interleaved=interleaved, seq_len=seq_len),
                   out_dtype=out_dtype, q_scale=_scale(q_scale_tensor, q_scale),
                   k_scale=_scale(k_scale_tensor, k_scale), kv_c=kv_c, kv_cache=kv_cache,
                   slot_mapping=slot_mapping, cache_dtype=cache_dtype,
                   kv_scale=_scale(kv_scale_tensor, kv_scale), kpe_cache=kpe_cache)
    q_out, k_out = _fake(q_nope, q_pe, k_pe, out_dtype)
    run_mla(mla, [described_output(q_out[..., :nope], out_dtype) if nope else None,
                  described_output(q_out[..., nope:], out_dtype), None,
                  described_output(k_out, out_dtype)])
    return q_out, k_out


def _fake(q_nope, q_pe, k_pe, out_dtype, *rest):
    dtype = q_pe.dtype if out_dtype is None else getattr(torch, out_dtype)
    T, H = q_pe.shape[0], q_pe.shape[1]
    return (q_pe.new_empty((T, H, q_nope.shape[-1] + q_pe.shape[-1]), dtype=dtype),
            k_pe.new_empty(k_pe.shape, dtype=dtype))


def _fake_implementation(q_nope, q_pe, k_pe, kv_c, positions, kv_cache, slot_mapping,
                         cos_sin_cache, theta, scaling, scaling_numbers, interleaved, out_dtype,
                         *rest):
    return _fake(q_nope, q_pe, k_pe, out_dtype)


if _HAS_CUSTOM_OPS and not hasattr(getattr(torch.ops, NAMESPACE), "mla_rope_and_cache"):
    torch.library.custom_op(f"{NAMESPACE}::mla_rope_and_cache", _implementation,
                            mutates_args=("kv_cache", "kpe_cache"), schema=MLA_SCHEMA
                            ).register_fake(_fake_implementation)
