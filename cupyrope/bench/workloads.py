"""What is measured: the reference shape and its data, one workload per implementation (cupyrope's
angle sources in and out of place, the SM copy of the same bytes, the peers), and the check of one
call against a float32 reference before anything is timed.

The copy reference is ``torch.mul(src, 1, out=dst)`` over a bfloat16 buffer of the bytes of q + k:
an SM kernel, not ``cudaMemcpy`` (slower inside CUDA graphs), moving read + write bytes. GB/s counts
the minimum bytes an implementation must move: q and k read once and written once, plus the
positions and the cos/sin rows it reads (unique cache rows; per-token tables in full). "% of copy"
is the SM copy's time over the implementation's time, for q and k of the same bytes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

from .clocks import input_sets_for, round_robin
from .peers import (Unavailable, compiled_hf_rope, flashinfer_rope, flashinfer_rope_computed,
                    flashinfer_rope_inplace, hf_rope, liger_rope, peer_status)

try:
    import torch
except ImportError:  # pragma: no cover - exercised only without torch
    torch = None

# The reference shape: bf16 q [T, 32, 128], k [T, 8, 128], int64 positions in [0, 131072),
# fp32 cache [131072, 128], NeoX.
REFERENCE_TOKENS = (1, 8, 64, 512, 4096, 16384, 65536)
DECODE_TOKENS = (1, 32, 512)

# The contract's targets (docs/contract.md §4), carried into reports so a reader sees pass / miss
# beside each number.
# Both are ratios to a copy timed in the same run (so they hold on any machine): decode GPU time
# per call in a graph of 20 against the SM copy of the same bytes, host time per eager call
# against ``torch.mul(src, 1, out=dst)`` on tensors of the same size (the "copy" case).
DECODE_TARGET_RATIO = {1: 1.15, 32: 1.15, 512: 1.05}  # cache and per-token tables
DECODE_COMPUTED_TARGET_RATIO = 1.3
HOST_TARGET_RATIO = {"inplace": 1.2, "out": 1.2, "out_of_place": 1.5}


def decode_target_ratio(tokens: int, impl: str) -> float | None:
    """The contract's decode target for a cupyrope case, as a ratio to the SM copy (None: none)."""
    if not impl.startswith("cupyrope"):
        return None
    if "computed" in impl:
        return DECODE_COMPUTED_TARGET_RATIO
    return DECODE_TARGET_RATIO.get(tokens)


def host_target_ratio(impl: str) -> float | None:
    """The contract's host-time target for a cupyrope case, as a ratio to torch.mul (None: none)."""
    if not impl.startswith("cupyrope"):
        return None
    if impl.endswith("-inplace"):
        return HOST_TARGET_RATIO["inplace"]
    if impl.endswith("-out"):
        return HOST_TARGET_RATIO["out"]
    return HOST_TARGET_RATIO["out_of_place"]

# Largest error against the float32 reference before a run is flagged: a wrong layout gives O(1).
CHECK_TOLERANCE = {"bfloat16": 0.125, "float16": 0.02, "float32": 2e-3}

# Every implementation, by key. "copy" is the SM copy of the bytes of q + k.
CUPYROPE_IMPLS = (
    "cupyrope-cache", "cupyrope-cache-inplace", "cupyrope-cache-out",
    "cupyrope-computed", "cupyrope-computed-inplace",
    "cupyrope-tables", "cupyrope-tables-inplace",
)
# The drop-in adapters, timed like the calls they stand for (decode and host benchmarks): vLLM's
# rotary_embedding on flat [T, H * D] q and k, in place.
COMPAT_IMPLS = ("cupyrope-vllm-inplace",)
PEER_IMPLS = (
    "torch-eager-hf", "torch-compile-hf", "liger-inplace",
    "flashinfer-cache", "flashinfer-cache-inplace", "flashinfer-computed",
)
ALL_IMPLS = ("copy",) + CUPYROPE_IMPLS + COMPAT_IMPLS + PEER_IMPLS
# The reference sweep: cupyrope cache out of place / in place, computed angles, per-token tables;
# then every peer that imports.
SWEEP_IMPLS = ("cupyrope-cache", "cupyrope-cache-inplace", "cupyrope-computed", "cupyrope-tables") + PEER_IMPLS

_TORCH_DTYPES = ("float16", "bfloat16", "float32")


def torch_dtype(name: str):
    """The torch dtype named ``name`` (``float16``, ``bfloat16`` or ``float32``)."""
    if name not in _TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {_TORCH_DTYPES}, got {name!r}")
    return getattr(torch, name)


@dataclasses.dataclass(frozen=True)
class RopeShape:
    """One benchmark shape: q ``[T, Hq, D]``, k ``[T, Hk, D]``, positions in ``[0, max_position)``.

    The cos/sin cache is float32 ``[max_position, rotary_dim]`` built with ``theta``; computed
    angles use the same ``theta``, per-token tables are the cache rows of the positions.
    """

    tokens: int
    num_q_heads: int = 32
    num_k_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    rotary_dim: int | None = None  # None: head_dim
    interleaved: bool = False
    max_position: int = 131072
    theta: float = 500000.0

    @property
    def rot(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def label(self) -> str:
        """Group name, e.g. ``bf16 q[65536,32,128] k[65536,8,128] neox``."""
        short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[self.dtype]
        t, d = self.tokens, self.head_dim
        text = f"{short} q[{t},{self.num_q_heads},{d}] k[{t},{self.num_k_heads},{d}]"
        text += " interleaved" if self.interleaved else " neox"
        if self.rot != d:
            text += f" rotary_dim={self.rot}"
        return text


@functools.lru_cache(maxsize=4)
def _shared_cache(max_position: int, rotary_dim: int, theta: float, device: str):
    import cupyrope as cr

    like = torch.empty(1, device=device)
    return cr.cos_sin_cache(max_position, rotary_dim, theta=theta, dtype="float32", like=like)


class RopeData:
    """Random inputs for one shape: ``num_sets`` sets of (q, k, positions) and one shared cache.

    Sets are views into one allocation each for q, k and positions; by default there are enough
    of them (:func:`input_sets_for`) that rotating among them reads DRAM on every call.
    ``device="cpu"`` builds the same data on the host (used to check the plumbing without a GPU).
    """

    def __init__(self, shape: RopeShape, *, num_sets: int | None = None, seed: int = 0,
                 device: str = "cuda"):
        if torch is None:
            raise RuntimeError("RopeData needs torch")
        s = self.shape = shape
        self.device = device
        dtype = torch_dtype(s.dtype)
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        t = s.tokens
        self.qk_bytes = t * (s.num_q_heads + s.num_k_heads) * s.head_dim * self.itemsize
        per_set = self.qk_bytes + t * 8 + t * s.rot * 4  # q, k, positions, cos/sin rows
        self.num_sets = num_sets or (input_sets_for(per_set) if device != "cpu" else 2)
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        n = self.num_sets
        q_all = torch.randn((n, t, s.num_q_heads, s.head_dim), generator=gen, device=device, dtype=dtype)
        k_all = torch.randn((n, t, s.num_k_heads, s.head_dim), generator=gen, device=device, dtype=dtype)
        self._positions_all = torch.randint(0, s.max_position, (n, t), generator=gen, device=device,
                                            dtype=torch.int64)
        self.q = list(q_all.unbind(0))
        self.k = list(k_all.unbind(0))
        self.positions = list(self._positions_all.unbind(0))
        self.cache = _shared_cache(s.max_position, s.rot, float(s.theta), device)
        self.unique_rows = int(torch.unique(self.positions[0]).numel())

    @functools.cached_property
    def half_tables(self) -> list[tuple]:
        """Per set: float32 (cos, sin) ``[T, rotary_dim // 2]``, the cache rows of the positions."""
        half = self.shape.rot // 2
        rows = self.cache[self._positions_all]  # [n, T, rotary_dim]
        cos, sin = rows[..., :half].contiguous(), rows[..., half:].contiguous()
        return list(zip(cos.unbind(0), sin.unbind(0)))

    @functools.cached_property
    def hf_tables(self) -> list[tuple]:
        """Per set: (cos, sin) ``[1, T, rotary_dim]`` in q's dtype, halves repeated (HF, Liger)."""
        half = self.shape.rot // 2
        rows = self.cache[self._positions_all]
        dtype = torch_dtype(self.shape.dtype)
        cos = torch.cat((rows[..., :half], rows[..., :half]), dim=-1).to(dtype)
        sin = torch.cat((rows[..., half:], rows[..., half:]), dim=-1).to(dtype)
        return [(c.unsqueeze(0), s.unsqueeze(0)) for c, s in zip(cos.unbind(0), sin.unbind(0))]

    def bytes_moved(self, source: str) -> int:
        """Minimum bytes of one call: q, k in and out, plus what the angle source reads.

        ``cache``: int64 positions and the unique fp32 cache rows; ``computed``: positions only;
        ``tables``: fp32 half-width per-token cos and sin; ``hf-tables``: half of each full-width
        q-dtype row (what Liger reads).
        """
        s, t = self.shape, self.shape.tokens
        qk = 2 * self.qk_bytes
        if source == "cache":
            return qk + t * 8 + self.unique_rows * s.rot * 4
        if source == "computed":
            return qk + t * 8
        if source == "tables":
            return qk + 2 * t * (s.rot // 2) * 4
        if source == "hf-tables":
            return qk + 2 * t * (s.rot // 2) * self.itemsize
        raise ValueError(f"unknown angle source {source!r}")


@dataclasses.dataclass
class Workload:
    """``fn(*arg_sets[i])`` is one call; ``arg_sets[i]`` starts with (q, k) of set i of the data."""

    name: str
    fn: Callable
    arg_sets: Sequence[tuple]
    bytes_moved: int

    def step(self) -> Callable[[], object]:
        """A no-argument call that walks the argument sets round-robin."""
        return round_robin(self.fn, self.arg_sets)


def sm_copy(nbytes: int, *, num_sets: int | None = None, device: str = "cuda") -> Workload:
    """The copy reference: ``torch.mul(src, 1, out=dst)`` over bfloat16 buffers of ``nbytes``.

    An SM kernel (not ``cudaMemcpy``, which is slower in graphs); it moves
    ``2 * nbytes`` (read + write). Rotates among enough (src, dst) pairs to read from DRAM.
    """
    numel = max(1, nbytes // 2)
    n = num_sets or input_sets_for(2 * numel)
    src = torch.randn((n, numel), device=device, dtype=torch.bfloat16)
    dst = torch.empty((n, numel), device=device, dtype=torch.bfloat16)

    def copy(a, b):
        return torch.mul(a, 1, out=b)

    return Workload("copy", copy, list(zip(src.unbind(0), dst.unbind(0))), 2 * numel * 2)


def make_workload(impl: str, data: RopeData) -> Workload:
    """The workload ``impl`` (a key of :data:`ALL_IMPLS`) on ``data``; raises :class:`Unavailable`."""
    s = data.shape
    q_k_pos = list(zip(data.q, data.k, data.positions))
    if impl == "copy":  # as many sets as the RoPE workloads on this data rotate among
        return sm_copy(data.qk_bytes, num_sets=data.num_sets, device=data.device)

    if impl.startswith("cupyrope-"):
        import cupyrope as cr

        parts = impl.split("-")
        source, inplace = parts[1], parts[-1] == "inplace"
        options = dict(interleaved=s.interleaved, inplace=inplace)
        if source == "cache" and parts[-1] == "out":  # preallocated outputs, one pair per set
            def fn(q, k, positions, cache, q_out, k_out):
                return cr.apply_rope(q, k, positions, cos_sin_cache=cache,
                                     interleaved=s.interleaved, out=(q_out, k_out))
            sets = [(q, k, p, data.cache, torch.empty_like(q), torch.empty_like(k))
                    for q, k, p in q_k_pos]
        elif source == "cache":
            def fn(q, k, positions, cache):
                return cr.apply_rope(q, k, positions, cos_sin_cache=cache, **options)
            sets = [(q, k, p, data.cache) for q, k, p in q_k_pos]
        elif source == "computed":
            def fn(q, k, positions):
                return cr.apply_rope(q, k, positions, theta=s.theta, rotary_dim=s.rot, **options)
            sets = q_k_pos
        elif source == "tables":
            def fn(q, k, cos, sin):
                return cr.apply_rope(q, k, cos=cos, sin=sin, rotary_dim=s.rot, **options)
            sets = [(q, k, c, sn) for q, k, (c, sn) in zip(data.q, data.k, data.half_tables)]
        elif source == "vllm":  # compat.rotary_embedding: flat [T, H * D] views, in place
            from cupyrope.compat import vllm

            def fn(q, k, positions, cache):
                vllm.rotary_embedding(positions, q, k, s.head_dim, cache, not s.interleaved)
                return q, k
            sets = [(q.view(q.shape[0], -1), k.view(k.shape[0], -1), p, data.cache)
                    for q, k, p in q_k_pos]
        else:
            raise ValueError(f"unknown implementation {impl!r}")
        # The adapter reads and writes what the cache source does.
        return Workload(impl, fn, sets, data.bytes_moved("cache" if source == "vllm" else source))

    if impl not in PEER_IMPLS:
        raise ValueError(f"unknown implementation {impl!r}; known: {ALL_IMPLS}")
    reason = peer_status()[impl]
    if reason:
        raise Unavailable(reason)
    cache_sets = [(q, k, p, data.cache) for q, k, p in q_k_pos]
    if impl in ("torch-eager-hf", "torch-compile-hf"):
        if s.interleaved:
            raise Unavailable(f"{impl}: the Hugging Face formulation is NeoX (rotate_half) only")
        fn = hf_rope if impl == "torch-eager-hf" else compiled_hf_rope()
        return Workload(impl, fn, cache_sets, data.bytes_moved("cache"))
    if impl == "liger-inplace":
        if s.interleaved or s.rot != s.head_dim:
            raise Unavailable("liger-inplace: Liger rotates full heads with NeoX pairing only")
        sets = [(q, k, c, sn) for q, k, (c, sn) in zip(data.q, data.k, data.hf_tables)]
        return Workload(impl, liger_rope, sets, data.bytes_moved("hf-tables"))
    if s.dtype not in ("float16", "bfloat16"):
        raise Unavailable(f"{impl}: FlashInfer's RoPE takes float16 / bfloat16 only")
    if impl == "flashinfer-computed":
        fn = functools.partial(flashinfer_rope_computed, rotary_dim=s.rot, theta=s.theta,
                               interleaved=s.interleaved)
        return Workload(impl, fn, q_k_pos, data.bytes_moved("computed"))
    base = flashinfer_rope if impl == "flashinfer-cache" else flashinfer_rope_inplace
    return Workload(impl, functools.partial(base, interleaved=s.interleaved), cache_sets,
                    data.bytes_moved("cache"))


# The agreement check

def reference_rope(x, positions, cos_sin_cache, *, interleaved=False):
    """float32 rotation of x ``[T, H, D]`` by the cache rows of ``positions`` (either pairing)."""
    rotary_dim = cos_sin_cache.shape[-1]
    half = rotary_dim // 2
    rows = cos_sin_cache[positions].float()
    cos, sin = rows[:, None, :half], rows[:, None, half:]  # [T, 1, half]: pair j's angle
    xf = x.float()
    out = xf.clone()
    if interleaved:
        x1, x2 = xf[..., 0:rotary_dim:2], xf[..., 1:rotary_dim:2]
        out[..., 0:rotary_dim:2] = x1 * cos - x2 * sin
        out[..., 1:rotary_dim:2] = x2 * cos + x1 * sin
    else:
        x1, x2 = xf[..., :half], xf[..., half:rotary_dim]
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:rotary_dim] = x2 * cos + x1 * sin
    return out


def max_abs_error(workload: Workload, data: RopeData) -> float:
    """Largest |output - float32 reference| of one call on copies of set 0 (NaN counts as inf)."""
    args = list(workload.arg_sets[0])
    q, k = args[0].clone(), args[1].clone()  # in-place workloads write here, not into the data
    # The reference rotates the data's own [T, H, D] arrays: a workload may take them in another
    # shape (the vLLM adapter's flat [T, H * D] views).
    ref_q = reference_rope(data.q[0], data.positions[0], data.cache,
                           interleaved=data.shape.interleaved)
    ref_k = reference_rope(data.k[0], data.positions[0], data.cache,
                           interleaved=data.shape.interleaved)
    out = workload.fn(q, k, *args[2:])
    errors = []
    for got, ref in ((out[0], ref_q), (out[1], ref_k)):
        diff = (got.reshape(ref.shape).float() - ref).abs()
        errors.append(float("inf") if bool(torch.isnan(diff).any()) else float(diff.max()))
    return max(errors)


def error_is_acceptable(error: float | None, dtype: str) -> bool:
    return error is None or error <= CHECK_TOLERANCE[dtype]
