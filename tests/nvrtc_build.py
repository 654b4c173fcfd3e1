"""One NVRTC build of a kernel-call entry for the compile tests: log and PTX, or a failed test."""

from __future__ import annotations

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
