"""DTensor sharding rules of the cupyrope torch operators: q and k sharded over heads, or over a
token dim with per-token positions / tables sharded alike, rotate shard by shard with no
communication; caches, norm weights and fp8 scales are replicated. :func:`register` runs when
``cupyrope.apply_rope`` first sees a DTensor.

Design notes: docs/architecture.md#frontendstorchshardingpy
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

# The per-token and table arguments of every operator after q and k (ROTATION_SCHEMA in
# cupyrope/frontends/torch/ops.py).
_TABLES = ("positions", "cos_sin_cache", "cos", "sin")


def _token_placement(x, token_ndim: int, dim: int, trailing: int):
    """The placement of a per-token array (positions: ``trailing`` 0, a leading M-RoPE component
    dim allowed; cos / sin tables: ``trailing`` 1) when q is sharded over token dim ``dim``: the
    same dim of x (aligned from the right, as broadcasting aligns), or Replicate where x
    broadcasts along it."""
    if x is None:
        return None
    own = x.ndim - trailing  # x's dims that line up with q's token dims (M-RoPE: one more)
    index = dim - (token_ndim - own) if own <= token_ndim else dim + (own - token_ndim)
    if index < 0 or x.shape[index] == 1:
        return Replicate()
    return Shard(index)


def _layouts(q, k, positions, cos_sin_cache, cos, sin):
    """(q and k placement, table placements) of every layout that rotates without communication:
    replicated, sharded over heads, sharded over a token dim."""
    replicated = [None if x is None else Replicate() for x in (positions, cos_sin_cache, cos, sin)]
    layouts = [((Replicate(), None if k is None else Replicate()), replicated)]
    layouts.append(((Shard(q.ndim - 2), None if k is None else Shard(k.ndim - 2)), replicated))
    token_ndim = q.ndim - 2
    for dim in range(token_ndim):
        if dim == token_ndim - 1 and positions is None and cos is None:
            continue  # the implicit arange along axis -3 would restart in every shard
        tables = [_token_placement(positions, token_ndim, dim, 0),
                  None if cos_sin_cache is None else Replicate(),
                  _token_placement(cos, token_ndim, dim, 1),
                  _token_placement(sin, token_ndim, dim, 1)]
        layouts.append(((Shard(dim), None if k is None else Shard(dim)), tables))
    return layouts


def _rules_for(op):
    """The sharding function of one operator: for each layout, the outputs placed as q and k
    (none for an in-place operator, which keeps its inputs' placements: DTensor never
    redistributes a tensor written in place), and one placement per operator argument: q, k and
    the tables as the layout says, every other tensor (RMSNorm weights, fp8 scales) replicated,
    None for the non-tensor arguments."""
    arguments = [a.name for a in op._schema.arguments]
    returns = len(op._schema.returns)

    def rules(*args):
        named = dict(zip(arguments, args))
        q, k = named["q"], named["k"]
        result = []
        for (q_place, k_place), tables in _layouts(q, k, *(named[n] for n in _TABLES)):
            given = {"q": q_place, "k": k_place, **dict(zip(_TABLES, tables))}
            inputs = [given[n] if n in given else (Replicate() if _is_tensor(named[n]) else None)
                      for n in arguments]
            outputs = [q_place, Replicate() if k is None else k_place][:returns]
            result.append((outputs, inputs))
        return result

    return rules


def _is_tensor(spec) -> bool:
    """A tensor argument as DTensor hands it to a sharding function (a spec with placements)."""
    return hasattr(spec, "placements")


# The operators with rules: the rotation and the fused ops that write only q and k. rope_and_cache
# also writes the KV caches through its slot mapping, for which no shard-local layout is defined.
_OPERATORS = ("apply_rope", "apply_rope_", "rms_norm_rope", "rms_norm_rope_", "apply_rope_fp8")


@functools.lru_cache(maxsize=None)
def register() -> None:
    """Register the rules with DTensor (once per process)."""
    for name in _OPERATORS:
        op = getattr(torch.ops.cupyrope, name).default
        register_sharding(op)(_rules_for(op))
