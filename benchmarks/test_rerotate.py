"""``rerotate_cache`` (re-rotating cached keys in place) against an SM copy of the bytes it reads
and writes and against ``torch.compile`` of the unfused torch sequence (gather the slots' rows,
rotate them by the cos/sin rows of their deltas, scatter them back).

Paged k cache ``[N / 16, 16, 8, 128]`` (NHD, block_size 16), every slot re-rotated once per call
(slots a permutation of the cache's, deltas random), NeoX. Per cache format (bf16; fp8 e4m3 with
a scale) and implementation:

- ``copy``: one SM copy of every byte the op must move: each row read and written once, the slot
  and delta (int64) and the fp32 table row of each slot read;
- ``cupyrope-cache`` (fp32 ``cos_sin_cache [131072, 128]``, row = delta) and
  ``cupyrope-computed`` (angles computed in the kernel);
- ``unfused-compile``: ``torch.compile`` of the gather / rotate / scatter sequence with the table.

N = 4096, 16384, 65536: GPU time per eager call, sets of (cache, slots, deltas) rotating so that
every call reads DRAM. N = 32 and 512: GPU time per call in a CUDA graph of 20 calls. N = 32,
``test_rerotate_host_time``: host time per eager call (300 calls, one synchronise) against the
copy's, a repeat call replaying its launch (``recipes.rerotate_key``).
"""

from __future__ import annotations

import pytest

from cupyrope import bench as bm

pytestmark = pytest.mark.benchmark(timer=bm.GPU_CLOCK)

HK, D, BLOCK_SIZE = 8, 128, 16
MAX_POSITION = 131072
FP8_SCALE = 0.25
FORMATS = ("bfloat16", "float8_e4m3fn")
FP8_NAMES = ("float8_e4m3fn",)
IMPLS = ("copy", "cupyrope-cache", "cupyrope-computed", "unfused-compile")
LARGE = (4096, 16384, 65536)
SMALL = (32, 512)


class RerotateData:
    """Sets of (k_cache, slots, delta) for N slots, one shared fp32 cos_sin_cache."""

    def __init__(self, slots: int, fmt: str, num_sets: int | None = None, device: str = "cuda"):
        import torch

        import cupyrope as cr

        self.slots_per_call, self.fmt = slots, fmt
        itemsize = 1 if fmt in FP8_NAMES else 2
        per_set = 2 * slots * HK * D * itemsize
        n = num_sets or bm.input_sets_for(per_set)
        g = torch.Generator(device=device).manual_seed(0)
        blocks = -(-slots // BLOCK_SIZE)
        dtype = getattr(torch, fmt)
        self.caches = [(torch.randn(blocks, BLOCK_SIZE, HK, D, device=device, generator=g)
                        / (FP8_SCALE if fmt in FP8_NAMES else 1.0)).to(dtype) for _ in range(n)]
        self.slots = [torch.randperm(blocks * BLOCK_SIZE, device=device, generator=g)[:slots]
                      for _ in range(n)]
        self.deltas = [torch.randint(0, MAX_POSITION, (slots,), device=device, generator=g)
                       for _ in range(n)]
        self.table = cr.cos_sin_cache(MAX_POSITION, D, theta=500000.0, dtype="float32",
                                      like=self.caches[0])
        self.itemsize = itemsize

    def bytes_moved(self) -> int:
        """Every byte the op must read and write once: the rows, slots, deltas, table rows."""
        return self.slots_per_call * (2 * HK * D * self.itemsize + 8 + 8 + D * 4)

    def arg_sets(self) -> list[tuple]:
        return [(c, s, d, self.table) for c, s, d in zip(self.caches, self.slots, self.deltas)]


def unfused(k_cache, slots, delta, table):
    """The sequence a user writes today: gather, rotate (NeoX) in float32, scatter."""
    import torch

    fp8 = k_cache.dtype == torch.float8_e4m3fn
    stored = k_cache.view(torch.uint8) if fp8 else k_cache  # fp8 rows move as bytes
    rows = stored.view(-1, HK, D).index_select(0, slots)
    rows = rows.view(k_cache.dtype).float() * FP8_SCALE if fp8 else rows.float()
    cos_sin = table.index_select(0, delta)[:, None, :]
    cos, sin = cos_sin[..., :D // 2], cos_sin[..., D // 2:]
    x1, x2 = rows[..., :D // 2], rows[..., D // 2:]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if fp8:
        rotated = (rotated * (1.0 / FP8_SCALE)).clamp(-448.0, 448.0).to(k_cache.dtype)
    stored.view(-1, HK, D).index_copy_(0, slots, rotated.to(k_cache.dtype).view(stored.dtype))
    return k_cache


def workload(impl: str, data: RerotateData) -> bm.Workload:
    import cupyrope as cr

    fp8 = {"k_scale": FP8_SCALE} if data.fmt in FP8_NAMES else {}
    if impl == "copy":
        return bm.sm_copy(data.bytes_moved() // 2, num_sets=len(data.caches))
    if impl == "cupyrope-cache":
        def fn(cache, slots, delta, table):
            return cr.rerotate_cache(cache, slots, delta, cos_sin_cache=table, **fp8)
    elif impl == "cupyrope-computed":
        def fn(cache, slots, delta, table):
            return cr.rerotate_cache(cache, slots, delta, theta=500000.0, **fp8)
    elif impl == "unfused-compile":
        fn = bm.cases.compile_unfused(unfused)
    else:
        raise ValueError(f"unknown implementation {impl!r}; known: {IMPLS}")
    return bm.Workload(impl, fn, data.arg_sets(), data.bytes_moved())


_DATA = bm.cases.LatestData(RerotateData)  # one shape at a time


def _group(kind: str, slots: int, fmt: str) -> str:
    return (f"rerotate_cache {kind}: {fmt} cache [{-(-slots // BLOCK_SIZE)}, {BLOCK_SIZE}, {HK}, "
            f"{D}], N={slots} slots")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("slots", LARGE)
@pytest.mark.parametrize("fmt", FORMATS)
def test_rerotate_bandwidth(rope_bench, fmt, slots, impl):
    data = _DATA.get(slots, fmt)
    rope_bench.workload(_group("eager", slots, fmt), bm.RopeShape(tokens=slots), impl,
                        lambda: workload(impl, data), lambda: workload("copy", data))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("slots", SMALL)
@pytest.mark.parametrize("fmt", FORMATS)
def test_rerotate_graph(rope_bench, fmt, slots, impl):
    data = _DATA.get(slots, fmt, bm.GRAPH_CALLS)
    rope_bench.workload(_group(f"CUDA graph of {bm.GRAPH_CALLS} calls", slots, fmt),
                        bm.RopeShape(tokens=slots), impl, lambda: workload(impl, data),
                        lambda: workload("copy", data), graph=True)


@pytest.mark.benchmark(timer=bm.synced_wall_clock)
@pytest.mark.parametrize("impl", IMPLS[:3])
@pytest.mark.parametrize("fmt", FORMATS)
def test_rerotate_host_time(rope_bench, fmt, impl):
    data = _DATA.get(SMALL[0], fmt, bm.GRAPH_CALLS)
    rope_bench.host_workload(_group(f"host time (loop of {bm.HOST_LOOP})", SMALL[0], fmt),
                             bm.RopeShape(tokens=SMALL[0]), impl, lambda: workload(impl, data),
                             lambda: workload("copy", data))
