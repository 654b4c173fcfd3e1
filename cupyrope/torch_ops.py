"""torch.library custom ops behind :func:`cupyrope.apply_rope` for torch: autograd, torch.compile.

``apply_rope`` sends torch tensors here when q or k requires grad (with grad mode on), and every
call made while ``torch.compile`` (or ``torch.export``) traces. Everything else keeps the array
path and its repeat-call fast path. Two operators are registered in the ``cupyrope`` namespace:

``torch.ops.cupyrope.apply_rope(Tensor q, Tensor? k, Tensor? positions, Tensor? cos_sin_cache,
Tensor? cos, Tensor? sin, float theta, str? scaling, float[]? scaling_numbers, bool interleaved,
SymInt? rotary_dim, bool inverse, SymInt? seq_len, bool validate) -> (Tensor, Tensor)``
    Out of place: new contiguous ``q_out`` and ``k_out`` (an empty placeholder of shape ``(0,)``
    when k is None: custom ops cannot return None). A dict is not an operator argument: the
    Hugging Face rope_scaling dict travels as a text (``scaling``) and its numbers
    (``scaling_numbers``), see :func:`cupyrope.scaling.scaling_op_args`. Differentiable in q and k.
``torch.ops.cupyrope.apply_rope_(Tensor(a!) q, Tensor(b!)? k, ...) -> ()``
    In place (a mutating op: torch.compile functionalises it and re-inplaces it).

Both run the same code as every other call (:func:`cupyrope.execute.run`): the CUDA kernels on torch's
current stream for CUDA tensors, the NumPy path for CPU tensors. Their fake (meta) implementations
give torch.compile the output shapes without running anything, so ``torch.compile(fullgraph=True)``
traces ``apply_rope`` with no graph break, in the ``"default"`` and ``"reduce-overhead"`` (CUDA
graphs) modes.

Gradients
---------
A rotation is orthogonal, so the gradient of ``apply_rope`` is the inverse rotation of the
upstream gradient: the backward calls the same operator on ``(grad_q, grad_k)`` with the same angle
source and ``inverse`` flipped, in one launch for both (partial rotary: the pass-through dims pass
the gradient through; attention factors scale both ways). Positions, tables and ``theta`` are not
differentiated: user-given ``cos`` / ``sin`` / ``cos_sin_cache`` tensors get no gradient (None),
as in TransformerEngine's and Liger's RoPE. The backward is itself differentiable (double
backward).

In place under autograd (``inplace=True`` with q or k requiring grad) writes into q and k in one
launch and records each on the autograd graph like a torch in-place op (``mark_dirty``), so q and
k may be views of one fused QKV projection output. As for torch's own in-place ops, a leaf that
requires grad (or a view of one) is refused, before anything is written. Under torch.compile the
same call is traced as the out-of-place op followed by ``copy_`` into q and k (correct gradients
on every torch version; the compiled graph holds the copies).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import execute
from .scaling import scaling_from_op_args, scaling_op_args
from .validators import check_bool, check_int, check_real

NAMESPACE = "cupyrope"
_HAS_CUSTOM_OPS = hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_fake")

# Everything after (q, k) in both operators' schemas, in order.
_TABLE_ARGS = ("positions", "cos_sin_cache", "cos", "sin")


def needs_autograd(q, k) -> bool:
    """True when q or k is a torch tensor that requires grad while grad mode is on."""
    if not torch.is_grad_enabled():
        return False
    wanted = any(isinstance(x, Tensor) and x.requires_grad for x in (q, k))
    if wanted and not _HAS_CUSTOM_OPS:
        raise NotImplementedError(
            f"apply_rope: autograd needs torch.library.custom_op (torch >= 2.4); this is torch "
            f"{torch.__version__}: call apply_rope under torch.no_grad() or pass detached tensors"
        )
    return wanted


# ----------------------------------------------------------------------------------------------
# The public entry for torch tensors


def apply_rope(q, k=None, positions=None, *, cos_sin_cache=None, cos=None, sin=None,
               theta=10000.0, scaling=None, interleaved=False, rotary_dim=None, inverse=False,
               inplace=False, validate=False, seq_len=None):
    """:func:`cupyrope.apply_rope` through the custom ops (differentiable and traceable).

    Same arguments, results and errors as :func:`cupyrope.apply_rope`, for torch tensors (CUDA or
    CPU); every array argument must be a torch tensor. ``cupyrope.apply_rope`` calls this itself
    when it must, so there is rarely a reason to call it directly.
    """
    _check_tensor(q, "q")
    if k is not None:
        _check_tensor(k, "k")
    tables = (positions, cos_sin_cache, cos, sin)
    for value, name in zip(tables, _TABLE_ARGS):
        if value is not None:
            _check_tensor(value, name)
    interleaved = check_bool(interleaved, "interleaved")
    inverse = check_bool(inverse, "inverse")
    inplace = check_bool(inplace, "inplace")
    validate = check_bool(validate, "validate")
    rotary_dim = _optional_int(rotary_dim, "rotary_dim")
    seq_len = _optional_int(seq_len, "seq_len")
    options = (_number(theta, "theta"), *scaling_op_args(scaling), interleaved, rotary_dim,
               inverse, seq_len, validate)

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
            q.copy_(q_out)
            if k is not None:
                k.copy_(k_out)
            return q if k is None else (q, k)
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


def run_fused(where, q, k, positions, *, rope: dict, fusion: dict, validate: bool):
    """A fused op (``rms_norm_rope``, ``rope_and_cache``, ``apply_rope(out_dtype=...)``) traced
    by torch.compile or on tensors that require grad."""
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            f"{where}: fused ops are not traceable by torch.compile yet; call it outside the "
            "compiled region, or use apply_rope (which is)")
    raise NotImplementedError(
        f"{where}: gradients of the fused ops are not available yet; call it under "
        "torch.no_grad() or on detached tensors (apply_rope is differentiable)")


def _check_tensor(x, name: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(
            f"apply_rope: {name} must be a torch tensor when q and k are torch tensors that require "
            f"grad or inside torch.compile, got {type(x).__module__}.{type(x).__qualname__}"
        )


def _number(value, name: str):
    """A float for the schema (a symbolic float under torch.compile stays as it is); its range
    (finite, > 0) is checked where the call runs."""
    if isinstance(value, torch.SymFloat):
        return value
    return check_real(value, name, "apply_rope")


def _optional_int(value, name: str):
    if value is None or isinstance(value, torch.SymInt):
        return value
    return check_int(value, name, "apply_rope")


def _check_inplace_autograd(x, name: str) -> None:
    """torch's own rule for in-place ops, checked before the kernel writes anything."""
    if x is None or not x.requires_grad:
        return
    if x.is_leaf:
        raise RuntimeError(
            f"apply_rope: inplace=True on {name}, a leaf tensor that requires grad; autograd "
            "cannot record an in-place change of a leaf (as for torch's own in-place ops): rotate "
            "out of place, or in place on a non-leaf (e.g. the output of the QKV projection)"
        )
    base = x._base
    if base is not None and base.is_leaf and base.requires_grad:
        raise RuntimeError(
            f"apply_rope: inplace=True on {name}, a view of a leaf tensor that requires grad; "
            "autograd cannot record an in-place change of it (as for torch's own in-place ops)"
        )
    if x._is_view() and _creation_meta(x) != "DEFAULT":
        # torch refuses in-place changes of views made by a function that returns several views
        # (split, chunk, unbind), or made under no_grad / inference mode; it raises only after the
        # write, so the same rule is checked here, before anything is written.
        raise RuntimeError(
            f"apply_rope: inplace=True on {name}, a view of a tensor that requires grad made "
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
# The operators


def _run(q, k, positions, cos_sin_cache, cos, sin, theta, scaling, scaling_numbers, interleaved,
         rotary_dim, inverse, seq_len, validate, inplace):
    """One call of the shared execution path on detached tensors (no routing back into the ops)."""
    q = q.detach()
    k = None if k is None else k.detach()
    return execute.run(q, k, positions, cos_sin_cache, cos, sin, theta=theta,
                       scaling=scaling_from_op_args(scaling, scaling_numbers),
                       interleaved=interleaved, rotary_dim=rotary_dim, inverse=inverse,
                       inplace=inplace, validate=validate, seq_len=seq_len)


def _empty_k(q: Tensor) -> Tensor:
    return q.new_empty((0,))


def _rope_functional(q: Tensor, k: Optional[Tensor], positions: Optional[Tensor],
                     cos_sin_cache: Optional[Tensor], cos: Optional[Tensor], sin: Optional[Tensor],
                     theta: float, scaling: Optional[str],
                     scaling_numbers: Optional[list[float]], interleaved: bool,
                     rotary_dim: Optional[int], inverse: bool, seq_len: Optional[int],
                     validate: bool) -> tuple[Tensor, Tensor]:
    result = _run(q, k, positions, cos_sin_cache, cos, sin, theta, scaling, scaling_numbers,
                  interleaved, rotary_dim, inverse, seq_len, validate, False)
    if k is None:
        return result, _empty_k(q)
    return result


def _rope_functional_fake(q, k, positions, cos_sin_cache, cos, sin, theta, scaling,
                          scaling_numbers, interleaved, rotary_dim, inverse, seq_len, validate):
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if k is None:
        return q_out, _empty_k(q)
    return q_out, torch.empty_like(k, memory_format=torch.contiguous_format)


def _rope_inplace(q: Tensor, k: Optional[Tensor], positions: Optional[Tensor],
                  cos_sin_cache: Optional[Tensor], cos: Optional[Tensor], sin: Optional[Tensor],
                  theta: float, scaling: Optional[str], scaling_numbers: Optional[list[float]],
                  interleaved: bool, rotary_dim: Optional[int], inverse: bool,
                  seq_len: Optional[int], validate: bool) -> None:
    _run(q, k, positions, cos_sin_cache, cos, sin, theta, scaling, scaling_numbers, interleaved,
         rotary_dim, inverse, seq_len, validate, True)


def _rope_inplace_fake(q, k, positions, cos_sin_cache, cos, sin, theta, scaling, scaling_numbers,
                       interleaved, rotary_dim, inverse, seq_len, validate) -> None:
    return None


def _gradient_ready(grad: Tensor) -> Tensor:
    """The kernels need stride 1 along head_dim; upstream gradients may be expanded (sum())."""
    if grad.dim() and grad.shape[-1] > 1 and grad.stride(-1) != 1:
        return grad.contiguous()
    return grad


def _rotate_gradients(grad_q, grad_k, need_q, need_k, tables, options):
    """(grad of q, grad of k): the inverse rotation of the upstream gradients, in one launch."""
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


def _register() -> None:
    functional = torch.library.custom_op(f"{NAMESPACE}::apply_rope", mutates_args=())(
        _rope_functional)
    functional.register_fake(_rope_functional_fake)
    functional.register_autograd(_backward, setup_context=_setup_context)
    inplace = torch.library.custom_op(f"{NAMESPACE}::apply_rope_", mutates_args=("q", "k"))(
        _rope_inplace)
    inplace.register_fake(_rope_inplace_fake)


if _HAS_CUSTOM_OPS and not hasattr(getattr(torch.ops, NAMESPACE), "apply_rope"):
    _register()
