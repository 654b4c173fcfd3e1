"""torch.library custom ops behind cupyrope's torch calls: autograd, torch.compile, CUDA graphs.

Calls that need autograd or involve a DTensor, and every call traced by ``torch.compile`` /
``torch.export``, come here. Each operator runs :func:`cupyrope.execute.run` or
:func:`cupyrope.execute.run_fused` on detached tensors, and its fake implementation gives the
tracer the outputs' shapes and dtypes, so ``torch.compile(fullgraph=True)`` has no graph break.

Design notes: docs/architecture.md#frontendstorchopspy
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ... import execute
from ...core.fused_plan import (LAYOUTS, PER_HEAD, cache_format_name, check_norm_over,
                                fp8_name, is_per_row)
from ...core.plan import plan_rope
from ...core.scaling import scaling_from_op_args, scaling_op_args
from ...core.validators import check_bool, check_int, check_real

NAMESPACE = "cupyrope"
_HAS_CUSTOM_OPS = hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_fake")

# The angle source and the rotation's options: the same arguments, in this order, in every
# operator's schema.
ROTATION_SCHEMA = (
    "Tensor? positions, Tensor? cos_sin_cache, Tensor? cos, Tensor? sin, float theta, "
    "str? scaling, float[]? scaling_numbers, bool interleaved, SymInt? rotary_dim, bool inverse, "
    "SymInt? seq_len")
_TABLE_ARGS = ("positions", "cos_sin_cache", "cos", "sin")
_OPTION_ARGS = ("theta", "scaling", "scaling_numbers", "interleaved", "rotary_dim", "inverse",
                "seq_len")
NORM_SCHEMA = "Tensor? q_weight, Tensor? k_weight, float? eps, float weight_offset, str norm_over"
FP8_SCHEMA = ("str? out_dtype, Tensor? q_scale_tensor, float? q_scale, Tensor? k_scale_tensor, "
              "float? k_scale")
CACHE_SCHEMA = ("Tensor v, Tensor(c!) k_cache, Tensor(d!) v_cache, Tensor slot_mapping, "
                "str layout, Tensor? v_scale_tensor, float? v_scale, str? cache_dtype")
_SCALES = ("q_scale", "k_scale", "v_scale")
# Stores quantised per row (per-(token, head) fp8 scales, NVFP4 block scales): arrays the call
# writes, taken by operators of their own (ROW_SCALED_OPS), so that the other operators' schemas
# declare no write they never make.
ROWS_SCHEMA = "Tensor(e!)? q_scale_rows, Tensor(f!)? k_scale_rows"
CACHE_ROWS_SCHEMA = (f"{ROWS_SCHEMA}, Tensor(g!)? v_scale_rows, Tensor(h!)? k_cache_scales, "
                     "Tensor(i!)? v_cache_scales")
_ROW_ARRAYS = ("q_scale_rows", "k_scale_rows", "v_scale_rows", "k_cache_scales", "v_cache_scales")
# The fused ops that write a KV cache (their results end with the caches).
CACHE_OPS = ("rope_and_cache", "write_cache")


def needs_autograd(*arrays) -> bool:
    """True when one of ``arrays`` is a torch tensor that requires grad while grad mode is on."""
    if not torch.is_grad_enabled():
        return False
    wanted = any(isinstance(x, Tensor) and x.requires_grad for x in arrays)
    if wanted and not _HAS_CUSTOM_OPS:
        raise NotImplementedError(
            f"cupyrope: autograd needs torch.library.custom_op (torch >= 2.4); this is torch "
            f"{torch.__version__}: call it under torch.no_grad() or pass detached tensors"
        )
    return wanted


def is_distributed(*arrays) -> bool:
    """True when one of ``arrays`` is a DTensor (its torch module is imported only by programs that
    use it, and takes a second to import: cupyrope never imports it itself). Asked of the few
    distinct types of the arguments, not of each argument: a fused call passes ~20."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:
        return False
    dtensor = module.DTensor
    return any(issubclass(kind, dtensor) for kind in set(map(type, arrays)))


@torch.compiler.assume_constant_result
def _sharding_rules_ready() -> bool:
    """Register the operators' DTensor sharding rules (cupyrope.frontends.torch.sharding) once DTensor is
    imported; every entry into the operators asks first. Run as a constant while torch.compile
    traces, so a compiled function whose first call sees DTensors has the rules too."""
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from . import sharding as torch_sharding

    torch_sharding.register()
    return True


# ----------------------------------------------------------------------------------------------
# Arguments of the public functions as operator arguments


def _rotation_args(op_name: str, positions, cos_sin_cache, cos, sin, theta, scaling, interleaved,
                   rotary_dim, inverse, seq_len) -> dict:
    """The ``ROTATION_SCHEMA`` arguments of a call, by name, checked and encoded (the scaling
    dict as text + numbers)."""
    tables = (positions, cos_sin_cache, cos, sin)
    for value, name in zip(tables, _TABLE_ARGS):
        if value is not None:
            _check_tensor(value, name, op_name)
    named = dict(zip(_TABLE_ARGS, tables))
    named.update(zip(("scaling", "scaling_numbers"), scaling_op_args(scaling, op_name)))
    named.update(theta=_number(theta, "theta", op_name),
                 interleaved=check_bool(interleaved, "interleaved", op_name),
                 rotary_dim=_optional_int(rotary_dim, "rotary_dim", op_name),
                 inverse=check_bool(inverse, "inverse", op_name),
                 seq_len=_optional_int(seq_len, "seq_len", op_name))
    return named


def _check_tensor(x, name: str, op_name: str = "apply_rope") -> None:
    if not isinstance(x, Tensor):
        raise TypeError(
            f"{op_name}: {name} must be a torch tensor when q and k are torch tensors that require "
            f"grad or inside torch.compile, got {type(x).__module__}.{type(x).__qualname__}"
        )


def _number(value, name: str, op_name: str = "apply_rope"):
    """A float for the schema (a symbolic float under torch.compile stays as it is); its range
    (finite, > 0) is checked where the call runs."""
    if isinstance(value, torch.SymFloat):
        return value
    return check_real(value, name, op_name)


def _optional_int(value, name: str, op_name: str = "apply_rope"):
    if value is None or isinstance(value, torch.SymInt):
        return value
    return check_int(value, name, op_name)


def _scale_args(value, name: str, op_name: str) -> dict:
    """An fp8 scale as the pair of operator arguments ``{name}_tensor`` (a 0-d / one-element
    float32 tensor, vLLM's convention) and ``{name}`` (a Python number); at most one is set.
    Per-row scales (a tensor of two or more dims) go to ``{name}_rows``, which only the
    operators of ROW_SCALED_OPS take."""
    if isinstance(value, str) and value == PER_HEAD:
        raise ValueError(f"{op_name}: {name}='{PER_HEAD}' makes new scale arrays only in "
                         "apply_rope and rms_norm_rope; pass a float32 tensor of per-row scales "
                         "to fill")
    if value is not None and is_per_row(value):
        _check_tensor(value, name, op_name)
        return {f"{name}_tensor": None, name: None, f"{name}_rows": value}
    if value is None:
        return {f"{name}_tensor": None, name: None}
    if isinstance(value, Tensor):
        return {f"{name}_tensor": value, name: None}
    return {f"{name}_tensor": None, name: _number(value, name, op_name)}


def _scale_from_args(named: dict, name: str):
    rows = named.get(f"{name}_rows")
    if rows is not None:
        return rows
    tensor = named[f"{name}_tensor"]
    return tensor if tensor is not None else named[name]


# ----------------------------------------------------------------------------------------------
# The public entry for torch tensors: apply_rope


def apply_rope(q, k=None, positions=None, *, cos_sin_cache=None, cos=None, sin=None,
               theta=10000.0, scaling=None, interleaved=False, rotary_dim=None, inverse=False,
               inplace=False, validate=False, seq_len=None, out=None):
    """:func:`cupyrope.apply_rope` through the custom ops (differentiable and traceable).

    Same arguments, results and errors as :func:`cupyrope.apply_rope`, for torch tensors (CUDA or
    CPU); every array argument must be a torch tensor. ``cupyrope.apply_rope`` calls this itself
    when it must, so there is rarely a reason to call it directly.
    """
    _check_tensor(q, "q")
    if k is not None:
        _check_tensor(k, "k")
    _sharding_rules_ready()
    rotation = _rotation_args("apply_rope", positions, cos_sin_cache, cos, sin, theta, scaling,
                              interleaved, rotary_dim, inverse, seq_len)
    inplace = check_bool(inplace, "inplace")
    tables = tuple(rotation[name] for name in _TABLE_ARGS)
    options = (*(rotation[name] for name in _OPTION_ARGS), check_bool(validate, "validate"))
    if out is not None:
        return _rotate_into_out(q, k, tables, options, inplace, out)

    if not inplace:
        q_out, k_out = torch.ops.cupyrope.apply_rope(q, k, *tables, *options)
        return q_out if k is None else (q_out, k_out)

    if k is q:
        raise ValueError("apply_rope: inplace=True but q and k are the same array")
    if torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad)):
        if torch.compiler.is_compiling():
            # Traced: the functional op and copies back, which torch.compile records like any
            # in-place change (it does not keep the mutation hidden in _RotateInPlace's forward
            # apart from the autograd graph: torch 2.11 gave wrong gradients that way).
            q_out, k_out = torch.ops.cupyrope.apply_rope(q, k, *tables, *options)
            return _copy_back(q, k, q_out, k_out)
        for x, name in ((q, "q"), (k, "k")):
            _check_inplace_autograd(x, name)
        if q.requires_grad:
            q = _RotateInPlace.apply(q, k, *tables, *options)  # one launch for q and k
        else:
            with torch.no_grad():
                torch.ops.cupyrope.apply_rope_(q, k, *tables, *options)
        if k is not None and k.requires_grad:
            k = _AlreadyRotated.apply(k, *tables, *options)
    else:
        torch.ops.cupyrope.apply_rope_(q, k, *tables, *options)
    return q if k is None else (q, k)


def _rotate_into_out(q, k, tables, options, inplace, out):
    """``out=`` through the custom op: refused under autograd (as torch refuses ``out=`` for
    differentiable arguments); traced, the functional op and a copy into the given tensors, which
    torch.compile records as writes to them. Shapes, dtypes and devices are checked first: a
    copy would broadcast and convert silently."""
    if inplace:
        raise ValueError("apply_rope: pass inplace=True (write into q and k) or out= (write into "
                         "other arrays), not both")
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    inputs = (q,) if k is None else (q, k)
    if len(outs) != len(inputs):
        raise TypeError(f"apply_rope: out must be {'q_out' if k is None else '(q_out, k_out)'} "
                        f"for a call {'without' if k is None else 'with'} k, got {len(outs)} arrays")
    for name, x, like in zip(("q_out", "k_out"), outs, inputs):
        _check_tensor(x, name)
        if (x.shape, x.dtype, x.device) != (like.shape, like.dtype, like.device):
            raise ValueError(f"apply_rope: {name} must have {name[0]}'s shape, dtype and device "
                             f"({tuple(like.shape)}, {like.dtype}, {like.device}), got "
                             f"({tuple(x.shape)}, {x.dtype}, {x.device})")
    if torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (*inputs, *tables, *outs)):
        raise RuntimeError("apply_rope: out= arguments do not support automatic differentiation "
                           "(as for torch's own ops), but an argument requires grad: call it "
                           "without out=, or under torch.no_grad()")
    q_out, k_out = torch.ops.cupyrope.apply_rope(q, k, *tables, *options)
    for given, result in zip(outs, (q_out, k_out)):
        given.copy_(result)
    return outs[0] if k is None else (outs[0], outs[1])


def _copy_back(q, k, q_out, k_out):
    """In place through autograd: the new values copied into q and k (torch's ``copy_``
    records the change on the autograd graph); returns q, or (q, k)."""
    q.copy_(q_out)
    if k is None:
        return q
    k.copy_(k_out)
    return q, k


def _check_inplace_autograd(x, name: str, op_name: str = "apply_rope") -> None:
    """torch's own rule for in-place ops, checked before the kernel writes anything."""
    if x is None or not x.requires_grad:
        return
    if x.is_leaf:
        raise RuntimeError(
            f"{op_name}: inplace=True on {name}, a leaf tensor that requires grad; autograd "
            "cannot record an in-place change of a leaf (as for torch's own in-place ops): rotate "
            "out of place, or in place on a non-leaf (e.g. the output of the QKV projection)"
        )
    base = x._base
    if base is not None and base.is_leaf and base.requires_grad:
        raise RuntimeError(
            f"{op_name}: inplace=True on {name}, a view of a leaf tensor that requires grad; "
            "autograd cannot record an in-place change of it (as for torch's own in-place ops)"
        )
    if x._is_view() and _creation_meta(x) != "DEFAULT":
        # torch refuses in-place changes of views made by a function that returns several views
        # (split, chunk, unbind), or made under no_grad / inference mode; it raises only after the
        # write, so the same rule is checked here, before anything is written.
        raise RuntimeError(
            f"{op_name}: inplace=True on {name}, a view of a tensor that requires grad made "
            f"{_CREATION_REASONS.get(_creation_meta(x), 'in a way autograd cannot rebase')}; "
            "autograd cannot record an in-place change of it (as for torch's own in-place ops): "
            "take q and k with slicing or narrow() instead, or rotate out of place"
        )


_CREATION_REASONS = {
    "MULTI_OUTPUT_NODE": "by a function that returns several views (split, chunk, unbind)",
    "NO_GRAD_MODE": "under torch.no_grad()",
    "INFERENCE_MODE": "under torch.inference_mode()",
    "IN_CUSTOM_FUNCTION": "inside a custom autograd Function",
}


def _creation_meta(x) -> str:
    """How autograd recorded the creation of view ``x`` (torch's CreationMeta, by name)."""
    get = getattr(torch._C._autograd, "_get_creation_meta", None)
    return "DEFAULT" if get is None else get(x).name


# ----------------------------------------------------------------------------------------------
# The public entry for torch tensors: the fused ops


def run_fused(op_name, q, k, positions, *, rope: dict, fusion: dict, validate: bool):
    """A fused op (``rms_norm_rope``, ``rope_and_cache``, ``apply_rope(out_dtype=...)``) on torch
    tensors, through its operator: called by :func:`cupyrope.execute.run_fused`'s router for calls
    traced by torch.compile and for tensors that require grad. Same arguments, results and errors
    as the public functions; ``rope`` and ``fusion`` are the dicts they build."""
    named = fused_op_args(op_name, q, k, positions, rope, fusion, validate)
    _sharding_rules_ready()
    inplace = check_bool(rope["inplace"], "inplace", op_name)
    if inplace and named["out_dtype"] is not None:
        raise ValueError(f"{op_name}: an fp8 out_dtype needs new outputs: pass inplace=False")
    key = (op_name, inplace and op_name != "apply_rope")  # apply_rope: out of place only
    rows = any(named.get(name) is not None for name in _ROW_ARRAYS)
    if rows and key not in _ROW_SCALED_OPS:
        raise ValueError(f"{op_name}: per-row fp8 scales need new outputs: pass inplace=False")
    op = _ROW_SCALED_OPS[key] if rows else _FUSED_OPS[key]
    graded = [name for name in ("q", "k", "q_weight", "k_weight", "v", "k_cache", "v_cache",
                                "q_scale_tensor", "k_scale_tensor", "v_scale_tensor",
                                *_ROW_ARRAYS)
              if needs_autograd(named.get(name))]
    if graded and not (op_name == "rms_norm_rope" and named["out_dtype"] is None):
        what = ("the KV-cache write" if op_name in CACHE_OPS else
                f"fp8 outputs (out_dtype={named['out_dtype']!r})")
        raise NotImplementedError(
            f"{op_name}: no gradient for {what}, but {', '.join(graded)} "
            f"{'requires' if len(graded) == 1 else 'require'} grad; call it under "
            "torch.no_grad() or on detached tensors (apply_rope, and rms_norm_rope without "
            "out_dtype, are differentiable)")
    if graded and inplace:
        return _norm_in_place_under_autograd(q, k, named, rope)
    outputs = op.call(named)
    q_out, k_out = (q, k) if op.inplace else outputs
    if op_name in CACHE_OPS:
        return q_out, k_out, named["k_cache"], named["v_cache"]
    return q_out if k is None else (q_out, k_out)


def fused_op_args(op_name, q, k, positions, rope: dict, fusion: dict, validate) -> dict:
    """Every operator argument of a fused call, by name, checked and encoded."""
    _check_tensor(q, "q", op_name)
    if k is not None:
        _check_tensor(k, "k", op_name)
    options = {name: value for name, value in rope.items() if name != "inplace"}
    named = dict(q=q, k=k, validate=check_bool(validate, "validate", op_name),
                 **_rotation_args(op_name, positions, **options))
    for name in _TABLE_ARGS[1:]:  # tables get no gradient (as for apply_rope)
        if named[name] is not None:
            named[name] = named[name].detach()
    arrays = ["q_weight", "k_weight"] if "q_weight" in fusion else []
    if "q_weight" in fusion:
        eps = fusion["eps"]
        norm_over = check_norm_over(fusion.get("norm_over", "head"), op_name)
        named.update(q_weight=fusion["q_weight"], k_weight=fusion["k_weight"],
                     eps=None if eps is None else _number(eps, "eps", op_name),
                     weight_offset=_number(fusion["weight_offset"], "weight_offset", op_name),
                     norm_over=norm_over)
    named["out_dtype"] = fp8_name(fusion["out_dtype"], "out_dtype", op_name)
    for name in _SCALES[:2]:
        named.update(_scale_args(fusion[name], name, op_name))
    if "k_cache" in fusion:
        arrays += ["v", "k_cache", "v_cache", "slot_mapping"]
        named.update({name: fusion[name] for name in ("v", "k_cache", "v_cache", "slot_mapping")})
        if fusion["layout"] not in LAYOUTS:
            raise ValueError(f"{op_name}: layout must be one of {LAYOUTS}, got {fusion['layout']!r}")
        named.update(layout=fusion["layout"],
                     cache_dtype=cache_format_name(fusion["cache_dtype"], op_name),
                     **_scale_args(fusion["v_scale"], "v_scale", op_name))
        named.update(k_cache_scales=fusion.get("k_cache_scales"),
                     v_cache_scales=fusion.get("v_cache_scales"))
    for name in _ROW_ARRAYS:  # the operators of ROW_SCALED_OPS take them all
        named.setdefault(name, None)
        if named[name] is not None:
            arrays.append(name)
    for name in arrays:
        if named[name] is not None:
            _check_tensor(named[name], name, op_name)
    return named


def _norm_in_place_under_autograd(q, k, named: dict, rope: dict):
    """``rms_norm_rope(inplace=True)`` with tensors that require grad: the out-of-place operator
    on copies of q and k (its backward keeps them: q and k are about to change), then ``copy_``
    into q and k, which records the change like any torch in-place op."""
    if not torch.compiler.is_compiling():
        for x, name in ((q, "q"), (k, "k")):
            _check_inplace_autograd(x, name, "rms_norm_rope")
        # The checks of the in-place call (q and k must not share an element with each other or
        # another operand), before anything is written.
        plan_rope(q.detach(), None if k is None else k.detach(), named["positions"],
                  op_name="rms_norm_rope", **rope)
    copies = dict(named, q=q.clone(), k=None if k is None else k.clone())
    q_out, k_out = _FUSED_OPS[("rms_norm_rope", False)].call(copies)
    return _copy_back(q, k, q_out, k_out)


# ----------------------------------------------------------------------------------------------
# The apply_rope operators


def _run(q, k, positions, cos_sin_cache, cos, sin, theta, scaling, scaling_numbers, interleaved,
         rotary_dim, inverse, seq_len, validate, inplace):
    """One call of the shared execution path on detached tensors (no routing back into the ops)."""
    q = q.detach()
    k = None if k is None else k.detach()
    return execute.run(q, k, positions, cos_sin_cache, cos, sin, theta=theta,
                       scaling=scaling_from_op_args(scaling, scaling_numbers),
                       interleaved=interleaved, rotary_dim=rotary_dim, inverse=inverse,
                       inplace=inplace, validate=validate, seq_len=seq_len)


def _empty_k(q: Tensor, dtype=None) -> Tensor:
    """The placeholder second output of an operator called with k=None."""
    return q.new_empty((0,), dtype=dtype)


def _rope_functional(q, k, *rotation_and_validate) -> tuple[Tensor, Tensor]:
    result = _run(q, k, *rotation_and_validate, False)
    if k is None:
        return result, _empty_k(q)
    return result


def _new_output(x: Tensor, dtype=None) -> Tensor:
    """A new contiguous tensor of x's shape and device (of ``dtype``, by default x's), as the
    array path allocates outputs: what the fake implementations return."""
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)


def _rope_functional_fake(q, k, *rotation_and_validate):
    return _new_output(q), (_empty_k(q) if k is None else _new_output(k))


def _rope_inplace(q, k, *rotation_and_validate) -> None:
    _run(q, k, *rotation_and_validate, True)


def _rope_inplace_fake(q, k, *rotation_and_validate) -> None:
    return None


def _gradient_ready(grad: Tensor) -> Tensor:
    """A dense copy of an upstream gradient with a non-unit stride along head_dim (an expanded
    one, from sum()): the kernels would take it as it is, but only on their scalar path."""
    if grad.dim() and grad.shape[-1] > 1 and grad.stride(-1) != 1:
        return grad.contiguous()
    return grad


def _rotate_gradients(grad_q, grad_k, need_q, need_k, tables, options):
    """(grad of q, grad of k): the inverse rotation of the upstream gradients, in one launch.

    A rotation is orthogonal, so its gradient is the rotation by the same angles with ``inverse``
    flipped (pass-through dims pass the gradient through; attention factors scale both ways).
    Positions and tables get no gradient."""
    theta, scaling, scaling_numbers, interleaved, rotary_dim, inverse, seq_len, _ = options
    back = (theta, scaling, scaling_numbers, interleaved, rotary_dim, not inverse, seq_len, False)
    if need_q and need_k:
        return torch.ops.cupyrope.apply_rope(_gradient_ready(grad_q), _gradient_ready(grad_k),
                                             *tables, *back)
    if need_q:
        return torch.ops.cupyrope.apply_rope(_gradient_ready(grad_q), None, *tables, *back)[0], None
    if need_k:
        return None, torch.ops.cupyrope.apply_rope(_gradient_ready(grad_k), None, *tables, *back)[0]
    return None, None


def _setup_context(ctx, inputs, output):
    q, k, positions, cos_sin_cache, cos, sin, *options = inputs
    ctx.save_for_backward(positions, cos_sin_cache, cos, sin)
    ctx.options = tuple(options)
    ctx.has_k = k is not None


def _backward(ctx, grad_q_out, grad_k_out):
    need_q, need_k = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and ctx.has_k
    grad_q, grad_k = _rotate_gradients(grad_q_out, grad_k_out, need_q, need_k, ctx.saved_tensors,
                                       ctx.options)
    return (grad_q, grad_k) + (None,) * (len(_TABLE_ARGS) + len(ctx.options))


def _record_in_place(ctx, rotated: Tensor, tables, options) -> Tensor:
    """Record on the autograd graph that ``rotated`` was changed in place, keeping what its
    backward (the inverse rotation) needs."""
    ctx.mark_dirty(rotated)
    ctx.save_for_backward(*tables)
    ctx.options = options
    return rotated


class _RotateInPlace(torch.autograd.Function):
    """Rotates q and k in place in one launch; records the change of q (the change of k is
    recorded by :class:`_AlreadyRotated`: autograd lets a function that dirties a view return
    only one tensor)."""

    @staticmethod
    def forward(ctx, q, k, positions, cos_sin_cache, cos, sin, *options):
        torch.ops.cupyrope.apply_rope_(q, k, positions, cos_sin_cache, cos, sin, *options)
        return _record_in_place(ctx, q, (positions, cos_sin_cache, cos, sin), options)

    @staticmethod
    def backward(ctx, grad_q_out):
        grad_q, _ = _rotate_gradients(grad_q_out, None, ctx.needs_input_grad[0], False,
                                      ctx.saved_tensors, ctx.options)
        # k's gradient flows through _AlreadyRotated: q's new value does not depend on k.
        return (grad_q, None) + (None,) * (len(_TABLE_ARGS) + len(ctx.options))


class _AlreadyRotated(torch.autograd.Function):
    """Records on the autograd graph that k was rotated in place (by :class:`_RotateInPlace`'s
    launch); its backward is the inverse rotation."""

    @staticmethod
    def forward(ctx, k, positions, cos_sin_cache, cos, sin, *options):
        return _record_in_place(ctx, k, (positions, cos_sin_cache, cos, sin), options)

    @staticmethod
    def backward(ctx, grad_k_out):
        _, grad_k = _rotate_gradients(None, grad_k_out, False, ctx.needs_input_grad[0],
                                      ctx.saved_tensors, ctx.options)
        return (grad_k,) + (None,) * (len(_TABLE_ARGS) + len(ctx.options))


# ----------------------------------------------------------------------------------------------
# The fused operators


@dataclass
class FusedOp:
    """One fused operator: its name in the ``cupyrope`` namespace, the public function it serves
    (``op_name``: error messages and plan), whether it writes q and k in place, and its schema. Its
    implementation and fake take the schema's arguments by name (``arguments``, in order)."""

    name: str
    op_name: str
    inplace: bool
    schema: str
    arguments: tuple[str, ...] = field(init=False)
    mutated: tuple[str, ...] = field(init=False)  # the arguments declared written (``Tensor(a!)``)

    def __post_init__(self):
        parsed = torch._C.parse_schema(f"{NAMESPACE}::{self.name}{self.schema}").arguments
        self.arguments = tuple(a.name for a in parsed)
        self.mutated = tuple(a.name for a in parsed
                             if a.alias_info is not None and a.alias_info.is_write)

    def call(self, named: dict):
        """The operator on the arguments of :func:`_fused_args`."""
        operator = getattr(torch.ops.cupyrope, self.name)
        return operator(*(named[name] for name in self.arguments))

    def implementation(self, *args):
        """Real implementation: :func:`cupyrope.execute.run_fused` with the router off."""
        named = dict(zip(self.arguments, args))
        q, k = named["q"].detach(), None if named["k"] is None else named["k"].detach()
        result = execute.run_fused(self.op_name, q, k, named["positions"],
                                   rope=_rope_of(named, self.inplace),
                                   fusion=_fusion_of(self.op_name, named),
                                   validate=named["validate"], router=None)
        if self.inplace:
            return None
        outputs = result if isinstance(result, tuple) else (result,)
        if k is None:
            return outputs[0], _empty_k(q, _torch_dtype(named["out_dtype"]))
        return outputs[0], outputs[1]

    def fake(self, *args):
        """Fake (meta) implementation: the outputs' shapes and dtypes, nothing run."""
        if self.inplace:
            return None
        named = dict(zip(self.arguments, args))
        q, k, dtype = named["q"], named["k"], _torch_dtype(named["out_dtype"])
        return _new_output(q, dtype), (_empty_k(q, dtype) if k is None else _new_output(k, dtype))


def _torch_dtype(name):
    return None if name is None else getattr(torch, name)


def _rope_of(named: dict, inplace: bool) -> dict:
    """The ``rope`` dict of :func:`cupyrope.execute.run_fused` from operator arguments."""
    rope = {name: named[name] for name in _TABLE_ARGS[1:] + _OPTION_ARGS
            if name not in ("scaling", "scaling_numbers")}
    rope["scaling"] = scaling_from_op_args(named["scaling"], named["scaling_numbers"])
    rope["inplace"] = inplace
    return rope


def _fusion_of(op_name: str, named: dict) -> dict:
    """The ``fusion`` dict of :func:`cupyrope.execute.run_fused` from operator arguments."""
    fusion = {"out_dtype": named["out_dtype"]}
    if op_name == "write_cache":
        fusion["rotate"] = False
    scales = _SCALES if "k_cache" in named else _SCALES[:2]
    fusion.update({name: _scale_from_args(named, name) for name in scales})
    if "q_weight" in named:
        fusion.update({name: named[name] for name in ("q_weight", "k_weight", "eps",
                                                      "weight_offset", "norm_over")})
        fusion["norm"] = (op_name == "rms_norm_rope" or named["q_weight"] is not None
                          or named["k_weight"] is not None)
    if "k_cache" in named:
        fusion.update({name: named[name] for name in ("v", "k_cache", "v_cache", "slot_mapping",
                                                      "layout", "cache_dtype")})
        if named.get("k_cache_scales") is not None or named.get("v_cache_scales") is not None:
            fusion.update(k_cache_scales=named["k_cache_scales"],
                          v_cache_scales=named["v_cache_scales"])
    return fusion


def _fused_schema(q_and_k: str, *parts: str, inplace: bool) -> str:
    return (f"({q_and_k}, {ROTATION_SCHEMA}, {', '.join(parts)}, bool validate) -> "
            + ("()" if inplace else "(Tensor, Tensor)"))


FUSED_OPS = (
    FusedOp("rms_norm_rope", "rms_norm_rope", False,
            _fused_schema("Tensor q, Tensor? k", NORM_SCHEMA, FP8_SCHEMA, inplace=False)),
    FusedOp("rms_norm_rope_", "rms_norm_rope", True,
            _fused_schema("Tensor(a!) q, Tensor(b!)? k", NORM_SCHEMA, FP8_SCHEMA, inplace=True)),
    FusedOp("apply_rope_fp8", "apply_rope", False,
            _fused_schema("Tensor q, Tensor? k", FP8_SCHEMA, inplace=False)),
    FusedOp("rope_and_cache", "rope_and_cache", False,
            _fused_schema("Tensor q, Tensor k", CACHE_SCHEMA, NORM_SCHEMA, FP8_SCHEMA,
                          inplace=False)),
    FusedOp("rope_and_cache_", "rope_and_cache", True,
            _fused_schema("Tensor(a!) q, Tensor(b!) k", CACHE_SCHEMA, NORM_SCHEMA, FP8_SCHEMA,
                          inplace=True)),
    # write_cache: q is a zero-head view of k; its (q_out, k_out) are unwritten and dropped.
    FusedOp("write_cache", "write_cache", False,
            _fused_schema("Tensor q, Tensor k", CACHE_SCHEMA, FP8_SCHEMA, inplace=False)),
)
# (public function, writes q and k in place) -> its operator
_FUSED_OPS = {(op.op_name, op.inplace): op for op in FUSED_OPS}

# The same calls with stores quantised per row: the arrays they write are declared mutated.
ROW_SCALED_OPS = (
    FusedOp("apply_rope_fp8_rows", "apply_rope", False,
            _fused_schema("Tensor q, Tensor? k", FP8_SCHEMA, ROWS_SCHEMA, inplace=False)),
    FusedOp("rms_norm_rope_fp8_rows", "rms_norm_rope", False,
            _fused_schema("Tensor q, Tensor? k", NORM_SCHEMA, FP8_SCHEMA, ROWS_SCHEMA,
                          inplace=False)),
    FusedOp("rope_and_cache_rows", "rope_and_cache", False,
            _fused_schema("Tensor q, Tensor k", CACHE_SCHEMA, NORM_SCHEMA, FP8_SCHEMA,
                          CACHE_ROWS_SCHEMA, inplace=False)),
    FusedOp("rope_and_cache_rows_", "rope_and_cache", True,
            _fused_schema("Tensor(a!) q, Tensor(b!) k", CACHE_SCHEMA, NORM_SCHEMA, FP8_SCHEMA,
                          CACHE_ROWS_SCHEMA, inplace=True)),
    FusedOp("write_cache_rows", "write_cache", False,
            _fused_schema("Tensor q, Tensor k", CACHE_SCHEMA, FP8_SCHEMA, CACHE_ROWS_SCHEMA,
                          inplace=False)),
)
_ROW_SCALED_OPS = {(op.op_name, op.inplace): op for op in ROW_SCALED_OPS}


# ----------------------------------------------------------------------------------------------
# Gradients of rms_norm_rope


_NORM_OP = _FUSED_OPS[("rms_norm_rope", False)]


def _norm_setup_context(ctx, inputs, output):
    named = dict(zip(_NORM_OP.arguments, inputs))
    ctx.save_for_backward(named["q"], named["k"], named["q_weight"], named["k_weight"],
                          *(named[name] for name in _TABLE_ARGS))
    ctx.eps, ctx.weight_offset = named["eps"], named["weight_offset"]
    ctx.all_heads = named["norm_over"] == "all_heads"
    ctx.options = (*(named[name] for name in _OPTION_ARGS), False)


def _norm_backward(ctx, grad_q_out, grad_k_out):
    q, k, q_weight, k_weight, *tables = ctx.saved_tensors
    need = dict(zip(_NORM_OP.arguments, ctx.needs_input_grad))
    need_q = need["q"] or need["q_weight"]
    need_k = k is not None and (need["k"] or need["k_weight"])
    # One launch rotates both gradients back, in float32 (no rounding before the norm's part).
    grad_q, grad_k = _rotate_gradients(grad_q_out.float() if need_q else None,
                                       grad_k_out.float() if need_k else None, need_q, need_k,
                                       tables, ctx.options)
    grads = dict.fromkeys(_NORM_OP.arguments)
    for x, weight, grad, name in ((q, q_weight, grad_q, "q"), (k, k_weight, grad_k, "k")):
        if grad is None:
            continue
        grad_x, grad_weight = rms_norm_backward(x, weight, grad, ctx.eps, ctx.weight_offset,
                                                all_heads=ctx.all_heads)
        if need[name]:
            grads[name] = grad_x.to(x.dtype)
        if need[f"{name}_weight"]:
            grads[f"{name}_weight"] = grad_weight.to(weight.dtype)
    return tuple(grads[name] for name in _NORM_OP.arguments)


def rms_norm_backward(x: Tensor, weight: Tensor, grad: Tensor, eps: float,
                      weight_offset: float, *, all_heads: bool = False) -> tuple[Tensor, Tensor]:
    """(grad of x, grad of weight) in float32 of ``n * (weight_offset + weight)``, ``n = x *
    rsqrt(mean(x**2) + eps)`` per head (last dim; ``all_heads``: the last two dims), for the
    float32 upstream gradient ``grad`` of that product. Torch arithmetic, so it is
    differentiable again.

    With ``r = rsqrt(mean(x**2) + eps)`` and ``g_n = grad * (weight_offset + weight)``:
    ``grad_weight = sum(grad * n)`` over every token (and head, per head), ``grad_x = r * (g_n -
    n * mean(g_n * n))``. The weight's gradient has the weight's shape."""
    dims = (-2, -1) if all_heads else (-1,)
    x = x.float()
    w = weight.float().reshape(x.shape[-2:]) if all_heads else weight.float()
    rstd = torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
    normed = x * rstd
    grad_weight = (grad * normed).sum(dim=tuple(range(grad.dim() - len(w.shape))))
    grad_normed = grad * (weight_offset + w)
    grad_x = rstd * (grad_normed - normed * (grad_normed * normed).mean(dims, keepdim=True))
    return grad_x, grad_weight.reshape(weight.shape)


# ----------------------------------------------------------------------------------------------
# Registration


def _register() -> None:
    functional = torch.library.custom_op(
        f"{NAMESPACE}::apply_rope", _rope_functional, mutates_args=(),
        schema=f"(Tensor q, Tensor? k, {ROTATION_SCHEMA}, bool validate) -> (Tensor, Tensor)")
    functional.register_fake(_rope_functional_fake)
    functional.register_autograd(_backward, setup_context=_setup_context)
    inplace = torch.library.custom_op(
        f"{NAMESPACE}::apply_rope_", _rope_inplace, mutates_args=("q", "k"),
        schema=f"(Tensor(a!) q, Tensor(b!)? k, {ROTATION_SCHEMA}, bool validate) -> ()")
    inplace.register_fake(_rope_inplace_fake)
    for op in FUSED_OPS + ROW_SCALED_OPS:
        registered = torch.library.custom_op(f"{NAMESPACE}::{op.name}", op.implementation,
                                             mutates_args=op.mutated, schema=op.schema)
        registered.register_fake(op.fake)
        if op is _NORM_OP:
            registered.register_autograd(_norm_backward, setup_context=_norm_setup_context)


if _HAS_CUSTOM_OPS and not hasattr(getattr(torch.ops, NAMESPACE), "apply_rope"):
    _register()


# ----------------------------------------------------------------------------------------------
# rerotate_cache: the re-rotation of cached keys in place, as an operator that mutates its cache
# (torch.compile functionalises it; CUDA graphs capture its one launch)

RERO_SCHEMA = (
    "(Tensor(a!) k_cache, Tensor slots, Tensor? delta, SymInt delta_value, "
    "Tensor? cos_sin_cache, float theta, str? scaling, float[]? scaling_numbers, "
    "bool interleaved, SymInt? rotary_dim, SymInt? seq_len, str layout, "
    "Tensor? k_scale_tensor, float? k_scale, str? cache_dtype, bool validate) -> ()")


def rerotate_cache(k_cache, slots, delta, *, cos_sin_cache=None, theta=10000.0, scaling=None,
                   interleaved=False, rotary_dim=None, layout="NHD", k_scale=None,
                   cache_dtype=None, validate=False, seq_len=None):
    """:func:`cupyrope.rerotate_cache` on torch tensors through the ``cupyrope::rerotate_cache_``
    operator: what ``torch.compile`` traces (and DTensors reach). Same arguments, results and
    errors; every array argument must be a torch tensor. Returns ``k_cache``."""
    op_name = "rerotate_cache"
    _check_tensor(k_cache, "k_cache", op_name)
    if is_distributed(k_cache, slots, delta, cos_sin_cache, k_scale):
        raise NotImplementedError(
            f"{op_name}: DTensor arguments are not supported (a paged cache is local to its "
            "device); pass the local shards (x.to_local())")
    if needs_autograd(k_cache):
        raise NotImplementedError(
            f"{op_name}: no gradient for the re-rotation of a cache, but k_cache requires grad; "
            "call it under torch.no_grad() or on a detached cache")
    _check_tensor(slots, "slots", op_name)
    if isinstance(delta, Tensor):
        delta_tensor, delta_value = delta, 0
    elif isinstance(delta, torch.SymInt):
        delta_tensor, delta_value = None, delta
    else:
        delta_tensor, delta_value = None, check_int(delta, "delta", op_name)
    if cos_sin_cache is not None:
        _check_tensor(cos_sin_cache, "cos_sin_cache", op_name)
    if layout not in LAYOUTS:
        raise ValueError(f"{op_name}: layout must be one of {LAYOUTS}, got {layout!r}")
    scaling_text, scaling_numbers = scaling_op_args(scaling, op_name)
    scale = _scale_args(k_scale, "k_scale", op_name)
    torch.ops.cupyrope.rerotate_cache_(
        k_cache, slots, delta_tensor, delta_value, cos_sin_cache, _number(theta, "theta", op_name),
        scaling_text, scaling_numbers, check_bool(interleaved, "interleaved", op_name),
        _optional_int(rotary_dim, "rotary_dim", op_name), _optional_int(seq_len, "seq_len", op_name),
        layout, scale["k_scale_tensor"], scale["k_scale"],
        fp8_name(cache_dtype, "cache_dtype", op_name), check_bool(validate, "validate", op_name))
    return k_cache


def _rerotate_implementation(k_cache, slots, delta, delta_value, cos_sin_cache, theta, scaling,
                             scaling_numbers, interleaved, rotary_dim, seq_len, layout,
                             k_scale_tensor, k_scale, cache_dtype, validate) -> None:
    from ...cuda.launch import run_rerotate

    run_rerotate(k_cache, slots, delta if delta is not None else delta_value,
                 cos_sin_cache=cos_sin_cache, theta=theta,
                 scaling=scaling_from_op_args(scaling, scaling_numbers), interleaved=interleaved,
                 rotary_dim=rotary_dim, layout=layout,
                 k_scale=k_scale_tensor if k_scale_tensor is not None else k_scale,
                 cache_dtype=cache_dtype, validate=validate, seq_len=seq_len)


def _rerotate_fake(*args) -> None:
    return None


if _HAS_CUSTOM_OPS and not hasattr(getattr(torch.ops, NAMESPACE), "rerotate_cache_"):
    torch.library.custom_op(f"{NAMESPACE}::rerotate_cache_", _rerotate_implementation,
                            mutates_args=("k_cache",), schema=RERO_SCHEMA
                            ).register_fake(_rerotate_fake)
