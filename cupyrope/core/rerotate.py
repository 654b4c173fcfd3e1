"""``rerotate_cache``: the checks that turn its arguments into a :class:`RerotatePlan` (or raise,
before anything is launched or written), the ``validate=True`` checks of values, and the NumPy
path that re-rotates the rows of a CPU cache with the kernel's arithmetic.

A key cached at position ``p`` holds ``R(p) k``. Rotations compose exactly, ``R(d) R(p) = R(p +
d)``, so rotating its row by the angle of ``d`` gives the key at position ``p + d`` (sliding-window
eviction and attention sinks shift cached keys this way), at the cost of one rounding to the
cache's format per re-rotation (docs/rerotate.md measures the drift over many).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .abi import AngleSource
from .arrays import ArrayInfo, describe, host_view, in_place_refusal, to_host
from .dtypes import FP8_DTYPES, ITEMSIZE, POSITION_DTYPES, numpy_dtype
from .fused_plan import LAYOUTS, Scale, _layout_text, _scale, fp8_name
from .numpy_path import cos_sin_per_token, store_as
from .overlap import overlaps_itself, shares_memory
from .plan import RopePlan, plan_rope
from .validators import check_bool, is_integer

OP_NAME = "rerotate_cache"
# The cache formats a re-rotation reads and writes (fp8 also as uint8 bits with cache_dtype).
CACHE_DTYPES = ("float16", "bfloat16", "float32", *FP8_DTYPES)
_INT64_RANGE = (-2**63, 2**63 - 1)

# Field for field the layout of cupyrope::RerotateParams (kernels_cu/rerotate.cuh).
RERO_PARAMS_DTYPE = np.dtype(
    [(name, np.uint64) for name in ("cache", "slots", "delta", "scale")]
    + [(name, np.int64) for name in (
        "num_slots", "slots_are_int64", "slot_stride", "delta_is_int64", "delta_stride",
        "delta_value", "cache_slots", "block_size", "block_stride", "row_stride", "head_stride",
        "num_heads", "stage_slots", "heads_per_item", "stage_bytes", "rows_at", "angles_at")]
    + [("scale_value", np.float64)]
)


@dataclass
class RerotatePlan:
    """A checked ``rerotate_cache`` call. ``rope`` is the angle source as a rotation plan of
    ``num_slots`` tokens (its positions: the deltas), which the NumPy path and the launch read
    the tables, frequencies and pairing from. Strides are in elements."""

    op_name: str
    cache: ArrayInfo
    cache_dtype: str  # the element format (fp8 for uint8 bits)
    layout: str
    num_blocks: int
    block_size: int
    num_heads: int
    head_dim: int
    slots: ArrayInfo
    delta: ArrayInfo | None  # None: every slot moves by delta_value
    delta_value: int
    delta_stride: int  # 0 when one delta array element serves every slot
    scale: Scale
    rope: RopePlan

    @property
    def num_slots(self) -> int:
        return self.slots.shape[0]

    @property
    def cache_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def is_empty(self) -> bool:
        return self.num_slots == 0 or self.num_heads == 0 or self.cache.size == 0

    def cache_strides(self) -> tuple[int, int, int]:
        """(block, row-in-block, head) element strides of the cache in its layout."""
        s = self.cache.strides
        return (s[0], s[1], s[2]) if self.layout == "NHD" else (s[0], s[2], s[1])

    def operands(self) -> list[tuple[str, ArrayInfo]]:
        named = (("k_cache", self.cache), ("slots", self.slots), ("delta", self.delta),
                 ("cos_sin_cache", self.rope.cache), ("k_scale", self.scale.array))
        return [(name, info) for name, info in named if info is not None]


def _same_device(info: ArrayInfo, cache: ArrayInfo, name: str, op_name: str) -> None:
    if info.device != cache.device:
        raise ValueError(f"{op_name}: {name} is on {info.where()} but k_cache is on "
                         f"{cache.where()}; all arrays of one call must be on the same device")


def _check_cache(cache: ArrayInfo, layout, cache_dtype, op_name: str):
    """(element format, num_blocks, block_size, num_heads, head_dim) of the k cache."""
    if layout not in LAYOUTS:
        raise ValueError(f"{op_name}: layout must be one of {LAYOUTS}, got {layout!r}")
    if cache.dtype not in CACHE_DTYPES + ("uint8",):
        raise TypeError(f"{op_name}: k_cache must be one of {CACHE_DTYPES} (or uint8 holding fp8 "
                        f"bits, with cache_dtype), got {cache.dtype}")
    named = fp8_name(cache_dtype, "cache_dtype", op_name)
    if cache.dtype == "uint8":
        if named is None:
            raise TypeError(f"{op_name}: a uint8 k_cache holds fp8 bits: say which format with "
                            "cache_dtype='float8_e4m3fn' or 'float8_e5m2'")
        element = named
    else:
        if named is not None and named != cache.dtype:
            raise ValueError(f"{op_name}: cache_dtype {named} but k_cache is {cache.dtype}")
        element = cache.dtype
    if cache.ndim != 4:
        raise ValueError(f"{op_name}: k_cache must be 4-d ({_layout_text(layout)}), got shape "
                         f"{cache.shape}")
    blocks, size, heads = ((cache.shape[0], cache.shape[1], cache.shape[2]) if layout == "NHD"
                           else (cache.shape[0], cache.shape[2], cache.shape[1]))
    head_dim = cache.shape[3]
    if cache.size > 0 and head_dim > 1 and cache.strides[-1] != 1:
        raise ValueError(f"{op_name}: k_cache's last dim (head_dim) must have stride 1, got "
                         f"strides {cache.strides}")
    if not cache.writable:
        raise ValueError(f"{op_name}: k_cache is read-only; the re-rotation writes into it")
    refusal = in_place_refusal(cache)
    if refusal is not None:
        raise RuntimeError(f"{op_name}: k_cache {refusal}")
    if overlaps_itself(cache):
        raise ValueError(f"{op_name}: k_cache of shape {cache.shape} and strides {cache.strides} "
                         "reaches some element from two indices; a cache written in place must "
                         "not alias itself")
    if cache.on_gpu and cache.ptr % ITEMSIZE[cache.dtype]:
        raise ValueError(f"{op_name}: k_cache's data pointer {cache.ptr:#x} is not a multiple of "
                         f"its element size ({ITEMSIZE[cache.dtype]} bytes)")
    return element, blocks, size, heads, head_dim


def _check_slots(slots, cache: ArrayInfo, op_name: str) -> ArrayInfo:
    info = describe(slots, "slots")
    if info.dtype not in POSITION_DTYPES:
        raise TypeError(f"{op_name}: slots must be int32 or int64, got {info.dtype}")
    if info.ndim != 1:
        raise ValueError(f"{op_name}: slots must have shape (N,) (one cache slot, block * "
                         f"block_size + row, per key to re-rotate), got {info.shape}")
    _same_device(info, cache, "slots", op_name)
    return info


def _check_delta(delta, num_slots: int, cache: ArrayInfo, op_name: str):
    """(delta array or None, scalar delta, element stride) of the ``delta`` argument."""
    if delta is None:
        raise TypeError(f"{op_name}: delta is required: an int (one position shift for every "
                        f"slot) or an int32 / int64 array of shape ({num_slots},)")
    if isinstance(delta, (bool, np.bool_)) or isinstance(delta, (float, np.floating)):
        raise TypeError(f"{op_name}: delta must be an int or an int32 / int64 array, got "
                        f"{type(delta).__name__}")
    if is_integer(delta):
        value = int(delta)
        if not _INT64_RANGE[0] <= value <= _INT64_RANGE[1]:
            raise ValueError(f"{op_name}: delta must fit int64, got {value}")
        return None, value, 0
    info = describe(delta, "delta")
    if info.dtype not in POSITION_DTYPES:
        raise TypeError(f"{op_name}: delta must be int32 or int64, got {info.dtype}")
    if info.shape not in ((num_slots,), (), (1,)):
        raise ValueError(f"{op_name}: delta must be an int or have shape ({num_slots},) (one "
                         f"position shift per slot) or (1,), got {info.shape}")
    _same_device(info, cache, "delta", op_name)
    stride = info.strides[0] if info.shape == (num_slots,) and num_slots > 1 else 0
    return info, 0, stride


def _rotation(cache: ArrayInfo, num_slots: int, num_heads: int, head_dim: int, delta: ArrayInfo,
              cos_sin_cache, theta, scaling, interleaved, rotary_dim, seq_len,
              op_name: str) -> RopePlan:
    """The angle source as the plan of a rotation of ``num_slots`` tokens of ``num_heads`` heads
    (the deltas its positions): every check of apply_rope's angle sources applies."""
    if isinstance(scaling, dict) and scaling.get("mrope_section") is not None:
        raise ValueError(f"{op_name}: M-RoPE (scaling['mrope_section']) rotates by three "
                         "position components; a re-rotation shifts one position: pass a "
                         "scaling without mrope_section")
    table = None
    if cos_sin_cache is not None:
        table = describe(cos_sin_cache, "cos_sin_cache")
        _same_device(table, cache, "cos_sin_cache", op_name)
        if table.ndim == 2 and table.shape[1] > head_dim:
            raise ValueError(f"{op_name}: cos_sin_cache is {table.shape[1]} wide, more than "
                             f"k_cache's head_dim {head_dim}; its width is rotary_dim, which "
                             "must not exceed head_dim")
    # The slots' rows as the keys of a rotation (no memory: only their shape and dtype are read).
    compute = cache.dtype if cache.dtype in ("float16", "bfloat16", "float32") else "float32"
    keys = ArrayInfo(obj=None, kind=cache.kind, device=cache.device, ptr=0,
                     shape=(num_slots, num_heads, head_dim),
                     strides=(num_heads * head_dim, head_dim, 1), dtype=compute, writable=False)
    rope = plan_rope(keys, None, delta, cos_sin_cache=table, theta=theta, scaling=scaling,
                     interleaved=interleaved, rotary_dim=rotary_dim, seq_len=seq_len,
                     op_name=op_name)
    # The keys carry the schedule's attention factor (mscale) from their first rotation: the
    # re-rotation is by the angle alone (a table's entries are divided by the factor of row 0).
    rope.attention_factor = 1.0
    return rope


def plan_rerotate(k_cache, slots, delta, *, cos_sin_cache=None, theta=10000.0, scaling=None,
                  interleaved=False, rotary_dim=None, layout="NHD", k_scale=None,
                  cache_dtype=None, seq_len=None, validate=False,
                  op_name: str = OP_NAME) -> RerotatePlan:
    """Check every argument of :func:`cupyrope.rerotate_cache` (see it for their meaning)."""
    validate = check_bool(validate, "validate", op_name)
    cache = describe(k_cache, "k_cache")
    element, blocks, size, heads, head_dim = _check_cache(cache, layout, cache_dtype, op_name)
    if element in FP8_DTYPES:
        if k_scale is not None and not isinstance(k_scale, (int, float, np.integer, np.floating)):
            _same_device(describe(k_scale, "k_scale"), cache, "k_scale", op_name)
        scale = _scale(k_scale, "k_scale", op_name, cache)
    elif k_scale is not None:
        raise ValueError(f"{op_name}: k_scale is only used with an fp8 cache (stored = value / "
                         f"k_scale); k_cache is {element}")
    else:
        scale = Scale()
    slot_info = _check_slots(slots, cache, op_name)
    num_slots = slot_info.shape[0]
    delta_info, delta_value, delta_stride = _check_delta(delta, num_slots, cache, op_name)
    rope = _rotation(cache, num_slots, heads, head_dim, delta_info, cos_sin_cache, theta, scaling,
                     interleaved, rotary_dim, seq_len, op_name)
    plan = RerotatePlan(op_name, cache, element, layout, blocks, size, heads, head_dim, slot_info,
                        delta_info, delta_value, delta_stride, scale, rope)
    for name, info in plan.operands()[1:]:
        if shares_memory(cache, info):
            raise ValueError(f"{op_name}: k_cache shares memory with {name}: pass a cache that "
                             "no other argument overlaps")
    if rope.source == AngleSource.CACHE_TABLE and delta_info is None:
        _check_table_deltas(plan, np.array([delta_value]))
    if validate:
        check_rerotate_values(plan)
    return plan


def _check_table_deltas(plan: RerotatePlan, deltas: np.ndarray) -> None:
    """A cos_sin_cache row is the angle of one delta: the deltas must index its rows."""
    if deltas.size == 0:
        return
    rows = plan.rope.cache.shape[0]
    lo, hi = int(deltas.min()), int(deltas.max())
    if lo < 0 or hi >= rows:
        raise IndexError(
            f"{plan.op_name}: delta indexes the rows of cos_sin_cache, so it must lie in [0, "
            f"{rows}), got values in [{lo}, {hi}]"
            + ("; a table holds no negative angle: compute the angles from theta (exact for "
               "negative deltas) to shift keys back" if lo < 0 else ""))


def check_rerotate_values(plan: RerotatePlan) -> None:
    """``validate=True``: the checks that read values on the host (they synchronise). Every slot
    is padding (negative) or inside the cache, no two entries name one slot, and with a
    cos_sin_cache every delta of a slot that is re-rotated indexes one of its rows."""
    op_name = plan.op_name
    slots = to_host(plan.slots).astype(np.int64)
    bad = slots >= plan.cache_slots
    if bad.any():
        raise IndexError(f"{op_name}: slots holds {int(bad.sum())} slot(s) >= {plan.cache_slots} "
                         f"(num_blocks * block_size), first {int(slots[bad][0])}; negative slots "
                         "are skipped")
    written = slots >= 0
    values, first, counts = np.unique(slots[written], return_index=True, return_counts=True)
    shared = counts > 1
    if shared.any():
        slot = int(values[shared][np.argmin(first[shared])])
        entries = np.flatnonzero(slots == slot).tolist()
        raise ValueError(f"{op_name}: slots names slot {slot} at entries {entries} "
                         f"({int(shared.sum())} slot(s) named twice in all); each key is "
                         "re-rotated once per call: slots must be distinct (negative slots may "
                         "repeat)")
    if plan.rope.source == AngleSource.CACHE_TABLE and plan.delta is not None:
        deltas = np.broadcast_to(to_host(plan.delta).astype(np.int64).reshape(-1),
                                 slots.shape)
        _check_table_deltas(plan, deltas[written])


# ----------------------------------------------------------------------------------------------
# The NumPy path


def _deltas_plan(plan: RerotatePlan) -> RopePlan:
    """The rotation plan with the deltas as host positions (a scalar delta made an array)."""
    if plan.delta is not None:
        return plan.rope
    values = np.full((1,), plan.delta_value, np.int64)
    return dataclasses.replace(plan.rope, positions=describe(values, "delta"),
                               positions_strides=(0,))


def without_attention_factor(cos: np.ndarray, sin: np.ndarray, table: np.ndarray, half: int):
    """float32 table entries without the schedule's attention factor, as the kernel does: a table
    row holds the factor times cos and sin of the angle, and the cached keys already carry the
    factor, so each pair's entries are multiplied by the reciprocal of the factor row 0 holds
    (position 0: cos = the factor). Rows are unchanged where the factor is 1; NaN stays NaN."""
    inverse = np.float32(1) / np.asarray(table[0, :half], np.float32)
    return cos * inverse, sin * inverse


def rerotate_on_host(plan: RerotatePlan) -> None:
    """Re-rotate the slots of a CPU cache in place, with the kernel's arithmetic: each element
    decoded to float32 (fp8: times the scale), each pair rotated in float32 by cos/sin of the
    delta's angle (computed in float64 and rounded, or read from the table), rounded once to the
    cache's format (fp8: value * (1 / scale), saturated). Padding and slots past the cache are
    skipped; a slot named twice keeps one rotation of its original row. As in the kernel, the
    rotation is by the angle alone: no attention factor (computed angles leave it out, table
    entries are divided by the one row 0 holds)."""
    if plan.is_empty:
        return
    rope = _deltas_plan(plan)
    cos, sin = cos_sin_per_token(rope)  # [N, half] float32
    if rope.source == AngleSource.CACHE_TABLE:
        cos, sin = without_attention_factor(cos, sin, np.asarray(host_view(rope.cache)),
                                            rope.rotary_dim // 2)
    slots = np.asarray(host_view(plan.slots)).astype(np.int64)
    valid = (slots >= 0) & (slots < plan.cache_slots)
    blocks, rows = slots[valid] // plan.block_size, slots[valid] % plan.block_size
    cos, sin = cos[valid][:, None, :], sin[valid][:, None, :]  # broadcast over heads
    cache = np.asarray(host_view(plan.cache))
    view = cache.view(numpy_dtype(plan.cache_dtype)) if cache.dtype == np.uint8 else cache
    r, half = rope.rotary_dim, rope.rotary_dim // 2
    index = (blocks, rows) if plan.layout == "NHD" else (blocks, slice(None), rows)
    x = view[index][..., :r].astype(np.float32)  # [n, heads, r]
    if plan.cache_dtype in FP8_DTYPES:
        x = x * np.float32(plan.scale.value)
    if rope.interleaved:
        first, second = slice(0, r, 2), slice(1, r, 2)
    else:
        first, second = slice(0, half), slice(half, r)
    y = np.empty_like(x)
    y[..., first] = x[..., first] * cos - x[..., second] * sin
    y[..., second] = x[..., second] * cos + x[..., first] * sin
    stored = store_as(y, plan.cache_dtype, plan.scale.value)
    if cache.dtype == np.uint8:
        stored = stored.view(np.uint8)
    cache[index + (Ellipsis, slice(0, r))] = stored
