"""Shared fixtures: reproducible random data, the ``gpu`` marker, and the interop requirement check.

- ``rng``: a NumPy Generator seeded from the test's node id (so a failure reproduces with the same data);
  set CUPYROPE_TEST_SEED to mix another value in and draw different data.
- ``randn(shape, dtype)``: N(0, 1) values in any float dtype (bfloat16 through ml_dtypes), never zeros.
- ``@pytest.mark.gpu``: skipped unless ``cupy.is_available()``.
- CUPYROPE_REQUIRE_INTEROP="torch,jax,...": the session fails at start if one of them cannot be imported,
  so that CI cannot silently skip the interop tests.
- CUPYROPE_TEST_SHARD="K/N": run every N-th selected test from the K-th (0-based), the others
  deselected; the N shards of one selection run each test exactly once (scripts/gpu_check.sh runs
  the GPU suite under compute-sanitizer as separate processes this way).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys

import numpy as np
import pytest

# tests/ importable: ``from reference import ...`` and ``from tolerances import ...`` in every test file.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tolerances import np_dtype  # noqa: E402

REQUIRE_INTEROP_ENV = "CUPYROPE_REQUIRE_INTEROP"
TEST_SHARD_ENV = "CUPYROPE_TEST_SHARD"


def random_array(rng: np.random.Generator, shape, dtype="float32") -> np.ndarray:
    """N(0, 1) values rounded to ``dtype``; exact zeros are replaced so no element is ever 0."""
    values = rng.standard_normal(shape)
    values = np.where(np.abs(values) < 1e-3, np.copysign(0.5, values), values)
    return values.astype(np_dtype(dtype))


def _cupy_available() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    try:
        return bool(cupy.is_available())
    except Exception:  # a broken driver counts as no GPU
        return False


def _required_interop() -> list[str]:
    raw = os.environ.get(REQUIRE_INTEROP_ENV, "")
    return [name.strip() for name in raw.split(",") if name.strip()]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU with CuPy (skipped when cupy.is_available() is false)")
    # scripts/gpu_check.sh runs `-m "gpu or nvrtc"`: the GPU-relevant tests. Everything else is
    # the NumPy path and the API layer, which CI covers on every commit.
    config.addinivalue_line("markers", "nvrtc: compiles the CUDA sources with NVRTC (no GPU needed)")
    missing = []
    for name in _required_interop():
        try:
            importlib.import_module(name)
        except Exception as exc:  # ImportError, or a package that breaks at import
            missing.append(f"{name} ({type(exc).__name__}: {exc})")
    if missing:
        pytest.exit(
            f"{REQUIRE_INTEROP_ENV}={os.environ[REQUIRE_INTEROP_ENV]!r} requires these packages, which cannot be "
            f"imported: {', '.join(missing)}. Install them, or unset {REQUIRE_INTEROP_ENV}.",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


def _test_shard() -> tuple[int, int] | None:
    """(K, N) from CUPYROPE_TEST_SHARD="K/N", None when unset; a malformed value ends the session."""
    raw = os.environ.get(TEST_SHARD_ENV, "").strip()
    if not raw:
        return None
    index, _, count = raw.partition("/")
    if index.isdigit() and count.isdigit() and int(index) < int(count):
        return int(index), int(count)
    pytest.exit(f"{TEST_SHARD_ENV}={raw!r} is not K/N with 0 <= K < N (e.g. 0/4), the shard to run; "
                f"unset it to run every test.", returncode=pytest.ExitCode.USAGE_ERROR)


# trylast: after -m / -k have deselected their tests, so that the shards split what is selected.
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    # The NVRTC builds (a minute each on one core) go first, so that a parallel run starts them
    # on separate workers before the short tests (a stable sort keeps every other order).
    def is_nvrtc_build(item) -> bool:
        group = item.get_closest_marker("xdist_group")
        return group is not None and str(group.args[0] if group.args else "").startswith("nvrtc-")

    items.sort(key=lambda item: not is_nvrtc_build(item))
    shard = _test_shard()
    if shard is not None:
        index, count = shard
        config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % count != index])
        items[:] = items[index::count]
    if any(item.get_closest_marker("gpu") for item in items) and not _cupy_available():
        skip = pytest.mark.skip(reason="needs CuPy and a CUDA GPU (cupy.is_available() is false)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


@pytest.fixture
def backend(request):
    """The array backend a test is parametrised with (``indirect=True`` over
    ``backends.backend_params``); skips when its framework is missing."""
    from backends import Backend, require

    b = Backend(request.param)
    require(b)
    return b


def _seed_for(nodeid: str) -> int:
    text = nodeid + "|" + os.environ.get("CUPYROPE_TEST_SEED", "")
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A Generator seeded from this test's node id (and CUPYROPE_TEST_SEED when set)."""
    return np.random.default_rng(_seed_for(request.node.nodeid))


@pytest.fixture
def randn(rng):
    """randn(shape, dtype="float32") -> NumPy array of N(0, 1) values (no zeros) in that dtype."""

    def make(shape, dtype="float32"):
        return random_array(rng, shape, dtype)

    return make


def _recorded_plans(monkeypatch, entry, planner: str = "plan_launch") -> list:
    """``entry(spec)`` of every launch that ``launch.<planner>`` plans from here on, in order
    (repeat calls of a layout replay their first launch unplanned: the recipes of earlier tests
    are forgotten first)."""
    from cupyrope import execute
    from cupyrope.cuda import launch

    execute.clear()
    recorded = []
    plan = getattr(launch, planner)

    def recording(*args, **kwargs):
        spec = plan(*args, **kwargs)
        recorded.append(entry(spec))
        return spec

    monkeypatch.setattr(launch, planner, recording)
    return recorded


@pytest.fixture
def hopper_fast_memory(monkeypatch):
    """``require(module, what)``: skip the test off Hopper GPUs (compute capability 9.x), where
    the staged kernels (``what`` names the one) are traps, and on a Hopper GPU let the launch
    rules of ``module`` (``cupyrope.cuda.launch`` or ``mla_launch``) see an H200's memory (4.8
    TB/s), so that an H100 takes the staged launches too. The repeat-call recipes planned under
    these rules are forgotten after the test."""
    from cupyrope import execute

    def require(module, what: str) -> None:
        cupy = pytest.importorskip("cupy")
        try:
            major = cupy.cuda.Device().compute_capability[:-1]
        except cupy.cuda.runtime.CUDARuntimeError:
            pytest.skip("no GPU")
        if major != "9":
            pytest.skip(f"the staged {what} runs on Hopper GPUs (compute capability 9.x)")
        monkeypatch.setattr(module, "_memory_bandwidth", lambda device: 4.8e12)

    yield require
    execute.clear()


@pytest.fixture
def launched_kernels(monkeypatch) -> list:
    """The KernelSpec of every launch the test plans, in order."""
    return _recorded_plans(monkeypatch, lambda spec: spec.kernel)


@pytest.fixture
def planned_launches(monkeypatch) -> list:
    """The LaunchSpec (kernel, grid, block...) of every launch the test plans, in order."""
    return _recorded_plans(monkeypatch, lambda spec: spec)


@pytest.fixture
def planned_rerotations(monkeypatch) -> list:
    """The LaunchSpec of every re-rotation (rerotate_cache) the test plans, in order."""
    return _recorded_plans(monkeypatch, lambda spec: spec, "plan_rerotate_launch")
