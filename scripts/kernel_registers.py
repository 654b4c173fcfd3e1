"""Registers, stack, spills and SASS size of kernel specialisations, built without a GPU.

The kernels are occupancy-bound where each thread keeps one access in flight (the MLA kernel:
8 -> 12 resident blocks took it from 60 to 75 % of a copy on an H200), so a launch bound is
worth trying wherever a specialisation fits a smaller register cap without spilling. This
script compiles the specialisations whose name expression contains every ``--filter`` string
(``cupyrope.cuda.compiler.ALL_SPECIALISATIONS``) for one architecture with NVRTC (the pip wheel,
no GPU needed) and prints ptxas' report for each: registers, stack frame, spill stores / loads.
With ``--sass`` it also counts the SASS instructions: the PTX goes through the ``ptxas`` and
``nvdisasm`` found on PATH (or given), so that two trees' kernels can be compared instruction
for instruction (``--dump DIR`` writes each specialisation's SASS there).

Usage (from the repository root)::

    python scripts/kernel_registers.py --arch sm_90 --filter mla_rope_kernel
    python scripts/kernel_registers.py --arch sm_100 --filter rope_fused_lean_kernel --filter bfloat16_t
    python scripts/kernel_registers.py --arch sm_90 --filter rerotate --sass --dump /tmp/sass

Exit status 1 when a printed specialisation spills (``tests/test_kernel_compile.py`` is the
check CI runs; this is the tool for trying bounds).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS_RE = re.compile(r"Used (\d+) registers")
_SASS_LINE_RE = re.compile(r"\s+/\*[0-9a-f]{4,}\*/")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_90", help="sm_80, sm_90, sm_100, sm_120 ...")
    parser.add_argument("--filter", action="append", default=[],
                        help="a substring every selected name expression contains (repeatable)")
    parser.add_argument("--sass", action="store_true",
                        help="count SASS instructions (needs ptxas and nvdisasm)")
    parser.add_argument("--ptxas", default=shutil.which("ptxas"), help="ptxas for --sass")
    parser.add_argument("--nvdisasm", default=shutil.which("nvdisasm"), help="nvdisasm for --sass")
    parser.add_argument("--dump", type=Path, help="write each specialisation's SASS here")
    args = parser.parse_args(argv)

    from cupy_backends.cuda.libs import nvrtc

    from cupyrope.cuda import compiler

    if args.sass and not (args.ptxas and args.nvdisasm):
        parser.error("--sass needs ptxas and nvdisasm (on PATH, or --ptxas / --nvdisasm)")
    source, _ = compiler._read_sources()
    specs = [spec for spec in compiler.ALL_SPECIALISATIONS
             if all(text in spec.name_expression for text in args.filter)]
    if not specs:
        print(f"no specialisation's name expression contains all of {args.filter}")
        return 2
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
    spilling = 0
    for index, spec in enumerate(specs):
        program = nvrtc.createProgram(source, "rope.cu", [], [])
        try:
            nvrtc.addNameExpression(program, spec.name_expression)
            nvrtc.compileProgram(program, [*compiler.compile_options("float64"),
                                           f"--gpu-architecture={args.arch}",
                                           "--ptxas-options=--verbose"])
            log = nvrtc.getProgramLog(program)
            ptx = nvrtc.getPTX(program)
        finally:
            nvrtc.destroyProgram(program)
        registers = ", ".join(_REGISTERS_RE.findall(log)) or "?"
        frames = [tuple(int(g) for g in m.groups()) for m in _FRAME_RE.finditer(log)]
        stack = max((f[0] for f in frames), default=0)
        spills = max((f[1] + f[2] for f in frames), default=0)
        spilling += spills > 0
        line = (f"{registers:>4} registers  stack {stack:4d}  spill {spills:4d}  "
                f"{spec.name_expression.replace('cupyrope::', '')}")
        if args.sass:
            sass = _sass(ptx, args.arch, args.ptxas, args.nvdisasm)
            count = sum(1 for text in sass.splitlines() if _SASS_LINE_RE.match(text))
            line = f"{count:6d} SASS  " + line
            if args.dump:
                (args.dump / f"{index:04d}.sass").write_text(
                    f"// {spec.name_expression}\n{sass}")
        print(line, flush=True)
    return 1 if spilling else 0


def _sass(ptx, arch: str, ptxas: str, nvdisasm: str) -> str:
    """The SASS of NVRTC's PTX, assembled by ``ptxas`` (its PTX version lowered to what that
    ptxas reads when NVRTC is the newer) and disassembled by ``nvdisasm``."""
    text = ptx.decode() if isinstance(ptx, bytes) else ptx
    text = text.rstrip("\x00")
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    release = re.search(r"release (\d+)\.(\d+)", version)
    if release:  # e.g. NVRTC 13.x PTX for ptxas 13.0: ISA 9.0
        major, minor = int(release.group(1)), int(release.group(2))
        if major >= 13:
            text = re.sub(r"\.version \d+\.\d+", f".version 9.{minor}", text, count=1)
    with tempfile.TemporaryDirectory() as folder:
        ptx_path, cubin = Path(folder) / "kernel.ptx", Path(folder) / "kernel.cubin"
        ptx_path.write_text(text)
        subprocess.run([ptxas, f"-arch={arch}", str(ptx_path), "-o", str(cubin)], check=True)
        return subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout


if __name__ == "__main__":
    sys.exit(main())
