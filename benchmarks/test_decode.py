"""Decode (T = 1, 32, 512): GPU time per call inside a CUDA graph, and host time per eager call.

- ``test_decode_graph``: a CUDA graph of 20 back-to-back calls (on 20 different input sets),
  replayed between CUDA events; the clock divides by 20, so the time is GPU time per call
  (``bm.decode_target_ratio``: <= 1.15 / 1.15 / 1.05 x the SM copy of the same bytes at
  T = 1 / 32 / 512 from a cache or tables, <= 1.3 x computed).
- ``test_host_overhead``: wall time of 300 eager calls from torch tensors and one synchronise,
  divided by 300 (``bm.host_target_ratio``: <= 1.2 x ``torch.mul(src, 1, out=dst)`` on tensors
  of the same size in place and with out=, <= 1.5 x out of place).

The SM copy (the "copy" case: torch.mul) and the peers run in the same groups;
``ratio_to_copy``, ``target_ratio_to_copy`` and ``meets_target`` in extra_info (and the summary)
say whether cupyrope meets the contract's target.
"""

from __future__ import annotations

import pytest

from cupyrope import bench as bm

DECODE_IMPLS = (
    "copy", "cupyrope-cache", "cupyrope-cache-inplace", "cupyrope-cache-out", "cupyrope-computed",
    "cupyrope-tables",
) + bm.COMPAT_IMPLS + bm.PEER_IMPLS

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
