"""pytest-benchmark suite for cupyrope (docs/contract.md §4), reporting GPU time.

Run on a GPU machine from the repository root::

    python -m pytest benchmarks --benchmark-only -q
    python -m pytest benchmarks --benchmark-only -q --benchmark-json=bench.json   # keep the numbers

Without torch, CuPy and a CUDA GPU every benchmark is skipped.

How the reported time comes to be GPU time
------------------------------------------
pytest-benchmark times a target with a *timer* it reads before and after ``iterations`` calls,
records ``(end - start) / iterations`` per round, and its ``benchmark`` marker accepts that timer
per test (``@pytest.mark.benchmark(timer=...)``, a documented option). The bandwidth and graph
benchmarks pass :data:`cupyrope.bench.GPU_CLOCK`: each reading records a CUDA event on the
current stream, and ``end - start`` synchronises on the end event and returns the GPU time between
the events. So ``benchmark.pedantic(step, rounds=R, iterations=N)`` yields R samples of GPU time
per call, and the min / median / mean columns pytest-benchmark prints are GPU microseconds.

Before each start reading the clock enqueues a ``torch.cuda._sleep`` spin that lasts as long as the
host needs to enqueue the N calls (measured while warming up, :func:`~cupyrope.bench.plan_batches`):
the calls then run back to back on the GPU, and a launch-bound call (small T) is timed by its GPU
time, not by Python. N is chosen so that a round lasts ~0.5 ms of GPU time (at most 200 calls); the
inputs rotate round-robin among enough sets that every call reads DRAM, not L2.

- bandwidth benchmarks (``test_bandwidth.py``): GPU time per call;
- decode graph benchmarks (``test_decode.py``): one iteration is a replay of a CUDA graph of 20
  calls and the clock divides by 20, so the time is GPU time per call inside the graph;
- host-overhead benchmarks (``test_decode.py``): the timer is ``synced_wall_clock``
  (``torch.cuda.synchronize()`` then ``time.perf_counter()``), so one round is 300 eager calls plus
  one synchronise, divided by 300: host time per call.

``benchmark.extra_info`` holds GB/s (minimum bytes: q and k read and written once, positions and the
cos/sin rows read), ``pct_of_copy`` (SM copy time / this time, for the SM copy of the same bytes in
the same group) and ``max_abs_err`` against a float32 reference. ``benchmark.group`` is the shape.
A summary with those columns is printed at the end, with each cupyrope row's speed-up over
torch.compile (of the Hugging Face formulation or of the unfused sequence) and over Liger where
its group has them; set ``CUPYROPE_BENCH_REPORT=path.md`` to also
write it to a file. Peers (torch eager / torch.compile of the Hugging Face formulation, Liger,
FlashInfer) that are not installed, or that cannot take a shape, are skipped with the reason.
"""

from __future__ import annotations

import os
import warnings

import pytest

from cupyrope import bench as bm

ROUNDS = 10        # timed rounds per case: pytest-benchmark's statistics are over these
HOST_ROUNDS = 5    # rounds of 300 eager calls
REPORT_ENV = "CUPYROPE_BENCH_REPORT"
# Summary columns: a cupyrope row's speed-up over these implementations of its group.
SPEEDUP_OVER = {"× torch.compile": ("torch-compile-hf", "unfused-compile"),
                "× Liger": ("liger-inplace",)}

_BENCH_DIR = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))


def _gpu_missing_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "the benchmarks need torch"
    try:
        if not torch.cuda.is_available():
            return "the benchmarks need a CUDA GPU (torch.cuda.is_available() is False)"
    except Exception as exc:  # a broken driver counts as no GPU
        return f"the benchmarks need a CUDA GPU ({type(exc).__name__}: {exc})"
    try:
        import cupy

        if not cupy.is_available():
            return "the benchmarks need CuPy with a CUDA GPU (cupy.is_available() is False)"
    except Exception as exc:
        return f"the benchmarks need CuPy ({type(exc).__name__}: {exc})"
    return None


def pytest_collection_modifyitems(config, items):
    def in_benchmarks(item) -> bool:
        path = getattr(item, "path", None) or item.fspath  # item.path: pytest >= 7
        return os.path.realpath(str(path)).startswith(_BENCH_DIR + os.sep)

    ours = [item for item in items if in_benchmarks(item)]
    if not ours:
        return
    reason = _gpu_missing_reason()
    if reason:
        skip = pytest.mark.skip(reason=reason)
        for item in ours:
            item.add_marker(skip)


# ---- shared state: one shape's data at a time, copy times per group, the summary -------------

class _SharedData:
    """Keeps the data of the last shape only: cases of one shape are adjacent in every test list."""

    def __init__(self):
        self.key, self.data = None, None

    def get(self, shape: bm.RopeShape, num_sets: int | None = None) -> bm.RopeData:
        key = (shape, num_sets)
        if key != self.key:
            self.key, self.data = None, None  # free the previous shape before allocating
            self.data = bm.RopeData(shape, num_sets=num_sets)
            self.key = key
        return self.data


_DATA = _SharedData()
_COPY_US: dict[str, float] = {}
_RECORDS: list[dict] = []


def _is_ours(impl: str) -> bool:
    return impl == "copy" or impl.startswith("cupyrope")


def _guarded(impl: str, thunk):
    """Run ``thunk``; a peer that is unavailable or fails is skipped with the reason (ours raise)."""
    try:
        return thunk()
    except bm.Unavailable as exc:
        pytest.skip(str(exc))
    except Exception as exc:
        if _is_ours(impl):
            raise
        pytest.skip(f"{impl} failed on this shape: {type(exc).__name__}: {exc}")


class RopeBench:
    """Runs one case through ``benchmark.pedantic`` and fills ``extra_info`` (see module docstring)."""

    def __init__(self, benchmark):
        self.benchmark = benchmark

    # -- measurements --------------------------------------------------------------------------

    def bandwidth(self, shape: bm.RopeShape, impl: str, *, rounds: int = ROUNDS) -> None:
        """GPU time per eager call, inputs rotating so that each call reads DRAM."""
        data = _DATA.get(shape)
        work = _guarded(impl, lambda: bm.make_workload(impl, data))
        group = shape.label()
        error = None if impl == "copy" else _guarded(impl, lambda: bm.max_abs_error(work, data))
        step = work.step()
        plan = _guarded(impl, lambda: bm.plan_batches(step))
        self.benchmark.group = group
        bm.GPU_CLOCK.configure(prime_us=plan.prime_us)
        self.benchmark.pedantic(step, rounds=rounds, iterations=plan.calls, warmup_rounds=1)
        self._report(group, shape, impl, work, error, plan, copy=lambda: self._copy_eager(data))

    def graph(self, tokens: int, impl: str, *, rounds: int = ROUNDS) -> None:
        """GPU time per call inside a CUDA graph of 20 back-to-back calls (decode)."""
        shape = bm.RopeShape(tokens=tokens)
        data = _DATA.get(shape, num_sets=bm.GRAPH_CALLS)
        work = _guarded(impl, lambda: bm.make_workload(impl, data))
        group = f"decode, CUDA graph of {bm.GRAPH_CALLS} calls: {shape.label()}"
        error = None if impl == "copy" else _guarded(impl, lambda: bm.max_abs_error(work, data))
        captured = _guarded(impl, lambda: bm.capture_graph(work.fn, rotate_inputs=work.arg_sets))
        plan = _guarded(impl, lambda: bm.plan_batches(captured.replay))
        self.benchmark.group = group
        bm.GPU_CLOCK.configure(prime_us=plan.prime_us, divisor=bm.GRAPH_CALLS)
        self.benchmark.pedantic(captured.replay, rounds=rounds, iterations=plan.calls, warmup_rounds=1)
        self._report(group, shape, impl, work, error, plan,
                     target_ratio=bm.decode_target_ratio(tokens, impl),
                     copy=lambda: self._copy_graph(data))

    def host(self, tokens: int, impl: str, *, rounds: int = HOST_ROUNDS) -> None:
        """Host wall time per eager call: 300 calls, one synchronise (timer: synced_wall_clock)."""
        shape = bm.RopeShape(tokens=tokens)
        data = _DATA.get(shape, num_sets=bm.GRAPH_CALLS)
        group = f"host time per eager call (loop of {bm.HOST_LOOP}, one synchronise): T={tokens}"
        self.host_workload(group, shape, impl, lambda: bm.make_workload(impl, data),
                           lambda: bm.make_workload("copy", data), rounds=rounds,
                           target_ratio=bm.host_target_ratio(impl))

    def host_workload(self, group: str, shape: bm.RopeShape, impl: str, make, copy, *,
                      rounds: int = HOST_ROUNDS, target_ratio: float | None = None) -> None:
        """Host wall time per eager call of an op's workload ``make()`` on its first argument
        set (300 calls, one synchronise; timer: synced_wall_clock), against that of the copy
        workload ``copy()`` (``target_ratio``: the contract's bound on the ratio, if any)."""
        import torch

        work = _guarded(impl, make)
        args = work.arg_sets[0]

        def warm():
            for _ in range(3):
                work.fn(*args)
            torch.cuda.synchronize()

        def copy_host() -> float:
            reference = copy()
            return bm.host_time_us(reference.fn, args=reference.arg_sets[0])

        _guarded(impl, warm)
        self.benchmark.group = group
        self.benchmark.pedantic(work.fn, args=args, rounds=rounds, iterations=bm.HOST_LOOP,
                                warmup_rounds=1)
        self._report(group, shape, impl, work, None, None, target_ratio=target_ratio,
                     copy=copy_host, bandwidth=False)

    def workload(self, group: str, shape: bm.RopeShape, impl: str, make, copy, *,
                 graph: bool = False, rounds: int = ROUNDS) -> None:
        """An op's workload ``make()`` against the SM copy workload ``copy()`` of its bytes in
        ``group``: GPU time per eager call, inputs rotating, or per call in a CUDA graph of 20
        calls (``graph``). ``shape`` gives the summary its T and dtype."""
        work = _guarded(impl, make)
        if graph:
            captured = _guarded(impl, lambda: bm.capture_graph(work.fn, rotate_inputs=work.arg_sets))
            target, divisor = captured.replay, bm.GRAPH_CALLS
        else:
            target, divisor = work.step(), 1
        plan = _guarded(impl, lambda: bm.plan_batches(target))
        self.benchmark.group = group
        bm.GPU_CLOCK.configure(prime_us=plan.prime_us, divisor=divisor)
        self.benchmark.pedantic(target, rounds=rounds, iterations=plan.calls, warmup_rounds=1)
        self._report(group, shape, impl, work, None, plan,
                     copy=lambda: bm.cases.time_us(copy(), graph=graph))

    # -- reporting -----------------------------------------------------------------------------

    def _median_us(self) -> float | None:
        stats = getattr(self.benchmark, "stats", None)  # None under --benchmark-disable
        return None if stats is None else stats.stats.median * 1e6

    @staticmethod
    def _copy_eager(data: bm.RopeData) -> float:
        work = bm.make_workload("copy", data)
        return bm.gpu_time_us(work.fn, rotate_inputs=work.arg_sets)

    @staticmethod
    def _copy_graph(data: bm.RopeData) -> float:
        work = bm.make_workload("copy", data)
        return bm.graph_time_us(work.fn, rotate_inputs=work.arg_sets)

    def _report(self, group, shape, impl, work, error, plan, *, target_ratio=None, copy=None,
                bandwidth=True) -> None:
        us = self._median_us()
        if us is None:
            return
        info = self.benchmark.extra_info
        info.update(impl=impl, tokens=shape.tokens, dtype=shape.dtype, median_us=round(us, 3),
                    gpu=bm.device_name())
        if bandwidth:  # GPU time: GB/s of the minimum bytes
            info.update(gbps=round(work.bytes_moved / us / 1e3, 1), bytes_moved=work.bytes_moved)
        if plan is not None:
            info.update(calls_per_round=plan.calls, host_us_per_call=round(plan.host_us, 2))
        if copy is not None:
            if impl == "copy":
                _COPY_US[group] = us
            elif group not in _COPY_US:  # the copy case was deselected: measure it now
                _COPY_US[group] = copy()
            info["copy_us"] = round(_COPY_US[group], 3)
            info["pct_of_copy"] = round(100.0 * _COPY_US[group] / us, 1)
            info["ratio_to_copy"] = round(us / _COPY_US[group], 3)
        if error is not None:
            info["max_abs_err"] = error
            if not bm.error_is_acceptable(error, shape.dtype):
                warnings.warn(f"{impl} on {group}: max abs error {error:.3g} against the float32 "
                              f"reference exceeds {bm.CHECK_TOLERANCE[shape.dtype]}", stacklevel=2)
        if target_ratio is not None and "ratio_to_copy" in info:
            info["target_ratio_to_copy"] = target_ratio
            info["meets_target"] = info["ratio_to_copy"] <= target_ratio
        _RECORDS.append(dict(group=group, **info))


@pytest.fixture
def rope_bench(benchmark) -> RopeBench:
    return RopeBench(benchmark)


def _summary_lines() -> list[str]:
    from tabulate import tabulate

    # Per group, the peers each cupyrope row is a speed-up over (time of theirs / time of ours).
    peers = {}
    for r in _RECORDS:
        for column, impls in SPEEDUP_OVER.items():
            if r["impl"] in impls:
                peers[(r["group"], column)] = r["median_us"]

    def speedup(r, column):
        theirs = peers.get((r["group"], column))
        return "" if theirs is None or not r["impl"].startswith("cupyrope") else (
            f"{theirs / r['median_us']:.2f}×")

    rows = []
    for r in _RECORDS:
        err = r.get("max_abs_err")
        err_text = "" if err is None else f"{err:.3g}"
        if err is not None and not bm.error_is_acceptable(err, r["dtype"]):
            err_text += " (!)"
        pct, gbps = r.get("pct_of_copy"), r.get("gbps")
        target = r.get("target_ratio_to_copy")
        target_text = "" if target is None else (
            f"{r['ratio_to_copy']:.2f}× copy, ≤ {target}: {'met' if r['meets_target'] else 'MISSED'}")
        ratio = r.get("ratio_to_rope")  # fused decode cases (test_fused.py): target ≤ 1.3
        if ratio is not None:
            target_text = f"{ratio}× apply_rope, ≤ 1.3: {'met' if ratio <= 1.3 else 'MISSED'}"
        rows.append([r["group"], r["impl"], f"{r['median_us']:.2f}", "" if gbps is None else f"{gbps:.0f}",
                     "" if pct is None else f"{pct:.1f}", *(speedup(r, c) for c in SPEEDUP_OVER),
                     err_text, target_text])
    table = tabulate(rows, headers=["group", "impl", "µs", "GB/s", "% of SM copy", *SPEEDUP_OVER,
                                    "max abs err", "target"], tablefmt="pipe",
                     disable_numparse=True,
                     colalign=("left", "left", "right", "right", "right", "right", "right", "right",
                               "left"))
    return table.splitlines()


def pytest_terminal_summary(terminalreporter):
    if not _RECORDS:
        return
    lines = _summary_lines()
    terminalreporter.write_sep("=", f"cupyrope RoPE benchmarks on {bm.device_name()} (median GPU / host µs)")
    for line in lines:
        terminalreporter.write_line(line)
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "w") as f:
            f.write(f"# cupyrope RoPE benchmarks on {bm.device_name()}\n\n" + "\n".join(lines) + "\n")
        terminalreporter.write_line(f"summary written to {path}")
