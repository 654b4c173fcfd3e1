"""The NumPy mirror of RopeParams must match the C++ struct byte for byte (checked by NVRTC)."""

import pytest

from cupyrope import kernels
from cupyrope.abi import MAX_TOKEN_DIMS, PARAMS_DTYPE

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")


def _layout_source() -> str:
    checks = ["using cupyrope::RopeParams;",
              f"static_assert(sizeof(RopeParams) == {PARAMS_DTYPE.itemsize}, \"size\");",
              f"static_assert(cupyrope::kMaxTokenDims == {MAX_TOKEN_DIMS}, \"kMaxTokenDims\");"]
    for name in PARAMS_DTYPE.names:
        field, offset = PARAMS_DTYPE.fields[name][:2]
        checks.append(
            f"static_assert(__builtin_offsetof(RopeParams, {name}) == {offset}, "
            f"\"offset of {name}\");")
        checks.append(
            f"static_assert(sizeof(((RopeParams*)0)->{name}) == {field.itemsize}, "
            f"\"size of {name}\");")
    return '#include "rope_params.cuh"\n' + "\n".join(checks) + "\n"


def _nvrtc_has_offsetof() -> bool:
    """Some NVRTC builds (seen with a CUDA 13.0 toolkit's) reject __builtin_offsetof."""
    probe = nvrtc.createProgram("struct S { long long a, b; };\n"
                                "static_assert(__builtin_offsetof(S, b) == 8, \"b\");\n",
                                "probe.cu", [], [])
    try:
        nvrtc.compileProgram(probe, ["--gpu-architecture=sm_80"])
        return True
    except nvrtc.NVRTCError:
        return False
    finally:
        nvrtc.destroyProgram(probe)


def test_params_struct_matches_numpy_dtype():
    if not _nvrtc_has_offsetof():
        pytest.skip(f"NVRTC {nvrtc.getVersion()} does not compile __builtin_offsetof")
    program = nvrtc.createProgram(_layout_source(), "layout.cu", [], [])
    try:
        nvrtc.compileProgram(program, list(kernels.compile_options()) + ["--gpu-architecture=sm_80"])
    except nvrtc.NVRTCError:
        pytest.fail("RopeParams layout differs from PARAMS_DTYPE:\n" + nvrtc.getProgramLog(program))
    finally:
        nvrtc.destroyProgram(program)


def test_every_field_is_eight_bytes():
    # No padding can appear between 8-byte fields, on any ABI.
    for name in PARAMS_DTYPE.names:
        field = PARAMS_DTYPE.fields[name][0]
        assert field.base.itemsize == 8, name
