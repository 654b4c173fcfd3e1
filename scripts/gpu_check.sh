#!/usr/bin/env bash
# GPU check of cupyrope, for the device machine (a CUDA GPU with torch, CuPy, JAX, pytest and
# ml_dtypes preinstalled, no internet). Run it from the repository root:
#
#     bash scripts/gpu_check.sh
#
# It prints the GPU and the versions in use, installs this checkout in editable mode (or falls back
# to PYTHONPATH), compiles every kernel specialisation for this GPU with this machine's NVRTC (the
# kernel cache; a specialisation that fails to compile fails the check), runs the GPU test suite
# in parallel (every test marked gpu, plus the ABI tests under this machine's NVRTC; the pure CPU
# tests and the NVRTC builds of every architecture with their spill checks are CI's), times the
# first call of a new process with a cold and with a warm CuPy kernel cache, runs the benchmarks,
# and prints a summary table last. The exit status is pytest's, or 1 when the kernel cache
# failed. 2026-11-28, 16 cores: H200 296 s (kernel cache 51 s, the suite 84 s, the torch.compile /
# XLA pre-step 48 s, the benchmarks 106 s); H100 380 s (69 / 111 / 61 / 130; the aim is 300 s);
# H200 on a slower host 412 s (69 / 112 / 66 / 157: every step is CPU-bound but the benchmarks);
# H200 at 278147e 350 s (65 / 104 / 57 / 116).
#
# Files written to ${OUT:-/tmp} (the device tool returns at most 8): pytest.log, pytest.xml (times),
# first_call_{cold,warm}.log, and, when they run, bench.log, bench_summary.md, bench.json, sweep/ (table, JSON,
# plot) and sanitizer_{memcheck,racecheck}[.K].log.
#
# Knobs (environment):
#   GPU_CHECK_SUITE=0             skip the test suite (e.g. for a sanitizer-only run)
#   GPU_CHECK_WORKERS=N           pytest-xdist workers for the suite (default: nproc; GPU tests share
#                                 the one GPU)
#   GPU_CHECK_NVRTC=1             also run the NVRTC build tests (tests/test_kernel_compile.py:
#                                 lowering, spills, FP64-free float-float PTX) under this machine's
#                                 NVRTC; ~60 s more on 16 cores
#   CUPYROPE_COMPILE_ARCHS=sm_90  the architectures those builds cover (default: this GPU's; "" for
#                                 all four, as CI; "none" without GPU_CHECK_NVRTC)
#   GPU_CHECK_BENCH=0             skip the benchmarks
#   GPU_CHECK_BENCH_TIMEOUT=240   seconds the timed pytest benchmarks may take at most
#   GPU_CHECK_BENCH_PRECOMPILE=0  skip compiling the torch.compile peers on every core first
#   GPU_CHECK_SWEEP=1             also run the reference sweep (python -m cupyrope bench: table,
#                                 JSON and plot in sweep/; ~2 more minutes with every peer)
#   GPU_CHECK_SANITIZER=1         also run the kernel and reliability tests under compute-sanitizer
#                                 memcheck and racecheck (one process each, side by side)
#   GPU_CHECK_SANITIZER_TIMEOUT=300  seconds each sanitizer process may take at most (the two run
#                                 side by side; a run cut short reports the tests it passed)
#   GPU_CHECK_SANITIZER_K=...     the -k expression of that run (default: a subset that covers
#                                 every angle source, pairing, dtype and layout; "" for all)
#   GPU_CHECK_SANITIZER_FILES=... the test files (paths, space-separated) of that run (default: the
#                                 kernel and reliability files; "tests" with GPU_CHECK_SANITIZER_K=""
#                                 for the whole GPU suite, as SPEC section 5 asks)
#   GPU_CHECK_SANITIZER_SHARDS=N  sanitizer processes per tool (default 1), each over every N-th
#                                 test (CUPYROPE_TEST_SHARD), spread over the visible GPUs; logs
#                                 sanitizer_{memcheck,racecheck}.K.log when N > 1
#   GPU_CHECK_SANITIZER_MAXFAIL=1 failed tests after which a sanitizer process stops (default 1)
#   The whole GPU suite (SPEC section 5) on four GPUs, 64 cores: GPU_CHECK_SUITE=0 GPU_CHECK_BENCH=0
#   GPU_CHECK_SANITIZER=1 GPU_CHECK_SANITIZER_FILES=tests GPU_CHECK_SANITIZER_K="" \
#   GPU_CHECK_SANITIZER_SHARDS=14 GPU_CHECK_SANITIZER_MAXFAIL=20 GPU_CHECK_SANITIZER_TIMEOUT=480
#   (at 5dda58c ~3-6.5 minutes a shard: see docs/reliability.md)
#   GPU_CHECK_WHEELS=DIR          wheels installed (no index, no dependencies) into a scratch
#                                 directory put first on PYTHONPATH, for peers the machine lacks:
#                                 the benchmarks' Liger-Kernel rows (pip download --no-deps
#                                 liger-kernel; torch and triton are on the device images)
#   CUPYROPE_REQUIRE_INTEROP      default "torch,jax": the suite fails at start if one cannot be
#                                 imported (set it empty to let those tests skip instead)
#   PYTHON                        interpreter (default: python)
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2  # the repository root
OUT_DIR="${OUT:-/tmp}"
mkdir -p "${OUT_DIR}"
PY="${PYTHON:-python3}"  # on the device images python3 is the interpreter that has torch

# JAX would otherwise take 75% of the GPU memory at its first array, starving the CuPy and torch
# tests of the same pytest process.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export CUPYROPE_REQUIRE_INTEROP="${CUPYROPE_REQUIRE_INTEROP-torch,jax}"
# tests/test_kernel_compile.py must fail, not skip, if NVRTC cannot be loaded here.
export CUPYROPE_REQUIRE_NVRTC="${CUPYROPE_REQUIRE_NVRTC-1}"
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1
# Inductor compiles Triton kernels in a pool of min(32, cores) subprocesses per Python process,
# each importing torch: under pytest-xdist that is one pool per worker, 16 x 16 processes on 16
# cores. The parallel steps (the suite, the benchmarks' torch.compile caches) set it to 1 on their
# command lines: their workers already fill the cores. The timed benchmarks keep the default.
XDIST_INDUCTOR=(env TORCHINDUCTOR_COMPILE_THREADS=1)

section() { echo; echo "=== [${SECONDS}s] $*"; }

# ------------------------------------------------------------------------------------------------
section "GPU"
nvidia-smi -L || echo "(nvidia-smi failed)"
GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)"

# The versions (importing torch, JAX and CuPy: ~10 s on one core) are read beside the install and
# the kernel cache, and printed after them.
VERSIONS_LOG="$(mktemp "${TMPDIR:-/tmp}/gpu_check_versions.XXXXXX")"
"${PY}" - >"${VERSIONS_LOG}" 2>&1 <<'EOF' &
import importlib
import platform

print(f"python     {platform.python_version()} ({platform.machine()})")
for name in ("numpy", "ml_dtypes", "cupy", "torch", "jax", "jaxlib", "pytest", "setuptools"):
    try:
        module = importlib.import_module(name)
        print(f"{name:10s} {getattr(module, '__version__', '?')}")
    except Exception as exc:
        print(f"{name:10s} NOT IMPORTABLE ({type(exc).__name__}: {exc})")
try:
    import torch

    print(f"torch CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()}")
except Exception:
    pass
try:
    import cupy
    from cupy_backends.cuda.libs import nvrtc

    rt = cupy.cuda.runtime

    def _name(raw):
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    print(f"CUDA runtime {rt.runtimeGetVersion()}, driver {rt.driverGetVersion()}, "
          f"NVRTC {'.'.join(map(str, nvrtc.getVersion()))}, "
          f"device 0: {_name(rt.getDeviceProperties(0)['name'])}")
except Exception as exc:
    print(f"CuPy CUDA details unavailable ({type(exc).__name__}: {exc})")
try:
    import jax

    print(f"jax devices: {jax.devices()}")
except Exception as exc:
    print(f"jax devices unavailable ({type(exc).__name__}: {exc})")
EOF
VERSIONS_PID=$!
if [[ -z "${GPU_NAME}" ]]; then
    GPU_NAME="$("${PY}" -c 'import cupy; n = cupy.cuda.runtime.getDeviceProperties(0)["name"]; print(n.decode() if isinstance(n, bytes) else n)' 2>/dev/null || echo unknown)"
fi

# ------------------------------------------------------------------------------------------------
WHEELS="none"
if [[ -n "${GPU_CHECK_WHEELS:-}" ]]; then
    section "wheels from ${GPU_CHECK_WHEELS}"
    wheel_site="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_site.XXXXXX")"
    wheel_files=("${GPU_CHECK_WHEELS}"/*.whl)
    if [[ ! -e "${wheel_files[0]}" ]]; then
        WHEELS="none found in ${GPU_CHECK_WHEELS}"
    elif "${PY}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "${wheel_site}" "${wheel_files[@]}" >"/tmp/pip_wheels.log" 2>&1; then
        export PYTHONPATH="${wheel_site}${PYTHONPATH:+:${PYTHONPATH}}"
        WHEELS="$(for f in "${wheel_files[@]}"; do basename "${f}" .whl; done | paste -sd ' ')"
    else
        WHEELS="install failed (pip_wheels.log): $(grep -iE 'error' /tmp/pip_wheels.log | tail -n 1)"
    fi
    echo "${WHEELS}"
fi

# ------------------------------------------------------------------------------------------------
section "install (editable, no deps, no build isolation)"
if "${PY}" -m pip install -e . --no-deps --no-build-isolation >"/tmp/pip_install.log" 2>&1; then
    INSTALL="pip install -e ."
    echo "installed"
else
    INSTALL="PYTHONPATH (pip install failed)"
    echo "pip install -e . failed; its errors (pip_install.log has it all):"
    grep -iE 'error' "/tmp/pip_install.log" | tail -n 5
    echo "falling back to PYTHONPATH=${PWD}"
    export PYTHONPATH="${PWD}${PYTHONPATH:+:${PYTHONPATH}}"
fi
"${PY}" -c 'import cupyrope, cupyrope.cuda.compiler as k; print("cupyrope", cupyrope.__version__, "from", cupyrope.__file__); print("kernel sources:", k.kernel_source_dir())'

# ------------------------------------------------------------------------------------------------
# Every specialisation compiled once, one process per core, before the tests start: else several
# pytest workers compile the same kernels at once on their first calls. This is also the check
# that every specialisation compiles with this machine's NVRTC for this GPU.
KERNEL_CACHE="not run"
KERNEL_CACHE_STATUS=0
if [[ "${GPU_CHECK_SUITE:-1}" != 0 || "${GPU_CHECK_SANITIZER:-0}" == 1 ]]; then
    section "kernel cache: python -m cupyrope compile"
    "${PY}" -m cupyrope compile >/tmp/kernel_cache.log 2>&1
    KERNEL_CACHE_STATUS=$?
    tail -n 3 /tmp/kernel_cache.log
    KERNEL_CACHE="$(tail -n 1 /tmp/kernel_cache.log) (exit ${KERNEL_CACHE_STATUS})"
fi

section "versions"
wait "${VERSIONS_PID}"
cat "${VERSIONS_LOG}"
rm -f "${VERSIONS_LOG}"

PYTEST_STATUS=0
SUMMARY_LINE="(suite not run)"
if [[ "${GPU_CHECK_SUITE:-1}" != 0 ]]; then
    section "test suite"
    TIMEOUT_ARGS=()
    if "${PY}" -c 'import pytest_timeout' 2>/dev/null; then
        TIMEOUT_ARGS=(--timeout=600)
    else
        echo "(pytest-timeout is not installed: running without --timeout)"
    fi
    XDIST_ARGS=()
    if "${PY}" -c 'import xdist' 2>/dev/null; then
        # loadgroup: the tests of one NVRTC build stay on one worker (tests/test_kernel_compile.py)
        XDIST_ARGS=(-n "${GPU_CHECK_WORKERS:-$(nproc)}" --dist loadgroup)
    else
        echo "(pytest-xdist is not installed: running on one worker)"
    fi
    # The GPU-relevant suite: tests marked gpu, and the NVRTC tests (this machine's NVRTC may
    # differ from CI's). Their builds of every specialisation repeat the kernel cache's compile
    # (with ptxas' report), so they run only with GPU_CHECK_NVRTC=1, for this GPU's architecture:
    # CI builds every architecture. The pure NumPy-path tests run in CI.
    if [[ "${GPU_CHECK_NVRTC:-0}" != 1 ]]; then
        export CUPYROPE_COMPILE_ARCHS=none
    elif [[ -z "${CUPYROPE_COMPILE_ARCHS+set}" ]]; then
        CUPYROPE_COMPILE_ARCHS="$("${PY}" -c 'import cupy; d = cupy.cuda.Device(0); print("sm_" + d.compute_capability)' 2>/dev/null)"
        export CUPYROPE_COMPILE_ARCHS
    fi
    echo "NVRTC builds for: ${CUPYROPE_COMPILE_ARCHS:-every architecture} (GPU_CHECK_NVRTC=1 runs them)"
    "${XDIST_INDUCTOR[@]}" "${PY}" -m pytest tests -m "gpu or nvrtc" -q -rfEs --maxfail=25 --durations=12 ${XDIST_ARGS[@]+"${XDIST_ARGS[@]}"} \
        --junitxml="${OUT_DIR}/pytest.xml" \
        ${TIMEOUT_ARGS[@]+"${TIMEOUT_ARGS[@]}"} -p no:cacheprovider 2>&1 | tee "${OUT_DIR}/pytest.log"
    PYTEST_STATUS=${PIPESTATUS[0]}
    # pytest's last line, e.g. "250 passed, 3 skipped in 95.21s (0:01:35)".
    SUMMARY_LINE="$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected)' "${OUT_DIR}/pytest.log" \
        | grep -E ' in [0-9.]+s' | tail -n 1)"
    echo "pytest exit status: ${PYTEST_STATUS}"
fi

count() {  # count WORD: the number before WORD in pytest's summary line, 0 when absent
    local n
    n="$(echo "${SUMMARY_LINE}" | grep -Eo "(^|[^a-z])[0-9]+ $1" | grep -Eo '[0-9]+' | head -n 1)"
    echo "${n:-0}"
}

# ------------------------------------------------------------------------------------------------
# First use in a new process: import cupyrope + first apply_rope (bf16, cache source) + sync.
# CUDA context and inputs are made before the clock starts; they are not cupyrope's cost.
FIRST_CALL_PY='
import time
import numpy as np
import cupy as cp
import ml_dtypes

rng = np.random.default_rng(0)
T, HQ, HK, D, MAX_POSITION = 16, 8, 2, 128, 4096
dtype = np.dtype(ml_dtypes.bfloat16)
def to_gpu(host):
    return cp.asarray(host.view(np.uint16)).view(dtype)
q_host = rng.standard_normal((T, HQ, D)).astype(dtype)
k_host = rng.standard_normal((T, HK, D)).astype(dtype)
positions_host = rng.integers(0, MAX_POSITION, T)
inv_freq = 1.0 / 10000.0 ** (np.arange(0, D, 2) / D)
angles = np.arange(MAX_POSITION)[:, None] * inv_freq
cache_host = np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)
q, k = to_gpu(q_host), to_gpu(k_host)
positions, cache = cp.asarray(positions_host), cp.asarray(cache_host)
cp.cuda.Device().synchronize()

start = time.perf_counter()
import cupyrope as cr
imported = time.perf_counter()
q_out, k_out = cr.apply_rope(q, k, positions, cos_sin_cache=cache)
cp.cuda.Device().synchronize()
done = time.perf_counter()

# Sanity: the same call on the NumPy path.
q_ref, _ = cr.apply_rope(q_host, k_host, positions_host, cos_sin_cache=cache_host)
got = q_out.view(cp.uint16).get().view(dtype).astype(np.float64)
err = float(np.max(np.abs(got - q_ref.astype(np.float64))))
print(f"RESULT import_s={imported - start:.4f} first_call_s={done - imported:.4f} "
      f"total_s={done - start:.4f} max_err_vs_numpy={err:.3g}")
'

first_call() {  # first_call LABEL CACHE_DIR -> prints total seconds (or "failed")
    local label="$1" cache_dir="$2" log="${OUT_DIR}/first_call_$1.log" t0 t1
    t0="$(date +%s.%N)"
    CUPY_CACHE_DIR="${cache_dir}" "${PY}" -c "${FIRST_CALL_PY}" >"${log}" 2>&1
    local status=$?
    t1="$(date +%s.%N)"
    echo "process wall time (python start to exit): $(awk "BEGIN { printf \"%.3f\", ${t1} - ${t0} }") s" >>"${log}"
    if [[ ${status} -ne 0 ]]; then
        echo "failed (exit ${status}, see first_call_${label}.log)"
        return
    fi
    sed -n 's/.*total_s=\([0-9.]*\).*/\1/p' "${log}" | tail -n 1
}

section "first call in a fresh process"
COLD_CACHE_DIR="$(mktemp -d "${TMPDIR:-/tmp}/cupyrope_cold_cache.XXXXXX")"
COLD_S="$(first_call cold "${COLD_CACHE_DIR}")"
echo "cold CuPy cache (${COLD_CACHE_DIR}):"
cat "${OUT_DIR}/first_call_cold.log"
echo "files in the cache after it: $(find "${COLD_CACHE_DIR}" -type f | wc -l)"
WARM_S="$(first_call warm "${COLD_CACHE_DIR}")"
echo "warm CuPy cache (same folder, new process):"
cat "${OUT_DIR}/first_call_warm.log"
rm -rf "${COLD_CACHE_DIR}"

# ------------------------------------------------------------------------------------------------
BENCH="not run (no benchmarks/)"
if [[ "${GPU_CHECK_BENCH:-1}" == 0 ]]; then
    BENCH="skipped (GPU_CHECK_BENCH=0)"
elif [[ -d benchmarks ]] && ! grep -rlq --include='*.py' -E '^\s*def test_' benchmarks 2>/dev/null; then
    BENCH="not run (no tests in benchmarks/)"
elif [[ -d benchmarks ]] && ! "${PY}" -c 'import pytest_benchmark' 2>/dev/null; then
    BENCH="not run (pytest-benchmark is not installed)"
elif [[ -d benchmarks ]]; then
    if [[ "${GPU_CHECK_SWEEP:-0}" == 1 ]]; then
        section "reference sweep: table, JSON and plot in ${OUT_DIR}/sweep"
        timeout --signal=INT --kill-after=30 300 \
            "${PY}" -m cupyrope bench --out "${OUT_DIR}/sweep" 2>&1 | tail -n 60
    fi
    # torch.compile of the unfused sequences takes most of the benchmarks' time when done one
    # case after another. Compiling them first on every core (pytest-benchmark times nothing
    # under xdist: each case runs once) leaves Inductor's FX-graph and Triton caches on disk for
    # the timed run, which then only traces (each case compiles one graph for its own shapes:
    # cupyrope.bench compiles with dynamic=False). Its failures do not count: the timed run is
    # the check. (Run beside the kernel cache instead, both took as long as one after the other.)
    # XLA's compiles of the JAX benchmarks (about a second each) go to JAX's persistent cache the
    # same way (executables that call back into Python are never cached: those compile again).
    JAX_COMPILATION_CACHE_DIR="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_jax_cache.XXXXXX")"
    export JAX_COMPILATION_CACHE_DIR JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
    if [[ "${GPU_CHECK_BENCH_PRECOMPILE:-1}" == 1 ]] && "${PY}" -c 'import xdist' 2>/dev/null; then
        section "benchmarks: torch.compile and XLA caches, one worker per core"
        timeout --signal=INT --kill-after=15 "${GPU_CHECK_BENCH_PRECOMPILE_TIMEOUT:-150}" \
            "${XDIST_INDUCTOR[@]}" "${PY}" -m pytest benchmarks -k "compile or jax" -n "${GPU_CHECK_WORKERS:-$(nproc)}" -q \
            -p no:cacheprovider --durations=3 2>&1 | tail -n 6
    fi
    section "benchmarks"
    budget="${GPU_CHECK_BENCH_TIMEOUT:-240}"
    CUPYROPE_BENCH_REPORT="${OUT_DIR}/bench_summary.md" timeout --signal=INT --kill-after=30 "${budget}" \
        "${PY}" -m pytest benchmarks --benchmark-only -q -p no:cacheprovider --durations=0 --durations-min=1.0 \
        --benchmark-json="${OUT_DIR}/bench.json" 2>&1 \
        | tee "${OUT_DIR}/bench.log"
    bench_status=${PIPESTATUS[0]}
    rm -rf "${JAX_COMPILATION_CACHE_DIR}"
    unset JAX_COMPILATION_CACHE_DIR
    BENCH="exit ${bench_status}$([[ ${bench_status} -eq 124 ]] && echo " (timed out after ${budget}s)"), see bench.log"
fi

# ------------------------------------------------------------------------------------------------
MEMCHECK="not run"
RACECHECK="not run"
# Under compute-sanitizer every launch is instrumented (10-100x slower): a subset that still takes
# every kernel path (angle sources, pairings, dtypes, layouts, lean and general, in place, graphs),
# without the 2^31-element, thread, hypothesis and grid-limit sweeps.
SANITIZER_SUBSET="not 2p31 and not threads and not repeat_calls and not guard_bytes and not grid_limits and not every_byte_offset"
SANITIZER_FILES=(tests/test_gpu.py tests/test_reliability_gpu.py tests/test_fused.py tests/test_mla.py
                 tests/test_fused_mla.py tests/test_rerotate.py tests/test_fp8_per_head.py
                 tests/test_nvfp4_cache.py tests/test_strided_last_dim.py tests/test_fused_staged.py
                 tests/test_mla_staged.py)
if [[ -n "${GPU_CHECK_SANITIZER_FILES:-}" ]]; then
    read -r -a SANITIZER_FILES <<<"${GPU_CHECK_SANITIZER_FILES}"
fi
# Shards: each its own compute-sanitizer process over every SHARDS-th test (CUPYROPE_TEST_SHARD,
# tests/conftest.py), spread over the visible GPUs. Not pytest-xdist under one sanitizer: 28
# workers under one compute-sanitizer each ran no test in 420 s (H200, 2026-11-28).
SANITIZER_SHARDS="${GPU_CHECK_SANITIZER_SHARDS:-1}"
mapfile -t SANITIZER_GPUS < <(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null)
if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
    IFS=, read -r -a SANITIZER_GPUS <<<"${CUDA_VISIBLE_DEVICES}"
fi
[[ ${#SANITIZER_GPUS[@]} -gt 0 ]] || SANITIZER_GPUS=(0)
sanitizer_log() {  # sanitizer_log TOOL SHARD
    if [[ "${SANITIZER_SHARDS}" -eq 1 ]]; then echo "${OUT_DIR}/sanitizer_$1.log"; else echo "${OUT_DIR}/sanitizer_$1.$2.log"; fi
}
sanitize() {  # sanitize TOOL SHARD GPU: one pytest process under compute-sanitizer --tool TOOL
    # One cudaMalloc per array (no CuPy pool) so that memcheck sees every array's bounds.
    CUDA_VISIBLE_DEVICES="$3" CUPYROPE_TEST_SHARD="$2/${SANITIZER_SHARDS}" CUPYROPE_TEST_NO_POOL=1 \
        timeout --kill-after=15 "${GPU_CHECK_SANITIZER_TIMEOUT:-300}" \
        compute-sanitizer --tool "$1" --print-limit 20 \
        "${PY}" -m pytest "${SANITIZER_FILES[@]}" -m gpu -v --durations=10 -p no:cacheprovider \
        --maxfail="${GPU_CHECK_SANITIZER_MAXFAIL:-1}" \
        -k "${GPU_CHECK_SANITIZER_K-${SANITIZER_SUBSET}}" >"$(sanitizer_log "$1" "$2")" 2>&1
    echo "$?" >"$(sanitizer_log "$1" "$2").status"
}
sanitizer_result() {  # sanitizer_result TOOL: the tool's summaries and pytest's, over its shards
    local shard log status errors=0 processes=0 kind="" passed=0 failed=0 cut=0 reports=0 worst=0 n
    for ((shard = 0; shard < SANITIZER_SHARDS; shard++)); do
        log="$(sanitizer_log "$1" "${shard}")"
        status="$(cat "${log}.status" 2>/dev/null || echo 1)"
        rm -f "${log}.status"
        [[ "${status}" -gt "${worst}" ]] && worst="${status}"
        # "ERROR SUMMARY: 0 errors" / "RACECHECK SUMMARY: 0 hazards displayed (...)"
        while read -r n; do
            errors=$((errors + n)); processes=$((processes + 1))
        done < <(grep -E '(ERROR|RACECHECK) SUMMARY' "${log}" | sed -E 's/^=* *//; s/^[A-Z]+ SUMMARY: ([0-9]+).*/\1/')
        n="$(grep -oE '(ERROR|RACECHECK) SUMMARY' "${log}" | tail -n 1)"; kind="${n:-${kind}}"
        if [[ "${status}" -eq 124 || "${status}" -eq 137 ]]; then
            # Cut short: pytest -v's lines so far; the last one names the test it was in (to the
            # log, beside the summary this function returns).
            echo "$1 shard ${shard} cut short in: $(grep -E '^tests/.*::' "${log}" | tail -n 1 | cut -d' ' -f1)" >&2
            cut=$((cut + 1))
            passed=$((passed + $(grep -cE '::.* PASSED' "${log}")))
            failed=$((failed + $(grep -cE '::.* FAILED' "${log}")))
            reports=$((reports + $(grep -cE '^========= (Invalid|Error|Program hit|Race)' "${log}")))
        else
            n="$(grep -oE '[0-9]+ passed' "${log}" | tail -n 1 | cut -d' ' -f1)"; passed=$((passed + ${n:-0}))
            n="$(grep -oE '[0-9]+ failed' "${log}" | tail -n 1 | cut -d' ' -f1)"; failed=$((failed + ${n:-0}))
        fi
    done
    local line="${kind:-no summary line}${kind:+: ${errors} in ${processes} of ${SANITIZER_SHARDS} process(es)}"
    local tests="${passed} passed, ${failed} failed"
    if [[ "${cut}" -gt 0 ]]; then
        tests+="; ${cut} shard(s) timed out after ${GPU_CHECK_SANITIZER_TIMEOUT:-300} s (${reports} sanitizer reports in them)"
    fi
    echo "${line}; ${tests} (worst exit ${worst})"
}
if [[ "${GPU_CHECK_SANITIZER:-0}" == 1 ]]; then
    if command -v compute-sanitizer >/dev/null 2>&1; then
        # The two tools run side by side (each instrumented process uses one core; neither times
        # anything), after the benchmarks; shard k of tool t on GPU (t * SHARDS + k) mod GPUs.
        section "compute-sanitizer memcheck and racecheck (side by side, ${SANITIZER_SHARDS} shard(s) each)"
        SANITIZER_PIDS=()
        tool_index=0
        for tool in memcheck racecheck; do
            for ((shard = 0; shard < SANITIZER_SHARDS; shard++)); do
                gpu="${SANITIZER_GPUS[$(((tool_index * SANITIZER_SHARDS + shard) % ${#SANITIZER_GPUS[@]}))]}"
                sanitize "${tool}" "${shard}" "${gpu}" & SANITIZER_PIDS+=($!)
            done
            tool_index=$((tool_index + 1))
        done
        wait "${SANITIZER_PIDS[@]}"
        MEMCHECK="$(sanitizer_result memcheck)"
        RACECHECK="$(sanitizer_result racecheck)"
        tail -n 3 "$(sanitizer_log memcheck 0)" "$(sanitizer_log racecheck 0)"
    else
        MEMCHECK="compute-sanitizer not found"
        RACECHECK="${MEMCHECK}"
    fi
fi

# ------------------------------------------------------------------------------------------------
section "summary"
row() { printf '%-34s %s\n' "$1" "$2"; }
seconds() { if [[ "$1" =~ ^[0-9.]+$ ]]; then echo "$1 s"; else echo "${1:-failed}"; fi; }
echo "------------------------------------------------------------------------------"
row "GPU" "${GPU_NAME:-unknown}"
row "install" "${INSTALL}"
row "wheels (GPU_CHECK_WHEELS)" "${WHEELS}"
row "kernel cache (this GPU, NVRTC)" "${KERNEL_CACHE}"
row "tests passed / failed / skipped" "$(count passed) / $(count failed) / $(count skipped)   (errors $(count 'errors?'))"
row "pytest summary" "${SUMMARY_LINE:-(no summary line; see pytest.log)}"
row "cold compile: import + 1st call" "$(seconds "${COLD_S}")"
row "warm cache: import + 1st call" "$(seconds "${WARM_S}")"
row "benchmarks" "${BENCH}"
row "compute-sanitizer memcheck" "${MEMCHECK}"
row "compute-sanitizer racecheck" "${RACECHECK}"
row "pytest exit status" "${PYTEST_STATUS}"
echo "------------------------------------------------------------------------------"
if [[ ${PYTEST_STATUS} -eq 0 && ${KERNEL_CACHE_STATUS} -ne 0 ]]; then
    exit 1
fi
exit "${PYTEST_STATUS}"
