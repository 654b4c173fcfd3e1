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


def _compile_one(device_id: int, index: int) -> None:
    """Compile ``ALL_SPECIALISATIONS[index]`` on ``device_id`` (in a worker)."""
    compiler.get_kernel(compiler.ALL_SPECIALISATIONS[index], device_id)


def compile_cost_rank(spec) -> int:
    """How long ``spec`` takes to compile, as a rank (higher: longer). NVRTC and ptxas on one core
    for sm_90 take ~1.2 s for an all-heads fused kernel, ~0.7 s for a per-row fused one, 0.3-0.4 s
    for the general and lean fused ones, 0.06-0.23 s for the rest: the family decides, the dtype
    or the angle source moves a kernel by less than a third."""
    if not isinstance(spec, compiler.KernelSpec):
        return 1  # MLA and re-rotation kernels
    if spec.fused:
        if spec.all_heads and not spec.lean:
            return 5
        if spec.rows:
            return 4
        return 1 if spec.decode else 3
    return 0 if spec.lean or spec.decode else 1


def fill_kernel_cache(*, device: int | None = None, jobs: int | None = None) -> int:
    """Compile every kernel specialisation for ``device`` (the current one by default) into
    CuPy's disk cache, in ``jobs`` processes (default: one per core); returns how many.

    The specialisations are handed out one at a time, the longest to compile first, so that the
    processes finish together (fixed slices of the table left some working alone for a third of
    the time). Each worker process opens its own CUDA context on the device. Compile errors
    propagate.
    """
    device_id = compiler.current_device() if device is None else int(device)
    jobs = (os.cpu_count() or 1) if jobs is None else int(jobs)
    if jobs < 1:
        raise ValueError(f"fill_kernel_cache: jobs must be at least 1, got {jobs}")
    specs = compiler.ALL_SPECIALISATIONS
    if jobs == 1:
        for spec in specs:
            compiler.get_kernel(spec, device_id)
        return len(specs)
    order = sorted(range(len(specs)), key=lambda i: compile_cost_rank(specs[i]), reverse=True)
    # spawn: a forked child would inherit this process's CUDA state, which CUDA does not allow.
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        for _ in pool.map(_compile_one, [device_id] * len(order), order, chunksize=1):
            pass
    return len(order)
