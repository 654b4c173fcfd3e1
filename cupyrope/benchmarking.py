"""Measuring machinery for the RoPE benchmarks (SPEC §4): GPU clocks, workloads, peers, the sweep.

Shared by the pytest-benchmark suite in ``benchmarks/`` and by the command line::

    python -m cupyrope.benchmarking --out results/      # reference sweep: table, JSON and plot

Everything here runs on torch CUDA tensors (cupyrope returns torch tensors for torch inputs), on
torch's current stream. torch, matplotlib, tqdm and the peers (Liger-Kernel, FlashInfer) are optional:
the module imports without them, and a peer that cannot be imported is reported as unavailable.

How time is measured
--------------------
- :func:`gpu_time_us`: median GPU time per call, from CUDA events around batches of back-to-back
  calls. Before each batch a ``torch.cuda._sleep`` spin kernel holds the stream for as long as the
  host needs to enqueue the batch, so the calls run back to back on the GPU and the events measure
  GPU time, not launch overhead (a host-bound batch would otherwise time the Python loop).
  Inputs rotate round-robin among enough sets (:func:`input_sets_for`) that a call's inputs have
  left the L2 cache (50-60 MB on H100/H200) before they are used again: every call reads DRAM.
- :func:`graph_time_us`: GPU time per call from a CUDA graph of 20 back-to-back calls (decode).
- :func:`host_time_us`: wall time per eager call, a loop of 300 calls then one synchronise.
- :func:`sm_copy`: the copy reference, ``torch.mul(src, 1, out=dst)`` over a bfloat16 buffer of the
  bytes of q + k (an SM kernel, not ``cudaMemcpy``; SPEC §4), moving read + write bytes.

GB/s counts the minimum bytes an implementation must move: q and k read once and written once,
plus the positions and the cos/sin rows it reads (unique cache rows; per-token tables in full).
"% of copy" is the SM copy's time over the implementation's time, for q and k of the same bytes.

Example
-------
>>> from cupyrope import benchmarking as bm                                  # doctest: +SKIP
>>> data = bm.RopeData(bm.RopeShape(tokens=65536))                           # doctest: +SKIP
>>> work = bm.make_workload("cupyrope-cache", data)                          # doctest: +SKIP
>>> bm.gpu_time_us(work.fn, rotate_inputs=work.arg_sets)                     # doctest: +SKIP
318.4
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import inspect
import itertools
import json
import math
import os
import statistics
import sys
import time
import traceback
from typing import Callable, Sequence

try:  # optional: the module must import (e.g. inside the wheel's tests) without torch
    import torch
except ImportError:  # pragma: no cover - exercised only without torch
    torch = None

# SPEC §4 reference shape: bf16 q [T, 32, 128], k [T, 8, 128], int64 positions in [0, 131072),
# fp32 cache [131072, 128], NeoX.
REFERENCE_TOKENS = (1, 8, 64, 512, 4096, 16384, 65536)
DECODE_TOKENS = (1, 32, 512)
GRAPH_CALLS = 20          # calls per captured graph (SPEC §4 decode)
HOST_LOOP = 300           # calls per host-time loop (SPEC §4 host overhead)

# SPEC §4 targets, carried into reports so a reader sees pass / miss beside each number.
DECODE_TARGET_US = {1: 1.5, 32: 1.6, 512: 3.2}
HOST_TARGET_US = 8.0

# Largest error against the float32 reference before a run is flagged: a wrong layout gives O(1).
CHECK_TOLERANCE = {"bfloat16": 0.125, "float16": 0.02, "float32": 2e-3}

# Every implementation, by key. "copy" is the SM copy of the bytes of q + k.
CUPYROPE_IMPLS = (
    "cupyrope-cache", "cupyrope-cache-inplace",
    "cupyrope-computed", "cupyrope-computed-inplace",
    "cupyrope-tables", "cupyrope-tables-inplace",
)
PEER_IMPLS = (
    "torch-eager-hf", "torch-compile-hf", "liger-inplace",
    "flashinfer-cache", "flashinfer-cache-inplace", "flashinfer-computed",
)
ALL_IMPLS = ("copy",) + CUPYROPE_IMPLS + PEER_IMPLS
# The reference sweep (SPEC §4 table): cupyrope cache out of place / in place, computed angles,
# per-token tables; then every peer that imports.
SWEEP_IMPLS = ("cupyrope-cache", "cupyrope-cache-inplace", "cupyrope-computed", "cupyrope-tables") + PEER_IMPLS

_TORCH_DTYPES = ("float16", "bfloat16", "float32")
_MAX_PRIME_US = 50_000.0   # never hold the stream longer than this before a batch


class Unavailable(RuntimeError):
    """An implementation that cannot run here (not installed, or not for this shape)."""


def _require_cuda():
    if torch is None:
        raise RuntimeError("cupyrope.benchmarking needs torch (with CUDA) to measure anything")
    if not torch.cuda.is_available():
        raise RuntimeError("cupyrope.benchmarking needs a CUDA GPU: torch.cuda.is_available() is False")
    return torch


def torch_dtype(name: str):
    """The torch dtype named ``name`` (``float16``, ``bfloat16`` or ``float32``)."""
    if name not in _TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {_TORCH_DTYPES}, got {name!r}")
    return getattr(torch, name)


def device_name() -> str:
    """The CUDA device's marketing name, e.g. ``NVIDIA H100 80GB HBM3``; ``"no GPU"`` without one."""
    if torch is None or not torch.cuda.is_available():
        return "no GPU"
    return torch.cuda.get_device_name()


def l2_cache_bytes() -> int:
    """L2 size of the current device (50 MB on H100, 60 MB assumed when torch cannot tell)."""
    try:
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size)
    except Exception:
        return 60 * 2**20


def input_sets_for(bytes_per_set: int, *, l2_bytes: int | None = None, factor: float = 2.0,
                   max_sets: int = 16384) -> int:
    """How many input sets to rotate among so that a set has left L2 before its next use.

    ``factor`` x L2 of other data passes between two uses of a set; one set when a single set is
    already that large. Capped at ``max_sets`` (T = 1 needs ~10^4 sets of 10 KB).
    """
    l2 = l2_cache_bytes() if l2_bytes is None else l2_bytes
    return max(1, min(max_sets, math.ceil(factor * l2 / max(1, bytes_per_set))))


# --------------------------------------------------------------------------------------------
# Clocks
# --------------------------------------------------------------------------------------------

_sleep_cycles_per_us: float | None = None


def _calibrate_sleep() -> float:
    """Clock cycles per microsecond of ``torch.cuda._sleep`` (measured, so any clock rate works)."""
    cycles = 2_000_000
    rate = 0.0
    for _ in range(2):  # the first run loads the kernel and may run at idle clocks
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        rate = max(rate, cycles / max(1e-3, start.elapsed_time(end) * 1e3))
    return rate


def gpu_sleep_us(us: float) -> None:
    """Hold the current stream for about ``us`` microseconds (no-op where torch lacks ``_sleep``)."""
    global _sleep_cycles_per_us
    if us <= 0 or not hasattr(torch.cuda, "_sleep"):
        return
    if _sleep_cycles_per_us is None:
        _sleep_cycles_per_us = _calibrate_sleep()
    torch.cuda._sleep(int(min(us, _MAX_PRIME_US) * _sleep_cycles_per_us))


class _GpuReading:
    """A CUDA event recorded on the current stream; ``later - earlier`` is GPU seconds."""

    __slots__ = ("event", "divisor")

    def __init__(self, event, divisor: int):
        self.event, self.divisor = event, divisor

    def __sub__(self, earlier: "_GpuReading") -> float:
        self.event.synchronize()
        return earlier.event.elapsed_time(self.event) * 1e-3 / self.divisor


class GpuClock:
    """A clock whose readings subtract to GPU seconds: a timer for pytest-benchmark.

    pytest-benchmark's runner reads ``start = timer()``, calls the target ``iterations`` times, reads
    ``end = timer()`` and records ``(end - start) / iterations``. With this clock each reading
    records a CUDA event, and ``end - start`` synchronises on the end event and returns the GPU time
    between the two events, so the statistics pytest-benchmark reports are GPU time per call.

    Readings alternate start / end. Before each start reading the clock enqueues a spin kernel of
    ``prime_us`` (see :func:`plan_batches`) so that the whole batch is queued before the GPU reaches
    it. ``divisor`` divides each reading (20 for a replay of a graph of 20 calls).
    """

    __name__ = "cuda_event_clock"  # what pytest-benchmark prints as the timer's name

    def __init__(self):
        self.prime_us = 0.0
        self.divisor = 1
        self._next_is_start = True

    def configure(self, *, prime_us: float = 0.0, divisor: int = 1) -> "GpuClock":
        self.prime_us, self.divisor, self._next_is_start = float(prime_us), int(divisor), True
        return self

    def __call__(self) -> _GpuReading:
        if self._next_is_start:
            gpu_sleep_us(self.prime_us)
        self._next_is_start = not self._next_is_start
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return _GpuReading(event, self.divisor)

    def __repr__(self):
        return f"GpuClock(prime_us={self.prime_us:.0f}, divisor={self.divisor})"


GPU_CLOCK = GpuClock()  # the one clock the pytest suite hands to pytest-benchmark


def synced_wall_clock() -> float:
    """``time.perf_counter()`` after a device synchronise: a host-time timer for pytest-benchmark.

    Around a loop of N eager calls it gives (N calls + one synchronise) / N, as SPEC §4 asks.
    """
    torch.cuda.synchronize()
    return time.perf_counter()



@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """How :func:`gpu_time_us` (and the pytest suite) batch calls between two events."""

    calls: int        # calls per timed batch
    prime_us: float   # spin before each batch: covers the host time to enqueue the batch
    host_us: float    # estimated host (enqueue) time per call
    gpu_us: float     # estimated GPU time per call


def _prime_for(host_us: float, calls: int) -> float:
    return min(_MAX_PRIME_US, 1.5 * host_us * calls + 20.0)


def plan_batches(step: Callable[[], object], *, warmup: int = 3, target_batch_us: float = 500.0,
                 max_calls: int = 200) -> BatchPlan:
    """Warm ``step`` up (compiles, allocator), then size batches of about ``target_batch_us``."""
    _require_cuda()
    for _ in range(max(1, warmup)):
        step()
    torch.cuda.synchronize()
    probe = 5
    t0 = time.perf_counter()
    for _ in range(probe):
        step()
    host_us = (time.perf_counter() - t0) / probe * 1e6  # enqueue time: no synchronise inside
    torch.cuda.synchronize()
    clock = GpuClock().configure(prime_us=_prime_for(host_us, probe))
    start = clock()
    for _ in range(probe):
        step()
    gpu_us = (clock() - start) / probe * 1e6
    calls = int(min(max_calls, max(1, math.ceil(target_batch_us / max(gpu_us, 1e-3)))))
    return BatchPlan(calls=calls, prime_us=_prime_for(host_us, calls), host_us=host_us, gpu_us=gpu_us)


def round_robin(fn: Callable, rotate_inputs: Sequence[tuple] | None) -> Callable[[], object]:
    """A no-argument step calling ``fn(*args)`` with the argument sets in turn (or ``fn()``)."""
    if rotate_inputs is None:
        return fn
    sets = list(rotate_inputs)
    if not sets:
        raise ValueError("rotate_inputs is empty")
    if len(sets) == 1:
        only = sets[0]
        return lambda: fn(*only)
    cycle = itertools.cycle(sets)
    return lambda: fn(*next(cycle))


def gpu_time_us(fn: Callable, *, rotate_inputs: Sequence[tuple] | None = None, warmup: int = 3,
                repeats: int = 10, target_batch_us: float = 500.0, max_calls: int = 200) -> float:
    """Median GPU time per call of ``fn``, in microseconds.

    Parameters
    ----------
    fn : callable
        ``fn(*args)`` for each ``args`` of ``rotate_inputs``, or ``fn()`` when it is None.
    rotate_inputs : sequence of tuples, optional
        Argument sets used round-robin; give enough (:func:`input_sets_for`) that data which
        would fit in L2 is read from DRAM on every call.
    warmup : int
        Untimed calls first (compilation, allocator, clocks).
    repeats : int
        Timed batches; the result is their median.
    target_batch_us, max_calls : float, int
        Each batch holds enough back-to-back calls to last about ``target_batch_us`` of GPU time.
    """
    step = round_robin(fn, rotate_inputs)
    plan = plan_batches(step, warmup=warmup, target_batch_us=target_batch_us, max_calls=max_calls)
    clock = GpuClock().configure(prime_us=plan.prime_us)
    samples = []
    for _ in range(max(1, repeats)):
        start = clock()
        for _ in range(plan.calls):
            step()
        samples.append((clock() - start) / plan.calls * 1e6)
    return statistics.median(samples)


class CapturedCalls:
    """A CUDA graph of ``n`` back-to-back calls of ``fn`` (argument sets in turn); ``replay()``.

    Holds the argument tensors and the graph (and so its memory pool) alive.
    """

    def __init__(self, fn: Callable, *, rotate_inputs: Sequence[tuple] | None = None,
                 n: int = GRAPH_CALLS, warmup: int = 3):
        _require_cuda()
        sets = [()] if rotate_inputs is None else list(rotate_inputs)
        self.n, self.args = n, [sets[i % len(sets)] for i in range(n)]
        # Warm up on a side stream (compiles, lazy uploads, allocator) as torch's graph docs ask.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(1, warmup)):
                for args in self.args:
                    fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for args in self.args:
                fn(*args)
        torch.cuda.synchronize()

    def replay(self) -> None:
        self.graph.replay()


def capture_graph(fn: Callable, *, rotate_inputs: Sequence[tuple] | None = None,
                  n: int = GRAPH_CALLS, warmup: int = 3) -> CapturedCalls:
    """Capture ``n`` back-to-back calls of ``fn`` in one CUDA graph (see :class:`CapturedCalls`)."""
    return CapturedCalls(fn, rotate_inputs=rotate_inputs, n=n, warmup=warmup)


def graph_time_us(fn: Callable, n: int = GRAPH_CALLS, *, rotate_inputs: Sequence[tuple] | None = None,
                  warmup: int = 3, repeats: int = 10) -> float:
    """GPU time per call from a CUDA graph of ``n`` back-to-back calls (decode, SPEC §4).

    The graph is captured after warm-up, replayed in timed batches between CUDA events, and the
    median time per replay is divided by ``n``.
    """
    captured = capture_graph(fn, rotate_inputs=rotate_inputs, n=n, warmup=warmup)
    return gpu_time_us(captured.replay, warmup=warmup, repeats=repeats) / n


def host_time_us(fn: Callable, n: int = HOST_LOOP, *, args: tuple = (), warmup: int = 10,
                 repeats: int = 5) -> float:
    """Wall time per eager call: ``n`` calls then ONE ``torch.cuda.synchronize()``, divided by ``n``.

    The median of ``repeats`` such loops, after ``warmup`` calls and a synchronise.
    """
    _require_cuda()
    for _ in range(max(1, warmup)):
        fn(*args)
    torch.cuda.synchronize()
    samples = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        for _ in range(n):
            fn(*args)
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(samples)


# --------------------------------------------------------------------------------------------
# Data and workloads
# --------------------------------------------------------------------------------------------

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

    An SM kernel (not ``cudaMemcpy``, which is slower in graphs, SPEC §4); it moves
    ``2 * nbytes`` (read + write). Rotates among enough (src, dst) pairs to read from DRAM.
    """
    numel = max(1, nbytes // 2)
    n = num_sets or input_sets_for(2 * numel)
    src = torch.randn((n, numel), device=device, dtype=torch.bfloat16)
    dst = torch.empty((n, numel), device=device, dtype=torch.bfloat16)

    def copy(a, b):
        return torch.mul(a, 1, out=b)

    return Workload("copy", copy, list(zip(src.unbind(0), dst.unbind(0))), 2 * numel * 2)


# ---- peers ----------------------------------------------------------------------------------

def rotate_half(x):
    """Hugging Face ``rotate_half``: ``[x1, x2] -> [-x2, x1]`` on the last dim."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_rope(q, k, positions, cos_sin_cache):
    """The Hugging Face formulation (NeoX), out of place: cos/sin gathered from the cache.

    q ``[T, Hq, D]``, k ``[T, Hk, D]``, positions ``[T]``, cos_sin_cache ``[P, rotary_dim]``
    (first half cos, second half sin); dims past rotary_dim pass through.
    """
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)           # [T, rotary_dim / 2]
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(-2).to(q.dtype)  # [T, 1, rotary_dim], HF layout
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(-2).to(q.dtype)

    def rotate(x):
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        out = x_rot * cos + rotate_half(x_rot) * sin
        return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out

    return rotate(q), rotate(k)


@functools.lru_cache(maxsize=1)
def compiled_hf_rope():
    """``torch.compile(hf_rope)``, mode default, ``dynamic=False`` (one graph per shape)."""
    # Every benchmarked shape is a recompilation; past the default limit (8) dynamo would fall back
    # to eager without a word and the "torch.compile" numbers would be eager ones.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
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
        if source == "cache":
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
        else:
            raise ValueError(f"unknown implementation {impl!r}")
        return Workload(impl, fn, sets, data.bytes_moved(source))

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


# ---- agreement check ------------------------------------------------------------------------

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
    ref_q = reference_rope(q, data.positions[0], data.cache, interleaved=data.shape.interleaved)
    ref_k = reference_rope(k, data.positions[0], data.cache, interleaved=data.shape.interleaved)
    out = workload.fn(q, k, *args[2:])
    errors = []
    for got, ref in ((out[0], ref_q), (out[1], ref_k)):
        diff = (got.reshape(ref.shape).float() - ref).abs()
        errors.append(float("inf") if bool(torch.isnan(diff).any()) else float(diff.max()))
    return max(errors)


def error_is_acceptable(error: float | None, dtype: str) -> bool:
    return error is None or error <= CHECK_TOLERANCE[dtype]


# --------------------------------------------------------------------------------------------
# The reference sweep and its reports
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Row:
    """One measurement of the sweep: GPU time per call, GB/s of minimum bytes, % of the SM copy."""

    impl: str
    tokens: int
    us: float
    gbps: float
    pct_of_copy: float
    max_abs_err: float | None = None


class _Progress:
    """tqdm when it imports, else a line per step on stderr."""

    def __init__(self, total: int, enabled: bool):
        self._bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm

                self._bar = tqdm(total=total, unit="case", dynamic_ncols=True)
            except ImportError:
                pass

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_description(text)

    def update(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def reference_sweep(tokens: Sequence[int] = REFERENCE_TOKENS, *, impls: Sequence[str] | None = None,
                    warmup: int = 3, repeats: int = 10, check: bool = True, progress: bool = True,
                    failures: list[str] | None = None) -> list[Row]:
    """Measure the SPEC §4 reference shape over ``tokens`` for the SM copy, cupyrope and the peers.

    Parameters
    ----------
    tokens : sequence of int
        Values of T (default 1, 8, 64, 512, 4096, 16384, 65536).
    impls : sequence of str, optional
        Keys from :data:`ALL_IMPLS`; default :data:`SWEEP_IMPLS` (cupyrope cache out of place and
        in place, computed angles, per-token tables; then every peer). The SM copy always runs.
    check : bool
        Before timing, compare one call against a float32 reference (``max_abs_err`` in the row).
    failures : list, optional
        Receives a line (with the traceback) for each cupyrope or copy case that raised; the sweep
        goes on without it, so one failure does not cost the other measurements. A peer that
        raises is left out with a note.

    Returns
    -------
    list of Row
        ``(impl, tokens, us, gbps, pct_of_copy, max_abs_err)``, copy first for each T.
    """
    _require_cuda()
    wanted = list(SWEEP_IMPLS if impls is None else impls)
    status = peer_status()
    bar = _Progress(total=len(tokens) * (1 + len(wanted)), enabled=progress)
    for impl in wanted:
        if status.get(impl):
            bar.write(f"skipping {impl}: {status[impl]}")
    runnable = ["copy"] + [i for i in wanted if i != "copy" and not status.get(i)]
    rows: list[Row] = []
    try:
        for t in tokens:
            shape = RopeShape(tokens=t)
            data = RopeData(shape)
            copy_us = None
            for impl in runnable:
                bar.describe(f"T={t} {impl}")
                try:
                    work = make_workload(impl, data)
                    error = max_abs_error(work, data) if check and impl != "copy" else None
                    us = gpu_time_us(work.fn, rotate_inputs=work.arg_sets, warmup=warmup, repeats=repeats)
                except Unavailable as exc:
                    bar.write(f"T={t} {impl}: skipped ({exc})")
                    continue
                except Exception as exc:
                    if impl == "copy" or impl.startswith("cupyrope"):
                        line = f"T={t} {impl}: FAILED\n{traceback.format_exc()}"
                        bar.write(line)
                        if failures is not None:
                            failures.append(line)
                    else:
                        bar.write(f"T={t} {impl}: failed, left out ({type(exc).__name__}: {exc})")
                    continue
                finally:
                    bar.update()
                if impl == "copy":
                    copy_us = us
                if not error_is_acceptable(error, shape.dtype):
                    bar.write(f"T={t} {impl}: max abs error {error:.3g} > {CHECK_TOLERANCE[shape.dtype]}")
                pct = 100.0 * copy_us / us if copy_us else float("nan")
                rows.append(Row(impl, t, us, work.bytes_moved / us / 1e3, pct, error))
            del data
            torch.cuda.empty_cache()
    finally:
        bar.close()
    return rows


def _today() -> str:
    return datetime.date.today().isoformat()


def format_table(rows: Sequence[Row], gpu_name: str | None = None) -> str:
    """Markdown: one line per (T, impl) with µs, GB/s, % of the SM copy; then a % pivot by T."""
    name = gpu_name or device_name()
    lines = [
        f"RoPE reference shape (bf16 q [T,32,128], k [T,8,128], int64 positions < 131072, "
        f"fp32 cache [131072,128], NeoX) on {name}, {_today()}",
        "",
        "| impl | T | µs | GB/s | % of SM copy | max abs err |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        err = "" if r.max_abs_err is None else f"{r.max_abs_err:.3g}"
        lines.append(f"| {r.impl} | {r.tokens} | {r.us:.2f} | {r.gbps:.0f} | {r.pct_of_copy:.1f} | {err} |")
    tokens = sorted({r.tokens for r in rows})
    impls = list(dict.fromkeys(r.impl for r in rows))
    by_key = {(r.impl, r.tokens): r for r in rows}
    lines += ["", "% of SM copy (copy time / impl time):", "",
              "| impl | " + " | ".join(f"T={t}" for t in tokens) + " |",
              "|---|" + "---:|" * len(tokens)]
    for impl in impls:
        cells = [f"{by_key[(impl, t)].pct_of_copy:.1f}" if (impl, t) in by_key else "" for t in tokens]
        lines.append(f"| {impl} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: Sequence[Row], path: str, *, gpu_name: str | None = None) -> str:
    """Bandwidth (GB/s of minimum bytes) against tokens, log x, one line per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name = gpu_name or device_name()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for impl in dict.fromkeys(r.impl for r in rows):
        points = sorted((r.tokens, r.gbps) for r in rows if r.impl == impl)
        style = dict(color="black", linestyle="--") if impl == "copy" else {}
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=impl, **style)
    ax.set_xscale("log", base=2)
    ticks = sorted({r.tokens for r in rows})
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.set_xlabel("tokens T")
    ax.set_ylabel("GB/s (q, k in + out, positions, cos/sin rows)")
    ax.set_title(f"RoPE bf16 q[T,32,128] k[T,8,128], fp32 cache, NeoX — {name}, {_today()}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def environment() -> dict:
    """GPU, L2 and library versions, for the records."""
    info = {"gpu": device_name(), "date": _today(), "python": sys.version.split()[0]}
    if torch is not None:
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["l2_bytes"] = l2_cache_bytes()
    for module in ("cupy", "triton", "liger_kernel", "flashinfer"):
        try:
            info[module] = getattr(__import__(module), "__version__", "?")
        except Exception:
            pass
    return info


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m cupyrope.benchmarking",
         default_out: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=(
        "Reference sweep (bf16 q [T,32,128], k [T,8,128], fp32 cache, NeoX): cupyrope against an "
        "SM copy of the same bytes and the peers installed; prints the table and writes it with a "
        "bandwidth plot."))
    parser.add_argument("--tokens", type=int, nargs="+", default=list(REFERENCE_TOKENS))
    parser.add_argument("--impls", nargs="+", default=None, choices=[i for i in ALL_IMPLS if i != "copy"],
                        help="implementations besides the SM copy (default: the SPEC §4 set and every peer)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-check", action="store_true", help="skip the agreement check before timing")
    parser.add_argument("--out", default=default_out, help="folder for reference_sweep.{md,json,png}")
    args = parser.parse_args(argv)

    failures: list[str] = []
    rows = reference_sweep(args.tokens, impls=args.impls, repeats=args.repeats, check=not args.no_check,
                           failures=failures)
    name = device_name()
    table = format_table(rows, name)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "reference_sweep.md"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(args.out, "reference_sweep.json"), "w") as f:
            json.dump({"environment": environment(), "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
        try:
            print("plot:", plot(rows, os.path.join(args.out, "reference_sweep.png"), gpu_name=name))
        except ImportError as exc:
            print(f"no plot: {exc}", file=sys.stderr)
    if failures:
        print(f"{len(failures)} cupyrope / copy case(s) failed:", *failures, sep="\n", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
