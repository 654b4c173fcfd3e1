"""Shared pieces of the autograd tests (tests/test_autograd_cpu.py, tests/test_gpu_autograd.py).

- ``angle_call``: the arguments of one angle source for cupyrope (torch tensors on a device) and the
  same angles for tests/reference.py (NumPy), plus the per-token float64 cos / sin of every pair;
- ``torch_reference_rope``: an independent, differentiable float64 torch formulation of RoPE (Hugging
  Face's ``x * cos + rotate_half(x) * sin`` for NeoX, the stacked pairs for GPT-J) whose autograd
  gradients the library's are compared with;
- ``to_torch``: NumPy -> torch (bfloat16 through its bits).
"""

from __future__ import annotations

import numpy as np

import cupyrope as cr
from reference import reference_angles, reference_inv_freq
from tolerances import max_abs_angle, np_dtype

THETA = 10000.0
MAX_POSITION = 512
SOURCES = ["cache", "tables_half", "tables_full", "computed", "computed_linear"]



def widen_tables(cos, sin, source: str, interleaved: bool):
    """Half-width tables as given, or widened to Hugging Face's full width for "tables_full":
    pairs repeated (interleaved) or halves repeated (NeoX)."""
    if source != "tables_full":
        return cos, sin
    if interleaved:
        return np.repeat(cos, 2, axis=-1), np.repeat(sin, 2, axis=-1)
    return np.concatenate([cos, cos], axis=-1), np.concatenate([sin, sin], axis=-1)

def to_torch(a, device="cpu", requires_grad=False):
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype == np_dtype("bfloat16"):
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    t = t.to(device)
    return t.requires_grad_(True) if requires_grad else t


def angle_call(source, token_shape, rotary_dim, *, interleaved, rng, device="cpu",
               table_dtype="float64"):
    """(cupyrope kwargs, reference kwargs, check kwargs, (cos, sin) float64 per token and pair).

    ``token_shape``: q.shape[:-2]. Positions are random in [0, MAX_POSITION) with the shape of the
    token dims (tables sources: the tables are built from them and positions are not passed).
    """
    import torch

    positions = rng.integers(0, MAX_POSITION, size=token_shape)
    factor = 2.0 if source == "computed_linear" else 1.0
    inv_freq = reference_inv_freq(rotary_dim, THETA, factor)
    angles = reference_angles(positions, inv_freq)
    cos64, sin64 = np.cos(angles), np.sin(angles)
    pos_t = torch.from_numpy(positions).to(device)
    if source == "cache":
        cache = cr.cos_sin_cache(MAX_POSITION, rotary_dim, theta=THETA, dtype=table_dtype)
        half = rotary_dim // 2
        rows = cache.astype(np.float64)[positions]
        lib = dict(positions=pos_t, cos_sin_cache=to_torch(cache, device))
        ref = dict(positions=positions, cos_sin_cache=cache.astype(np.float64))
        return lib, ref, {}, (rows[..., :half], rows[..., half:])
    if source.startswith("tables"):
        c, s = widen_tables(cos64, sin64, source, interleaved)
        c, s = c.astype(np_dtype(table_dtype)), s.astype(np_dtype(table_dtype))
        lib = dict(cos=to_torch(c, device), sin=to_torch(s, device))
        if source == "tables_half":
            lib["rotary_dim"] = rotary_dim
        ref = dict(cos=c.astype(np.float64), sin=s.astype(np.float64), rotary_dim=rotary_dim)
        step = 2 if (source == "tables_full" and interleaved) else 1
        cols = np.arange(rotary_dim // 2) * step
        return lib, ref, {}, (c.astype(np.float64)[..., cols], s.astype(np.float64)[..., cols])
    lib = dict(positions=pos_t, theta=THETA, rotary_dim=rotary_dim)
    ref = dict(positions=positions, theta=THETA, rotary_dim=rotary_dim)
    if source == "computed_linear":
        lib["scaling"] = {"rope_type": "linear", "factor": factor}
        ref["linear_factor"] = factor
    return lib, ref, {"max_angle": max_abs_angle(positions, inv_freq)}, (cos64, sin64)


def torch_reference_rope(x, cos, sin, rotary_dim, interleaved):
    """float64 RoPE of torch tensor ``x`` [..., H, D] with per-token ``cos``/``sin`` [..., r/2]
    (float64 torch tensors), written with torch ops so that autograd differentiates it."""
    import torch

    x = x.double()
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # over heads
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        c, s = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        half = rotary_dim // 2
        rotate_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * c + rotate_half * s
    return torch.cat((out, rest), dim=-1)
