"""Clocks for GPU and host time: what pytest-benchmark and the sweep measure with.

- :func:`gpu_time_us`: median GPU time per call, from CUDA events around batches of back-to-back
  calls. Before each batch a ``torch.cuda._sleep`` spin kernel holds the stream for as long as the
  host needs to enqueue the batch, so the calls run back to back on the GPU and the events measure
  GPU time, not launch overhead (a host-bound batch would otherwise time the Python loop).
- :data:`GPU_CLOCK`: the same measurement as a pytest-benchmark timer (:class:`GpuClock`).
- :func:`graph_time_us`: GPU time per call from a CUDA graph of 20 back-to-back calls (decode).
- :func:`host_time_us`: wall time per eager call, a loop of 300 calls then one synchronise
  (``torch.utils.benchmark.Timer``, whose timer synchronises the GPU before each reading).
- :func:`input_sets_for`: how many input sets to rotate among so that every call reads DRAM.

These are what the well-kept timers lack: ``triton.testing.do_bench`` and
``cupyx.profiler.benchmark`` time each call on its own (with an L2 flush or a host round trip
between calls), not a queue of back-to-back calls; ``triton.testing.do_bench_cudagraph`` captures
as many calls of one argument-less function as fit its time budget, not a graph of 20 calls over
20 input sets. Host time is timed by ``torch.utils.benchmark``.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
import statistics
import time
from typing import Callable, Sequence

try:  # optional: the package must import (e.g. inside the wheel's tests) without torch
    import torch
except ImportError:  # pragma: no cover - exercised only without torch
    torch = None

GRAPH_CALLS = 20          # calls per captured graph (decode)
HOST_LOOP = 300           # calls per host-time loop (host overhead)
_MAX_PRIME_US = 50_000.0   # never hold the stream longer than this before a batch


def require_cuda():
    """torch, or a RuntimeError saying what is missing to measure on a GPU."""
    if torch is None:
        raise RuntimeError("cupyrope.bench needs torch (with CUDA) to measure anything")
    if not torch.cuda.is_available():
        raise RuntimeError("cupyrope.bench needs a CUDA GPU: torch.cuda.is_available() is False")
    return torch


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

    Around a loop of N eager calls it gives (N calls + one synchronise) / N (contract §4).
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
    require_cuda()
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
        require_cuda()
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
        # thread_local: a CUDA call another thread of the process makes meanwhile (JAX's runtime
        # threads, once a JAX benchmark has run in the same process) must not invalidate the
        # capture, as it can in the default global mode; this thread's own calls are still checked.
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
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
    """GPU time per call from a CUDA graph of ``n`` back-to-back calls (decode, contract §4).

    The graph is captured after warm-up, replayed in timed batches between CUDA events, and the
    median time per replay is divided by ``n``.
    """
    captured = capture_graph(fn, rotate_inputs=rotate_inputs, n=n, warmup=warmup)
    return gpu_time_us(captured.replay, warmup=warmup, repeats=repeats) / n


def host_time_us(fn: Callable, n: int = HOST_LOOP, *, args: tuple = (), warmup: int = 10,
                 repeats: int = 5) -> float:
    """Wall time per eager call: ``n`` calls then ONE ``torch.cuda.synchronize()``, divided by ``n``.

    The median of ``repeats`` such loops, after ``warmup`` calls, through
    ``torch.utils.benchmark.Timer``: its timer synchronises the GPU before each reading, so a block
    of ``n`` calls is timed from one synchronise to the next.
    """
    require_cuda()
    from torch.utils import benchmark

    for _ in range(max(1, warmup)):
        fn(*args)
    torch.cuda.synchronize()
    # The loop runs as an eager caller's would: timeit turns the garbage collector off for the
    # block (the setup turns it back on, the idiom timeit's documentation gives) and the Timer
    # would run torch on one thread unless told the caller's thread count.
    timer = benchmark.Timer(stmt="fn(*args)", setup="gc.enable()",
                            globals={"fn": fn, "args": args, "gc": gc},
                            num_threads=torch.get_num_threads())
    samples = [timer.timeit(n).median * 1e6 for _ in range(max(1, repeats))]
    return statistics.median(samples)
