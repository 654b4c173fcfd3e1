"""Run-time compilation of the kernels in ``kernels_cu/`` through NVRTC.

One specialisation table generates every ``name_expressions`` entry; a specialisation is compiled
on first need, once per (device, angle arithmetic, specialisation), and a fingerprint of
``kernels_cu/`` in the compile options keeps CuPy's disk cache from serving stale binaries.
``angle_arithmetic`` picks float64 or float-float in-kernel angles per device.

Design notes: docs/architecture.md#cudacompilerpy
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.resources
import itertools
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from ..core.abi import AngleSource, StoreFormat
from ..core.arrays import cupy_module
from ..core.dtypes import CUDA_TYPE_NAMES, FLOAT_DTYPES, dtype_name_of, refused_dtype_error

SOURCE_FILE = "rope.cu"


@dataclass(frozen=True)
class KernelSpec:
    """One instantiation of ``cupyrope::rope_kernel`` (or ``rope_lean_kernel``)."""

    dtype: str  # q / k dtype
    table_dtype: str  # cos / sin dtype (float32 placeholder for computed angles)
    vector: bool  # 16-byte accesses (else one element at a time)
    interleaved: bool  # GPT-J pairing (else NeoX)
    source: AngleSource
    wide_index: bool  # 64-bit offsets (else 32-bit: every offset of the launch fits)
    lean: bool = False  # the common case only (see rope.cu): one token dim, no M-RoPE, vector tables
    fused: bool = False  # rope_fused_kernel: RMSNorm, fp8 outputs, KV-cache write (fused.cuh)
    # The lean fused kernel (fused and lean: fused_lean.cuh) is compiled per set of fusions.
    norm: bool = False  # RMSNorm before the rotation
    cache: bool = False  # the k / v cache write
    # rope_decode_kernel: few tokens, one thread per (token, head, chunk); fused too:
    # rope_fused_decode_kernel (fused_decode.cuh), per set of fusions as the lean fused kernel
    decode: bool = False
    # rope_fused_rows_kernel: the general fused kernel with stores quantised per row (per-(token,
    # head) fp8 scales, NVFP4 caches: kernels_cu/quantize.cuh)
    rows: bool = False
    # The lean fused kernel with M-RoPE positions (each pair's position component read once a
    # token); a flag of its own so that the common kernels keep their registers.
    mrope: bool = False
    # The lean fused kernel with lanes for the dims past rotary_dim (a partial rotation: Qwen3-Next,
    # GLM), likewise a flag of its own.
    partial: bool = False
    # rope_fused_all_heads_kernel: the general fused kernel with the norm over all heads of a
    # token (norm_over="all_heads"), stores quantised per row or not; with lean (and norm, cache
    # as the launch has them) rope_fused_lean_all_heads_kernel, its lean layout
    all_heads: bool = False
    # rope_fused_lean_all_heads_kernel: the heads a thread row holds in registers
    # (launch.lean_all_heads_held; 0 for every other kernel)
    held: int = 0
    # rope_fused_staged_kernel (fused_staged.cuh): the norm (with or without the cache write),
    # and M-RoPE or a partial rotation with the cache write, rows by bulk copies through shared
    # memory; Hopper GPUs of fast memory (launch.fused_staged_applies)
    staged: bool = False

    @property
    def name_expression(self) -> str:
        """The instantiation, which is also this specialisation's key in the compiled module."""
        if self.staged:
            return (f"cupyrope::rope_fused_staged_kernel<{CUDA_TYPE_NAMES[self.dtype]}, "
                    f"{CUDA_TYPE_NAMES[self.table_dtype]}, {str(self.interleaved).lower()}, "
                    f"{str(self.norm).lower()}, {str(self.cache).lower()}, "
                    f"{str(self.mrope).lower()}, {str(self.partial).lower()}>")
        if self.fused and self.lean and self.all_heads:
            return (f"cupyrope::rope_fused_lean_all_heads_kernel<{CUDA_TYPE_NAMES[self.dtype]}, "
                    f"{CUDA_TYPE_NAMES[self.table_dtype]}, true, "
                    f"{str(self.interleaved).lower()}, {int(self.source)}, false, "
                    f"{str(self.cache).lower()}, {self.held}>")
        kernel = ("rope_fused_decode_kernel" if self.decode and self.fused else
                  "rope_decode_kernel" if self.decode else
                  "rope_fused_lean_kernel" if self.fused and self.lean else
                  "rope_fused_all_heads_kernel" if self.fused and self.all_heads else
                  "rope_fused_rows_kernel" if self.fused and self.rows else
                  "rope_fused_kernel" if self.fused else
                  "rope_lean_kernel" if self.lean else "rope_kernel")
        flags = (self.vector, self.interleaved)
        fusions = (f", {str(self.norm).lower()}, {str(self.cache).lower()}"
                   + (", true" if self.mrope else ", false, true" if self.partial else "")
                   if self.fused and (self.lean or self.decode) else "")
        return (
            f"cupyrope::{kernel}<{CUDA_TYPE_NAMES[self.dtype]}, "
            f"{CUDA_TYPE_NAMES[self.table_dtype]}, {', '.join(str(f).lower() for f in flags)}, "
            f"{int(self.source)}, {str(self.wide_index).lower()}{fusions}>"
        )


def _specialisations() -> tuple[KernelSpec, ...]:
    specs = []
    for dtype, vector, interleaved, wide in itertools.product(
        FLOAT_DTYPES, (True, False), (False, True), (False, True)
    ):
        for source in (AngleSource.CACHE_TABLE, AngleSource.TOKEN_TABLES):
            for table_dtype in FLOAT_DTYPES:
                specs.append(KernelSpec(dtype, table_dtype, vector, interleaved, source, wide))
        specs.append(KernelSpec(dtype, "float32", vector, interleaved, AngleSource.COMPUTED, wide))
    # The lean kernels: 16-byte accesses and 32-bit offsets only; the decode kernels take the same
    # layouts (launch.decode_kernel_applies), computed angles for 16- and 32-bit floats only
    # (launch.computed_decode_pays).
    lean = [dataclasses.replace(spec, lean=True) for spec in specs
            if spec.vector and not spec.wide_index]
    decode = [dataclasses.replace(spec, decode=True) for spec in lean
              if spec.source != AngleSource.COMPUTED or spec.dtype != "float64"]
    return tuple(specs + lean + decode)


SPECIALISATIONS: tuple[KernelSpec, ...] = _specialisations()

# The fused kernel's dtypes: q/k of 16 or 32 bits (arithmetic in float32), tables float32 or q's
# dtype (what Hugging Face models and vLLM pass).
FUSED_DTYPES = ("float16", "bfloat16", "float32")


def _fused_specialisations() -> tuple[KernelSpec, ...]:
    specs = []
    for dtype, vector, interleaved, wide in itertools.product(
        FUSED_DTYPES, (True, False), (False, True), (False, True)
    ):
        for source in (AngleSource.CACHE_TABLE, AngleSource.TOKEN_TABLES):
            for table_dtype in dict.fromkeys(("float32", dtype)):
                specs.append(KernelSpec(dtype, table_dtype, vector, interleaved, source, wide,
                                        fused=True))
        specs.append(KernelSpec(dtype, "float32", vector, interleaved, AngleSource.COMPUTED, wide,
                                fused=True))
    # The lean fused kernels: 16-byte accesses and 32-bit offsets, one per set of fusions.
    lean = [dataclasses.replace(spec, lean=True, norm=norm, cache=cache)
            for spec in specs if spec.vector and not spec.wide_index
            for norm, cache in itertools.product((False, True), repeat=2)]
    # M-RoPE positions (a cache or computed angles: M-RoPE takes no per-token tables).
    mrope = [dataclasses.replace(spec, mrope=True) for spec in lean
             if spec.source != AngleSource.TOKEN_TABLES]
    # A partial rotation (launch.fused_lean_applies), every angle source.
    partial = [dataclasses.replace(spec, partial=True) for spec in lean]
    # Stores quantised per row: every layout of the general fused kernel.
    rows = [dataclasses.replace(spec, rows=True) for spec in specs]
    # The norm over all heads: every layout of the general fused kernel (rows or not), and the
    # lean layout with and without the cache write (launch.fused_lean_all_heads_applies).
    all_heads = [dataclasses.replace(spec, all_heads=True) for spec in specs]
    # Its lean layout holds two NeoX heads a thread row, four interleaved, and on GPUs of fast
    # memory four NeoX ones (launch.lean_all_heads_held).
    all_heads += [dataclasses.replace(spec, all_heads=True, partial=False, held=held)
                  for spec in lean if spec.norm
                  for held in ((4,) if spec.interleaved else (2, 4))]
    # The fused decode kernels: the lean fused layouts without M-RoPE, few tokens
    # (launch.fused_decode_applies).
    decode = [dataclasses.replace(spec, decode=True) for spec in lean]
    # The staged kernels: the lean layouts of 16-bit q / k from a cos_sin_cache with the norm, the
    # cache write or both (the last two for M-RoPE and partial rotations:
    # launch.fused_staged_applies), and with neither for apply_rope (launch.plain_staged_applies).
    staged = [dataclasses.replace(spec, staged=True) for spec in lean + mrope + partial
              if spec.dtype != "float32" and spec.source == AngleSource.CACHE_TABLE
              and (spec.norm or spec.cache or not (spec.mrope or spec.partial))]
    return tuple(specs + lean + mrope + partial + rows + all_heads + decode + staged)


FUSED_SPECIALISATIONS: tuple[KernelSpec, ...] = _fused_specialisations()
ALL_SPECIALISATIONS = SPECIALISATIONS + FUSED_SPECIALISATIONS


# ------------------------------------------------------------------------------------------------
# rerotate_cache (kernels_cu/rerotate.cuh): one kernel per cache format.

# The cache formats a re-rotation reads and writes: (C++ element type, StoreFormat).
RERO_CACHE_TYPES = {
    "float16": ("cupyrope::half_t", StoreFormat.INPUT),
    "bfloat16": ("cupyrope::bfloat16_t", StoreFormat.INPUT),
    "float32": ("float", StoreFormat.INPUT),
    "float8_e4m3fn": ("unsigned char", StoreFormat.E4M3),
    "float8_e5m2": ("unsigned char", StoreFormat.E5M2),
}


@dataclass(frozen=True)
class RerotateSpec:
    """One instantiation of ``cupyrope::rerotate_cache_kernel``."""

    dtype: str  # the cache's element format (a key of RERO_CACHE_TYPES)
    table_dtype: str  # cos_sin_cache dtype (float32 placeholder for computed angles)
    vector: bool  # 16-byte accesses (else one element at a time)
    interleaved: bool  # GPT-J pairing (else NeoX)
    source: AngleSource  # CACHE_TABLE (row = delta) or COMPUTED
    staged: bool = False  # rerotate_staged_kernel (rows through shared memory; 16-byte units)

    @property
    def name_expression(self) -> str:
        element, store_format = RERO_CACHE_TYPES[self.dtype]
        table = CUDA_TYPE_NAMES[self.table_dtype]
        if self.staged:
            return (f"cupyrope::rerotate_staged_kernel<{element}, {table}, "
                    f"{str(self.interleaved).lower()}, {int(self.source)}, {int(store_format)}>")
        return (f"cupyrope::rerotate_cache_kernel<{element}, {table}, "
                f"{str(self.vector).lower()}, {str(self.interleaved).lower()}, "
                f"{int(self.source)}, {int(store_format)}>")


def _rerotate_specialisations() -> tuple[RerotateSpec, ...]:
    """Every cache format, both widths and pairings; computed angles, and cos_sin_cache tables of
    float32 or (16-bit caches) the cache's own dtype, as for the fused kernel; and the staged
    kernel of each 16-byte layout."""
    specs = []
    for dtype, vector, interleaved in itertools.product(RERO_CACHE_TYPES, (True, False),
                                                        (False, True)):
        tables = dict.fromkeys(("float32", dtype if dtype in CUDA_TYPE_NAMES else "float32"))
        specs += [RerotateSpec(dtype, table, vector, interleaved, AngleSource.CACHE_TABLE)
                  for table in tables]
        specs.append(RerotateSpec(dtype, "float32", vector, interleaved, AngleSource.COMPUTED))
    # The staged kernel (launch.rerotate_staged_layout) of every 16-byte layout above.
    return tuple(specs) + tuple(dataclasses.replace(spec, staged=True) for spec in specs
                                if spec.vector)


RERO_SPECIALISATIONS: tuple[RerotateSpec, ...] = _rerotate_specialisations()
ALL_SPECIALISATIONS = ALL_SPECIALISATIONS + RERO_SPECIALISATIONS


def kernel_source_dir() -> Path:
    """The folder holding the .cu/.cuh sources: package data when installed, else the checkout."""
    try:
        return Path(str(importlib.resources.files("cupyrope.kernels_cu")))
    except ModuleNotFoundError:
        # Running from a source checkout that was not pip-installed: kernels_cu/ sits beside the
        # package, exactly as the wheel's package-dir mapping lays it out.
        checkout = Path(__file__).resolve().parents[2] / "kernels_cu"  # cuda/ -> cupyrope/ -> checkout
        if not (checkout / SOURCE_FILE).is_file():
            raise FileNotFoundError(
                f"cupyrope's CUDA sources are missing: neither the installed package data "
                f"'cupyrope.kernels_cu' nor {checkout} holds {SOURCE_FILE}; reinstall cupyrope"
            ) from None
        return checkout


@functools.lru_cache(maxsize=None)
def _read_sources() -> tuple[str, str]:
    """(text of rope.cu, sha256 over every .cu/.cuh file in kernels_cu/)."""
    folder = kernel_source_dir()
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.suffix in (".cu", ".cuh"):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return (folder / SOURCE_FILE).read_text(), digest.hexdigest()[:16]


def source_fingerprint() -> str:
    return _read_sources()[1]


ANGLE_ARITHMETIC_ENV = "CUPYROPE_ANGLE_ARITHMETIC"
ANGLE_ARITHMETICS = ("float64", "float-float")

# Compute capabilities whose FP64 units run at half the FP32 rate (results per clock per SM, CUDA
# C++ Programming Guide, "Arithmetic Instructions" throughput table: 32 of 64 on 6.0 P100, 7.0
# V100, 8.0 A100; 64 of 128 on 9.0 H100 / H200; and B200 / GB200, 10.0, per NVIDIA's Blackwell
# datasheet: 40 of 80 TFLOPS). Every other GPU runs FP64 at 1/32 (5.x, 6.1, 6.2, 7.2, 7.5) or
# 1/64 (8.6, 8.7, 8.9, 12.x) of FP32, and Blackwell Ultra (10.3, B300 / GB300) cut it to ~1/64
# (1.25 of 75 TFLOPS): there float-float angles avoid FP64 altogether.
FULL_RATE_FP64_CAPABILITIES = frozenset({(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)})


def arithmetic_for_capability(major: int, minor: int) -> str:
    """The in-kernel angle arithmetic for a compute capability: "float64" where FP64 is full rate
    (``FULL_RATE_FP64_CAPABILITIES``), "float-float" elsewhere (unknown future GPUs included: it
    is as accurate, and needs no FP64 at all).

    >>> arithmetic_for_capability(9, 0), arithmetic_for_capability(8, 9)
    ('float64', 'float-float')
    """
    return "float64" if (int(major), int(minor)) in FULL_RATE_FP64_CAPABILITIES else "float-float"


def angle_arithmetic_setting() -> str:
    """``CUPYROPE_ANGLE_ARITHMETIC`` as the environment holds it now: "auto" (unset or empty: by
    device), "float64" or "float-float"; any other value raises ValueError."""
    raw = os.environ.get(ANGLE_ARITHMETIC_ENV, "")
    value = raw.strip().lower() or "auto"
    allowed = ("auto",) + ANGLE_ARITHMETICS
    if value not in allowed:
        raise ValueError(f"{ANGLE_ARITHMETIC_ENV}={raw!r} is not one of "
                         f"{', '.join(repr(a) for a in allowed)}")
    return value


@functools.lru_cache(maxsize=1)
def _setting_in_use() -> str:
    """``angle_arithmetic_setting()`` as read when a kernel was first needed; ``clear_cache()``
    forgets it (reading the environment on every call would cost the host path microseconds)."""
    return angle_arithmetic_setting()


@functools.lru_cache(maxsize=None)
def _compute_capability(device_id: int) -> tuple[int, int]:
    capability = cupy_module().cuda.Device(device_id).compute_capability  # e.g. "86"
    return int(capability[:-1]), int(capability[-1])


def angle_arithmetic(device_id: int) -> str:
    """How kernels compiled for ``device_id`` reduce in-kernel angles of float16 / bfloat16 /
    float32 q and k: ``CUPYROPE_ANGLE_ARITHMETIC`` if set to "float64" or "float-float", else
    ``arithmetic_for_capability`` of the device (float64 arrays always use float64). The variable
    is read once, at the first kernel a process needs; after changing it, call
    ``cupyrope.clear_cache()``."""
    setting = _setting_in_use()
    if setting != "auto":
        return setting
    return arithmetic_for_capability(*_compute_capability(device_id))


def kernel_arithmetic(spec: KernelSpec, device_id: int) -> str | None:
    """The arithmetic ``spec`` is compiled with on ``device_id``: None where the choice changes
    nothing (table-read angles, float64 q/k), so that those binaries never depend on it."""
    _setting_in_use()  # a bad value raises whatever the kernel
    if spec.source != AngleSource.COMPUTED or spec.dtype == "float64":
        return None
    return angle_arithmetic(device_id)


def compile_options(arithmetic: str | None = None) -> tuple[str, ...]:
    """NVRTC options shared by every specialisation (architecture is added per device), with the
    in-kernel angle arithmetic ("float64" or "float-float"; None: the header's default, float64)."""
    options = (
        "--std=c++17",
        f"-I{kernel_source_dir()}",
        # Part of CuPy's disk-cache key: any edit to a header gives new binaries.
        f"-DCUPYROPE_SOURCES_FINGERPRINT=0x{source_fingerprint()}",
    )
    if arithmetic is None:
        return options
    if arithmetic not in ANGLE_ARITHMETICS:
        raise ValueError(f"compile_options: arithmetic must be one of {ANGLE_ARITHMETICS} or None, "
                         f"got {arithmetic!r}")
    return options + (f"-DCUPYROPE_ANGLES_FLOAT_FLOAT={int(arithmetic == 'float-float')}",)


class CompiledKernel:
    """A loaded kernel: its driver handle plus the objects that keep the module alive."""

    __slots__ = ("spec", "device_id", "angle_arithmetic", "ptr", "num_regs", "_module",
                 "_function")

    def __init__(self, spec: KernelSpec, device_id: int, module, function,
                 angle_arithmetic: str | None = None):
        self.spec = spec
        self.device_id = device_id
        self.angle_arithmetic = angle_arithmetic  # None: the kernel computes no float angles
        self._module = module
        self._function = function
        self.ptr = function.kernel.ptr
        self.num_regs = function.num_regs  # sizes the launch geometry (blocks per SM)


# Keyed on (device, angle arithmetic, spec): kernels compiled one way are never handed out for the
# other (CUPYROPE_ANGLE_ARITHMETIC changed, then clear_cache()).
_compiled: dict[tuple[int, str | None, KernelSpec], CompiledKernel] = {}
_locks: dict[tuple[int, str | None, KernelSpec], threading.Lock] = {}
_locks_guard = threading.Lock()


def current_device() -> int:
    """The current CUDA device of this thread (CuPy's view, which torch's device guard shares)."""
    return cupy_module().cuda.runtime.getDevice()


def is_compiled(spec: KernelSpec, device_id: int) -> bool:
    """Whether ``spec`` is compiled and loaded on ``device_id`` in this process (with the angle
    arithmetic that ``get_kernel`` would use now)."""
    return (device_id, kernel_arithmetic(spec, device_id), spec) in _compiled


def get_kernel(spec: KernelSpec, device_id: int) -> CompiledKernel:
    """The compiled kernel for ``spec`` on ``device_id``, compiling it on first use."""
    arithmetic = kernel_arithmetic(spec, device_id)
    key = (device_id, arithmetic, spec)
    kernel = _compiled.get(key)
    if kernel is not None:
        return kernel
    with _locks_guard:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:  # other threads asking for the same kernel wait for this compile
        kernel = _compiled.get(key)
        if kernel is None:
            kernel = _compile(spec, device_id, arithmetic)
            _compiled[key] = kernel
    return kernel


def _compile(spec: KernelSpec, device_id: int, arithmetic: str | None = None) -> CompiledKernel:
    cupy = cupy_module()
    source, _ = _read_sources()
    with cupy.cuda.Device(device_id):
        module = cupy.RawModule(
            code=source, options=compile_options(arithmetic),
            name_expressions=(spec.name_expression,)
        )
        try:
            function = module.get_function(spec.name_expression)
        except cupy.cuda.compiler.CompileException as exc:
            raise RuntimeError(
                f"NVRTC failed to compile {spec.name_expression} for device {device_id}:\n{exc}"
            ) from exc
        function.kernel  # load the module now, not on the first launch
    return CompiledKernel(spec, device_id, module, function, arithmetic)


def compile_specialisations(
    dtypes=("bfloat16", "float16", "float32"),
    *,
    table_dtypes=("float32",),
    sources=tuple(AngleSource),
    interleaved=(False, True),
    vector=(True, False),
    wide_index=(False,),
    device: int | None = None,
) -> int:
    """Compile chosen specialisations ahead of time; returns how many are ready.

    Each 16-byte specialisation with 32-bit offsets comes three times: the decode kernel that
    common layouts run with few tokens, the lean kernel that they run otherwise and the general
    one that every other layout runs; all are compiled.

    Parameters
    ----------
    dtypes : iterable of str
        q / k dtypes among ``float16``, ``bfloat16``, ``float32``, ``float64``.
    table_dtypes : iterable of str
        cos/sin table dtypes for the table-based angle sources.
    sources : iterable of AngleSource or {"cache", "tables", "computed"}
    interleaved, vector : iterables of bool
        Pairings and access widths to compile.
    wide_index : iterable of bool
        64-bit offsets (for tensors whose offsets pass 2^31 elements) and/or 32-bit ones.
    device : int, optional
        CUDA device ordinal; the current device by default.

    Examples
    --------
    >>> import cupyrope as cr
    >>> cr.warmup(dtypes=("bfloat16",), sources=("cache",), interleaved=(False,))  # doctest: +SKIP
    4
    """
    wanted_sources = {_as_source(s) for s in sources}
    if isinstance(dtypes, str) or isinstance(table_dtypes, str):
        raise TypeError("warmup: dtypes and table_dtypes are collections of dtypes, e.g. "
                        "dtypes=('bfloat16',), not a single string")
    named = {}
    for name, values in (("dtypes", dtypes), ("table_dtypes", table_dtypes)):
        names = [dtype_name_of(v) for v in values]  # strings or NumPy / torch / JAX dtypes
        unknown = [v for v, n in zip(values, names) if n not in FLOAT_DTYPES]
        if unknown:  # a value that names no dtype at all is a TypeError, as for every dtype argument
            error = TypeError if any(refused_dtype_error(v) is TypeError for v in unknown) else ValueError
            raise error(f"warmup: {name} must be among {FLOAT_DTYPES}, got {sorted(map(str, unknown))}")
        named[name] = set(names)
    dtypes, table_dtypes = named["dtypes"], named["table_dtypes"]
    device_id = current_device() if device is None else int(device)
    count = 0
    for spec in SPECIALISATIONS:
        if (
            spec.dtype in dtypes
            and spec.source in wanted_sources
            and spec.interleaved in interleaved
            and spec.vector in vector
            and spec.wide_index in wide_index
            and (spec.source == AngleSource.COMPUTED or spec.table_dtype in table_dtypes)
        ):
            get_kernel(spec, device_id)
            count += 1
    return count


_SOURCE_NAMES = {
    "cache": AngleSource.CACHE_TABLE,
    "tables": AngleSource.TOKEN_TABLES,
    "computed": AngleSource.COMPUTED,
}


def _as_source(value) -> AngleSource:
    if isinstance(value, AngleSource):
        return value
    if value in _SOURCE_NAMES:
        return _SOURCE_NAMES[value]
    raise ValueError(f"warmup: sources must be among {sorted(_SOURCE_NAMES)}, got {value!r}")


# Modules forgotten by clear_cache stay loaded: a captured CUDA graph may still launch them.
_retired: list[CompiledKernel] = []


def clear_cache() -> None:
    """Forget every compiled kernel in this process (CuPy's disk cache stays) and the
    ``CUPYROPE_ANGLE_ARITHMETIC`` setting read; the next call reads it again and compiles (or
    loads from disk) again. Loaded modules are kept, never unloaded."""
    with _locks_guard:
        _retired.extend(_compiled.values())
        _compiled.clear()
        _locks.clear()
    _read_sources.cache_clear()
    _setting_in_use.cache_clear()


# ------------------------------------------------------------------------------------------------
# The DeepSeek MLA ops (kernels_cu/mla.cuh): one kernel per activation dtype, access width,
# pairing and angle source (the store formats, input dtype or fp8, are launch parameters).

MLA_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class MlaSpec:
    """One instantiation of ``cupyrope::mla_rope_kernel``."""

    dtype: str  # q / k_pe / kv_c dtype
    table_dtype: str  # cos_sin_cache dtype (float32 placeholder for computed angles)
    vector: bool  # 16-byte accesses (else one element at a time)
    interleaved: bool  # GPT-J pairing (else NeoX)
    source: AngleSource  # CACHE_TABLE or COMPUTED
    wide_index: bool = False  # 64-bit element offsets (else 32-bit: every array's reach fits)
    # mla_staged_kernel (mla_staged.cuh): rows by bulk copies through shared memory, for many
    # tokens of contiguous rows on Hopper GPUs of fast memory (mla_launch.mla_staged_applies);
    # 16-bit, vector, from a cos_sin_cache, 64-bit offsets
    staged: bool = False

    @property
    def name_expression(self) -> str:
        if self.staged:
            return (f"cupyrope::mla_staged_kernel<{CUDA_TYPE_NAMES[self.dtype]}, "
                    f"{CUDA_TYPE_NAMES[self.table_dtype]}, {str(self.interleaved).lower()}>")
        return (f"cupyrope::mla_rope_kernel<{CUDA_TYPE_NAMES[self.dtype]}, "
                f"{CUDA_TYPE_NAMES[self.table_dtype]}, {str(self.vector).lower()}, "
                f"{str(self.interleaved).lower()}, {int(self.source)}, "
                f"{str(self.wide_index).lower()}>")


def _mla_specialisations() -> tuple[MlaSpec, ...]:
    """Every MLA dtype, both widths, pairings and offset widths; computed angles, and
    cos_sin_cache tables of float32 or (16-bit activations) the activations' own dtype; the
    staged kernels."""
    specs = []
    for dtype, vector, interleaved, wide in itertools.product(MLA_DTYPES, (True, False),
                                                              (True, False), (False, True)):
        specs += [MlaSpec(dtype, table, vector, interleaved, AngleSource.CACHE_TABLE, wide)
                  for table in dict.fromkeys(("float32", dtype))]
        specs.append(MlaSpec(dtype, "float32", vector, interleaved, AngleSource.COMPUTED, wide))
    # The staged kernels: 16-bit, from a cos_sin_cache of float32 or their dtype, both pairings.
    specs += [MlaSpec(dtype, table, True, interleaved, AngleSource.CACHE_TABLE, True, staged=True)
              for dtype, interleaved in itertools.product(("float16", "bfloat16"), (True, False))
              for table in ("float32", dtype)]
    return tuple(specs)


MLA_SPECIALISATIONS: tuple[MlaSpec, ...] = _mla_specialisations()
ALL_SPECIALISATIONS = ALL_SPECIALISATIONS + MLA_SPECIALISATIONS
