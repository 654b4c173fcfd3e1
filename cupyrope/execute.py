"""The one execution path that every route shares: arrays in, a checked plan, the kernel launch (or
the NumPy path on the CPU), results out.

:func:`run` (:func:`run_fused` for the fused ops) replays a repeat-call recipe when it has one,
else plans in full; its caller's ``router`` sends traced or differentiated calls to a frontend.

Design notes: docs/architecture.md#executepy
"""

from __future__ import annotations

import threading

from .core.arrays import ArrayInfo, describe, empty_like_caller, finish, host_view, mark_written
from .core.fused_plan import plan_fused
from .core.numpy_path import fused_on_host, rotate_on_host
from .core.overlap import byte_span
from .core.plan import RopePlan, check_values, plan_outputs, plan_rope
from .cuda.recipes import (FUSED_OPERANDS, call_key, fused_call_key, guard_in_place, guard_written,
                      recipes, replay, replay_fused, replay_rerotate)


def run(q, k, positions, cos_sin_cache, cos, sin, theta, scaling, interleaved, rotary_dim,
        inverse, inplace, validate, seq_len, router=None, out=None):
    """``apply_rope`` on arrays: the repeat-call path, then (if ``router`` sends the call nowhere
    else) the full one. ``router(q, k, positions, cos_sin_cache, cos, sin)`` returns the module
    whose ``apply_rope`` must take the call instead (autograd, tracing), or None. ``out``: the
    arrays to write the results into (q_out, or (q_out, k_out)). Every argument may be passed by
    position: the eager call does, keyword arguments make a repeat call measurably slower
    (measured: docs/perf_log.md#cupyropeexecutepy)."""
    if out is not None and inplace is True:
        raise ValueError("apply_rope: pass inplace=True (write into q and k) or out= (write into "
                         "other arrays), not both")
    outs = None if out is None else (tuple(out) if isinstance(out, (tuple, list)) else (out,))
    key = None
    if not validate:
        key = call_key(q, k, positions, cos_sin_cache, cos, sin,
                       (theta, scaling, interleaved, rotary_dim, inverse, inplace, seq_len), outs)
        if key is not None:
            recipe = recipes.get(key[0])
            if recipe is not None:
                result = replay(recipe, q, k, key[1], inplace, outs)
                if result is not None:
                    return result

    if router is not None:
        route = router(q, k, positions, cos_sin_cache, cos, sin)
        if route is not None:
            return route.apply_rope(
                q, k, positions, cos_sin_cache=cos_sin_cache, cos=cos, sin=sin, theta=theta,
                scaling=scaling, interleaved=interleaved, rotary_dim=rotary_dim, inverse=inverse,
                inplace=inplace, validate=validate, seq_len=seq_len,
                **({} if out is None else {"out": out}))

    plan = plan_rope(q, k, positions, cos_sin_cache=cos_sin_cache, cos=cos, sin=sin, theta=theta,
                     scaling=scaling, interleaved=interleaved, rotary_dim=rotary_dim,
                     inverse=inverse, inplace=inplace, seq_len=seq_len)
    given = None if out is None else plan_outputs(plan, out)
    if validate:
        check_values(plan)

    if given is None:
        inputs, natives, outputs = _outputs(plan)
    else:
        inputs, natives, outputs = None, [info.obj for info in given], given
    recipe = rotate(plan, outputs)
    if plan.inplace or given is not None:
        mark_written(*natives)
    if recipe is not None and key is not None:
        recipe.torch = plan.q.kind == "torch"
        operands = [plan.q, plan.k, plan.positions, plan.cache, plan.cos, plan.sin]
        if plan.inplace:
            guard_in_place(recipe, [None if info is None else byte_span(info) for info in operands],
                           key[1])
        elif given is not None:
            operands += given + [None] * (2 - len(given))
            guard_written(recipe, [None if info is None else byte_span(info) for info in operands],
                          key[1], (6, 7))
        recipes.put(key[0], recipe)

    if plan.inplace or given is not None:
        results = natives
    else:
        results = [finish(info, x) for info, x in zip(inputs, natives)]
    return results[0] if plan.k is None else (results[0], results[1])


def _outputs(plan: RopePlan, dtype: str | None = None):
    """(inputs, natives, outputs) of a plan: the arrays rotated, what the caller gets back and
    what the launch writes: the inputs themselves in place, else new arrays of the caller's type
    (of ``dtype``, by default the input's)."""
    inputs = [plan.q] + ([plan.k] if plan.k is not None else [])
    if plan.inplace:
        return inputs, [info.obj for info in inputs], inputs
    made = [empty_like_caller(info, dtype) for info in inputs]
    return inputs, [m[0] for m in made], [m[1] for m in made]


def rotate(plan: RopePlan, outputs: list[ArrayInfo]):
    """Rotate a checked plan into ``outputs`` (the inputs when in place): one kernel launch on the
    GPU (the fused kernel for a fused plan), the NumPy path on the host, nothing for an empty
    call. Returns the launch recipe of a GPU
    launch (for repeat calls), else None."""
    if plan.is_empty:
        return None
    if plan.q.on_gpu:
        from .cuda.launch import rotate_on_gpu  # CuPy is imported with the first GPU call only

        return rotate_on_gpu(plan, outputs)
    host_outputs = [host_view(info) for info in outputs]
    if plan.fusion is not None:
        fused_on_host(plan, host_outputs)
    else:
        rotate_on_host(plan, host_outputs)
    return None


def rotate_into(plan: RopePlan, outputs) -> None:
    """Rotate a checked plan into output arrays a caller allocated (e.g. XLA's buffers)."""
    rotate(plan, [describe(out, "output") for out in outputs])


def clear() -> None:
    """Forget the launch recipes of earlier calls."""
    recipes.clear()


# The recipe the calling thread's last fused call through run_fused kept or replayed, for adapters
# that reshape their arguments (cupyrope.compat.vllm): they keep it under a key of the arguments
# as they were given.
_kept = threading.local()


def watch_kept() -> None:
    """Forget the calling thread's kept recipe: :func:`keep_kept_under` then answers for the
    fused calls made after this one only."""
    _kept.recipe = None


def keep_kept_under(key) -> None:
    """Keep the launch recipe of the calling thread's last fused call through :func:`run_fused`
    since :func:`watch_kept` (planned and kept, or replayed by its general key) under ``key``
    too; nothing when there is none (the NumPy path, a frontend's route, a call replayed by its
    fast key, or no call at all)."""
    recipe = getattr(_kept, "recipe", None)
    if recipe is not None:
        recipes.put(key, recipe)


def replay_fast(found, q, k, caches, inplace: bool):
    """A fused call's repeat by its fast key (:func:`cupyrope.cuda.recipes.fast_fused_key`, formed
    from the public function's own arguments before any dict is built): the outputs as
    :func:`run_fused` returns them, or None when no recipe is kept under it or the full path
    must decide. Reached only outside tracing and with ``validate`` off; tensors that require
    grad while grad mode is on, DTensors and JAX arrays never form a fast key, so no call a
    router would send elsewhere replays here."""
    recipe = recipes.get(found[0])
    if recipe is None:
        return None
    return replay_fused(recipe, q, k, caches, found[1], inplace)


def replay_rerotate_fast(found, k_cache):
    """A re-rotation's repeat by its key (:func:`cupyrope.cuda.recipes.rerotate_key`): the cache,
    or None when no recipe is kept under it or the full path must decide."""
    recipe = recipes.get(found[0])
    if recipe is None:
        return None
    return replay_rerotate(recipe, k_cache, found[1])


def run_fused(op_name: str, q, k, positions, *, rope: dict, fusion: dict, validate: bool,
              router=None, fast_key=None):
    """A fused op on arrays (:func:`cupyrope.rms_norm_rope`, :func:`cupyrope.rope_and_cache`,
    ``apply_rope(out_dtype=...)``): the plan, new outputs (fp8 when asked), one fused launch on
    the GPU or the NumPy path on the host. Returns the outputs as :func:`run` does, then the
    caches (written in place) when the call writes them. ``router(op_name, q, k, positions, rope,
    fusion)`` returns the module whose ``run_fused`` must take the call instead (autograd,
    tracing), or None. ``fast_key``: the call's key from :func:`fast_fused_key`, under which
    a recipe this call keeps is kept too."""
    if router is not None:
        route = router(op_name, q, k, positions, rope, fusion)
        if route is not None:
            return route.run_fused(op_name, q, k, positions, rope=rope, fusion=fusion,
                                   validate=validate)
    # The repeat-call path, after the router (autograd and tracing never reach it).
    key = None if validate else fused_call_key(op_name, q, k, positions, rope, fusion)
    caches = (fusion["k_cache"], fusion["v_cache"]) if "k_cache" in fusion else None
    if key is not None:
        recipe = recipes.get(key[0])
        if recipe is not None:
            result = replay_fused(recipe, q, k, caches, key[1], rope["inplace"])
            if result is not None:
                _kept.recipe = recipe
                return result

    plan = plan_fused(op_name, q, k, positions, rope=rope, fusion=fusion, validate=validate)
    f = plan.fusion
    inputs, natives, outputs = _outputs(plan, f.out_dtype)
    recipe = rotate(plan, outputs)
    written = natives if plan.inplace else []
    if f.writes_cache:
        written = [*written, f.k_cache.obj, f.v_cache.obj]
    mark_written(*written)
    if recipe is not None and key is not None:
        _keep_fused_recipe(recipe, plan, key, fast_key)
    results = natives if plan.inplace else [finish(info, out, f.out_dtype)
                                            for info, out in zip(inputs, natives)]
    if f.writes_cache:
        return results[0], results[1], f.k_cache.obj, f.v_cache.obj
    return results[0] if plan.k is None else (results[0], results[1])


def _keep_fused_recipe(recipe, plan: RopePlan, key, fast_key=None) -> None:
    """Keep the recipe of a fused call for repeat calls, guarded so that a replay writes q and k
    (in place) and the caches only where they meet the other operands as the full path checked."""
    f = plan.fusion
    infos = {"q": plan.q, "k": plan.k, "positions": plan.positions, "cos_sin_cache": plan.cache,
             "cos": plan.cos, "sin": plan.sin, "q_weight": f.q_weight, "k_weight": f.k_weight,
             "v": f.v, "k_cache": f.k_cache, "v_cache": f.v_cache, "slot_mapping": f.slot_mapping,
             **{name: None if scale is None else scale.array
                for name, scale in (("q_scale", f.q_scale), ("k_scale", f.k_scale),
                                    ("v_scale", f.v_scale))}}
    spans = [None if infos[name] is None else byte_span(infos[name]) for name in FUSED_OPERANDS]
    written = ((("q", "k") if plan.inplace else ())
               + (("k_cache", "v_cache") if f.writes_cache else ()))
    recipe.torch = plan.q.kind == "torch"
    recipe.out_dtype = f.out_dtype
    guard_written(recipe, spans, key[1], tuple(FUSED_OPERANDS.index(name) for name in written))
    recipes.put(key[0], recipe)
    if fast_key is not None:
        recipes.put(fast_key, recipe)
    _kept.recipe = recipe
