"""The peers cupyrope is measured against, each behind a function of the same arguments: the
Hugging Face formulation (eager and ``torch.compile``), Liger-Kernel and FlashInfer. A peer that
cannot be imported here is reported by :func:`peer_status` and left out of every run."""

from __future__ import annotations

import functools
import inspect

try:
    import torch
except ImportError:  # pragma: no cover - exercised only without torch
    torch = None


class Unavailable(RuntimeError):
    """An implementation that cannot run here (not installed, or not for this shape)."""


def rotate_half(x):
    """Hugging Face ``rotate_half``: ``[x1, x2] -> [-x2, x1]`` on the last dim."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_rope(q, k, positions, cos_sin_cache):
    """The Hugging Face formulation (NeoX), out of place: cos/sin gathered from the cache.

    q ``[T, Hq, D]``, k ``[T, Hk, D]``, positions ``[T]``, cos_sin_cache ``[P, rotary_dim]``
    (first half cos, second half sin); dims past rotary_dim pass through.
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)           # [T, rotary_dim / 2]
    return hf_rotate(q, k, cos, sin)


def hf_rotate(q, k, cos, sin):
    """The Hugging Face rotation (NeoX) of q and k by half-width ``[T, rotary_dim / 2]`` cos and
    sin rows, out of place; dims past rotary_dim pass through."""
    rotary_dim = 2 * cos.shape[-1]
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(-2).to(q.dtype)  # [T, 1, rotary_dim], HF layout
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(-2).to(q.dtype)

    def rotate(x):
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        out = x_rot * cos + rotate_half(x_rot) * sin
        return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out

    return rotate(q), rotate(k)


@functools.lru_cache(maxsize=None)
def hf_mrope(sections: tuple[int, int, int], interleaved: bool = False):
    """``rope(q, k, positions, cos_sin_cache)``: M-RoPE as vLLM's native path writes it, positions
    ``[3, T]`` (temporal, height, width). Sectioned (Qwen2-VL): the cos / sin rows of the three
    components gathered, frequency section i taken from component i. Interleaved (Qwen3-VL):
    frequency j from the height when ``j % 3 == 1 and j < 3 * sections[1]``, the width when
    ``j % 3 == 2 and j < 3 * sections[2]``, else the temporal position."""
    sections = tuple(int(s) for s in sections)

    def pick(rows):  # [3, T, rotary_dim / 2] -> [T, rotary_dim / 2]
        if not interleaved:
            return torch.cat([part[i] for i, part in enumerate(rows.split(sections, dim=-1))],
                             dim=-1)
        picked = rows[0].clone()
        picked[..., 1:3 * sections[1]:3] = rows[1, ..., 1:3 * sections[1]:3]
        picked[..., 2:3 * sections[2]:3] = rows[2, ..., 2:3 * sections[2]:3]
        return picked

    def mrope(q, k, positions, cos_sin_cache):
        cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [3, T, rotary_dim / 2]
        return hf_rotate(q, k, pick(cos), pick(sin))

    return mrope


@functools.lru_cache(maxsize=1)
def compiled_hf_rope():
    """``torch.compile(hf_rope)``, mode default, ``dynamic=False`` (one graph per shape)."""
    # Every benchmarked shape is a recompilation; past the default limit (8) dynamo would fall back
    # to eager without a word and the "torch.compile" numbers would be eager ones. The unfused
    # sequences of every serving shape share a few code objects, hence the generous limits.
    for name, limit in (("recompile_limit", 256), ("cache_size_limit", 256),
                        ("accumulated_recompile_limit", 1024),
                        ("accumulated_cache_size_limit", 1024)):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(limit, getattr(torch._dynamo.config, name)))
    return torch.compile(hf_rope, dynamic=False)


def liger_rope(q, k, cos, sin):
    """Liger-Kernel's Triton RoPE, in place: q ``[T, Hq, D]``, k ``[T, Hk, D]``, cos/sin ``[1, T, D]``.

    Liger takes ``[B, H, S, D]`` views of ``[B, S, H, D]`` storage, so q/k go in as transposed views
    and it writes into their storage; cos/sin are pre-gathered full-width (HF) tables.
    """
    from liger_kernel.ops.rope import LigerRopeFunction

    t = q.shape[0]
    out = LigerRopeFunction.apply(q.view(1, t, *q.shape[1:]).transpose(1, 2),
                                  k.view(1, t, *k.shape[1:]).transpose(1, 2), cos, sin)
    # Older releases return (q, k, cos, sin), newer ones (q, k): both [1, H, T, D] views.
    return out[0].transpose(1, 2).reshape(q.shape), out[1].transpose(1, 2).reshape(k.shape)


def _flashinfer_rope_module():
    import flashinfer.rope as fr

    # Before the vLLM-compatible API, apply_rope_with_cos_sin_cache took (q, k, cos_cache, sin_cache,
    # pos_ids, interleave); the calls below are written for (positions, query, key, head_size,
    # cos_sin_cache, is_neox).
    params = list(inspect.signature(fr.apply_rope_with_cos_sin_cache).parameters)
    if params and params[0] == "q":
        raise Unavailable(f"FlashInfer's apply_rope_with_cos_sin_cache takes {params}: an older API")
    return fr


def flashinfer_rope(q, k, positions, cos_sin_cache, *, interleaved=False):
    """FlashInfer ``apply_rope_with_cos_sin_cache`` (vLLM layout), out of place."""
    fr = _flashinfer_rope_module()
    t, d = q.shape[0], q.shape[-1]
    q_out, k_out = fr.apply_rope_with_cos_sin_cache(positions, q.view(t, -1), k.view(t, -1), d,
                                                    cos_sin_cache, is_neox=not interleaved)
    return q_out.view(q.shape), k_out.view(k.shape)


def flashinfer_rope_inplace(q, k, positions, cos_sin_cache, *, interleaved=False):
    """FlashInfer ``apply_rope_with_cos_sin_cache_inplace``; returns q, k."""
    fr = _flashinfer_rope_module()
    t, d = q.shape[0], q.shape[-1]
    fr.apply_rope_with_cos_sin_cache_inplace(positions, q.view(t, -1), k.view(t, -1), d,
                                             cos_sin_cache, is_neox=not interleaved)
    return q, k


def flashinfer_rope_computed(q, k, positions, *, rotary_dim, theta, interleaved=False):
    """FlashInfer ``apply_rope_pos_ids``: angles computed in the kernel (fast-math sin/cos)."""
    import flashinfer.rope as fr

    return fr.apply_rope_pos_ids(q, k, positions, rotary_dim=rotary_dim, interleave=interleaved,
                                 rope_scale=1.0, rope_theta=float(theta))


def _import_reason(module: str) -> str | None:
    try:
        __import__(module)
    except Exception as exc:  # ImportError, or a package that breaks at import
        return f"{module} cannot be imported ({type(exc).__name__}: {exc})"
    return None


@functools.lru_cache(maxsize=1)
def peer_status() -> dict[str, str | None]:
    """For each peer key: None when it can run here, else why not."""
    torch_reason = None if torch is not None else "torch is not installed"
    liger = _import_reason("liger_kernel.ops.rope")
    flashinfer = _import_reason("flashinfer.rope")
    if flashinfer is None:
        try:
            _flashinfer_rope_module()
        except Unavailable as exc:
            flashinfer = str(exc)
    return {
        "torch-eager-hf": torch_reason,
        "torch-compile-hf": torch_reason or _import_reason("triton"),
        "liger-inplace": liger,
        "flashinfer-cache": flashinfer,
        "flashinfer-cache-inplace": flashinfer,
        "flashinfer-computed": flashinfer,
    }
