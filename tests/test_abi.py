"""Everything the kernels share with Python (cupyrope/core/abi.py) matches the CUDA sources: the
RopeParams layout byte for byte, the angle sources, the M-RoPE modes, the block size limit and the
access layout of every dtype, pairing and width, all checked by NVRTC static_asserts (no GPU)."""

import itertools

import pytest

from cupyrope.cuda import compiler
from cupyrope.core.abi import (
    MAX_TOKEN_DIMS,
    DECODE_PARAMS_DTYPE,
    FUSED_DECODE_PARAMS_DTYPE,
    PARAMS_DTYPE,
    THREADS_PER_BLOCK,
    AngleSource,
    FUSION_PARAMS_DTYPE,
    MRopeMode,
    StoreFormat,
    WeightDtype,
    access_layout,
)
from cupyrope.core.dtypes import CUDA_TYPE_NAMES, ITEMSIZE

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

pytestmark = pytest.mark.nvrtc


def _compile(source: str, name: str) -> str | None:
    """None when NVRTC compiles ``source`` for sm_80, else its log."""
    program = nvrtc.createProgram(source, name, [], [])
    try:
        nvrtc.compileProgram(program, list(compiler.compile_options()) + ["--gpu-architecture=sm_80"])
        return None
    except nvrtc.NVRTCError:
        return nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)


def _enum_checks(enum_type, cuda_names: dict[str, str]) -> list[str]:
    """static_asserts that every member of a Python enum has its CUDA constant's value."""
    assert set(cuda_names) == {member.name for member in enum_type}
    return [f"static_assert(cupyrope::{cuda_names[m.name]} == {int(m)}, "
            f"\"{enum_type.__name__} {m.name}\");" for m in enum_type]


def _constants_source() -> str:
    checks = [f"static_assert(cupyrope::kMaxTokenDims == {MAX_TOKEN_DIMS}, \"kMaxTokenDims\");",
              f"static_assert(cupyrope::kMaxThreadsPerBlock == {THREADS_PER_BLOCK}, \"threads\");",
              f"static_assert(sizeof(cupyrope::RopeParams) == {PARAMS_DTYPE.itemsize}, \"size\");"]
    checks += _enum_checks(AngleSource, {"CACHE_TABLE": "kCacheTable",
                                         "TOKEN_TABLES": "kTokenTables",
                                         "COMPUTED": "kComputedAngles"})
    checks += _enum_checks(MRopeMode, {"NONE": "kMRopeNone", "SECTIONED": "kMRopeSectioned",
                                       "INTERLEAVED": "kMRopeInterleaved"})
    checks += _enum_checks(StoreFormat, {"INPUT": "kStoreInput", "E4M3": "kStoreE4M3",
                                         "E5M2": "kStoreE5M2", "NVFP4": "kStoreNVFP4"})
    checks += _enum_checks(WeightDtype, {"FLOAT32": "kWeightFloat32", "FLOAT16": "kWeightFloat16",
                                         "BFLOAT16": "kWeightBFloat16"})
    for dtype, vector, interleaved in itertools.product(CUDA_TYPE_NAMES, (True, False), (True, False)):
        access, pairs = access_layout(ITEMSIZE[dtype], vector, interleaved)
        layout = (f"cupyrope::Layout<{CUDA_TYPE_NAMES[dtype]}, {str(vector).lower()}, "
                  f"{str(interleaved).lower()}>")
        checks.append(f"static_assert({layout}::access == {access}, \"access {layout}\");")
        checks.append(f"static_assert({layout}::pairs == {pairs}, \"pairs {layout}\");")
    for name in PARAMS_DTYPE.names:
        field = PARAMS_DTYPE.fields[name][0]
        checks.append(
            f"static_assert(sizeof(((cupyrope::RopeParams*)0)->{name}) == {field.itemsize}, "
            f"\"size of {name}\");")
    checks.append(f"static_assert(sizeof(cupyrope::FusionParams) == {FUSION_PARAMS_DTYPE.itemsize}, "
                  "\"FusionParams size\");")
    # The decode kernel's compact struct: each field's size, and no padding (the sizes add up to
    # the struct's), so that the fields in declaration order sit at DECODE_PARAMS_DTYPE's offsets.
    # The repeat-call path writes the data pointers at RopeParams' offsets into either struct.
    checks.append(f"static_assert(sizeof(cupyrope::DecodeParams) == {DECODE_PARAMS_DTYPE.itemsize}, "
                  "\"DecodeParams size\");")
    sizes = []
    for name in DECODE_PARAMS_DTYPE.names:
        field = DECODE_PARAMS_DTYPE.fields[name][0]
        sizes.append(f"sizeof(((cupyrope::DecodeParams*)0)->{name})")
        checks.append(f"static_assert({sizes[-1]} == {field.itemsize}, \"size of {name}\");")
        if name in PARAMS_DTYPE.names[:8]:
            assert PARAMS_DTYPE.fields[name][1] == DECODE_PARAMS_DTYPE.fields[name][1], name
    checks.append(f"static_assert({' + '.join(sizes)} == sizeof(cupyrope::DecodeParams), "
                  "\"DecodeParams has padding\");")
    return '#include "rotation.cuh"\n' + "\n".join(checks) + "\n"


def test_shared_constants_match_the_cuda_sources():
    log = _compile(_constants_source(), "abi.cu")
    assert log is None, f"cupyrope/core/abi.py differs from the CUDA sources:\n{log}"


def test_a_mismatch_fails_the_check():
    """The check above is not vacuous: one wrong value makes NVRTC refuse the program."""
    wrong = _constants_source().replace(f"kMaxTokenDims == {MAX_TOKEN_DIMS}",
                                        f"kMaxTokenDims == {MAX_TOKEN_DIMS + 1}")
    log = _compile(wrong, "abi_wrong.cu")
    assert log is not None and "kMaxTokenDims" in log


def _layout_source() -> str:
    # __INTADDR__ is the offsetof of NVRTC's front end (EDG): every NVRTC accepts it, where 13.0
    # rejects __builtin_offsetof.
    checks = ["using cupyrope::RopeParams;", "using cupyrope::FusionParams;",
              "using cupyrope::FusedDecodeParams;",
              f"static_assert(sizeof(FusedDecodeParams) == {FUSED_DECODE_PARAMS_DTYPE.itemsize}, "
              "\"FusedDecodeParams size\");"]
    # The fused decode kernel's struct leads with FusionParams' nine data pointers at the same
    # offsets: the repeat-call path writes them into either.
    for name in FUSED_DECODE_PARAMS_DTYPE.names[:9]:
        offset = FUSION_PARAMS_DTYPE.fields[name][1]
        assert FUSED_DECODE_PARAMS_DTYPE.fields[name][1] == offset, name
    for struct, dtype in (("RopeParams", PARAMS_DTYPE), ("FusionParams", FUSION_PARAMS_DTYPE),
                          ("FusedDecodeParams", FUSED_DECODE_PARAMS_DTYPE)):
        for name in dtype.names:
            offset = dtype.fields[name][1]
            checks.append(
                f"static_assert(__INTADDR__(&(({struct}*)0)->{name}) == {offset}, "
                f"\"offset of {name}\");")
    return '#include "rope_params.cuh"\n' + "\n".join(checks) + "\n"


def test_params_struct_matches_numpy_dtype():
    log = _compile(_layout_source(), "layout.cu")
    assert log is None, ("RopeParams, FusionParams or FusedDecodeParams differs from its NumPy "
                         "dtype:\n" + str(log))


def test_a_wrong_offset_fails_the_check():
    """The offset check is not vacuous: one field placed elsewhere makes NVRTC refuse it."""
    offset = PARAMS_DTYPE.fields["sin_sign"][1]
    wrong = _layout_source().replace(f"->sin_sign) == {offset}", f"->sin_sign) == {offset + 8}")
    log = _compile(wrong, "layout_wrong.cu")
    assert log is not None and "offset of sin_sign" in log


def test_every_field_is_eight_bytes():
    # No padding can appear between 8-byte fields, on any ABI.
    for dtype in (PARAMS_DTYPE, FUSION_PARAMS_DTYPE):
        for name in dtype.names:
            assert dtype.fields[name][0].base.itemsize == 8, name
