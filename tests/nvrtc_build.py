"""One NVRTC build of a kernel-call entry for the compile tests: log and PTX, or a failed test."""

from __future__ import annotations

import re

import pytest


def compile_entry(nvrtc, source: str, filename: str, options, arch: str, case) -> tuple[str, str]:
    """Compile ``source`` for ``arch`` with ptxas' per-function report; returns (log, PTX text)."""
    program = nvrtc.createProgram(source, filename, [], [])
    try:
        try:
            nvrtc.compileProgram(program, [*options, f"--gpu-architecture={arch}",
                                           "--ptxas-options=--verbose"])
        except Exception as exc:
            pytest.fail(f"{case}: NVRTC failed ({exc}):\n{nvrtc.getProgramLog(program)}")
        log = nvrtc.getProgramLog(program)
        ptx = nvrtc.getPTX(program)
    finally:
        nvrtc.destroyProgram(program)
    return log, (ptx.decode() if isinstance(ptx, bytes) else ptx)


def assert_native_entry_compiles(nvrtc, launch, arch: str, case) -> str:
    """A planned native JAX launch (``cupyrope.frontends.jax.native.plan_native_launch``): its
    block whole warps within the shared-memory limit, its entry compiled for ``arch`` with no
    stack frame or spill. Returns the entry's source."""
    from cupyrope.frontends.jax import native
    from test_kernel_compile import _FRAME_RE

    spec, block = launch.spec, launch.block
    threads = block[0] * block[1] * block[2]
    assert threads % 32 == 0 and launch.shared_bytes <= 48 * 1024, (case, block)
    source, options = native.entry_program(spec, block, launch.buffers, None)
    name = native.kernel_name(spec, block, launch.buffers)
    log, ptx = compile_entry(nvrtc, source, "cupyrope_xla.cu", options, arch, case)
    assert re.search(rf"\.entry {name}\(", ptx), f"{case}: no entry {name} in the PTX"
    frames = [tuple(int(g) for g in m.groups()) for m in _FRAME_RE.finditer(log)]
    assert all(f == (0, 0, 0) for f in frames), (case, frames, log[-2000:])
    return source
