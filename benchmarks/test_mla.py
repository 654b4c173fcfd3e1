"""``mla_rope_and_cache`` (DeepSeek-V3 MLA: q rotated and stored as fp8, the latent cache row
written, one launch) against an SM copy of the bytes it reads and writes and against
``torch.compile`` of the unfused torch sequence.

DeepSeek-V3 shapes: q ``[T, 16, 128 + 64]`` bf16 (16 heads a GPU at TP 8), k_pe ``[T, 64]``,
kv_c ``[T, 512]``, fp32 ``cos_sin_cache [4096, 64]``, GPT-J pairing; q out fp8 e4m3 (scale 0.5),
the cache ``[T / 16, 16, 576]`` bf16 (``bf16`` rows) or fp8 e4m3 with scale 0.25 (``fp8``
rows), slot t = t (every row written once a call). Implementations:

- ``copy``: one SM copy of every byte the op must move: q read and written (fp8) once, k_pe and
  kv_c read, the cache row written, the position, slot and fp32 table row of each token read;
- ``cupyrope-mla``: :func:`cupyrope.mla_rope_and_cache` (which also returns the rotated k_pe,
  fp8 like q);
- ``unfused-compile``: ``torch.compile`` of the sequence a user writes today (rotate the rope
  parts in float32, quantise q whole, concatenate and scatter the cache rows).

T = 4096, 16384, 65536: GPU time per eager call, input sets rotating so that every call reads
DRAM. T = 1, 32, 512: GPU time per call in a CUDA graph of 20 calls (decode).
"""

from __future__ import annotations

import pytest

from cupyrope import bench as bm

pytestmark = pytest.mark.benchmark(timer=bm.GPU_CLOCK)

H, NOPE, ROPE, RANK, BLOCK_SIZE = 16, 128, 64, 512, 16
MAX_POSITION = 4096
Q_SCALE, KV_SCALE = 0.5, 0.25
CACHES = ("bf16", "fp8")
IMPLS = ("copy", "cupyrope-mla", "unfused-compile")
LARGE = (4096, 16384, 65536)
SMALL = (1, 32, 512)


class MlaData:
    """Sets of (q, k_pe, kv_c, positions, kv_cache, slots) for T tokens, one shared table."""

    def __init__(self, tokens: int, cache: str, num_sets: int | None = None,
                 device: str = "cuda"):
        import torch

        import cupyrope as cr

        self.tokens, self.cache = tokens, cache
        cache_itemsize = 1 if cache == "fp8" else 2
        per_set = tokens * (H * (NOPE + ROPE) * 3 + (ROPE + RANK) * (2 + cache_itemsize))
        n = num_sets or bm.input_sets_for(per_set)
        g = torch.Generator(device=device).manual_seed(0)
        blocks = -(-tokens // BLOCK_SIZE)
        cache_dtype = torch.float8_e4m3fn if cache == "fp8" else torch.bfloat16
        bf16 = dict(device=device, dtype=torch.bfloat16, generator=g)
        self.sets = [(torch.randn(tokens, H, NOPE + ROPE, **bf16),
                      torch.randn(tokens, ROPE, **bf16),
                      torch.randn(tokens, RANK, **bf16),
                      torch.randint(0, MAX_POSITION, (tokens,), device=device, generator=g),
                      torch.zeros(blocks, BLOCK_SIZE, RANK + ROPE, device=device,
                                  dtype=cache_dtype),
                      torch.arange(tokens, device=device)) for _ in range(n)]
        self.table = cr.cos_sin_cache(MAX_POSITION, ROPE, dtype="float32", like=self.sets[0][0])
        self.cache_itemsize = cache_itemsize

    def bytes_moved(self) -> int:
        """Every byte the op must read and write once."""
        q = H * (NOPE + ROPE) * (2 + 1)  # bf16 in, fp8 out
        return self.tokens * (q + (ROPE + RANK) * (2 + self.cache_itemsize) + ROPE  # fp8 k_pe
                              + 8 + 8 + ROPE * 4)

    def arg_sets(self) -> list[tuple]:
        return [(*s, self.table) for s in self.sets]


def unfused(q, k_pe, kv_c, positions, kv_cache, slots, table):
    """The sequence a user writes today: GPT-J rotation of the rope parts in float32, q (and the
    rotated k_pe) quantised, the rotated k_pe concatenated with kv_c and scattered into the
    cache."""
    import torch

    cos_sin = table.index_select(0, positions)
    cos, sin = cos_sin[:, None, :ROPE // 2], cos_sin[:, None, ROPE // 2:]

    def rotate(x):  # [T, heads, ROPE], pairs (2j, 2j + 1)
        x = x.float().unflatten(-1, (ROPE // 2, 2))
        x1, x2 = x[..., 0], x[..., 1]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)

    q_rot = torch.cat((q[..., :NOPE].float(), rotate(q[..., NOPE:])), dim=-1)
    q8 = (q_rot * (1.0 / Q_SCALE)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    k_rot = rotate(k_pe[:, None, :])[:, 0]
    rows = torch.cat((kv_c.float(), k_rot), dim=-1)
    if kv_cache.dtype == torch.float8_e4m3fn:
        rows = (rows * (1.0 / KV_SCALE)).clamp(-448.0, 448.0)
    stored = kv_cache.view(torch.uint8) if kv_cache.dtype == torch.float8_e4m3fn else kv_cache
    stored.view(-1, RANK + ROPE).index_copy_(0, slots, rows.to(kv_cache.dtype).view(stored.dtype))
    return q8, k_rot.clamp(-448.0, 448.0).to(torch.float8_e4m3fn), kv_cache


def workload(impl: str, data: MlaData) -> bm.Workload:
    import cupyrope as cr

    fp8_cache = {"kv_scale": KV_SCALE} if data.cache == "fp8" else {}
    if impl == "copy":
        return bm.sm_copy(data.bytes_moved() // 2, num_sets=len(data.sets))
    if impl == "cupyrope-mla":
        def fn(q, k_pe, kv_c, positions, kv_cache, slots, table):
            return cr.mla_rope_and_cache(q, k_pe, kv_c, positions, kv_cache, slots,
                                         cos_sin_cache=table, out_dtype="float8_e4m3fn",
                                         q_scale=Q_SCALE, **fp8_cache)
    elif impl == "unfused-compile":
        fn = bm.cases.compile_unfused(unfused)
    else:
        raise ValueError(f"unknown implementation {impl!r}; known: {IMPLS}")
    return bm.Workload(impl, fn, data.arg_sets(), data.bytes_moved())


_DATA = bm.cases.LatestData(MlaData)  # one shape at a time


def _group(kind: str, tokens: int, cache: str) -> str:
    return (f"mla_rope_and_cache {kind}: q [{tokens}, {H}, {NOPE}+{ROPE}] bf16 -> fp8, "
            f"{cache} cache [{-(-tokens // BLOCK_SIZE)}, {BLOCK_SIZE}, {RANK + ROPE}]")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tokens", LARGE)
@pytest.mark.parametrize("cache", CACHES)
def test_mla_bandwidth(rope_bench, cache, tokens, impl):
    data = _DATA.get(tokens, cache)
    rope_bench.workload(_group("eager", tokens, cache), bm.RopeShape(tokens=tokens), impl,
                        lambda: workload(impl, data), lambda: workload("copy", data))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tokens", SMALL)
@pytest.mark.parametrize("cache", CACHES)
def test_mla_graph(rope_bench, cache, tokens, impl):
    data = _DATA.get(tokens, cache, bm.GRAPH_CALLS)
    rope_bench.workload(_group(f"CUDA graph of {bm.GRAPH_CALLS} calls", tokens, cache),
                        bm.RopeShape(tokens=tokens), impl, lambda: workload(impl, data),
                        lambda: workload("copy", data), graph=True)
