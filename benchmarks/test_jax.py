"""apply_rope under ``jax.jit`` against XLA's own fusion of the same step (contract §4, JAX).

Data, steps and the implementations compared (``jnp-copy``, ``xla-hf``, ``xla-hf-f32-angles``,
``cupyrope-native``, ``cupyrope-callback``) are :mod:`cupyrope.bench.jax_steps`'s, shared with
``python -m cupyrope bench --jax``; reference shape, T = 1, 32, 4096, 16384, 65536. Three groups
per T:

- ``test_jax_step``: wall time per jitted step in a dispatch loop (N calls of the compiled step on
  the same inputs, one ``block_until_ready``, divided by N; timer ``jax_steps.JAX_CLOCK``).
  extra_info of cupyrope's cases: ``ratio_to_xla`` (over ``xla-hf``'s time), ``target``
  (``≤ XLA + 2 µs`` at T <= 32, ``≤ XLA``, ``< XLA`` at T >= 16384) and ``meets_target``;
  ``max_abs_err`` of every rotation against the float64 rotation (exact angles);
- ``test_jax_torch_path``: the torch path's GPU time per call for the same shape, a CUDA graph of
  20 ``apply_rope`` calls (``GPU_CLOCK``, divided by 20);
- ``test_jax_loop``: GPU time per call, a jitted loop of 20 chained calls (each call's outputs
  feeding the next through an optimization barrier), timed like the steps and divided by 20.
  extra_info of ``cupyrope-native``: ``ratio_to_torch`` and ``meets_gpu_time_target`` (≤ 1.05).

At the end of the module the JAX table (:func:`jax_steps.format_jax_table`) is printed, and written
beside ``$CUPYROPE_BENCH_REPORT`` as ``<name>_jax.md`` when that is set. Skipped without a JAX GPU
backend (and, like every benchmark, without torch CUDA and CuPy). The whole module takes about
half a minute on an H100 / H200, most of it compiling.
"""

from __future__ import annotations

import os

import pytest

from cupyrope import bench as bm
from cupyrope.bench import jax_steps as js

# JAX would otherwise take 75% of the GPU at its first array, starving the torch benchmarks.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

CASES = [pytest.param(tokens, impl, id=f"T{tokens}-{impl}")
         for tokens in js.JAX_TOKENS for impl in js.JAX_IMPLS]

# Data, compiled steps and results of every T, kept for the module (under 1 GB of JAX arrays).
_DATA: dict = {}
_STEPS: dict = {}
_ROWS: dict = {}


def _rounds(tokens: int) -> int:
    return 10 if tokens <= 4096 else 5


def _row(tokens: int) -> js.JaxRow:
    return _ROWS.setdefault(tokens, js.JaxRow(tokens))


def _step(tokens: int, impl: str) -> js.JaxStep:
    if tokens not in _DATA:
        _DATA[tokens] = js.JaxRopeData(bm.RopeShape(tokens=tokens))
    key = (tokens, impl)
    if key not in _STEPS:
        try:
            _STEPS[key] = js.compile_step(impl, _DATA[tokens])
        except bm.Unavailable as exc:
            pytest.skip(str(exc))
    return _STEPS[key]


def _case(tokens: int, impl: str) -> tuple[js.JaxStep, js.JaxRopeData, js.JaxRow]:
    """The compiled step of (T, impl), the data of T, the table row of T."""
    return _step(tokens, impl), _DATA[tokens], _row(tokens)


@pytest.fixture(scope="module", autouse=True)
def _jax_gpu_and_table(request):
    reason = js.jax_gpu_missing_reason()
    if reason:
        pytest.skip(reason)
    yield
    rows = [_ROWS[t] for t in sorted(_ROWS)]
    _STEPS.clear()
    _DATA.clear()
    if not rows:
        return
    table = js.format_jax_table(rows, js.jax_device_name(), js.jax_environment().get("jax", ""))
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", "cupyrope under jax.jit against XLA's fusion")
        for line in table.splitlines():
            reporter.write_line(line)
    path = os.environ.get("CUPYROPE_BENCH_REPORT")
    if path:
        stem, ext = os.path.splitext(path)
        with open(f"{stem}_jax{ext or '.md'}", "w") as f:
            f.write(table + "\n")


def _timed(rope_bench, step: js.JaxStep, compiled, group: str, tokens: int, iterations: int,
           divisor: int) -> float | None:
    """``iterations`` dispatches of ``compiled`` per round, one wait (JAX_CLOCK); median µs."""
    clock = js.JAX_CLOCK.configure(divisor=divisor)
    args = step.args

    def dispatch():
        clock.hold(compiled(*args))

    rope_bench.benchmark.group = group
    rope_bench.benchmark.pedantic(dispatch, rounds=_rounds(tokens), iterations=iterations,
                                  warmup_rounds=1)
    return rope_bench._median_us()


def _copy_us(times: dict):
    """The jnp copy's time of this T as the conftest's copy reference (None when not measured)."""
    us = times.get("jnp-copy")
    return None if us is None else (lambda: us)


@pytest.mark.benchmark(timer=js.JAX_CLOCK)
@pytest.mark.parametrize("tokens, impl", CASES)
def test_jax_step(rope_bench, tokens, impl):
    step, data, row = _case(tokens, impl)
    error = None
    if impl in js.ROTATION_IMPLS:
        error = row.max_abs_err[impl] = js.max_abs_error(step, data)
    group = f"JAX jitted step, wall time (dispatch loop, one wait): {data.shape.label()}"
    us = _timed(rope_bench, step, step.step, group, tokens, js.dispatch_calls(tokens), 1)
    if us is None:  # --benchmark-disable
        return
    row.wall_us[impl] = us
    info = rope_bench.benchmark.extra_info
    xla = row.wall_us.get("xla-hf")
    if impl.startswith("cupyrope") and xla is not None:
        info.update(xla_us=round(xla, 3), ratio_to_xla=round(us / xla, 3),
                    target=js.step_target(tokens),
                    meets_target=js.meets_step_target(tokens, us, xla))
    rope_bench._report(group, data.shape, impl, step, error, None,
                       copy=_copy_us(row.wall_us))


@pytest.mark.benchmark(timer=bm.GPU_CLOCK)
@pytest.mark.parametrize("tokens", js.JAX_TOKENS, ids=lambda t: f"T{t}")
def test_jax_torch_path(rope_bench, tokens):
    """The torch path of the same call: a CUDA graph of 20 apply_rope calls, GPU time per call."""
    shape = bm.RopeShape(tokens=tokens)
    data = bm.RopeData(shape, num_sets=bm.GRAPH_CALLS if tokens <= 512 else None)
    work = bm.make_workload(js.TORCH_PATH_IMPL, data)
    captured = bm.capture_graph(work.fn, rotate_inputs=work.arg_sets)
    plan = bm.plan_batches(captured.replay)
    group = f"JAX jitted loop of {js.LOOP_CALLS}, GPU time per call: {shape.label()}"
    rope_bench.benchmark.group = group
    bm.GPU_CLOCK.configure(prime_us=plan.prime_us, divisor=bm.GRAPH_CALLS)
    rope_bench.benchmark.pedantic(captured.replay, rounds=_rounds(tokens), iterations=plan.calls,
                                  warmup_rounds=1)
    us = rope_bench._median_us()
    if us is not None:
        _row(tokens).torch_gpu_us = us
        rope_bench._report(group, shape, f"torch-{js.TORCH_PATH_IMPL}", work, None, plan)


@pytest.mark.benchmark(timer=js.JAX_CLOCK)
@pytest.mark.parametrize("tokens, impl", CASES)
def test_jax_loop(rope_bench, tokens, impl):
    step, data, row = _case(tokens, impl)
    group = f"JAX jitted loop of {js.LOOP_CALLS}, GPU time per call: {data.shape.label()}"
    loops = max(2, js.dispatch_calls(tokens) // js.LOOP_CALLS)
    try:
        compiled = step.loop
    except bm.Unavailable as exc:
        pytest.skip(str(exc))
    us = _timed(rope_bench, step, compiled, group, tokens, loops, js.LOOP_CALLS)
    if us is None:
        return
    row.gpu_us[impl] = us
    info = rope_bench.benchmark.extra_info
    if impl == "cupyrope-native" and row.torch_gpu_us is not None:
        info.update(torch_gpu_us=round(row.torch_gpu_us, 3),
                    ratio_to_torch=round(us / row.torch_gpu_us, 3),
                    target_ratio_to_torch=js.GPU_TIME_TARGET_RATIO,
                    meets_gpu_time_target=js.meets_gpu_time_target(us, row.torch_gpu_us))
    rope_bench._report(group, data.shape, impl, step, None, None,
                       copy=_copy_us(row.gpu_us))
