"""Every kernel specialisation compiles with NVRTC, without a GPU.

NVRTC (the pip wheel ``nvidia-cuda-nvrtc``) and ptxas run on the host, so a machine with no GPU
can still prove that each entry of ``cupyrope.cuda.compiler.ALL_SPECIALISATIONS`` (the rope and the
fused kernels) instantiates, lowers to a kernel symbol and assembles without register spills for
Ampere (sm_80), Hopper (sm_90) and Blackwell (sm_100 data-centre, sm_120 consumer GPUs). This
catches template errors in the ``.cuh`` headers long before a GPU run would.

The specialisations go into a few programs per architecture (every fourth one in each): one
program per specialisation would parse the headers 464 times, one program for all of them would
keep a single pytest-xdist worker busy for minutes while the others idle. The computed-angle
specialisations of float16 / bfloat16 / float32 are compiled a second time with float-float angles
(``-DCUPYROPE_ANGLES_FLOAT_FLOAT=1``, the build GPUs with slow FP64 get), and the PTX of that build
is checked for FP64 arithmetic: it has none. On Blackwell each specialisation is compiled once, with
the angle arithmetic that architecture gets (float64 on sm_100, float-float on sm_120): a second
pass there would add its compile time for builds no such GPU runs. Architectures this NVRTC does
not know (Blackwell needs 12.8 or newer) skip.

The tests skip when CuPy's NVRTC binding or libnvrtc is missing; CI sets
``CUPYROPE_REQUIRE_NVRTC=1`` so that a broken install fails there instead of silently skipping.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import NamedTuple

import pytest

from cupyrope.cuda import compiler
from cupyrope.core.abi import AngleSource

pytestmark = pytest.mark.nvrtc

ARCHITECTURES = ("sm_80", "sm_90", "sm_100", "sm_120")
# Architectures built with both angle arithmetics; the others get the one their GPUs run.
BOTH_ARITHMETICS = ("sm_80", "sm_90")


def arithmetic_of(arch: str) -> str:
    """The in-kernel angle arithmetic a GPU of ``arch`` (``sm_XY``) compiles with."""
    number = int(arch.removeprefix("sm_"))
    return compiler.arithmetic_for_capability(number // 10, number % 10)

# ptxas -v prints, per function: "N bytes stack frame, N bytes spill stores, N bytes spill loads".
# A stack frame alone is fine (float64 range reduction of in-kernel angles needs a 40-byte local
# array in __internal_trig_reduction_slowpathd); spills mean registers ran out and cost bandwidth.
_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)'")
_FRAME_RE = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)


def _nvrtc_or_skip():
    """CuPy's NVRTC binding with a loadable libnvrtc, else skip (or fail where it is required)."""
    required = os.environ.get("CUPYROPE_REQUIRE_NVRTC", "") not in ("", "0")
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()  # loads libnvrtc now; a missing library raises here, not mid-test
    except Exception as exc:  # ImportError, or RuntimeError/OSError from the library loader
        reason = f"NVRTC is not usable here ({type(exc).__name__}: {exc})"
        if required:
            pytest.fail(f"{reason}, but CUPYROPE_REQUIRE_NVRTC is set")
        pytest.skip(reason)
    return nvrtc


class CompiledProgram:
    """What one NVRTC compile of all specialisations for one architecture produced."""

    def __init__(self, arch: str, lowered: dict[str, str], cubin: bytes, log: str,
                 arithmetic: str = "float64", ptx: str = ""):
        self.arch = arch
        self.lowered = lowered  # name expression -> mangled kernel symbol
        self.cubin = cubin
        self.log = log
        self.arithmetic = arithmetic  # of the in-kernel angles (compile_options)
        self.ptx = ptx


PARTS = 6  # programs per architecture, every specialisation (float64 angles, the default)
# The specialisations that float-float angles change, compiled a second time that way.
FLOAT_FLOAT_SPECIALISATIONS = tuple(
    spec for spec in compiler.ALL_SPECIALISATIONS
    if spec.source == AngleSource.COMPUTED and spec.dtype != "float64"
)
FLOAT_FLOAT_PARTS = 2


def _arithmetics(arch: str) -> tuple[str, ...]:
    return ("float64", "float-float") if arch in BOTH_ARITHMETICS else (arithmetic_of(arch),)


BUILDS = ([(arch, "float64", part) for arch in ARCHITECTURES for part in range(PARTS)]
          + [(arch, "float-float", part) for arch in ARCHITECTURES
             if "float-float" in _arithmetics(arch) for part in range(FLOAT_FLOAT_PARTS)])


def _specs_of(build) -> tuple[compiler.KernelSpec, ...]:
    """The specialisations one build compiles. The float64 builds of an architecture that runs
    float-float angles leave out the specialisations its float-float builds take."""
    arch, arithmetic, part = build
    if arithmetic == "float-float":
        return FLOAT_FLOAT_SPECIALISATIONS[part::FLOAT_FLOAT_PARTS]
    specs = compiler.ALL_SPECIALISATIONS
    if "float64" not in _arithmetics(arch):
        specs = tuple(spec for spec in specs if spec not in FLOAT_FLOAT_SPECIALISATIONS)
    return specs[part::PARTS]


def _nvrtc_knows(nvrtc, arch: str) -> bool:
    """Whether this NVRTC compiles for ``arch`` (getSupportedArchs: NVRTC 11.2 and newer)."""
    return int(arch.removeprefix("sm_")) in nvrtc.getSupportedArchs()


def _build_id(build) -> str:
    arch, arithmetic, part = build
    return f"{arch}-part{part}" if arithmetic == "float64" else f"{arch}-{arithmetic}-part{part}"


def _architectures_asked() -> tuple[str, ...]:
    """The architectures ``CUPYROPE_COMPILE_ARCHS`` (e.g. ``sm_90``) narrows the builds to; all when
    unset, none for a name that is no architecture (``none``: the GPU check's default, whose kernel
    cache step compiles every specialisation for its GPU; with ``GPU_CHECK_NVRTC=1`` it builds for
    its own GPU here too). CI builds every architecture."""
    asked = os.environ.get("CUPYROPE_COMPILE_ARCHS", "").replace(",", " ").split()
    return tuple(asked) or ARCHITECTURES


# Under pytest-xdist's --dist loadgroup (as the GPU check runs it) the tests of one build share a
# worker and its one compile, and tests/conftest.py starts the builds first, each on its own worker:
# the longest jobs of the suite then never queue behind one another.
@pytest.fixture(scope="module", ids=_build_id, params=[
    pytest.param(build, marks=pytest.mark.xdist_group(f"nvrtc-{_build_id(build)}")) for build in BUILDS])
def compiled(request) -> CompiledProgram:
    arch, arithmetic, part = request.param
    if arch not in _architectures_asked():
        pytest.skip(f"{arch} is left out by CUPYROPE_COMPILE_ARCHS="
                    f"{os.environ.get('CUPYROPE_COMPILE_ARCHS')!r}")
    nvrtc = _nvrtc_or_skip()
    if not _nvrtc_knows(nvrtc, arch):
        pytest.skip(f"NVRTC {nvrtc.getVersion()} does not compile for {arch}")
    source, _ = compiler._read_sources()
    specs = _specs_of(request.param)
    options = (compiler.compile_options() if arithmetic == "float64"
               else compiler.compile_options(arithmetic))
    expressions = [spec.name_expression for spec in specs]

    program = nvrtc.createProgram(source, compiler.SOURCE_FILE, [], [])
    try:
        for expression in expressions:
            nvrtc.addNameExpression(program, expression)
        options = [
            *options,
            f"--gpu-architecture={arch}",  # sm_XX (not compute_XX): NVRTC emits SASS, ptxas runs
            "--ptxas-options=--verbose",  # per-function register / stack / spill report
        ]
        try:
            nvrtc.compileProgram(program, options)
        except Exception as exc:
            pytest.fail(
                f"NVRTC failed to compile rope.cu for {arch} ({exc}):\n"
                f"{nvrtc.getProgramLog(program)}"
            )
        lowered = {e: nvrtc.getLoweredName(program, e) for e in expressions}
        cubin = nvrtc.getCUBIN(program)
        # The log is a C string; NVRTC's copy keeps the terminating NUL.
        log = nvrtc.getProgramLog(program).rstrip("\x00")
        ptx = nvrtc.getPTX(program)
    finally:
        nvrtc.destroyProgram(program)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    return CompiledProgram(arch, lowered, bytes(cubin), log, arithmetic, ptx.rstrip("\x00"))


def test_specialisation_table_is_not_empty():
    # A vacuous table would make the compile tests pass without compiling anything.
    assert len(compiler.SPECIALISATIONS) > 0 and len(compiler.FUSED_SPECIALISATIONS) > 0
    expressions = [spec.name_expression for spec in compiler.ALL_SPECIALISATIONS]
    assert len(set(expressions)) == len(expressions), "duplicate name expressions"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_specialisation_is_built_for_each_architecture(arch):
    """The builds of an architecture cover every specialisation, once per angle arithmetic that
    it is built with (both on sm_80 / sm_90, the one its GPUs run elsewhere)."""
    builds = [build for build in BUILDS if build[0] == arch]
    float64 = [spec for build in builds if build[1] == "float64" for spec in _specs_of(build)]
    float_float = [spec for build in builds if build[1] == "float-float"
                   for spec in _specs_of(build)]
    if arch in BOTH_ARITHMETICS:
        assert sorted(float64, key=str) == sorted(compiler.ALL_SPECIALISATIONS, key=str)
        assert sorted(float_float, key=str) == sorted(FLOAT_FLOAT_SPECIALISATIONS, key=str)
    else:
        assert sorted(float64 + float_float, key=str) == sorted(compiler.ALL_SPECIALISATIONS, key=str)
        runs = float_float if arithmetic_of(arch) == "float-float" else float64
        assert set(FLOAT_FLOAT_SPECIALISATIONS) <= set(runs), (
            f"{arch}: computed-angle kernels built with an arithmetic its GPUs do not run")


def test_every_specialisation_lowers_to_a_kernel(compiled):
    missing = [e for e, name in compiled.lowered.items() if not name or not name.startswith("_Z")]
    assert not missing, f"{compiled.arch}: no lowered (mangled) name for {missing}"
    # Two expressions that lower to one symbol would mean a template argument is ignored.
    by_symbol: dict[str, list[str]] = {}
    for expression, name in compiled.lowered.items():
        by_symbol.setdefault(name, []).append(expression)
    clashes = {name: exprs for name, exprs in by_symbol.items() if len(exprs) > 1}
    assert not clashes, f"{compiled.arch}: expressions sharing one kernel symbol: {clashes}"


def test_cubin_is_not_empty(compiled):
    assert len(compiled.cubin) > 0, f"{compiled.arch}: NVRTC returned an empty cubin"
    assert compiled.cubin[:4] == b"\x7fELF", f"{compiled.arch}: the cubin is not an ELF image"


def test_no_register_spills(compiled):
    """ptxas reports no spill stores or loads for any entry, nor for any function it calls."""
    frames: dict[str, list[tuple[int, int, int]]] = {}  # kernel symbol -> (stack, stores, loads)
    entry = None
    for line in compiled.log.splitlines():
        match = _ENTRY_RE.search(line)
        if match:
            entry = match.group(1)
            frames.setdefault(entry, [])
            continue
        match = _FRAME_RE.search(line)
        if match and entry is not None:
            # Lines for non-inlined callees (e.g. the slow trig reduction) follow their caller's
            # "Compiling entry function" line, so they are charged to that entry.
            frames[entry].append(tuple(int(g) for g in match.groups()))

    symbols = {name: expression for expression, name in compiled.lowered.items()}
    unreported = sorted(symbols[s] for s in symbols if not frames.get(s))
    assert not unreported, (
        f"{compiled.arch}: ptxas printed no stack/spill line for {unreported}; "
        f"the log format may have changed:\n{compiled.log[:2000]}"
    )
    spilling = []
    for symbol, lines in frames.items():
        spills = [(stores, loads) for _, stores, loads in lines if stores or loads]
        if symbol in symbols and spills:
            amounts = ", ".join(f"{st} B stored / {ld} B loaded" for st, ld in spills)
            spilling.append(f"{symbols[symbol]}: {amounts}")
    assert not spilling, f"{compiled.arch}: kernels that spill registers:\n" + "\n".join(spilling)


class SourceCopy(NamedTuple):
    folder: Path  # writable copy of kernels_cu/ that cupyrope.cuda.compiler now reads
    original_fingerprint: str  # fingerprint of the real kernels_cu/


@pytest.fixture
def source_copy(monkeypatch, tmp_path) -> SourceCopy:
    """Point cupyrope.cuda.compiler at a writable copy of kernels_cu/; restore the real one afterwards."""
    compiler._read_sources.cache_clear()
    _, original_fingerprint = compiler._read_sources()
    folder = tmp_path / "kernels_cu"
    shutil.copytree(compiler.kernel_source_dir(), folder)
    monkeypatch.setattr(compiler, "kernel_source_dir", lambda: folder)
    compiler._read_sources.cache_clear()  # _read_sources memoises; forget the real folder's result
    yield SourceCopy(folder, original_fingerprint)
    monkeypatch.undo()
    compiler._read_sources.cache_clear()  # and forget the copy's, so later tests see the real one


def test_fingerprint_is_stable_for_identical_sources(source_copy):
    # The same files in another folder give the same fingerprint: the key depends on the
    # contents only, so an unchanged install keeps hitting CuPy's disk cache.
    assert compiler.source_fingerprint() == source_copy.original_fingerprint


def test_fingerprint_changes_when_a_header_changes(source_copy):
    # The fingerprint goes into the compile options and so into CuPy's disk-cache key: if editing
    # a header left it unchanged, a stale binary would be loaded instead of recompiling.
    source_before, fingerprint_before = compiler._read_sources()
    options_before = compiler.compile_options()

    header = sorted(source_copy.folder.glob("*.cuh"))[0]
    header.write_text(header.read_text() + "\n// an edit that changes no code\n")
    compiler._read_sources.cache_clear()
    source_after, fingerprint_after = compiler._read_sources()

    assert source_after == source_before, "only the header changed, rope.cu must read the same"
    assert fingerprint_after != fingerprint_before, f"editing {header.name} kept the fingerprint"
    assert compiler.compile_options() != options_before, "compile options ignore the fingerprint"


# PTX instructions that touch float64 values without computing in FP64: loads, stores and moves,
# the conversion of the float64 launch parameters (sin_sign, attention_factor, the fused ops' eps
# and scales) to float32, once per thread, and the lean kernel's position, converted to float64
# in rope.cu once per token (float_float.cuh splits it back into floats with integer operations).
_FP64_DATA_MOVEMENT = re.compile(r"^(ld|st|mov)\.|^cvt\.rn\.f32\.f64$|^cvt\.rn\.f64\.s64$")
_PTX_OPCODE = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_.]*)\s", re.M)


def fp64_arithmetic(ptx: str) -> dict[str, int]:
    """Counts of the PTX opcodes that compute in float64 (any ``.f64`` opcode but data movement):
    add, mul, fma, rint (cvt.rni.f64.f64), float64 <-> integer conversions of angles, ..."""
    counts: dict[str, int] = {}
    for opcode in _PTX_OPCODE.findall(ptx):
        if ".f64" in opcode and not _FP64_DATA_MOVEMENT.search(opcode):
            counts[opcode] = counts.get(opcode, 0) + 1
    return counts


def test_fp64_arithmetic_only_in_float64_angles(compiled):
    """The float-float build has no FP64 arithmetic at all (every kernel in its program computes
    angles), while the float64 build of the same computed-angle kernels has it (the check sees
    FP64 where it is). A staged kernel built for an architecture without bulk copies (below
    sm_90) is a trap (kernels_cu/bulk_copy.cuh): no angles to look for there."""
    assert compiled.ptx, f"{compiled.arch}: NVRTC returned no PTX"
    if compiled.arithmetic == "float-float":
        found = fp64_arithmetic(compiled.ptx)
        assert not found, (f"{compiled.arch}: FP64 arithmetic in the float-float build of "
                           f"{sorted(compiled.lowered)}: {found}")
        return
    entries = re.split(r"^\.(?:visible|weak) \.entry ", compiled.ptx, flags=re.M)[1:]
    bodies = {entry.split("(", 1)[0].strip(): entry for entry in entries}
    bulk_copies = int(compiled.arch.removeprefix("sm_")) >= 90
    expressions = {spec.name_expression for spec in FLOAT_FLOAT_SPECIALISATIONS
                   if bulk_copies or not getattr(spec, "staged", False)}
    checked = 0
    for expression, symbol in compiled.lowered.items():
        if expression in expressions:
            found = fp64_arithmetic(bodies[symbol])
            assert found.get("fma.rn.f64") and found.get("mul.f64"), (
                f"{compiled.arch}: no float64 product and reduction in {expression}: {found}")
            checked += 1
    if "float64" in _arithmetics(compiled.arch):
        assert checked, f"{compiled.arch}: no computed-angle kernel in this program"
    else:  # their float-float builds hold them (test_every_specialisation_is_built_...)
        assert not checked, f"{compiled.arch}: float64 angles in a float-float architecture"


def test_kernel_registers_script_reports_the_selected_specialisations(capsys):
    """scripts/kernel_registers.py prints ptxas' registers / stack / spills of each selected
    specialisation (exit 0: none spills), and exit 2 when its filters select nothing."""
    import importlib.util

    _nvrtc_or_skip()
    path = Path(__file__).resolve().parents[1] / "scripts" / "kernel_registers.py"
    spec = importlib.util.spec_from_file_location("kernel_registers", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    wanted = "mla_rope_kernel<bfloat16_t, float, true, true, 0, false>"  # DeepSeek's
    # Name expressions spell the namespace (cupyrope::bfloat16_t); the report drops it.
    assert script.main(["--arch", "sm_90", "--filter", "mla_rope_kernel<",
                        "--filter", "bfloat16_t, float, true, true, 0, false>"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].endswith(wanted), lines
    registers, stack, spill = re.match(r"\s*(\d+) registers  stack\s+(\d+)  spill\s+(\d+)  ",
                                       lines[0]).groups()
    assert 0 < int(registers) <= 32 and int(spill) == 0, lines  # 16 resident blocks on sm_90
    assert script.main(["--filter", "no kernel is called this"]) == 2
    assert "no specialisation" in capsys.readouterr().out
