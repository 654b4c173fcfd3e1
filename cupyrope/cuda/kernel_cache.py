"""Filling CuPy's kernel disk cache ahead of time: every specialisation, in parallel processes.

A process compiles a specialisation on its first call that needs it (about a second each). A
deployment image, or a test run spread over many processes, can instead compile the whole table
once, one process per core, so that every later process only loads binaries from the disk cache.
The cache key holds the sources' fingerprint and the angle arithmetic, as ``get_kernel``'s does.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os

from . import compiler


def _compile_slice(device_id: int, first: int, step: int) -> int:
    """Compile every ``step``-th specialisation from ``first`` on ``device_id`` (in a worker)."""
    specs = compiler.ALL_SPECIALISATIONS[first::step]
    for spec in specs:
        compiler.get_kernel(spec, device_id)
    return len(specs)


def fill_kernel_cache(*, device: int | None = None, jobs: int | None = None) -> int:
    """Compile every kernel specialisation for ``device`` (the current one by default) into
    CuPy's disk cache, in ``jobs`` processes (default: one per core); returns how many.

    Each worker process opens its own CUDA context on the device. Compile errors propagate.
    """
    device_id = compiler.current_device() if device is None else int(device)
    jobs = (os.cpu_count() or 1) if jobs is None else int(jobs)
    if jobs < 1:
        raise ValueError(f"fill_kernel_cache: jobs must be at least 1, got {jobs}")
    if jobs == 1:
        return _compile_slice(device_id, 0, 1)
    # spawn: a forked child would inherit this process's CUDA state, which CUDA does not allow.
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        counts = pool.map(_compile_slice, [device_id] * jobs, range(jobs), [jobs] * jobs)
        return sum(counts)
