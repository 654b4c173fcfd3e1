"""The fused serving ops on served models' heads against an SM copy of their bytes and
torch.compile of the unfused sequence, in one run (data and workloads: :mod:`cupyrope.bench.shapes`,
shared with ``python -m cupyrope bench --serving``, which sweeps T = 4096, 16384, 65536 and both
ops for every layout).

One T a row here: 16384 per eager call, inputs rotating so that every call reads DRAM; the
speculative-decoding batch (64 sequences x 4 draft tokens at consecutive positions after random
contexts, T = 256) per call in a CUDA graph of 20 calls. Layouts (``SERVING_LAYOUTS``):

- ``mrope``: Qwen2-VL M-RoPE, mrope_section [16, 24, 24], through rms_norm_rope and rope_and_cache;
- ``mrope-interleaved``: Qwen3-VL interleaved M-RoPE [24, 20, 20], through rope_and_cache;
- ``d256`` (q 16 / k 4 heads, rms_norm_rope) and ``d512`` (8 / 2 heads, rope_and_cache);
- ``rot-quarter``: rotary_dim = D / 4 (Qwen3-Next: D 256, 16 / 2 heads), rms_norm_rope;
- ``rot-half``: rotary_dim = D / 2 (GLM: D 128, 32 / 2 heads), rope_and_cache;
- ``spec-decode``: the reference heads, rope_and_cache;
- ``olmo2``: OLMo 2 7B's heads (q and k 32 of 128), rms_norm_rope with the norm over all heads.
"""

from __future__ import annotations

import pytest

from cupyrope import bench as bm
from cupyrope.bench.shapes import serving_data, serving_group, serving_tokens, serving_workload

pytestmark = pytest.mark.benchmark(timer=bm.GPU_CLOCK)

TOKENS = 16384
ROUNDS = 5
ROWS = (("mrope", "rms_norm_rope"), ("mrope", "rope_and_cache"),
        ("mrope-interleaved", "rope_and_cache"), ("d256", "rms_norm_rope"),
        ("d512", "rope_and_cache"), ("rot-quarter", "rms_norm_rope"),
        ("rot-half", "rope_and_cache"), ("spec-decode", "rope_and_cache"),
        ("olmo2", "rms_norm_rope"))
IMPLS = ("copy", "cupyrope-fused", "unfused-compile")


def _tokens(name: str) -> int:
    return serving_tokens(name, (TOKENS,))[0]


CASES = [pytest.param(name, op, impl, id=f"{name}-{op}-T{_tokens(name)}-{impl}")
         for name, op in ROWS for impl in IMPLS]

_DATA = bm.cases.LatestData(serving_data)  # one layout and T at a time


@pytest.mark.parametrize("name, op, impl", CASES)
def test_serving(rope_bench, name, op, impl):
    data = _DATA.get(name, _tokens(name))
    rope_bench.workload(serving_group(op, name, data), data.shape, impl,
                        lambda: serving_workload(op, impl, data),
                        lambda: serving_workload(op, "copy", data),
                        graph=data.tokens <= bm.shapes.GRAPH_MAX_TOKENS, rounds=ROUNDS)
