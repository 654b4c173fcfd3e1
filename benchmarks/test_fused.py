"""The fused serving ops against the unfused sequences a user writes today (contract §4, fused ops).

Data, workloads and the implementations compared (``copy``, ``cupyrope-fused``, ``unfused-eager``,
``unfused-compile``) are :mod:`cupyrope.bench.fused`'s, shared with ``python -m cupyrope bench
--fused``; one group per op and T, ``pct_of_copy`` against an SM copy of every byte the fused op
must read and write once.

T = 4096, 16384, 65536: GPU time per eager call, inputs rotating among enough sets that every call
reads DRAM (the unfused eager sequence for the first three ops only). Decode T = 1, 32, 512: GPU
time per call in a CUDA graph of 20 calls, fused op in place against ``apply_rope`` in place
(``plain-rope``, timed under rms_norm_rope) on the same q and k, and against torch.compile of the
unfused sequence; ``ratio_to_rope`` is the fused time over apply_rope's (target <= 1.3).
"""

from __future__ import annotations

import pytest

from cupyrope import bench as bm
from cupyrope.bench.fused import (BLOCK_SIZE, D, FUSED_OPS, FUSED_TOKENS, GRAPH_MAX_TOKENS, HK,
                                  FusedData, make_fused_workload)

pytestmark = pytest.mark.benchmark(timer=bm.GPU_CLOCK)

DECODE_TOKENS = tuple(t for t in FUSED_TOKENS if t <= GRAPH_MAX_TOKENS)
LARGE_TOKENS = tuple(t for t in FUSED_TOKENS if t > GRAPH_MAX_TOKENS)
EAGER_OPS = ("rms_norm_rope", "rope_and_cache", "fp8 out")  # the others: as rope_and_cache


def _id(op, tokens, impl):
    return f"{op.replace(' ', '_')}-T{tokens}-{impl}"


CASES = [pytest.param(op, tokens, impl, id=_id(op, tokens, impl))
         for op in FUSED_OPS for tokens in LARGE_TOKENS
         for impl in ("copy", "cupyrope-fused", "unfused-eager", "unfused-compile")
         if impl != "unfused-eager" or op in EAGER_OPS]
DECODE_CASES = [pytest.param(op, tokens, impl, id=_id(op, tokens, impl))
                for op in FUSED_OPS for tokens in DECODE_TOKENS
                for impl in ("plain-rope", "cupyrope-fused", "unfused-compile")
                if impl != "plain-rope" or op == "rms_norm_rope"]

_DATA = bm.cases.LatestData(FusedData)  # one (T, sets) at a time


@pytest.mark.parametrize("op, tokens, impl", CASES)
def test_fused_bandwidth(rope_bench, op, tokens, impl):
    data = _DATA.get(tokens)
    group = f"fused {op}: {data.shape.label()}, v [T, {HK}, {D}], paged cache bf16 block {BLOCK_SIZE}"
    rope_bench.workload(group, data.shape, impl, lambda: make_fused_workload(op, impl, data),
                        lambda: bm.sm_copy(data.bytes_moved(op) // 2))


_PLAIN_ROPE_US: dict[int, float] = {}  # apply_rope in place, by T


@pytest.mark.parametrize("op, tokens, impl", DECODE_CASES)
def test_fused_decode_graph(rope_bench, op, tokens, impl):
    data = _DATA.get(tokens, bm.GRAPH_CALLS)
    try:
        work = make_fused_workload(op, impl, data)
        captured = bm.capture_graph(work.fn, rotate_inputs=work.arg_sets)
    except bm.Unavailable as exc:
        pytest.skip(str(exc))
    except Exception as exc:
        if impl in ("plain-rope", "cupyrope-fused"):
            raise
        pytest.skip(f"{impl} failed in a CUDA graph: {type(exc).__name__}: {exc}")
    plan = bm.plan_batches(captured.replay)
    group = f"fused decode {op}, CUDA graph of {bm.GRAPH_CALLS} calls: {data.shape.label()}"
    benchmark = rope_bench.benchmark
    benchmark.group = group
    bm.GPU_CLOCK.configure(prime_us=plan.prime_us, divisor=bm.GRAPH_CALLS)
    benchmark.pedantic(captured.replay, rounds=10, iterations=plan.calls, warmup_rounds=1)
    us = rope_bench._median_us()
    if us is not None:
        if impl == "plain-rope":
            _PLAIN_ROPE_US[tokens] = us
        elif impl == "cupyrope-fused" and tokens in _PLAIN_ROPE_US:
            ratio = us / _PLAIN_ROPE_US[tokens]
            benchmark.extra_info["ratio_to_rope"] = round(ratio, 2)
    rope_bench._report(group, data.shape, impl, work, None, plan, copy=None)
