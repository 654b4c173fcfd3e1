"""Decode (T = 1, 32, 512): GPU time per call inside a CUDA graph, and host time per eager call.

- ``test_decode_graph``: a CUDA graph of 20 back-to-back calls (on 20 different input sets),
  replayed between CUDA events; the clock divides by 20, so the time is GPU time per call
  (``bm.DECODE_TARGET_US``: <= 1.5 / 1.6 / 3.2 µs at T = 1 / 32 / 512).
- ``test_host_overhead``: wall time of 300 eager calls from torch tensors and one synchronise,
  divided by 300 (contract §4: <= 8 µs).

The SM copy and the peers run in the same groups; ``spec_target_us`` / ``meets_target`` in
extra_info (and the summary) say whether cupyrope meets the contract's target.
"""

from __future__ import annotations

import pytest

from cupyrope import bench as bm

DECODE_IMPLS = (
    "copy", "cupyrope-cache", "cupyrope-cache-inplace", "cupyrope-cache-out", "cupyrope-computed",
    "cupyrope-tables",
) + bm.PEER_IMPLS

CASES = [pytest.param(tokens, impl, id=f"T{tokens}-{impl}")
         for tokens in bm.DECODE_TOKENS for impl in DECODE_IMPLS]


@pytest.mark.benchmark(timer=bm.GPU_CLOCK)
@pytest.mark.parametrize("tokens, impl", CASES)
def test_decode_graph(rope_bench, tokens, impl):
    rope_bench.graph(tokens, impl)


@pytest.mark.benchmark(timer=bm.synced_wall_clock)
@pytest.mark.parametrize("tokens, impl", CASES)
def test_host_overhead(rope_bench, tokens, impl):
    rope_bench.host(tokens, impl)
