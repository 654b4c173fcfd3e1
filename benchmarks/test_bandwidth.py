"""Bandwidth: GPU time per eager call against the SM copy of the same bytes, in one run (contract §4).

One pytest-benchmark group per shape, the SM copy first in each (``pct_of_copy`` in extra_info):

- the reference shape (bf16 q [T, 32, 128], k [T, 8, 128], fp32 cache [131072, 128], NeoX) for
  T = 1 ... 65536: cupyrope with each angle source (cache, computed, per-token tables), out of place
  and in place, and the peers (torch eager / torch.compile of the Hugging Face formulation, Liger,
  FlashInfer) where installed;
- interleaved (GPT-J) pairing at T = 16384 and 65536;
- head_dim 64, 80, 96, 256 at T = 16384 (bf16, cache; 128 is the reference group);
- rotary_dim = head_dim / 2 at T = 16384 and 65536;
- float16 and float32 q / k at T = 16384 and 65536.

The reported time is GPU time per call (``GPU_CLOCK``, see conftest.py); inputs rotate so that every
call reads DRAM.
"""

from __future__ import annotations

import pytest

from cupyrope import bench as bm

pytestmark = pytest.mark.benchmark(timer=bm.GPU_CLOCK)

LARGE_TOKENS = (16384, 65536)
REFERENCE_IMPLS = ("copy",) + bm.CUPYROPE_IMPLS + bm.PEER_IMPLS
SOURCES_OUT_OF_PLACE = ("cupyrope-cache", "cupyrope-computed", "cupyrope-tables")


def _case(shape: bm.RopeShape, impl: str):
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[shape.dtype]
    name = f"{short}-T{shape.tokens}-D{shape.head_dim}"
    name += "-interleaved" if shape.interleaved else ""
    name += f"-rot{shape.rot}" if shape.rot != shape.head_dim else ""
    return pytest.param(shape, impl, id=f"{name}-{impl}")


def _cases():
    cases = []
    # The reference shape, every implementation.
    for tokens in bm.REFERENCE_TOKENS:
        shape = bm.RopeShape(tokens=tokens)
        cases += [_case(shape, impl) for impl in REFERENCE_IMPLS]
    # GPT-J pairing.
    for tokens in LARGE_TOKENS:
        shape = bm.RopeShape(tokens=tokens, interleaved=True)
        impls = ("copy",) + SOURCES_OUT_OF_PLACE + ("cupyrope-cache-inplace", "flashinfer-cache")
        cases += [_case(shape, impl) for impl in impls]
    # Head dims, at one T with the cache.
    for head_dim in (64, 80, 96, 256):
        shape = bm.RopeShape(tokens=16384, head_dim=head_dim)
        cases += [_case(shape, impl) for impl in ("copy", "cupyrope-cache", "cupyrope-cache-inplace")]
    # Partial rotary.
    for tokens in LARGE_TOKENS:
        shape = bm.RopeShape(tokens=tokens, rotary_dim=64)
        cases += [_case(shape, impl) for impl in ("copy",) + SOURCES_OUT_OF_PLACE]
    # Other dtypes.
    for dtype in ("float16", "float32"):
        for tokens in LARGE_TOKENS:
            shape = bm.RopeShape(tokens=tokens, dtype=dtype)
            impls = ("copy",) + SOURCES_OUT_OF_PLACE + ("cupyrope-cache-inplace",)
            cases += [_case(shape, impl) for impl in impls]
    return cases


@pytest.mark.parametrize("shape, impl", _cases())
def test_bandwidth(rope_bench, shape, impl):
    rope_bench.bandwidth(shape, impl)
