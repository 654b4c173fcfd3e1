"""Bandwidth: GPU time per eager call against the SM copy of the same bytes, in one run (contract §4).

One pytest-benchmark group per shape, the SM copy first in each (``pct_of_copy`` in extra_info):

- the reference shape (bf16 q [T, 32, 128], k [T, 8, 128], fp32 cache [131072, 128], NeoX) for
  T = 1 ... 65536: cupyrope with each angle source (cache, computed, per-token tables), out of place
  and in place, and the peers (torch eager / torch.compile of the Hugging Face formulation, Liger,
  FlashInfer) where installed;
- interleaved (GPT-J) pairing at T = 16384 and 65536;
- head_dim 64, 80, 96, 256 at T = 16384 (bf16, cache; 128 is the reference group);
- head_dim 64, 80, 96, 256 with GQA ratios 1, 4, 8 (32 q heads; 32, 8 or 4 k heads) at T = 65536,
  or less for large heads (at most 1 GiB of traffic: ``bm.shapes.bandwidth_tokens``), cache out of
  place and in place, and torch.compile of the Hugging Face formulation at GQA 4 (every ratio in
  ``python -m cupyrope bench --shapes``);
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
HEAD_SHAPE_ROUNDS = 5  # 63 rows of >= 100 MiB: few rounds keep them cheap
COMPILED_GQA = 4  # torch.compile costs a compile per shape: one ratio here, all in the sweep
REFERENCE_IMPLS = ("copy",) + bm.CUPYROPE_IMPLS + bm.PEER_IMPLS
SOURCES_OUT_OF_PLACE = ("cupyrope-cache", "cupyrope-computed", "cupyrope-tables")


def _case(shape: bm.RopeShape, impl: str):
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[shape.dtype]
    name = f"{short}-T{shape.tokens}-D{shape.head_dim}"
    name += "-interleaved" if shape.interleaved else ""
    name += f"-rot{shape.rot}" if shape.rot != shape.head_dim else ""
    if (shape.num_q_heads, shape.num_k_heads) != (32, 8):
        name += f"-Hq{shape.num_q_heads}-Hk{shape.num_k_heads}"
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
    head_dim_rows = ("copy", "cupyrope-cache", "cupyrope-cache-inplace")
    for head_dim in (64, 80, 96, 256):
        shape = bm.RopeShape(tokens=16384, head_dim=head_dim)
        cases += [_case(shape, impl) for impl in head_dim_rows]
    # Head dims by GQA ratio, at the bandwidth T (a shape the rows above have gets the rest).
    for shape in bm.shapes.head_shapes():
        impls = head_dim_rows + (("torch-compile-hf",) if shape.num_q_heads
                                 == COMPILED_GQA * shape.num_k_heads else ())
        done = shape.tokens == 16384 and shape.num_k_heads == 8
        cases += [_case(shape, impl) for impl in impls if not (done and impl in head_dim_rows)]
    # Tensor-parallel shards: few heads a token.
    for shape in bm.shapes.shard_shapes():
        cases += [_case(shape, impl) for impl in head_dim_rows]
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
    many = shape in bm.shapes.head_shapes() + bm.shapes.shard_shapes()
    rope_bench.bandwidth(shape, impl, **({"rounds": HEAD_SHAPE_ROUNDS} if many else {}))
