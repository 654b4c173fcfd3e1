"""Repeat calls: a launch reduced to filling in data pointers.

A :class:`LaunchRecipe` is everything about a launch except the data pointers, kept under a key of
everything else the launch depends on; a repeated call with that key skips checking and planning
and only launches (the fused ops too: :func:`fused_call_key`, :func:`replay_fused`).

Design notes: docs/architecture.md#cudarecipespy
"""

from __future__ import annotations

import ctypes
import struct
import threading

from ..core.abi import DECODE_PARAMS_DTYPE, FUSION_PARAMS_DTYPE, PARAMS_DTYPE
from ..core.arrays import (GPU_KINDS, bump_versions, cupy_module, current_stream, gpu_array_key,
                     grad_enabled, inference_mode_enabled, new_gpu_outputs)
from .dependent_launch import DependentLauncher
from ..core.rerotate import RERO_PARAMS_DTYPE
from ..core.scaling import exact_key

_ArgumentPointers = ctypes.c_void_p * 1
# The seven data pointers lead the struct, in this order: one pack_into writes them all.
_DATA_POINTERS = struct.Struct("<7Q")
assert all([dtype.fields[name][1] for name in
            ("q", "k", "q_out", "k_out", "positions", "cos", "sin")] == list(range(0, 56, 8))
           for dtype in (PARAMS_DTYPE, DECODE_PARAMS_DTYPE))
# FusionParams leads with its nine data pointers, in this order: one pack_into writes them all.
FUSION_POINTERS = ("q_weight", "k_weight", "q_scale", "k_scale", "v_scale", "v", "k_cache",
                   "v_cache", "slot_mapping")
_FUSION_DATA_POINTERS = struct.Struct("<9Q")
assert [FUSION_PARAMS_DTYPE.fields[name][1] for name in FUSION_POINTERS] == list(range(0, 72, 8))
# RerotateParams (a re-rotation's second struct) leads with its four data pointers.
REROTATE_POINTERS = ("cache", "slots", "delta", "scale")
_REROTATE_DATA_POINTERS = struct.Struct("<4Q")
assert [RERO_PARAMS_DTYPE.fields[name][1] for name in REROTATE_POINTERS] == [0, 8, 16, 24]


class LaunchRecipe:
    """Everything about a launch except the data pointers, so that a repeated call with arrays of
    the same shapes, strides, dtypes and alignment only fills in pointers and launches."""

    __slots__ = ("function_ptr", "device", "grid", "block", "shared_bytes", "sin_offset", "vector",
                 "keep_alive", "spec", "torch", "in_place_checks", "out_dtype", "fusion_pointers",
                 "_words", "_fusion_words",
                 "_argv_address",
                 "_argv", "_lock", "_runtime", "_driver", "_head", "_dependent")

    def __init__(self, function_ptr, device, grid, block, params, sin_offset, vector, keep_alive,
                 shared_bytes=0, spec=None, fusion_params=None, dependent=False):
        self.function_ptr = function_ptr
        self.device = device
        self.grid = grid
        self.block = block
        self.shared_bytes = shared_bytes  # dynamic shared memory (lean computed angles)
        self.sin_offset = sin_offset  # cache source: sin half = cache pointer + this many bytes
        self.vector = vector
        self.keep_alive = keep_alive  # device constants the parameters point at
        self.spec = spec  # the KernelSpec launched (tests read it)
        self.torch = False  # torch arrays: in-place writes bump their version counters
        self.in_place_checks = ()  # see guard_written
        self.out_dtype = None  # a fused call's fp8 output dtype (new outputs of a replay)
        # The data pointers that lead the second struct, packed at once: FusionParams' nine, or
        # RerotateParams' four (REROTATE_POINTERS).
        self.fusion_pointers = _FUSION_DATA_POINTERS
        # The parameter block is reused: only its pointer fields change between calls, and
        # cuLaunchKernel copies it before returning, so a lock around fill + launch suffices.
        # (RopeParams, or the decode kernel's DecodeParams: both lead with the data pointers)
        self._words = (ctypes.c_uint64 * (params.itemsize // 8)).from_buffer_copy(params.tobytes())
        # cuLaunchKernel takes an array of pointers, one per kernel argument: ours is the struct
        # (and the fused kernel's FusionParams after it).
        if fusion_params is None:
            self._argv = _ArgumentPointers(ctypes.addressof(self._words))
        else:
            self._fusion_words = (ctypes.c_uint64 * (fusion_params.itemsize // 8)).from_buffer_copy(
                fusion_params.tobytes())
            self._argv = (ctypes.c_void_p * 2)(ctypes.addressof(self._words),
                                               ctypes.addressof(self._fusion_words))
        self._argv_address = ctypes.addressof(self._argv)
        self._lock = threading.Lock()
        cupy = cupy_module()
        self._runtime, self._driver = cupy.cuda.runtime, cupy.cuda.driver
        # cuLaunchKernel's arguments before the stream, in its order, gathered once.
        self._head = (function_ptr, *grid, 1, *block, shared_bytes)
        # A programmatic dependent launch (cupyrope.cuda.dependent_launch) instead, where asked.
        self._dependent = (DependentLauncher(function_ptr, grid, block, shared_bytes)
                           if dependent else None)

    def launch(self, like, q, k, q_out, k_out, positions, cos, sin, fusion=None) -> None:
        """Launch on ``like``'s current stream with these data pointers (0 for absent ones);
        ``fusion``: the pointers that lead the second struct (FusionParams' in FUSION_POINTERS
        order; a re-rotation's RerotateParams' in REROTATE_POINTERS order)."""
        if self.sin_offset is not None:
            sin = cos + self.sin_offset
        runtime = self._runtime
        previous = runtime.getDevice()
        switched = previous != self.device
        if switched or self._driver.ctxGetCurrent() == 0:
            runtime.setDevice(self.device)  # also makes the primary context current on a new thread
        try:
            stream = current_stream(like, self.device)
            with self._lock:
                _DATA_POINTERS.pack_into(self._words, 0, q, k, q_out, k_out, positions, cos, sin)
                if fusion is not None:
                    self.fusion_pointers.pack_into(self._fusion_words, 0, *fusion)
                if self._dependent is None:
                    self._driver.launchKernel(*self._head, stream, self._argv_address, 0)
                else:
                    self._dependent(stream, self._argv_address)
        finally:
            if switched:
                runtime.setDevice(previous)


class RecipeCache:
    """Launch recipes of earlier GPU calls, keyed by :func:`call_key`."""

    MAX_RECIPES = 4096

    def __init__(self):
        self._recipes: dict = {}
        self._lock = threading.Lock()

    def get(self, key):
        return self._recipes.get(key)

    def put(self, key, recipe: LaunchRecipe) -> None:
        with self._lock:
            if len(self._recipes) >= self.MAX_RECIPES:
                self._recipes.clear()
            self._recipes[key] = recipe

    def clear(self) -> None:
        with self._lock:
            self._recipes.clear()

    def __len__(self) -> int:
        return len(self._recipes)

    def values(self) -> list[LaunchRecipe]:
        return list(self._recipes.values())


recipes = RecipeCache()


def call_key(q, k, positions, cos_sin_cache, cos, sin, options, outs=None):
    """(hashable key, data pointers) for a call on CUDA torch tensors / CuPy arrays, else None.

    ``options`` is ``(theta, scaling, interleaved, rotary_dim, inverse, inplace, seq_len)`` as the
    caller gave them. The key holds each operand's exact array type and each option's exact type
    (``rotary_dim=32.0`` is not ``rotary_dim=32``), so a repeat call is accepted exactly when the
    full path accepted the same call. A call whose key cannot be formed (another array type, an
    unhashable option) takes the full path. ``outs``: the ``out=`` arrays, keyed and pointed at
    like the operands (after them).
    """
    arrays = (q, k, positions, cos_sin_cache, cos, sin)
    if outs is not None:
        if len(outs) not in (1, 2):
            return None  # the full path says what out must be
        arrays += tuple(outs) + (None,) * (2 - len(outs))
    operands = _operands_key(arrays)
    if operands is None:
        return None
    metas, pointers = operands
    theta, scaling, interleaved, rotary_dim, inverse, inplace, seq_len = options
    # Only exact bools: interleaved=1 must still reach the check that rejects it.
    if not (type(interleaved) is bool and type(inverse) is bool and type(inplace) is bool):
        return None
    try:
        chosen = (type(theta), theta, None if scaling is None else exact_key(scaling), interleaved,
                  type(rotary_dim), rotary_dim, inverse, inplace, type(seq_len), seq_len,
                  None if outs is None else len(outs))
        hash(chosen)  # only options can be unhashable; the metadata always hashes
    except TypeError:  # an unhashable option (e.g. theta given as an array): full path
        return None
    return (tuple(metas), chosen), pointers


# Option values that are never arrays (an exact type test before the attribute probes of
# _is_array, which took a third of a fused repeat call's key).
_PLAIN_OPTION_TYPES = frozenset((bool, int, float, str, type(None)))


def _operands_key(arrays, numbers_at=frozenset()):
    """(metadata, pointers) of a call's array operands (None where absent), else None when one is
    not a CUDA array; at the indices ``numbers_at`` a number may stand (a scale: keyed with the
    options, pointer 0). gpu_array_key, inlined for torch tensors: this loop is most of a repeat
    call's host time."""
    metas, pointers = [], []
    kinds = GPU_KINDS  # array type -> "torch" / "cupy", as arrays.gpu_array_key sees it
    for index, x in enumerate(arrays):
        if x is None:
            metas.append(None)
            pointers.append(0)
            continue
        kind = type(x)
        if kinds.get(kind) == "torch":
            device = x.get_device()
            if device < 0 or (x.requires_grad and grad_enabled()):
                return None  # CPU, or autograd's (grad mode off: a plain array, as gpu_array_key)
            ptr = x.data_ptr()
            metas.append((kind, x.shape, x.stride(), x.dtype, device, ptr & 15))
            pointers.append(ptr)
        else:  # CuPy, a type not seen yet, or a number
            found = None if kind in _PLAIN_OPTION_TYPES else gpu_array_key(x)
            if found is None:
                if index not in numbers_at or _is_array(x):
                    return None  # not a CUDA array here (or one the full path must see)
                metas.append(None)
                pointers.append(0)
            else:
                metas.append(found[0])
                pointers.append(found[1])
    return metas, pointers


def guard_in_place(recipe: LaunchRecipe, spans, pointers) -> None:
    """:func:`guard_written` for an in-place rotation: q and k (the first two operands) are
    written."""
    guard_written(recipe, spans, pointers, (0, 1))


def guard_written(recipe: LaunchRecipe, spans, pointers, written) -> None:
    """Let ``recipe`` replay only where no written array can share an element with another
    operand. ``spans`` are the operands' (low, high) byte spans from their pointers (None where
    absent), ``pointers`` those the full path checked exactly and ``written`` the indices of the
    operands the launch writes: a replay whose written and other operands' address ranges meet
    must meet at the same distances, else the full path decides again (disjoint ranges never
    share an element)."""
    checks = []
    for w in written:
        if spans[w] is None:
            continue
        for o in range(len(spans)):
            if spans[o] is None or o == w or (o in written and o < w):  # each pair once
                continue
            distance = pointers[o] - pointers[w]
            met = distance + spans[o][0] < spans[w][1] and spans[w][0] < distance + spans[o][1]
            checks.append((w, o, spans[w][0] - spans[o][1], spans[w][1] - spans[o][0],
                           distance if met else None))
    recipe.in_place_checks = tuple(checks)


def _meets_as_checked(recipe: LaunchRecipe, pointers) -> bool:
    """Whether every pair of operands whose address ranges meet now met at the same distance when
    the full path checked them."""
    for w, o, low, high, checked in recipe.in_place_checks:
        distance = pointers[o] - pointers[w]
        if low < distance < high and distance != checked:  # the ranges meet, unlike as checked
            return False
    return True


def replay(recipe: LaunchRecipe, q, k, pointers, inplace: bool, outs=None):
    """Run a cached recipe on new arrays (into ``outs``, the ``out=`` arrays, when given); None
    when the full path must decide instead."""
    q_ptr, k_ptr, positions_ptr, cache_ptr, cos_ptr, sin_ptr = pointers[:6]
    if outs is not None:
        if recipe.in_place_checks and not _meets_as_checked(recipe, pointers):
            return None
        if recipe.torch and not inference_mode_enabled() and any(x.is_inference() for x in outs):
            return None  # torch refuses these writes: the full path raises its error
        recipe.launch(q, q_ptr, k_ptr, pointers[6], pointers[7], positions_ptr,
                      cache_ptr or cos_ptr, sin_ptr)
        if recipe.torch:
            bump_versions(tuple(outs))
        return outs[0] if k is None else (outs[0], outs[1])
    if inplace:
        if recipe.in_place_checks and not _meets_as_checked(recipe, pointers):
            return None
        if recipe.torch and (q.is_inference() or (k is not None and k.is_inference())) \
                and not inference_mode_enabled():
            return None  # torch refuses this write: the full path raises its error
        q_out, k_out, q_out_ptr, k_out_ptr = q, k, q_ptr, k_ptr
    else:
        q_out, q_out_ptr, k_out, k_out_ptr = new_gpu_outputs(q, k)
        if recipe.vector and (q_out_ptr | k_out_ptr) & 15:
            return None  # allocators align to 256 bytes; never expected, but never assumed
    recipe.launch(q, q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cache_ptr or cos_ptr,
                  sin_ptr)
    if inplace and recipe.torch:
        bump_versions((q,) if k is None else (q, k))
    return q_out if k is None else (q_out, k_out)


# The array operands of a fused call, in the order of a key's pointers: the rotation's, then
# FusionParams' (scales are arrays or numbers: a number is an option of the key).
FUSED_OPERANDS = ("q", "k", "positions", "cos_sin_cache", "cos", "sin") + FUSION_POINTERS
_SCALES = ("q_scale", "k_scale", "v_scale")


_FUSED_INDEX = {name: i for i, name in enumerate(FUSED_OPERANDS)}
_SCALE_INDICES = frozenset(_FUSED_INDEX[name] for name in _SCALES)
# The operands always keyed as arrays (a scale may be a number: an option then)
_ARRAY_OPERANDS = frozenset(FUSED_OPERANDS) - frozenset(_SCALES)


def fused_call_key(op_name: str, q, k, positions, rope: dict, fusion: dict):
    """(hashable key, pointers in FUSED_OPERANDS order) for a fused call on CUDA torch tensors /
    CuPy arrays, else None: as :func:`call_key`, over every array operand and option of the
    call (``op_name`` names the op)."""
    arrays = (q, k, positions, rope.get("cos_sin_cache"), rope.get("cos"), rope.get("sin"),
              *[fusion.get(name) for name in FUSION_POINTERS])
    operands = _operands_key(arrays, _SCALE_INDICES)  # a number as a scale: an option, below
    if operands is None:
        return None
    metas, pointers = operands
    # Every option as (name, type, value), the array operands (keyed above) left out; a list
    # comprehension, then fixes for the few values of other types (half the cost of a loop).
    options = [(name, type(value), value) for name, value in rope.items()
               if name not in _ARRAY_OPERANDS]
    options += [(name, type(value), value) for name, value in fusion.items()
                if name not in _ARRAY_OPERANDS]
    for at, (name, kind, value) in enumerate(options):
        if kind in _PLAIN_OPTION_TYPES:
            continue
        index = _FUSED_INDEX.get(name)
        if index is not None and metas[index]:  # a scale given as an array: keyed above
            options[at] = None
        elif _is_array(value):
            return None  # an array where an option goes: the full path decides
        elif name == "scaling":
            try:
                value = exact_key(value)
            except TypeError:
                return None
            options[at] = (name, type(value), value)
    try:
        key = (op_name, tuple(metas), tuple(options))
        hash(key)
    except TypeError:  # an unhashable option: full path
        return None
    return key, pointers


# The scale operands' places in FUSED_OPERANDS: a number there is keyed as an option.
_SCALE_PLACES = tuple(sorted(_SCALE_INDICES))
_NUMBER_TYPES = frozenset((int, float))
# The pointers of the operands a fast key's arrays leave out, by how many they give.
_ABSENT_POINTERS = [[0] * (len(FUSED_OPERANDS) - given) for given in range(len(FUSED_OPERANDS) + 1)]


def fast_fused_key(op_name: str, arrays: tuple, options: tuple):
    """(hashable key, pointers in FUSED_OPERANDS order) of a fused call from the public
    function's own arguments, else None: ``arrays`` the call's operands in FUSED_OPERANDS order
    (a leading part of it; the rest are absent), ``options`` its other arguments in the
    function's order. Only calls whose options are all of plain types (numbers, strings, bools,
    None) and whose scales are numbers or CUDA arrays get one; the others are keyed by
    :func:`fused_call_key` after the call's dicts are built. A fast key stands for exactly one
    general key: the op, every operand's metadata and every option with its type (measured:
    docs/perf_log.md#host-time-of-a-fused-repeat-call-before-its-dicts-2026-11-28)."""
    types = tuple(map(type, options))
    if not _PLAIN_OPTION_TYPES.issuperset(types):
        return None  # a dict (scaling), a dtype object or an array where an option goes
    operands = _operands_key(arrays, _SCALE_INDICES)
    if operands is None:
        return None
    metas, pointers = operands
    numbers = ()
    given = len(arrays)
    for place in _SCALE_PLACES:  # a scale given as a number is an option of the key
        if place < given:
            scale = arrays[place]
            if scale is not None and metas[place] is None:  # (an absent scale: metas say None)
                if type(scale) not in _NUMBER_TYPES:
                    return None  # "per_head" and other strings: the full path makes or refuses
                numbers += (place, type(scale), scale)
    pointers += _ABSENT_POINTERS[given]
    return (op_name, tuple(metas), options, types, numbers), pointers


def _is_array(x) -> bool:
    return hasattr(x, "__dlpack__") or hasattr(x, "__array__") or hasattr(x, "__cuda_array_interface__")


def replay_fused(recipe: LaunchRecipe, q, k, caches, pointers, inplace: bool):
    """Run a cached fused recipe on new arrays; None when the full path must decide instead.
    ``caches`` are the k and v caches the call writes (or None)."""
    if recipe.in_place_checks and not _meets_as_checked(recipe, pointers):
        return None
    # The arrays the launch writes (no generators: this is a repeat call's host time).
    written = ((q,) if k is None else (q, k)) if inplace else ()
    if caches is not None:  # (the k and v caches; either may be absent)
        for cache in caches:
            if cache is not None:
                written += (cache,)
    if recipe.torch and written and not inference_mode_enabled():
        for x in written:
            if x.is_inference():
                return None  # torch refuses these writes: the full path raises its error
    q_ptr, k_ptr, positions_ptr, cache_ptr, cos_ptr, sin_ptr = pointers[:6]
    if inplace:
        q_out, k_out, q_out_ptr, k_out_ptr = q, k, q_ptr, k_ptr
    else:
        q_out, q_out_ptr, k_out, k_out_ptr = new_gpu_outputs(q, k, recipe.out_dtype)
        if recipe.vector and (q_out_ptr | k_out_ptr) & 15:
            return None
    recipe.launch(q, q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cache_ptr or cos_ptr,
                  sin_ptr, pointers[6:])
    if recipe.torch and written:
        bump_versions(written)
    if caches is not None:
        return q_out, k_out, caches[0], caches[1]
    return q_out if k is None else (q_out, k_out)


# rerotate_cache's operands, in the order of its key's pointers: the delta and the scale may be
# numbers (an option of the key then, by value).
REROTATE_OPERANDS = ("k_cache", "slots", "delta", "cos_sin_cache", "k_scale")
_REROTATE_NUMBERS = (2, 4)
_REROTATE_NUMBER_PLACES = frozenset(_REROTATE_NUMBERS)


def rerotate_key(arrays: tuple, options: tuple):
    """(hashable key, pointers in REROTATE_OPERANDS order) of a ``rerotate_cache`` call from its
    own arguments, else None (the full path decides): ``arrays`` its operands in
    REROTATE_OPERANDS order, ``options`` ``(theta, scaling, interleaved, rotary_dim, layout,
    cache_dtype, seq_len)`` as given. As :func:`fast_fused_key`: every operand's metadata, every
    option with its type (scaling by :func:`exact_key`), a delta or scale given as a number by
    type and value; options of other types (a dtype object as cache_dtype) form none. Planned
    every call, a re-rotation took 156-173 µs of an H200 host's time, 19-21x ``torch.mul``;
    replayed 12-13 µs (docs/perf_log.md, "rerotate_cache's repeat calls")."""
    scaling = options[1]
    rest = options[:1] + options[2:]
    types = tuple(map(type, rest))
    if not _PLAIN_OPTION_TYPES.issuperset(types):
        return None
    operands = _operands_key(arrays, _REROTATE_NUMBER_PLACES)
    if operands is None:
        return None
    metas, pointers = operands
    numbers = ()
    for place in _REROTATE_NUMBERS:
        value = arrays[place]
        if value is not None and metas[place] is None:
            if type(value) not in _NUMBER_TYPES:
                return None  # a bool or a string: the full path refuses it
            numbers += (place, type(value), value)
    try:
        key = ("rerotate_cache", tuple(metas), rest, types,
               None if scaling is None else exact_key(scaling), numbers)
        hash(key)
    except TypeError:  # an unhashable option: full path
        return None
    return key, pointers


def replay_rerotate(recipe: LaunchRecipe, cache, pointers):
    """Run a re-rotation's recipe on new operands (written in place: ``cache``); None when the
    full path must decide instead."""
    if recipe.in_place_checks and not _meets_as_checked(recipe, pointers):
        return None
    if recipe.torch and cache.is_inference() and not inference_mode_enabled():
        return None  # torch refuses this write: the full path raises its error
    cache_ptr, slots_ptr, delta_ptr, table_ptr, scale_ptr = pointers
    recipe.launch(cache, 0, 0, 0, 0, 0, table_ptr, 0, (cache_ptr, slots_ptr, delta_ptr, scale_ptr))
    if recipe.torch:
        bump_versions((cache,))
    return cache


def keep_rerotate_recipe(recipe: LaunchRecipe, spans, key, torch: bool) -> None:
    """Keep a re-rotation's recipe under ``key`` (:func:`rerotate_key`), guarded so that a replay
    writes the cache only where it meets the other operands (``spans``, in REROTATE_OPERANDS
    order) as the full path checked."""
    recipe.torch = torch
    recipe.fusion_pointers = _REROTATE_DATA_POINTERS
    guard_written(recipe, spans, key[1], (0,))
    recipes.put(key[0], recipe)
