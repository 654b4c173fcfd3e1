"""The fused serving ops against the unfused sequences a user writes today, and an SM copy of the
bytes each fused op must move: the data and workloads of ``benchmarks/test_fused.py`` and of
``python -m cupyrope bench --fused``.

Reference shape (bf16 q ``[T, 32, 128]``, k and v ``[T, 8, 128]``, int64 positions in
[0, 131072), fp32 cache, NeoX), norm weights bf16, paged KV caches bf16 ``[T / 16 + 8, 16, 8,
128]`` (NHD, block_size 16, blocks shuffled). Per op:

- ``rms_norm_rope``: ``cupyrope-fused`` (:func:`cupyrope.rms_norm_rope`), ``unfused-eager``
  (``torch.nn.functional.rms_norm`` of q and of k, then ``cupyrope.apply_rope``),
  ``unfused-compile`` (``torch.compile`` of RMSNorm + the Hugging Face RoPE formulation);
- ``rope_and_cache``: ``cupyrope-fused`` (:func:`cupyrope.rope_and_cache`), ``unfused-eager``
  (``apply_rope``, then ``index_copy_`` of k and of v into the caches' slot rows),
  ``unfused-compile`` (``torch.compile`` of the HF RoPE and the two cache stores);
- ``norm+rope+cache``: ``rope_and_cache`` with the norm weights, against RMSNorm, then the
  ``rope_and_cache`` sequences above;
- ``rope_and_cache HND`` / ``rope_and_cache fp8``: the cache write into ``[blocks, 8, 16, 128]``
  caches, or into float8_e4m3fn caches with a scale (the unfused sequence quantises before storing);
- ``fp8 out``: ``cupyrope-fused`` (``apply_rope(out_dtype="float8_e4m3fn")``), ``unfused-eager``
  (``apply_rope`` then ``(x / scale).clamp(...).to(fp8)``), ``unfused-compile``;
- ``plain-rope`` (under ``rms_norm_rope``, whose bytes it moves): ``apply_rope`` in place, the
  decode yardstick (a fused op's decode target is 1.3x it);
- ``copy``: one SM copy of every byte the fused op must read and write once.

T <= 512 (decode and small batches) is timed per call in a CUDA graph of 20 calls, in place where
the op allows it; larger T per eager call with inputs rotating so that every call reads DRAM.
A :class:`HeadLayout` gives the same ops other heads (head_dim, GQA, partial rotary, M-RoPE,
speculative-decoding batches: :mod:`.shapes`).
"""

from __future__ import annotations

import dataclasses
import functools
import traceback
from typing import Sequence

from .clocks import gpu_time_us, graph_time_us, input_sets_for, require_cuda
from .peers import Unavailable, compiled_hf_rope, hf_mrope, hf_rope, peer_status
from .progress import Progress
from .workloads import RopeShape, Workload, sm_copy

HQ, HK, D = 32, 8, 128
BLOCK_SIZE = 16
EPS = 1e-6
FP8_SCALE = 0.5
FUSED_OPS = ("rms_norm_rope", "rope_and_cache", "norm+rope+cache", "rope_and_cache HND",
             "rope_and_cache fp8", "fp8 out")
CACHE_OPS = ("rope_and_cache", "norm+rope+cache", "rope_and_cache HND", "rope_and_cache fp8")
FUSED_IMPLS = ("copy", "cupyrope-fused", "plain-rope", "unfused-eager", "unfused-compile")
FUSED_TOKENS = (1, 32, 512, 4096, 16384, 65536)
GRAPH_MAX_TOKENS = 512  # at most this many tokens: GPU time per call in a CUDA graph
DECODE_TARGET_RATIO = 1.3  # a fused op's decode time over apply_rope's in place, at most
MAX_POSITION = 131072


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """The heads of a fused-op benchmark: q ``[T, Hq, D]``, k and v ``[T, Hk, D]``, the first
    ``rotary_dim`` dims rotated (None: all), M-RoPE (``mrope_section``: positions ``[3, T]``,
    sectioned or interleaved), speculative-decoding batches (``draft_tokens`` > 0: T /
    draft_tokens sequences of that many consecutive positions and slots, each sequence at a random
    context length), and the norm over all heads (``norm_over="all_heads"``, OLMo 2: weights of
    H * D elements)."""

    num_q_heads: int = HQ
    num_k_heads: int = HK
    head_dim: int = D
    rotary_dim: int | None = None
    mrope_section: tuple[int, int, int] | None = None
    mrope_interleaved: bool = False
    draft_tokens: int = 0
    norm_over: str = "head"

    @property
    def rot(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def scaling(self) -> dict | None:
        """The ``scaling`` dict the fused calls take (M-RoPE's keys), or None."""
        if self.mrope_section is None:
            return None
        return {"mrope_section": list(self.mrope_section),
                "mrope_interleaved": self.mrope_interleaved}

    @property
    def position_components(self) -> int:
        return 1 if self.mrope_section is None else 3

    def rope(self):
        """The unfused formulation of the rotation: ``rope(q, k, positions, cos_sin_cache)``."""
        if self.mrope_section is None:
            return hf_rope
        return hf_mrope(tuple(self.mrope_section), self.mrope_interleaved)

    def label(self) -> str:
        """What the group names add to the reference shape's label, e.g. `` M-RoPE [16, 24, 24]``."""
        text = ""
        if self.mrope_section is not None:
            kind = "interleaved M-RoPE" if self.mrope_interleaved else "M-RoPE"
            text += f" {kind} {list(self.mrope_section)}"
        if self.draft_tokens:
            text += f", spec decode {self.draft_tokens} draft tokens a sequence"
        if self.norm_over == "all_heads":
            text += ", norm over all heads"
        return text


REFERENCE_LAYOUT = HeadLayout()


class FusedData:
    """Input sets of one T: q, k, v, positions and slot mappings per set; one cache table, one pair
    of norm weights, one pair of paged caches (every set writes other slots of them).
    ``device="cpu"`` builds the same data on the host (to check the plumbing without a GPU);
    ``layout`` the heads (the reference shape's by default)."""

    def __init__(self, tokens: int, num_sets: int | None = None, *, device: str = "cuda",
                 layout: HeadLayout = REFERENCE_LAYOUT):
        import torch

        import cupyrope as cr

        self.tokens = tokens
        self.device = device
        self.layout = lay = layout
        hq, hk, d = lay.num_q_heads, lay.num_k_heads, lay.head_dim
        self.shape = RopeShape(tokens=tokens, num_q_heads=hq, num_k_heads=hk, head_dim=d,
                               rotary_dim=lay.rotary_dim)
        per_set = 2 * tokens * (hq + 2 * hk) * d * 2  # q, k, v read and written once, bf16
        n = num_sets or (input_sets_for(per_set) if device != "cpu" else 2)
        g = torch.Generator(device=device).manual_seed(0)

        def randn(*shape):
            return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=g)

        self.q = [randn(tokens, hq, d) for _ in range(n)]
        self.k = [randn(tokens, hk, d) for _ in range(n)]
        self.v = [randn(tokens, hk, d) for _ in range(n)]
        self.positions = [self._positions(g) for _ in range(n)]
        self.cache = cr.cos_sin_cache(MAX_POSITION, lay.rot, dtype="float32", like=self.q[0])
        # per head: (D,); over all heads: one weight per element of the projection
        q_width, k_width = (hq * d, hk * d) if lay.norm_over == "all_heads" else (d, d)
        self.q_weight = torch.rand(q_width, device=device, generator=g).to(torch.bfloat16) + 0.5
        self.k_weight = torch.rand(k_width, device=device, generator=g).to(torch.bfloat16) + 0.5
        sequences = tokens // lay.draft_tokens if lay.draft_tokens else 0
        num_blocks = max(-(-tokens // BLOCK_SIZE), sequences) + 8
        self.k_cache = torch.zeros(num_blocks, BLOCK_SIZE, hk, d, device=device,
                                   dtype=torch.bfloat16)
        self.v_cache = torch.zeros_like(self.k_cache)
        self._num_blocks = num_blocks
        self._other_caches: dict[str, tuple] = {}  # HND and fp8, made when an op first asks
        if lay.draft_tokens:  # each sequence's draft tokens in consecutive slots of its own block
            draft = torch.arange(lay.draft_tokens, device=device)
            self.slots = [
                (torch.randperm(num_blocks, device=device, generator=g)[:sequences, None]
                 * BLOCK_SIZE + torch.randint(0, BLOCK_SIZE - lay.draft_tokens + 1,
                                              (sequences, 1), device=device, generator=g)
                 + draft).flatten().contiguous() for _ in range(n)]
        else:
            rows = torch.arange(BLOCK_SIZE, device=device)
            self.slots = [(torch.randperm(num_blocks, device=device, generator=g)[:, None]
                           * BLOCK_SIZE + rows).flatten()[:tokens].contiguous() for _ in range(n)]

    def _positions(self, g):
        """One set's positions: random ``[T]`` (or ``[3, T]`` for M-RoPE); for speculative
        decoding, each sequence's draft tokens at consecutive positions after a random context."""
        import torch

        lay, t, device = self.layout, self.tokens, self.device
        if lay.draft_tokens:
            if t % lay.draft_tokens or lay.draft_tokens > BLOCK_SIZE:
                raise ValueError(f"T={t} is not a whole number of sequences of "
                                 f"{lay.draft_tokens} <= {BLOCK_SIZE} draft tokens")
            context = torch.randint(0, MAX_POSITION - lay.draft_tokens,
                                    (t // lay.draft_tokens, 1), device=device, generator=g)
            return (context + torch.arange(lay.draft_tokens, device=device)).flatten()
        shape = (t,) if lay.mrope_section is None else (3, t)
        return torch.randint(0, MAX_POSITION, shape, device=device, generator=g)

    def caches(self, op: str) -> tuple:
        """(k_cache, v_cache) of a cache op: NHD bf16, HND bf16 or NHD float8_e4m3fn."""
        import torch

        if op in ("rope_and_cache", "norm+rope+cache"):
            return self.k_cache, self.v_cache
        if op not in self._other_caches:
            hk, d = self.layout.num_k_heads, self.layout.head_dim
            if op == "rope_and_cache HND":
                shape, dtype = (self._num_blocks, hk, BLOCK_SIZE, d), torch.bfloat16
            else:
                shape, dtype = (self._num_blocks, BLOCK_SIZE, hk, d), torch.float8_e4m3fn
            self._other_caches[op] = tuple(torch.zeros(shape, device=self.device, dtype=dtype)
                                           for _ in range(2))
        return self._other_caches[op]

    def bytes_moved(self, op: str) -> int:
        """Every byte the fused op must read and write once (positions and cos/sin rows too)."""
        lay = self.layout
        qk = self.tokens * (lay.num_q_heads + lay.num_k_heads) * lay.head_dim * 2
        # int64 positions (three for M-RoPE) and one fp32 cache row's worth per token (M-RoPE
        # reads each frequency from one of three rows)
        angles = self.tokens * (8 * lay.position_components + lay.rot * 4)
        if op == "rms_norm_rope":
            return 2 * qk + angles
        if op == "fp8 out":
            return qk + qk // 2 + angles
        kv = self.tokens * lay.num_k_heads * lay.head_dim * 2
        cache_rows = kv if op == "rope_and_cache fp8" else 2 * kv  # k and v rows, 1 or 2 bytes
        return 2 * qk + kv + cache_rows + angles + self.tokens * 8  # + v, cache rows, slots

    def arg_sets(self, op: str) -> list[tuple]:
        """The arguments of each set for ``op``'s workloads."""
        sets = []
        for i, (q, k, positions) in enumerate(zip(self.q, self.k, self.positions)):
            if op == "rms_norm_rope":
                sets.append((q, k, positions, self.cache, self.q_weight, self.k_weight))
            elif op == "fp8 out":
                sets.append((q, k, positions, self.cache))
            else:
                weights = (self.q_weight, self.k_weight) if op == "norm+rope+cache" else ()
                sets.append((q, k, self.v[i], positions, self.cache, self.slots[i],
                             *self.caches(op), *weights))
        return sets


def _rms_norm(x, weight):
    """RMSNorm over each head, or (weights of every element of the projection) over all heads of
    a token together, as OLMo 2 normalises its projections before splitting the heads."""
    import torch

    if weight.numel() == x.shape[-1]:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, EPS)
    flat = x.flatten(-2)
    return torch.nn.functional.rms_norm(flat, (flat.shape[-1],), weight, EPS).view(x.shape)


def _quantize(x):
    import torch

    return (x.float() / FP8_SCALE).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def unfused(op: str, rope):
    """The unfused sequence of ``op`` with ``rope(q, k, positions, cache) -> (q, k)``."""

    if op == "rms_norm_rope":
        def norm_rope(q, k, positions, cache, qw, kw):
            return rope(_rms_norm(q, qw), _rms_norm(k, kw), positions, cache)
        return norm_rope
    if op == "fp8 out":
        def rope_fp8(q, k, positions, cache):
            q_out, k_out = rope(q, k, positions, cache)
            return _quantize(q_out), _quantize(k_out)
        return rope_fp8

    if op == "norm+rope+cache":
        then_cache = unfused("rope_and_cache", rope)

        def norm_rope_cache(q, k, v, positions, cache, slots, k_cache, v_cache, qw, kw):
            return then_cache(_rms_norm(q, qw), _rms_norm(k, kw), v, positions, cache, slots,
                              k_cache, v_cache)
        return norm_rope_cache
    if op == "rope_and_cache HND":
        def rope_cache_hnd(q, k, v, positions, cache, slots, k_cache, v_cache):
            q_out, k_out = rope(q, k, positions, cache)
            blocks, rows = slots // BLOCK_SIZE, slots % BLOCK_SIZE
            k_cache[blocks, :, rows] = k_out
            v_cache[blocks, :, rows] = v
            return q_out, k_out
        return rope_cache_hnd
    def store(cache, slots, x):
        if op == "rope_and_cache fp8":  # fp8 quantised, its bits copied (no fp8 index_copy_)
            import torch

            cache, x = cache.view(torch.uint8), _quantize(x).view(torch.uint8)
        cache.view(-1, *x.shape[-2:]).index_copy_(0, slots, x)

    def rope_cache(q, k, v, positions, cache, slots, k_cache, v_cache):
        q_out, k_out = rope(q, k, positions, cache)
        store(k_cache, slots, k_out)
        store(v_cache, slots, v)
        return q_out, k_out
    return rope_cache


def _cupyrope_rope(q, k, positions, cache, scaling=None):
    import cupyrope as cr

    return cr.apply_rope(q, k, positions, cos_sin_cache=cache, scaling=scaling)


@functools.lru_cache(maxsize=None)
def _compiled(op: str, rope=hf_rope):
    import torch

    compiled_hf_rope()  # raises dynamo's recompile limit for the many shapes benchmarked
    # One graph per shape, as a user compiling the unfused sequence for a served shape gets. With
    # automatic dynamic shapes the graph a case gets would depend on the shapes compiled before it
    # in the same process, so the GPU check's parallel compile pass could not warm its caches.
    return torch.compile(unfused(op, rope), dynamic=False)


def fused(op: str, inplace: bool = False, scaling: dict | None = None,
          norm_over: str = "head"):
    """The fused call of ``op``, taking the arguments of :meth:`FusedData.arg_sets`; ``scaling``
    (M-RoPE) and ``norm_over`` are passed on."""
    import cupyrope as cr

    if op == "rms_norm_rope":
        def norm_rope(q, k, positions, cache, qw, kw):
            return cr.rms_norm_rope(q, k, qw, kw, positions, eps=EPS, cos_sin_cache=cache,
                                    scaling=scaling, inplace=inplace, norm_over=norm_over)
        return norm_rope
    if op == "fp8 out":
        def rope_fp8(q, k, positions, cache):
            return cr.apply_rope(q, k, positions, cos_sin_cache=cache, out_dtype="float8_e4m3fn",
                                 q_scale=FP8_SCALE, k_scale=FP8_SCALE, scaling=scaling)
        return rope_fp8

    options = {"rope_and_cache HND": dict(layout="HND"),
               "rope_and_cache fp8": dict(k_scale=FP8_SCALE, v_scale=FP8_SCALE)}.get(op, {})
    if scaling is not None:
        options["scaling"] = scaling

    def rope_cache(q, k, v, positions, cache, slots, k_cache, v_cache, qw=None, kw=None):
        if qw is not None:
            options.update(q_weight=qw, k_weight=kw, eps=EPS, norm_over=norm_over)
        return cr.rope_and_cache(q, k, v, positions, k_cache, v_cache, slots,
                                 cos_sin_cache=cache, inplace=inplace, **options)
    return rope_cache


def plain_rope(op: str, scaling: dict | None = None):
    """apply_rope in place on the q and k of ``op``'s arguments: the decode yardstick."""
    import cupyrope as cr

    def rope_inplace(q, k, *rest):
        positions, cache = (rest[0], rest[1]) if op in ("rms_norm_rope", "fp8 out") else (
            rest[1], rest[2])
        return cr.apply_rope(q, k, positions, cos_sin_cache=cache, scaling=scaling, inplace=True)
    return rope_inplace


def make_fused_workload(op: str, impl: str, data: FusedData) -> Workload:
    """The workload ``impl`` (a key of :data:`FUSED_IMPLS`) of ``op`` on ``data``; raises
    :class:`Unavailable` when the implementation cannot run here."""
    nbytes = data.bytes_moved(op)
    scaling = data.layout.scaling
    if impl == "copy":
        return sm_copy(nbytes // 2, device=data.device)
    if impl == "cupyrope-fused":
        # Small launches in place (a decode step rotates its q and k where they are); the fp8
        # outputs are new arrays by nature.
        fn = fused(op, inplace=data.tokens <= GRAPH_MAX_TOKENS and op != "fp8 out",
                   scaling=scaling, norm_over=data.layout.norm_over)
    elif impl == "plain-rope":
        fn = plain_rope(op, scaling)
    elif impl == "unfused-eager":
        fn = unfused(op, _cupyrope_rope if scaling is None else
                     functools.partial(_cupyrope_rope, scaling=scaling))
    elif impl == "unfused-compile":
        reason = peer_status()["torch-compile-hf"]
        if reason:
            raise Unavailable(reason)
        fn = _compiled(op, data.layout.rope())
    else:
        raise ValueError(f"unknown implementation {impl!r}; known: {FUSED_IMPLS}")
    return Workload(impl, fn, data.arg_sets(op), nbytes)


@dataclasses.dataclass(frozen=True)
class FusedRow:
    """One measurement: GPU time per call, GB/s of the op's bytes, % of their SM copy."""

    op: str
    impl: str
    tokens: int
    us: float
    gbps: float
    pct_of_copy: float


def fused_sweep(tokens: Sequence[int] = FUSED_TOKENS, *, ops: Sequence[str] = FUSED_OPS,
                impls: Sequence[str] = FUSED_IMPLS, repeats: int = 10, progress: bool = True,
                failures: list[str] | None = None) -> list[FusedRow]:
    """Each fused op over ``tokens`` for its SM copy and ``impls``, GPU time per eager call with
    inputs rotating so that every call reads DRAM, under a progress bar (tqdm, when installed and
    ``progress``). A cupyrope or copy case that raises goes to ``failures`` (with its traceback);
    an unfused one that cannot run is left out with a note."""
    torch = require_cuda()
    order = ("copy",) + tuple(i for i in impls if i != "copy")

    def impls_of(op):  # apply_rope moves rms_norm_rope's bytes: timed there only
        return [i for i in order if i != "plain-rope" or op == "rms_norm_rope"]

    rows: list[FusedRow] = []
    cases = len(tokens) * sum(len(impls_of(op)) for op in ops)
    with Progress(cases, enabled=progress) as bar:
        for t in tokens:
            data = FusedData(t)
            for op in ops:
                copy_us = None
                for impl in impls_of(op):
                    bar.case(f"T={t} {op} {impl}")
                    try:
                        work = make_fused_workload(op, impl, data)
                        if t <= GRAPH_MAX_TOKENS:
                            us = graph_time_us(work.fn, rotate_inputs=work.arg_sets)
                        else:
                            us = gpu_time_us(work.fn, rotate_inputs=work.arg_sets,
                                             repeats=repeats)
                    except Unavailable as exc:
                        bar.note(f"T={t} {op} {impl}: skipped ({exc})")
                        continue
                    except Exception as exc:
                        if impl in ("copy", "cupyrope-fused"):
                            line = f"T={t} {op} {impl}: FAILED\n{traceback.format_exc()}"
                            bar.note(line)
                            if failures is not None:
                                failures.append(line)
                        else:
                            bar.note(f"T={t} {op} {impl}: failed, left out "
                                     f"({type(exc).__name__}: {exc})")
                        continue
                    finally:
                        bar.done()
                    if impl == "copy":
                        copy_us = us
                    pct = 100.0 * copy_us / us if copy_us else float("nan")
                    rows.append(FusedRow(op, impl, t, us, work.bytes_moved / us / 1e3, pct))
            del data
            torch.cuda.empty_cache()
    return rows


def format_fused_table(rows: Sequence[FusedRow], gpu_name: str) -> str:
    """Markdown: one line per (op, T, impl) with µs, GB/s and % of the SM copy of the op's bytes."""
    from tabulate import tabulate

    header = (f"Fused ops (bf16 q [T,32,128], k and v [T,8,128], fp32 cache, paged bf16 cache "
              f"block {BLOCK_SIZE}, NeoX) on {gpu_name}")
    lines = tabulate([[r.op, r.tokens, r.impl, f"{r.us:.2f}", f"{r.gbps:.0f}",
                       f"{r.pct_of_copy:.1f}"] for r in rows],
                     headers=["op", "T", "impl", "µs", "GB/s", "% of SM copy"], tablefmt="pipe",
                     disable_numparse=True)
    return "\n".join([header, "", format_fused_summary(rows), "", lines])


def format_fused_summary(rows: Sequence[FusedRow]) -> str:
    """Markdown, one line per (op, T): cupyrope's % of the SM copy (µs at T <= 512, graph of 20),
    its speed-up over torch.compile of the unfused sequence, and at T <= 512 its time over
    ``apply_rope`` in place (the decode target: at most 1.3)."""
    from tabulate import tabulate

    by_case = {(r.op, r.tokens, r.impl): r for r in rows}
    plain = {r.tokens: r.us for r in rows if r.impl == "plain-rope"}
    table = []
    for op, t in dict.fromkeys((r.op, r.tokens) for r in rows):
        ours = by_case.get((op, t, "cupyrope-fused"))
        if ours is None:
            continue
        compiled = by_case.get((op, t, "unfused-compile"))
        speedup = f"{compiled.us / ours.us:.2f}x" if compiled else "-"
        size = f"{ours.us:.2f} µs" if t <= GRAPH_MAX_TOKENS else f"{ours.pct_of_copy:.1f} %"
        decode = (f"{ours.us / plain[t]:.2f}" if t <= GRAPH_MAX_TOKENS and t in plain
                  and op != "fp8 out" else "-")
        table.append([op, t, size, speedup, decode])
    return tabulate(table, headers=["op", "T", "cupyrope (µs, or % of SM copy)",
                                    "vs torch.compile", "÷ apply_rope in place"],
                    tablefmt="pipe", disable_numparse=True)


def plot_fused(rows: Sequence[FusedRow], path: str, *, gpu_name: str) -> str:
    """One panel per op (three a row): % of an SM copy of the op's bytes against T, one line per
    implementation in the same colour in every panel (the 90 % target dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r.op for r in rows))
    impls = list(dict.fromkeys(r.impl for r in rows))
    colours = {impl: f"C{i}" for i, impl in enumerate(impls)}
    columns = min(3, len(ops))
    lines = -(-len(ops) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(4.6 * columns, 3.4 * lines), sharey=True,
                             squeeze=False)
    for ax in axes.flat[len(ops):]:
        ax.set_visible(False)
    for ax, op in zip(axes.flat, ops):
        for impl in impls:
            points = sorted((r.tokens, r.pct_of_copy) for r in rows if r.op == op and r.impl == impl)
            if points:
                ax.plot([t for t, _ in points], [p for _, p in points], marker="o", label=impl,
                        color=colours[impl])
        ax.set_xscale("log", base=2)
        ax.set_title(op)
        ax.set_xlabel("tokens T")
        ax.axhline(90, color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("% of an SM copy of the op's bytes")
    handles = [plt.Line2D([], [], color=colours[impl], marker="o", label=impl) for impl in impls]
    fig.legend(handles=handles, loc="lower center", ncol=len(impls), fontsize=8)
    fig.suptitle(f"cupyrope fused ops, bf16 q[T,32,128] k/v[T,8,128], {gpu_name}", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
