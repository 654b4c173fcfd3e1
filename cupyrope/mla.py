"""The DeepSeek MLA ops (DeepSeek-V2 / V3 / R1, Kimi K2): :func:`mla_rope_quantize` (FlashInfer's
``mla_rope_quantize_fp8`` shape: rope and nope parts apart) and :func:`mla_rope_and_cache` (q
rotated and stored whole, and vLLM's ``concat_and_cache_mla`` latent cache written, in one call).

Checks and the NumPy path live in :mod:`cupyrope.core.mla`; this module splits and joins the
caller's arrays and returns results in the caller's type.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from .core.mla import plan_mla
from .cuda.mla_launch import described_output as _described
from .cuda.mla_launch import new_mla_output as _new_like
from .cuda.mla_launch import run_mla as _run

Array = Any


def _rope_options(cos_sin_cache, theta, scaling, interleaved, inplace, seq_len) -> dict:
    """The rotation's arguments, as ``plan_rope`` takes them (the whole rope part is rotated)."""
    return dict(cos_sin_cache=cos_sin_cache, theta=theta, scaling=scaling,
                interleaved=interleaved, inplace=inplace, seq_len=seq_len)


def _token_heads(x, name: str, op_name: str):
    """``x`` as ``[T, heads, dim]``: a 2-d ``[T, dim]`` array gains a unit head dim (a view)."""
    ndim = len(getattr(x, "shape", ()))
    if ndim == 2:
        return x[:, None, :]
    if ndim != 3:
        raise ValueError(f"{op_name}: {name} must be [num_tokens, rope_dim] or [num_tokens, heads, "
                         f"dim], got shape {tuple(getattr(x, 'shape', ()))}")
    return x


def _torch_compiling() -> bool:
    """Whether torch.compile / export is tracing this call (torch is never imported here)."""
    torch = sys.modules.get("torch")
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling is not None and is_compiling())


def _traced_rope_and_cache(q, joint: bool, q_nope, q_pe, k_pe, k_heads, kv_c, positions,
                           kv_cache, slot_mapping, inplace, validate, options: dict):
    """``mla_rope_and_cache`` under torch.compile: the ``cupyrope::mla_rope_and_cache``
    operator (out of place; in place, its results are copied back into the rope parts)."""
    from .frontends.torch import mla_ops

    op_name = "mla_rope_and_cache"
    if validate:
        raise ValueError(f"{op_name}: validate=True reads slots on the host, which a traced "
                         "graph cannot; validate outside torch.compile")
    if inplace and options.get("out_dtype") is not None:
        raise ValueError(f"{op_name}: an fp8 out_dtype needs new outputs: pass inplace=False")
    q_out, k_out = mla_ops.mla_rope_and_cache(q_nope, q_pe, k_heads, kv_c, positions, kv_cache,
                                              slot_mapping, **options)
    nope = q_nope.shape[-1]
    if inplace:
        q_pe.copy_(q_out[..., nope:])
        k_heads.copy_(k_out)
        return q, k_pe, kv_cache
    k_out = k_out.reshape(k_pe.shape)
    if joint:
        return q_out, k_out, kv_cache
    return (q_out[..., :nope], q_out[..., nope:]), k_out, kv_cache


def _check_array_type(mla, op_name: str) -> None:
    """The MLA ops write their outputs and the cache in place here: NumPy, torch and CuPy arrays
    (JAX arrays take the functional form of :func:`_jax_mla`)."""
    q = mla.rope.q
    if q.kind not in ("numpy", "torch", "cupy"):
        raise TypeError(f"{op_name}: the MLA ops take NumPy, torch, CuPy or JAX arrays, got a "
                        f"{q.kind} array")


def _jax_mla(*arrays):
    """The JAX form of the MLA ops (:mod:`cupyrope.frontends.jax.mla`) when a JAX array or
    tracer is among ``arrays``, else None (JAX is never imported here)."""
    if "jax" not in sys.modules:
        return None
    from .frontends.jax import mla as jax_mla

    return jax_mla if jax_mla.is_mla_on_jax(*arrays) else None


def mla_rope_quantize(q_rope: Array, k_rope: Array, q_nope: Array | None = None,
                      k_nope: Array | None = None, positions: Array | None = None, *,
                      cos_sin_cache: Array | None = None, theta: float = 10000.0,
                      scaling: Mapping[str, Any] | None = None, interleaved: bool = True,
                      out_dtype: Any = None, q_scale: Any = None, k_scale: Any = None,
                      inplace: bool = False, validate: bool = False,
                      seq_len: int | None = None):
    """Rotate the rope parts of MLA q and k heads and store every part (rope and nope) in one
    pass, in the input dtype or as fp8 (FlashInfer's ``mla_rope_quantize_fp8`` layout).

    Parameters
    ----------
    q_rope : array, shape ``(T, num_q_heads, rope_dim)``
        float16, bfloat16 or float32; unit last stride, any other strides (a view
        ``q[..., nope:]`` of a joint head works).
    k_rope : array, shape ``(T, rope_dim)`` (MLA: one k head) or ``(T, num_k_heads, rope_dim)``
    q_nope, k_nope : arrays, shapes ``(T, num_q_heads, nope_dim)`` / k_rope's tokens and heads
        with ``nope_dim`` last, optional
        Passed through unrotated (quantised with their head's scale).
    positions : int32 or int64 array, shape ``(T,)``
    cos_sin_cache, theta, scaling, seq_len
        The angle source, as :func:`cupyrope.apply_rope` (DeepSeek's YaRN is ``scaling={"type":
        "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, ...}``); its rotary dims must
        be ``rope_dim``.
    interleaved : bool
        True (DeepSeek's): GPT-J pairing, dim ``2j`` with ``2j + 1`` of the rope part; False:
        NeoX, dim ``j`` with ``j + rope_dim // 2``.
    out_dtype : {None, "float8_e4m3fn", "float8_e5m2"} or an fp8 dtype object
        None: outputs of the input dtype; fp8: ``fp8(value / scale)``, saturated to the format's
        largest finite value (NumPy gets ml_dtypes fp8, torch its fp8 dtypes).
    q_scale, k_scale : float or one-element float32 array, optional
        The fp8 scales of the q parts and of the k parts (stored = value / scale); default 1.
    inplace : bool
        Rotate q_rope and k_rope in place (no nope parts, no fp8) and return them.
    validate : bool
        With a cache table, read positions on the host and raise IndexError outside it.

    Returns
    -------
    (q_rope_out, k_rope_out, q_nope_out, k_nope_out)
        Arrays shaped like the inputs (None where a nope input is None). JAX arrays and tracers
        take the same call (:mod:`cupyrope.frontends.jax.mla`: one kernel launch under
        ``jax.jit`` on NVIDIA GPUs); ``inplace=True`` raises TypeError there.

    Examples
    --------
    >>> import numpy as np, cupyrope as cr
    >>> rng = np.random.default_rng(0)
    >>> q_pe, q_nope = rng.standard_normal((3, 4, 64)), rng.standard_normal((3, 4, 128))
    >>> k_pe = rng.standard_normal((3, 64))
    >>> outs = cr.mla_rope_quantize(q_pe.astype(np.float32), k_pe.astype(np.float32),
    ...                             q_nope.astype(np.float32), None, np.arange(3))
    >>> [None if x is None else x.shape for x in outs]
    [(3, 4, 64), (3, 64), (3, 4, 128), None]
    """
    jax_mla = _jax_mla(q_rope, k_rope, q_nope, k_nope, positions, cos_sin_cache, q_scale, k_scale)
    if jax_mla is not None:  # functional: new arrays
        return jax_mla.mla_rope_quantize(
            q_rope, k_rope, q_nope, k_nope, positions, cos_sin_cache=cos_sin_cache, theta=theta,
            scaling=scaling, interleaved=interleaved, out_dtype=out_dtype, q_scale=q_scale,
            k_scale=k_scale, inplace=inplace, validate=validate, seq_len=seq_len)
    op_name = "mla_rope_quantize"
    k_heads = _token_heads(k_rope, "k_rope", op_name)
    k_nope_heads = None if k_nope is None else _token_heads(k_nope, "k_nope", op_name)
    mla = plan_mla(op_name, q_nope, q_rope, k_nope_heads, k_heads, positions,
                   rope=_rope_options(cos_sin_cache, theta, scaling, interleaved, inplace,
                                      seq_len),
                   out_dtype=out_dtype, q_scale=q_scale, k_scale=k_scale, validate=validate)
    _check_array_type(mla, op_name)
    if mla.rope.inplace:
        _run(mla, [None, mla.rope.q, None, mla.rope.k])
        return q_rope, k_rope, None, None
    results, infos = [], []
    for x in (q_rope, k_rope, q_nope, k_nope):
        out, info = (None, None) if x is None else _new_like(x, mla.out_dtype)
        results.append(out)
        infos.append(info)
    _run(mla, [infos[2], infos[0], infos[3], infos[1]])
    return tuple(results)


def mla_rope_and_cache(q: Array | tuple[Array, Array], k_pe: Array, kv_c: Array,
                       positions: Array | None, kv_cache: Array, slot_mapping: Array, *,
                       cos_sin_cache: Array | None = None, theta: float = 10000.0,
                       scaling: Mapping[str, Any] | None = None, interleaved: bool = True,
                       out_dtype: Any = None, q_scale: Any = None, k_scale: Any = None,
                       kv_scale: Any = None, cache_dtype: Any = None, inplace: bool = False,
                       validate: bool = False, seq_len: int | None = None,
                       kpe_cache: Array | None = None):
    """DeepSeek MLA's step before attention in one call: rotate the rope part of every q head
    and of ``k_pe``, store q whole (input dtype or fp8), and write ``[kv_c | rotated k_pe]``
    into vLLM's MLA cache (``concat_and_cache_mla``'s layout), or kv_c and the rotated k_pe
    into two caches (FlashInfer's ``ckv_cache`` / ``kpe_cache``) with ``kpe_cache``.

    Parameters
    ----------
    q : array ``(T, H, nope_dim + rope_dim)``, or a pair ``(q_nope (T, H, nope_dim), q_pe (T, H,
        rope_dim))``
        DeepSeek-V3: ``128 + 64`` (``512 + 64`` in the absorbed decode form); the rope part is
        the LAST ``rope_dim`` dims of a head. float16, bfloat16 or float32, unit last stride.
    k_pe : array ``(T, rope_dim)`` or ``(T, 1, rope_dim)``
        The shared rotary k head; its last dim is ``rope_dim``.
    kv_c : array ``(T, kv_lora_rank)`` or ``(T, 1, kv_lora_rank)``
        The normalised latent, cached as it is (512 for DeepSeek-V3).
    positions, cos_sin_cache, theta, scaling, seq_len, interleaved, validate
        As :func:`mla_rope_quantize` (``validate`` also checks the slots as
        :func:`cupyrope.rope_and_cache` does).
    kv_cache : array ``(num_blocks, block_size, kv_lora_rank + rope_dim)``
        q's dtype, an fp8 dtype, or uint8 holding fp8 bits (name the format with
        ``cache_dtype``); any strides with a unit last dim. Written in place.
    slot_mapping : int32 or int64 array ``(T,)``
        Token t goes to block ``slot // block_size``, row ``slot % block_size``; negative slots
        (padding) and slots past the cache write nothing.
    out_dtype, q_scale, k_scale
        fp8 outputs of q and of k_pe, as :func:`mla_rope_quantize`.
    kv_scale : float or one-element float32 array, optional
        The fp8 cache's scale (stored = value / kv_scale, vLLM's convention); default 1.
    cache_dtype : {None, "float8_e4m3fn", "float8_e5m2"}
        The fp8 format of a uint8 cache.
    inplace : bool
        Rotate the rope parts of q and k_pe in place (no fp8 outputs); the nope dims are not
        touched.
    kpe_cache : array ``(num_blocks, block_size, rope_dim)``, optional
        The rotated k_pe's own cache, of kv_cache's dtype (FlashInfer's MLA layout); kv_cache
        is then ``(num_blocks, block_size, kv_lora_rank)``. Written in place, slot for slot
        as kv_cache.

    Returns
    -------
    (q_out, k_pe_out, kv_cache)
        q_out in q's layout (one array or the pair), k_pe_out shaped like k_pe (in place: q and
        k_pe themselves), kv_cache the array given. JAX arrays and tracers: new arrays and a new
        cache (rows no slot names keep the input's values; the input is unchanged), with
        ``kpe_cache`` ``(q_out, k_pe_out, kv_cache, kpe_cache)`` (two new caches), one kernel
        launch under ``jax.jit`` on NVIDIA GPUs; ``inplace=True`` raises TypeError there.

    Examples
    --------
    >>> import numpy as np, cupyrope as cr
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 16, 192)).astype(np.float32)
    >>> k_pe = rng.standard_normal((2, 64)).astype(np.float32)
    >>> kv_c = rng.standard_normal((2, 512)).astype(np.float32)
    >>> cache = np.zeros((4, 8, 576), np.float32)
    >>> q_out, k_out, _ = cr.mla_rope_and_cache(q, k_pe, kv_c, np.arange(2), cache,
    ...                                         np.array([9, -1]))
    >>> bool((cache[1, 1, :512] == kv_c[0]).all() and (cache[1, 1, 512:] == k_out[0]).all())
    True
    """
    jax_mla = _jax_mla(*(q if isinstance(q, (tuple, list)) else (q,)), k_pe, kv_c, positions,
                       kv_cache, slot_mapping, cos_sin_cache, q_scale, k_scale, kv_scale,
                       kpe_cache)
    if jax_mla is not None:  # functional: new arrays and new caches
        return jax_mla.mla_rope_and_cache(
            q, k_pe, kv_c, positions, kv_cache, slot_mapping, cos_sin_cache=cos_sin_cache,
            theta=theta, scaling=scaling, interleaved=interleaved, out_dtype=out_dtype,
            q_scale=q_scale, k_scale=k_scale, kv_scale=kv_scale, cache_dtype=cache_dtype,
            inplace=inplace, validate=validate, seq_len=seq_len, kpe_cache=kpe_cache)
    op_name = "mla_rope_and_cache"
    k_heads = _token_heads(k_pe, "k_pe", op_name)
    joint = not isinstance(q, (tuple, list))
    if joint:
        if len(getattr(q, "shape", ())) != 3:
            raise ValueError(f"{op_name}: q must be [num_tokens, num_heads, nope_dim + rope_dim] "
                             f"or a pair (q_nope, q_pe), got shape "
                             f"{tuple(getattr(q, 'shape', ()))}")
        nope = q.shape[-1] - k_heads.shape[-1]
        if nope < 0:
            raise ValueError(f"{op_name}: q's head ({q.shape[-1]} dims) is shorter than k_pe's "
                             f"rope_dim {k_heads.shape[-1]}")
        q_nope, q_pe = q[..., :nope], q[..., nope:]
    elif len(q) != 2:
        raise ValueError(f"{op_name}: q must be one array or a pair (q_nope, q_pe), got "
                         f"{len(q)} arrays")
    else:
        q_nope, q_pe = q
    if _torch_compiling():
        return _traced_rope_and_cache(
            q, joint, q_nope, q_pe, k_pe, k_heads, kv_c, positions, kv_cache, slot_mapping,
            inplace is True, validate,
            dict(cos_sin_cache=cos_sin_cache, theta=theta, scaling=scaling,
                 interleaved=interleaved, out_dtype=out_dtype, q_scale=q_scale, k_scale=k_scale,
                 kv_scale=kv_scale, cache_dtype=cache_dtype, seq_len=seq_len,
                 kpe_cache=kpe_cache))
    in_place = inplace is True
    mla = plan_mla(op_name, None if in_place else q_nope, q_pe, None, k_heads, positions,
                   rope=_rope_options(cos_sin_cache, theta, scaling, interleaved, inplace,
                                      seq_len),
                   out_dtype=out_dtype, q_scale=q_scale, k_scale=k_scale, kv_c=kv_c,
                   kv_cache=kv_cache, slot_mapping=slot_mapping, cache_dtype=cache_dtype,
                   kv_scale=kv_scale, validate=validate, kpe_cache=kpe_cache)
    _check_array_type(mla, op_name)
    if mla.rope.inplace:
        _run(mla, [None, mla.rope.q, None, mla.rope.k])
        return q, k_pe, kv_cache
    k_out, k_info = _new_like(k_pe, mla.out_dtype)
    if joint:
        q_out, _ = _new_like(q, mla.out_dtype)
        nope = q_nope.shape[-1]
        infos = [_described(q_out[..., :nope], mla.out_dtype),
                 _described(q_out[..., nope:], mla.out_dtype)]
    else:
        (nope_out, nope_info), (pe_out, pe_info) = (_new_like(q_nope, mla.out_dtype),
                                                    _new_like(q_pe, mla.out_dtype))
        q_out, infos = (nope_out, pe_out), [nope_info, pe_info]
    _run(mla, [*infos, None, k_info])
    return q_out, k_out, kv_cache


def latent_cache_write(kv_c: Array, k_pe: Array, kv_cache: Array, slot_mapping: Array, *,
                       cache_dtype: Any = None, kv_scale: Any = None, validate: bool = False,
                       op_name: str = "latent_cache_write", kpe_cache: Array | None = None
                       ) -> Array:
    """The cache half of :func:`mla_rope_and_cache` without the rotation (vLLM's
    ``concat_and_cache_mla``): ``[kv_c | k_pe]`` into the row of each token's slot, k_pe as it
    is, stored once in the cache's format. Arguments as :func:`mla_rope_and_cache`; ``kv_c``,
    ``k_pe`` and ``slot_mapping`` have one token each; with ``kpe_cache``, kv_c and k_pe go to
    two caches. Returns kv_cache."""
    k_heads = _token_heads(k_pe, "k_pe", op_name)
    mla = plan_mla(op_name, None, k_heads[:, :0], None, k_heads, None,
                   rope=_rope_options(None, 10000.0, None, True, False, None), kv_c=kv_c,
                   kv_cache=kv_cache, slot_mapping=slot_mapping, cache_dtype=cache_dtype,
                   kv_scale=kv_scale, rotate=False, validate=validate, kpe_cache=kpe_cache)
    _check_array_type(mla, op_name)
    _run(mla, [None, None, None, None])
    return kv_cache
