"""Shapes beyond the reference one: apply_rope over head_dim and GQA ratio (``--shapes``), and the
fused serving ops on the heads of served models (``--serving``: M-RoPE, head_dim 256 / 512,
partial rotary, speculative-decoding batches), each against an SM copy of its bytes and
torch.compile of the unfused sequence in the same run. ``benchmarks/test_bandwidth.py`` and
``benchmarks/test_serving.py`` time one T of each; the sweeps here time them all."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .cases import measure
from .clocks import GRAPH_CALLS, require_cuda
from .fused import BLOCK_SIZE, GRAPH_MAX_TOKENS, FusedData, HeadLayout, make_fused_workload
from .progress import Progress
from .workloads import RopeData, RopeShape, Workload, make_workload, sm_copy

# ---- apply_rope over head shapes ---------------------------------------------------------------

HEAD_DIMS = (64, 80, 96, 256)
GQA_RATIOS = (1, 4, 8)  # num_q_heads / num_k_heads
SHAPE_Q_HEADS = 32
SHAPE_IMPLS = ("copy", "cupyrope-cache", "cupyrope-cache-inplace", "torch-compile-hf",
               "liger-inplace")
MAX_TOKENS = 65536
MAX_TRAFFIC = 2**30  # bytes of q and k read and written: T is halved from 65536 down to this


def bandwidth_tokens(num_q_heads: int, num_k_heads: int, head_dim: int, itemsize: int = 2) -> int:
    """T of a bandwidth row: 65536, halved while q and k traffic (read + write) exceeds 1 GiB
    (large heads); every head shape here keeps at least 256 MiB, far beyond L2."""
    per_token = 2 * (num_q_heads + num_k_heads) * head_dim * itemsize
    tokens = MAX_TOKENS
    while tokens > 1 and tokens * per_token > MAX_TRAFFIC:
        tokens //= 2
    return tokens


def head_shapes(head_dims: Sequence[int] = HEAD_DIMS,
                gqa_ratios: Sequence[int] = GQA_RATIOS) -> list[RopeShape]:
    """bf16 q ``[T, 32, D]``, k ``[T, 32 / ratio, D]``, fp32 cache, NeoX, T from
    :func:`bandwidth_tokens`."""
    shapes = []
    for head_dim in head_dims:
        for ratio in gqa_ratios:
            hk = SHAPE_Q_HEADS // ratio
            shapes.append(RopeShape(tokens=bandwidth_tokens(SHAPE_Q_HEADS, hk, head_dim),
                                    num_q_heads=SHAPE_Q_HEADS, num_k_heads=hk, head_dim=head_dim))
    return shapes


# Tensor-parallel shards of served models' heads, q / k heads a GPU: a GQA-8 model of 64 / 8 heads
# over 8 GPUs, one of 32 / 8 over 4 and over 8. Few heads a token: the launch's other regime.
SHARD_HEADS = ((8, 1), (8, 2), (4, 1))
SHARD_HEAD_DIMS = (80, 96, 128)


def shard_shapes(head_dims: Sequence[int] = SHARD_HEAD_DIMS,
                 heads: Sequence[tuple[int, int]] = SHARD_HEADS) -> list[RopeShape]:
    """bf16 q ``[T, Hq, D]``, k ``[T, Hk, D]`` of :data:`SHARD_HEADS`, fp32 cache, NeoX, T from
    :func:`bandwidth_tokens`."""
    return [RopeShape(tokens=bandwidth_tokens(hq, hk, head_dim), num_q_heads=hq, num_k_heads=hk,
                      head_dim=head_dim)
            for head_dim in head_dims for hq, hk in heads]


@dataclasses.dataclass(frozen=True)
class ShapeRow:
    """One apply_rope measurement of a head shape: GPU time per eager call, GB/s, % of SM copy."""

    head_dim: int
    num_q_heads: int
    num_k_heads: int
    tokens: int
    impl: str
    us: float
    gbps: float
    pct_of_copy: float


def shapes_sweep(shapes: Sequence[RopeShape] | None = None, *, impls: Sequence[str] = SHAPE_IMPLS,
                 repeats: int = 10, progress: bool = True,
                 failures: list[str] | None = None) -> list[ShapeRow]:
    """apply_rope from a cache, out of place and in place, on each head shape against its SM copy,
    torch.compile of the Hugging Face formulation and Liger (where installed); inputs rotate so
    that every call reads DRAM."""
    torch = require_cuda()
    shapes = list(head_shapes() + shard_shapes() if shapes is None else shapes)
    order = ("copy",) + tuple(i for i in impls if i != "copy")
    rows: list[ShapeRow] = []
    with Progress(len(shapes) * len(order), enabled=progress) as bar:
        for shape in shapes:
            data = RopeData(shape)
            copy_us = None
            for impl in order:
                done = measure(bar, f"{shape.label()} {impl}", impl,
                               lambda: make_workload(impl, data), graph=False, repeats=repeats,
                               failures=failures)
                if done is None:
                    continue
                work, us = done
                copy_us = us if impl == "copy" else copy_us
                rows.append(ShapeRow(shape.head_dim, shape.num_q_heads, shape.num_k_heads,
                                     shape.tokens, impl, us, work.bytes_moved / us / 1e3,
                                     100.0 * copy_us / us if copy_us else float("nan")))
            del data
            torch.cuda.empty_cache()
    return rows


def _times(rows, key):
    return {(key(r), r.impl): r.us for r in rows}


def _ratio(times, case, impl, ours) -> str:
    other = times.get((case, impl))
    return f"{other / ours:.2f}x" if other else "-"


def format_shapes_table(rows: Sequence[ShapeRow], gpu_name: str) -> str:
    """Markdown: a summary line per head shape (cupyrope's % of copy out of place and in place,
    its speed-up over torch.compile and Liger), then every row."""
    from tabulate import tabulate

    def shape_of(r):
        return (r.head_dim, r.num_q_heads, r.num_k_heads, r.tokens)

    times = _times(rows, shape_of)
    pct = {(shape_of(r), r.impl): r.pct_of_copy for r in rows}
    summary = []
    for case in dict.fromkeys(shape_of(r) for r in rows):
        ours = times.get((case, "cupyrope-cache"))
        if ours is None:
            continue
        d, hq, hk, t = case
        inplace = pct.get((case, "cupyrope-cache-inplace"))
        summary.append([d, f"{hq}/{hk}", t, f"{pct[(case, 'cupyrope-cache')]:.1f}",
                        "-" if inplace is None else f"{inplace:.1f}",
                        _ratio(times, case, "torch-compile-hf", ours),
                        _ratio(times, case, "liger-inplace", ours)])
    header = (f"apply_rope over head shapes (bf16 q [T,32,D], k [T,32/GQA,D], and tensor-parallel "
              f"shards of q / k 8/1, 8/2, 4/1 heads; fp32 cache, NeoX; T = 65536 or less for at "
              f"most 1 GiB of traffic) on {gpu_name}")
    return "\n".join([
        header, "",
        tabulate(summary, headers=["D", "Hq/Hk", "T", "% of SM copy", "in place: % of SM copy",
                                   "vs torch.compile", "vs Liger"],
                 tablefmt="pipe", disable_numparse=True), "",
        tabulate([[r.head_dim, f"{r.num_q_heads}/{r.num_k_heads}", r.tokens, r.impl,
                   f"{r.us:.2f}", f"{r.gbps:.0f}", f"{r.pct_of_copy:.1f}"] for r in rows],
                 headers=["D", "Hq/Hk", "T", "impl", "µs", "GB/s", "% of SM copy"],
                 tablefmt="pipe", disable_numparse=True)])


# ---- the fused serving ops on served models' heads -------------------------------------------

# name -> heads; the reference heads (32 / 8 / 128) unless the model's matter. head_dim 256 and
# 512 keep the reference's q elements per token. mrope: Qwen2-VL; mrope-interleaved: Qwen3-VL.
SERVING_LAYOUTS = {
    "mrope": HeadLayout(mrope_section=(16, 24, 24)),  # Qwen2-VL
    "mrope-interleaved": HeadLayout(mrope_section=(24, 20, 20), mrope_interleaved=True),
    "d256": HeadLayout(num_q_heads=16, num_k_heads=4, head_dim=256),
    "d512": HeadLayout(num_q_heads=8, num_k_heads=2, head_dim=512),
    # rotary_dim = D / 4 as Qwen3-Next, D / 2 as GLM
    "rot-quarter": HeadLayout(num_q_heads=16, num_k_heads=2, head_dim=256, rotary_dim=64),
    "rot-half": HeadLayout(num_q_heads=32, num_k_heads=2, head_dim=128, rotary_dim=64),
    "spec-decode": HeadLayout(draft_tokens=4),  # 64 sequences x 4 draft tokens
    # OLMo 2 7B: 32 heads of q and of k, norms over the whole projections
    "olmo2": HeadLayout(num_q_heads=32, num_k_heads=32, norm_over="all_heads"),
}
SERVING_OPS = ("rms_norm_rope", "rope_and_cache")
SERVING_IMPLS = ("copy", "cupyrope-fused", "unfused-compile")
SERVING_TOKENS = (4096, 16384, 65536)
SPEC_DECODE_SEQUENCES = 64


def serving_tokens(name: str, tokens: Sequence[int] = SERVING_TOKENS) -> tuple[int, ...]:
    """The T of a serving layout: ``tokens``, or one decode step's for speculative decoding."""
    layout = SERVING_LAYOUTS[name]
    if layout.draft_tokens:
        return (SPEC_DECODE_SEQUENCES * layout.draft_tokens,)
    return tuple(tokens)


def serving_data(name: str, tokens: int, *, device: str = "cuda") -> FusedData:
    """The data of a serving layout at T; graph rows (T <= 512) rotate among 20 sets."""
    num_sets = GRAPH_CALLS if tokens <= GRAPH_MAX_TOKENS and device != "cpu" else None
    return FusedData(tokens, num_sets, device=device, layout=SERVING_LAYOUTS[name])


def serving_workload(op: str, impl: str, data: FusedData) -> Workload:
    """``impl`` of ``op`` on ``data``; the copy rotates among as many sets as the data (so a graph
    of 20 calls reads DRAM as the op's does)."""
    if impl == "copy":
        return sm_copy(data.bytes_moved(op) // 2, num_sets=len(data.q), device=data.device)
    return make_fused_workload(op, impl, data)


def serving_group(op: str, name: str, data: FusedData) -> str:
    """The pytest-benchmark group of a serving row."""
    lay = data.layout
    kind = (f"CUDA graph of {GRAPH_CALLS} calls" if data.tokens <= GRAPH_MAX_TOKENS
            else "eager")
    return (f"serving {op} {name} ({kind}): {data.shape.label()}{lay.label()}, "
            f"v [T, {lay.num_k_heads}, {lay.head_dim}], paged cache bf16 block {BLOCK_SIZE}")


@dataclasses.dataclass(frozen=True)
class ServingRow:
    """One fused-op measurement of a serving layout (GPU time per call; per call in a CUDA graph of
    20 calls at T <= 512)."""

    layout: str
    op: str
    impl: str
    tokens: int
    us: float
    gbps: float
    pct_of_copy: float


def serving_sweep(tokens: Sequence[int] = SERVING_TOKENS, *, layouts: Sequence[str] | None = None,
                  ops: Sequence[str] = SERVING_OPS, impls: Sequence[str] = SERVING_IMPLS,
                  repeats: int = 10, progress: bool = True,
                  failures: list[str] | None = None) -> list[ServingRow]:
    """Each serving layout's ops over its T (:func:`serving_tokens`) for the SM copy, the fused op
    and torch.compile of the unfused sequence."""
    torch = require_cuda()
    names = list(SERVING_LAYOUTS if layouts is None else layouts)
    order = ("copy",) + tuple(i for i in impls if i != "copy")
    cases = sum(len(serving_tokens(n, tokens)) for n in names) * len(ops) * len(order)
    rows: list[ServingRow] = []
    with Progress(cases, enabled=progress) as bar:
        for name in names:
            for t in serving_tokens(name, tokens):
                data = serving_data(name, t)
                for op in ops:
                    copy_us = None
                    for impl in order:
                        done = measure(bar, f"{name} T={t} {op} {impl}", impl,
                                       lambda: serving_workload(op, impl, data),
                                       graph=t <= GRAPH_MAX_TOKENS, repeats=repeats,
                                       failures=failures)
                        if done is None:
                            continue
                        work, us = done
                        copy_us = us if impl == "copy" else copy_us
                        rows.append(ServingRow(name, op, impl, t, us, work.bytes_moved / us / 1e3,
                                               100.0 * copy_us / us if copy_us else float("nan")))
                del data
                torch.cuda.empty_cache()
    return rows


def format_serving_table(rows: Sequence[ServingRow], gpu_name: str) -> str:
    """Markdown: a summary line per (layout, op, T) with the fused op's % of its SM copy and its
    speed-up over torch.compile of the unfused sequence, then every row."""
    from tabulate import tabulate

    def case_of(r):
        return (r.layout, r.op, r.tokens)

    times = _times(rows, case_of)
    pct = {(case_of(r), r.impl): r.pct_of_copy for r in rows}
    summary = []
    for case in dict.fromkeys(case_of(r) for r in rows):
        ours = times.get((case, "cupyrope-fused"))
        if ours is None:
            continue
        name, op, t = case
        summary.append([name, op, t, f"{pct[(case, 'cupyrope-fused')]:.1f}",
                        _ratio(times, case, "unfused-compile", ours)])
    legend = "; ".join(f"{name}: {_describe(layout)}" for name, layout in SERVING_LAYOUTS.items())
    header = (f"Fused serving ops on served models' heads (bf16, fp32 cache, paged bf16 cache "
              f"block {BLOCK_SIZE}, NeoX; T <= 512 in CUDA graphs of {GRAPH_CALLS} calls) on "
              f"{gpu_name}. {legend}")
    return "\n".join([
        header, "",
        tabulate(summary, headers=["layout", "op", "T", "% of SM copy", "vs torch.compile"],
                 tablefmt="pipe", disable_numparse=True), "",
        tabulate([[r.layout, r.op, r.tokens, r.impl, f"{r.us:.2f}", f"{r.gbps:.0f}",
                   f"{r.pct_of_copy:.1f}"] for r in rows],
                 headers=["layout", "op", "T", "impl", "µs", "GB/s", "% of SM copy"],
                 tablefmt="pipe", disable_numparse=True)])


def _describe(layout: HeadLayout) -> str:
    text = f"q/k heads {layout.num_q_heads}/{layout.num_k_heads}, D={layout.head_dim}"
    if layout.rot != layout.head_dim:
        text += f", rotary_dim={layout.rot}"
    return text + layout.label()
