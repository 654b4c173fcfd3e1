"""Scaffolding the op benchmarks share (``benchmarks/test_mla.py``, ``test_rerotate.py``,
``test_serving.py`` and the ``--shapes`` / ``--serving`` sweeps): the data of one shape at a time,
``torch.compile`` of an unfused torch sequence, the guard that tells a peer that cannot run from a
failure of cupyrope's, and the time of one case against the SM copy of its bytes."""

from __future__ import annotations

import functools
from typing import Callable, Hashable

from .clocks import gpu_time_us, graph_time_us
from .peers import Unavailable, compiled_hf_rope, peer_status
from .workloads import Workload


class LatestData:
    """``get(*key)`` returns ``make(*key)``, kept while consecutive calls ask for the same key:
    the previous shape's data is freed before the next is allocated (cases of one shape are
    adjacent in every test list)."""

    def __init__(self, make: Callable):
        self._make = make
        self.key: tuple | None = None
        self.data = None

    def get(self, *key: Hashable):
        if key != self.key:
            self.key, self.data = None, None
            self.data = self._make(*key)
            self.key = key
        return self.data


@functools.lru_cache(maxsize=None)
def compile_unfused(fn: Callable) -> Callable:
    """``torch.compile(fn, dynamic=False)``: one graph per shape, as a user compiling the unfused
    sequence for a served shape gets. Raises :class:`Unavailable` where torch.compile cannot run."""
    import torch

    reason = peer_status()["torch-compile-hf"]
    if reason:
        raise Unavailable(reason)
    compiled_hf_rope()  # raises dynamo's recompile limit for the many shapes benchmarked
    return torch.compile(fn, dynamic=False)


def is_ours(impl: str) -> bool:
    """The copy and cupyrope's implementations: a failure of theirs is an error, not a skip."""
    return impl in ("copy", "plain-rope") or impl.startswith("cupyrope")


def guarded(impl: str, make: Callable):
    """``make()``; a peer (torch.compile, Liger, ...) that raises becomes :class:`Unavailable`
    with the reason, a failure of cupyrope or the copy propagates."""
    try:
        return make()
    except Unavailable:
        raise
    except Exception as exc:
        if is_ours(impl):
            raise
        raise Unavailable(f"{impl} failed on this shape: {type(exc).__name__}: {exc}") from exc


def time_us(work: Workload, *, graph: bool, repeats: int = 10) -> float:
    """GPU time per call of ``work``: in a CUDA graph of 20 calls (``graph``) or per eager call,
    its argument sets rotating so that every call reads DRAM."""
    if graph:
        return graph_time_us(work.fn, rotate_inputs=work.arg_sets, repeats=repeats)
    return gpu_time_us(work.fn, rotate_inputs=work.arg_sets, repeats=repeats)


def measure(bar, label: str, impl: str, make: Callable[[], Workload], *, graph: bool,
            repeats: int = 10, failures: list[str] | None = None):
    """``(workload, µs)`` of one sweep case under the progress ``bar``, or None when it did not
    run: a peer that cannot is noted and left out, a failure of cupyrope or the copy is noted with
    its traceback and goes to ``failures``."""
    import traceback

    bar.case(label)
    try:
        work = guarded(impl, make)
        return work, guarded(impl, lambda: time_us(work, graph=graph, repeats=repeats))
    except Unavailable as exc:
        bar.note(f"{label}: skipped ({exc})")
    except Exception:
        line = f"{label}: FAILED\n{traceback.format_exc()}"
        bar.note(line)
        if failures is not None:
            failures.append(line)
    finally:
        bar.done()
    return None
