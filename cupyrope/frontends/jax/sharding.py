"""Sharded JAX calls: a ``jax.experimental.custom_partitioning`` around a primitive call, with its
Shardy rule and GSPMD partitioning, so that each device runs the primitive on its own tokens and
heads. Design: ``docs/jax_internals.md``."""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from . import primitives


class PartitionedCall(NamedTuple):
    """One primitive call, hashable (custom_partitioning's static argument): which primitive,
    its params as sorted items, and the names of its operands in order."""

    kind: str  # "rope" or "fused"
    params: tuple[tuple[str, object], ...]
    names: tuple[str, ...]

    def bind(self, operands) -> tuple:
        return primitives.bind(self.kind, dict(self.params), operands)

    @property
    def implicit_positions(self) -> bool:
        """Positions are an arange along the last token dim (computed or cache angles without
        positions): a shard of that dim would restart it."""
        return "positions" not in self.names and "cos" not in self.names


def bind_partitioned(kind: str, params: dict, operands: list) -> tuple:
    """The results of one primitive call (as :func:`primitives.bind`) that each shard runs on
    its own tokens and heads under jax.jit (see :func:`_partition`)."""
    call = PartitionedCall(kind, tuple(sorted(params.items())),
                           primitives.operand_names(kind, params))
    return tuple(_partitioned_call()(call, *operands))


def _bound_call(call: PartitionedCall, *operands):
    return call.bind(operands)


@functools.lru_cache(maxsize=1)
def _partitioned_call():
    """The custom_partitioning of every partitionable call: each shard runs the primitive on its
    tokens and heads (see :func:`_partition`)."""
    from jax.experimental.custom_partitioning import custom_partitioning

    call = custom_partitioning(_bound_call, static_argnums=(0,))
    call.def_partition(partition=_partition, sharding_rule=_sharding_rule,
                       infer_sharding_from_operands=_infer_sharding,
                       propagate_user_sharding=None)
    return call


# Arrays indexed per token, and how many trailing dims each has past the token dims; M-RoPE
# positions also have a leading component dim.
_TOKEN_ALIGNED = {"positions": 0, "cos": 1, "sin": 1}


def _dims(call: PartitionedCall, shapes: dict) -> dict:
    """For each operand, per dim, what it indexes: ("token", i), ("head", name) / ("head_dim",)
    for q and k, or None (its own: replicated)."""
    n = len(shapes["q"]) - 2
    token_shape = shapes["q"][:n]
    dims = {}
    for name, shape in shapes.items():
        if name in ("q", "k"):
            dims[name] = tuple(("token", i) for i in range(n)) + (("head", name), ("head_dim",))
        elif name in _TOKEN_ALIGNED:
            trailing = _TOKEN_ALIGNED[name]
            leading = 1 if name == "positions" and len(shape) > n and shape[0] == 3 and (
                _is_mrope(call)) else 0
            core = shape[leading:len(shape) - trailing]
            offset = n - len(core)
            dims[name] = ((None,) * leading + tuple(
                ("token", offset + i) if offset + i >= 0 and size == token_shape[offset + i]
                and size != 1 else None for i, size in enumerate(core)) + (None,) * trailing)
        else:
            dims[name] = (None,) * len(shape)
    return dims


def _is_mrope(call: PartitionedCall) -> bool:
    params = dict(call.params)
    rotation = params["rotation"] if call.kind == "rope" else params["fused"].rotation
    scaling = rotation.scaling.as_dict() if rotation.scaling is not None else None
    return bool(scaling and scaling.get("mrope_section") is not None)


def _sharding_rule(call: PartitionedCall, mesh, operand_types, result_types):
    """Shardy's rule: one factor per token dim (shared by q, k, positions and per-token tables),
    heads of q and of k (two factors: their counts may differ), head_dim; everything else its
    own factors. The implicit arange's token dim needs replication."""
    from jax.experimental.custom_partitioning import SdyShardingRule
    from jax._src.lib.mlir import ir

    shapes = {name: tuple(ir.ShapedType(t).shape) for name, t in zip(call.names, operand_types)}
    dims = _dims(call, shapes)

    def factor(name, index, dim):
        if dim is None:
            return f"{name}_{index}"
        return {"token": lambda: f"t{dim[1]}", "head": lambda: f"h_{dim[1]}",
                "head_dim": lambda: "d"}[dim[0]]()

    mappings = {name: tuple(factor(name, i, d) for i, d in enumerate(dims[name])) for name in dims}
    outputs = tuple(mappings[name] for name in ("q", "k") if name in mappings)
    replicated = [f"t{len(shapes['q']) - 3}"] if call.implicit_positions and len(
        shapes["q"]) > 2 else []
    return SdyShardingRule(tuple(mappings[name] for name in call.names), outputs,
                           need_replication_factors=tuple(replicated + ["d"]))


def _infer_sharding(call: PartitionedCall, mesh, arg_shapes, result_shape):
    """GSPMD's propagation (when Shardy is off): the shardings :func:`_partition` would give."""
    return _shardings(call, mesh, arg_shapes)[1]


def _partition(call: PartitionedCall, mesh, arg_shapes, result_shape):
    """Each shard runs the primitive on its own tokens and heads: q's token and head shardings are
    kept, k's heads shard alike where the mesh axes divide Hk, positions and per-token tables are
    sharded along q's token dims, the cos/sin cache, weights and scales are replicated. Replicated
    instead: head_dim, dims that a mesh axis does not divide, and the last token dim when
    positions are the implicit arange along it (a shard would restart the arange)."""
    arg_shardings, result_shardings = _shardings(call, mesh, arg_shapes)

    def shard(*operands):
        return call.bind(operands)

    return mesh, shard, result_shardings, arg_shardings


def _shardings(call: PartitionedCall, mesh, arg_shapes):
    from jax.sharding import NamedSharding, PartitionSpec

    shapes = {name: tuple(a.shape) for name, a in zip(call.names, arg_shapes)}
    q = arg_shapes[0]
    if not isinstance(q.sharding, NamedSharding):
        raise ValueError(f"{call.kind}: sharded JAX calls need a NamedSharding over a Mesh, got "
                         f"{type(q.sharding).__name__}")
    q_spec = tuple(q.sharding.spec) + (None,) * (len(q.shape) - len(q.sharding.spec))

    def axes_size(axes):
        names = axes if isinstance(axes, tuple) else (axes,)
        return int(np.prod([mesh.shape[a] for a in names]))

    def kept(axes, size):
        return axes if axes is not None and size % axes_size(axes) == 0 else None

    n = len(q.shape) - 2
    tokens = [kept(q_spec[i], q.shape[i]) for i in range(n)]
    if call.implicit_positions and n:
        tokens[-1] = None
    heads = q_spec[n]
    dims = _dims(call, shapes)

    def spec(name):
        out = []
        for size, dim in zip(shapes[name], dims[name]):
            if dim is None or dim[0] == "head_dim":
                out.append(None)
            elif dim[0] == "token":
                out.append(tokens[dim[1]])
            else:
                out.append(kept(heads, size))
        return NamedSharding(mesh, PartitionSpec(*out))

    arg_shardings = tuple(spec(name) for name in call.names)
    result_shardings = tuple(spec(name) for name in ("q", "k") if name in shapes)
    return arg_shardings, result_shardings
