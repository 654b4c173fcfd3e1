"""The reference sweep: the reference shape over T for the SM copy, cupyrope and the peers, and its
reports (a markdown table through ``tabulate``, JSON, a bandwidth plot through matplotlib)."""

from __future__ import annotations

import dataclasses
import datetime
import sys
import traceback
from typing import Sequence

from .clocks import device_name, gpu_time_us, l2_cache_bytes, require_cuda
from .peers import Unavailable, peer_status
from .progress import Progress
from .workloads import (CHECK_TOLERANCE, REFERENCE_TOKENS, SWEEP_IMPLS, RopeData, RopeShape,
                        error_is_acceptable, make_workload, max_abs_error)

try:
    import torch
except ImportError:  # pragma: no cover - exercised only without torch
    torch = None


@dataclasses.dataclass(frozen=True)
class Row:
    """One measurement of the sweep: GPU time per call, GB/s of minimum bytes, % of the SM copy."""

    impl: str
    tokens: int
    us: float
    gbps: float
    pct_of_copy: float
    max_abs_err: float | None = None


def reference_sweep(tokens: Sequence[int] = REFERENCE_TOKENS, *, impls: Sequence[str] | None = None,
                    warmup: int = 3, repeats: int = 10, check: bool = True, progress: bool = True,
                    failures: list[str] | None = None) -> list[Row]:
    """Measure the reference shape over ``tokens`` for the SM copy, cupyrope and the peers.

    Parameters
    ----------
    tokens : sequence of int
        Values of T (default 1, 8, 64, 512, 4096, 16384, 65536).
    impls : sequence of str, optional
        Keys from :data:`ALL_IMPLS`; default :data:`SWEEP_IMPLS` (cupyrope cache out of place and
        in place, computed angles, per-token tables; then every peer). The SM copy always runs.
    check : bool
        Before timing, compare one call against a float32 reference (``max_abs_err`` in the row).
    failures : list, optional
        Receives a line (with the traceback) for each cupyrope or copy case that raised; the sweep
        goes on without it, so one failure does not cost the other measurements. A peer that
        raises is left out with a note.

    Returns
    -------
    list of Row
        ``(impl, tokens, us, gbps, pct_of_copy, max_abs_err)``, copy first for each T.
    """
    require_cuda()
    wanted = list(SWEEP_IMPLS if impls is None else impls)
    status = peer_status()
    runnable = ["copy"] + [i for i in wanted if i != "copy" and not status.get(i)]
    rows: list[Row] = []
    with Progress(len(tokens) * len(runnable), enabled=progress) as bar:
        for impl in wanted:
            if status.get(impl):
                bar.note(f"skipping {impl}: {status[impl]}")
        for t in tokens:
            shape = RopeShape(tokens=t)
            data = RopeData(shape)
            copy_us = None
            for impl in runnable:
                bar.case(f"T={t} {impl}")
                try:
                    work = make_workload(impl, data)
                    error = max_abs_error(work, data) if check and impl != "copy" else None
                    us = gpu_time_us(work.fn, rotate_inputs=work.arg_sets, warmup=warmup, repeats=repeats)
                except Unavailable as exc:
                    bar.note(f"T={t} {impl}: skipped ({exc})")
                    continue
                except Exception as exc:
                    if impl == "copy" or impl.startswith("cupyrope"):
                        line = f"T={t} {impl}: FAILED\n{traceback.format_exc()}"
                        bar.note(line)
                        if failures is not None:
                            failures.append(line)
                    else:
                        bar.note(f"T={t} {impl}: failed, left out ({type(exc).__name__}: {exc})")
                    continue
                finally:
                    bar.done()
                if impl == "copy":
                    copy_us = us
                if not error_is_acceptable(error, shape.dtype):
                    bar.note(f"T={t} {impl}: max abs error {error:.3g} > {CHECK_TOLERANCE[shape.dtype]}")
                pct = 100.0 * copy_us / us if copy_us else float("nan")
                rows.append(Row(impl, t, us, work.bytes_moved / us / 1e3, pct, error))
            del data
            torch.cuda.empty_cache()
    return rows


def _today() -> str:
    return datetime.date.today().isoformat()


def format_table(rows: Sequence[Row], gpu_name: str | None = None) -> str:
    """Markdown: one line per (T, impl) with µs, GB/s, % of the SM copy; then a % pivot by T."""
    from tabulate import tabulate

    name = gpu_name or device_name()
    header = (f"RoPE reference shape (bf16 q [T,32,128], k [T,8,128], int64 positions < 131072, "
              f"fp32 cache [131072,128], NeoX) on {name}, {_today()}")
    lines = tabulate([[r.impl, r.tokens, f"{r.us:.2f}", f"{r.gbps:.0f}", f"{r.pct_of_copy:.1f}",
                       "" if r.max_abs_err is None else f"{r.max_abs_err:.3g}"] for r in rows],
                     headers=["impl", "T", "µs", "GB/s", "% of SM copy", "max abs err"],
                     tablefmt="pipe", disable_numparse=True,
                     colalign=("left", "right", "right", "right", "right", "right"))
    tokens = sorted({r.tokens for r in rows})
    by_key = {(r.impl, r.tokens): r for r in rows}
    pivot = tabulate([[impl] + [f"{by_key[(impl, t)].pct_of_copy:.1f}" if (impl, t) in by_key else ""
                                for t in tokens] for impl in dict.fromkeys(r.impl for r in rows)],
                     headers=["impl"] + [f"T={t}" for t in tokens], tablefmt="pipe",
                     disable_numparse=True, colalign=("left",) + ("right",) * len(tokens))
    return "\n".join([header, "", lines, "", "% of SM copy (copy time / impl time):", "", pivot])


def plot(rows: Sequence[Row], path: str, *, gpu_name: str | None = None) -> str:
    """Bandwidth (GB/s of minimum bytes) against tokens, log x, one line per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name = gpu_name or device_name()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for impl in dict.fromkeys(r.impl for r in rows):
        points = sorted((r.tokens, r.gbps) for r in rows if r.impl == impl)
        style = dict(color="black", linestyle="--") if impl == "copy" else {}
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=impl, **style)
    ax.set_xscale("log", base=2)
    ticks = sorted({r.tokens for r in rows})
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.set_xlabel("tokens T")
    ax.set_ylabel("GB/s (q, k in + out, positions, cos/sin rows)")
    ax.set_title(f"RoPE bf16 q[T,32,128] k[T,8,128], fp32 cache, NeoX — {name}, {_today()}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def environment() -> dict:
    """GPU, L2 and library versions, for the records."""
    info = {"gpu": device_name(), "date": _today(), "python": sys.version.split()[0]}
    if torch is not None:
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["l2_bytes"] = l2_cache_bytes()
    for module in ("cupy", "triton", "liger_kernel", "flashinfer"):
        try:
            info[module] = getattr(__import__(module), "__version__", "?")
        except Exception:
            pass
    return info
