"""The package's architecture, checked: no import cycle, lazy imports included, so every module
only imports modules below it (the eager path included); one encoding of rope_scaling that every
route round-trips; the launch spec decided without CuPy."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import cupyrope as cr
from cupyrope.core.scaling import Scaling, scaling_from_op_args, scaling_op_args

PACKAGE = Path(cr.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """cupyrope modules that ``path`` imports anywhere in its body (functions included)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("cupyrope"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("cupyrope"):
                continue
            # `from . import execute` names a module; `from .plan import plan_rope` a name in one.
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                found.add(candidate if _is_module(candidate) else target)
    found.discard(module)
    return found


def _is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").is_file() or (PACKAGE / relative / "__init__.py").is_file()


def _graph() -> dict[str, set[str]]:
    files = [p for p in PACKAGE.rglob("*.py") if p.name != "__main__.py"]
    modules = {_module_name(p): p for p in files}
    return {name: {t for t in _imports(path) if t in modules and t != "cupyrope"}
            for name, path in modules.items()}


def test_no_import_cycle_lazy_imports_included():
    graph = _graph()
    assert "cupyrope.execute" in graph and "cupyrope.api" in graph
    state: dict[str, int] = {}

    def visit(name, trail):
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = trail[trail.index(name):] + [name]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        state[name] = 1
        for target in sorted(graph[name]):
            visit(target, trail + [name])
        state[name] = 2

    for name in sorted(graph):
        visit(name, [])


def test_routes_call_the_core_and_the_core_imports_no_route():
    graph = _graph()
    frontends = {prefix: {name for name in graph if name.startswith(prefix)}
                 for prefix in ("cupyrope.frontends.torch.", "cupyrope.frontends.jax.")}
    routes = {"cupyrope.api"} | set().union(*frontends.values())
    for modules in frontends.values():  # each frontend as a whole: its modules' imports
        imported = set().union(*(graph[name] for name in modules))
        assert "cupyrope.execute" in imported
        assert "cupyrope.api" not in imported
    assert "cupyrope.execute" in graph["cupyrope.api"]

    def below(name, seen):
        for target in graph[name]:
            if target not in seen:
                seen.add(target)
                below(target, seen)
        return seen

    assert not below("cupyrope.execute", set()) & routes


def test_only_the_interop_boundary_imports_frameworks():
    """torch, JAX and CuPy objects are handled in core/arrays.py; the framework routes
    (frontends/torch: the custom ops and their DTensor sharding rules; frontends/jax: the
    primitives, the jax.numpy lowering and the native XLA call), the torch adapters (compat) and
    the compile/launch layer (cuda/: compiler, launch, recipes, through arrays.cupy_module) are the
    only other places that name a framework."""
    allowed_dirs = {"frontends", "compat", "bench"}
    allowed = {"core/arrays.py", "api.py", "__main__.py"}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if relative.as_posix() in allowed or relative.parts[0] in allowed_dirs:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for name in names:
                assert name.split(".")[0] not in ("torch", "jax", "jaxlib", "cupy"), (
                    f"{relative} imports {name}; framework objects belong in core/arrays.py")


LAYERS = ("core", "cuda", "execute", "frontends", "public")  # lowest first


def _layer(module: str) -> str | None:
    """The layer a module belongs to: its sub-package, or the public surface for the modules at
    the top of the package (api, warmup, positions); None outside the layering (compat and bench
    use the public API; __init__ re-exports)."""
    parts = module.split(".")
    if module == "cupyrope.execute":
        return "execute"
    if len(parts) > 2 and parts[1] in ("core", "cuda", "frontends"):
        return parts[1]
    if len(parts) == 2 and parts[1] not in ("compat", "bench"):
        return "public"
    return None


def test_each_layer_imports_only_layers_below_it():
    """The folders are the layers: core/ (framework-free host side) <- cuda/ (compile and launch)
    <- execute <- frontends/ (torch and JAX routes) <- the public surface (api, warmup,
    positions). Nothing imports upward; compat/ and bench/ sit on top and nothing imports them."""
    graph = _graph()
    for name, targets in graph.items():
        mine = _layer(name)
        for target in targets:
            theirs = _layer(target)
            assert target.split(".")[1] not in ("compat", "bench") or name.split(".")[1] in ("compat", "bench"), (
                f"{name} imports {target}: the adapters and the benchmarks sit on top")
            if mine is None or theirs is None or mine == theirs:
                continue
            assert LAYERS.index(theirs) < LAYERS.index(mine), (
                f"{name} ({mine}) imports {target} ({theirs}), a layer above it")


SCALINGS = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2, 3]},
    {"rope_type": "default", "mrope_section": [8, 12, 12], "mrope_interleaved": True},
    {"rope_type": "linear", "factor": 2.0, "note": "a\x1eb\x1fc", "tag": "7:x:", "none": None},
    {"weird\x1e\x1fkey:1:": "value", "flag": False, "count": 3},
    {"full_attention": {"rope_type": "default"}},
    {},
]


@pytest.mark.parametrize("scaling", SCALINGS)
def test_every_scaling_dict_round_trips_every_encoding(scaling):
    frozen = Scaling.from_dict(scaling)
    hash(frozen)
    assert frozen.as_dict() == scaling
    assert Scaling.from_dict(scaling) == frozen
    text, numbers = scaling_op_args(scaling)
    assert scaling_from_op_args(text, numbers) == scaling
    assert scaling_op_args(None) == (None, None) and scaling_from_op_args(None, None) is None


def test_scaling_must_be_a_dict_with_string_keys():
    with pytest.raises(TypeError, match="scaling must be None or a Hugging Face rope_scaling dict"):
        Scaling.from_dict([("rope_type", "linear")])
    with pytest.raises(TypeError, match="scaling keys must be plain strings"):
        scaling_op_args({1: 2.0})


def test_plan_launch_without_cupy():
    """The launch spec of a call is decided from the plan alone (no CuPy, no GPU)."""
    from cupyrope.cuda import launch
    from cupyrope.core.abi import AngleSource
    from cupyrope.core.arrays import describe
    from cupyrope.core.plan import plan_rope

    q = np.zeros((70, 32, 128), np.float32)
    k = np.zeros((70, 8, 128), np.float32)
    plan = plan_rope(q, k, np.arange(70), theta=10000.0)
    outputs = [describe(np.zeros_like(q), "q_out"), describe(np.zeros_like(k), "k_out")]
    spec = launch.plan_launch(plan, outputs, inv_freq_ptr=4096, num_regs=lambda s: 40,
                              multiprocessors=132)
    assert spec.kernel.source == AngleSource.COMPUTED and spec.kernel.dtype == "float32"
    assert int(spec.params["inv_freq"]) == 4096 and int(spec.params["num_tokens"]) == 70
    assert int(spec.params["num_q_heads"]) == 32 and int(spec.params["num_k_heads"]) == 8
    assert len(spec.pointers) == 7 and spec.sin_offset is None
    lanes, head_lanes, tokens = spec.block
    assert lanes * head_lanes * tokens <= 256
    assert spec.grid[0] * tokens >= 70


def test_theta_must_be_a_real_number(randn):
    q = randn((3, 2, 8))
    for bad in ("10000", b"1", [10000.0], None):
        with pytest.raises(TypeError, match="theta must be a number"):
            cr.apply_rope(q, positions=np.arange(3), theta=bad)
    out = cr.apply_rope(q, positions=np.arange(3), theta=np.float32(10000.0))
    assert np.array_equal(out, cr.apply_rope(q, positions=np.arange(3), theta=10000))


def test_q_and_k_of_different_array_types_are_refused(randn):
    torch = pytest.importorskip("torch")
    q, k = randn((3, 2, 8)), randn((3, 1, 8))
    with pytest.raises(TypeError, match="k is a torch array but q is a numpy array"):
        cr.apply_rope(q, torch.from_numpy(k), np.arange(3))
    with pytest.raises(TypeError, match="k is a numpy array but q is a torch array"):
        cr.apply_rope(torch.from_numpy(q), k, torch.arange(3))


def test_validate_checks_that_full_width_tables_repeat_each_angle(randn, rng):
    T, D = 4, 8
    q = randn((T, 2, D))
    angles = rng.uniform(-3, 3, (T, D // 2))
    for interleaved in (False, True):
        full = np.repeat(angles, 2, axis=-1) if interleaved else np.concatenate([angles, angles], -1)
        cos, sin = np.cos(full), np.sin(full)
        good = cr.apply_rope(q, cos=cos, sin=sin, interleaved=interleaved, validate=True)
        assert np.array_equal(good, cr.apply_rope(q, cos=cos, sin=sin, interleaved=interleaved))
        bad = cos.copy()
        bad[2, -1] += 0.5  # the second copy of the last pair's angle differs
        with pytest.raises(ValueError, match="cos is rotary_dim .8. wide"):
            cr.apply_rope(q, cos=bad, sin=sin, interleaved=interleaved, validate=True)
        # without validate the first copy is read, as documented
        assert np.array_equal(cr.apply_rope(q, cos=bad if not interleaved else cos, sin=sin,
                                            interleaved=interleaved), good)


def test_dtype_arguments_take_dtype_objects():
    import ml_dtypes

    for dtype in ("bfloat16", np.dtype(ml_dtypes.bfloat16), ml_dtypes.bfloat16):
        assert cr.cos_sin_cache(4, 8, dtype=dtype).dtype == np.dtype(ml_dtypes.bfloat16)
    assert cr.cos_sin_cache(4, 8, dtype=np.float64).dtype == np.float64
    torch = pytest.importorskip("torch")
    cache = cr.cos_sin_cache(4, 8, dtype=torch.float16, like=torch.zeros(1))
    assert cache.dtype == torch.float16
    with pytest.raises(ValueError, match="dtype must be one of"):
        cr.cos_sin_cache(4, 8, dtype=np.int32)


def test_float64_like_gets_a_float64_cache():
    assert cr.cos_sin_cache(4, 8, like=np.zeros(2, np.float64)).dtype == np.float64
    assert cr.cos_sin_cache(4, 8, like=np.zeros(2, np.float32)).dtype == np.float32
    assert cr.cos_sin_cache(4, 8, like=np.zeros(2, np.float64), dtype="float32").dtype == np.float32
    assert cr.cos_sin_cache(4, 8).dtype == np.float32


def test_the_library_never_imports_the_benchmark_package():
    import subprocess
    import sys

    probe = ("import sys, numpy as np, cupyrope as cr\n"
             "cr.apply_rope(np.ones((2, 1, 4), np.float32), positions=np.arange(2))\n"
             "import cupyrope.compat, cupyrope.warmup\n"
             "print(sorted(m for m in sys.modules if m.startswith('cupyrope.bench')))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    import cupyrope.bench  # noqa: F401 - and it imports without a GPU or torch CUDA


def test_kernel_sources_found_in_a_checkout_that_is_not_installed(monkeypatch):
    """Without the installed package data (a plain checkout on PYTHONPATH), the sources are the
    checkout's kernels_cu/ beside the package."""
    import importlib.resources

    from cupyrope.cuda import compiler

    def not_installed(name):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(importlib.resources, "files", not_installed)
    folder = compiler.kernel_source_dir()
    assert folder == PACKAGE.parent / "kernels_cu"
    assert (folder / compiler.SOURCE_FILE).is_file()


def test_warnings_point_at_the_caller_outside_the_package():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cr.rope_frequencies(64, scaling={"rope_type": "linear", "factor": 2.0, "beta_fast": 32})
        # through api.py, execute.py and core/plan.py: modules of three folders
        cr.apply_rope(np.ones((2, 1, 8), np.float32), positions=np.arange(2),
                      scaling={"rope_type": "linear", "factor": 2.0, "beta_fast": 32})
    assert [Path(w.filename).resolve() for w in caught] == [Path(__file__).resolve()] * 2
