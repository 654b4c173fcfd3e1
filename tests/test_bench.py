"""The benchmark package on a machine without a GPU: its command line, the sweep's control flow
(skipped peers, failing cases, rows), the markdown table and the host-time loop. The timings
themselves need a GPU (``benchmarks/``, ``python -m cupyrope.bench``); here the GPU clock is
replaced by fixed numbers and the data lives on the CPU."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tabulate")

from cupyrope.bench import cli, clocks, sweep, workloads  # noqa: E402


def test_help_works_without_a_gpu():
    result = subprocess.run([sys.executable, "-m", "cupyrope.bench", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for option in ("--tokens", "--impls", "--repeats", "--no-check", "--out", "--fused", "--shapes",
                   "--serving"):
        assert option in result.stdout
    assert "cupyrope-bench" in result.stdout  # the default output folder


@pytest.mark.parametrize("argv", [["--tokens", "1"], ["--fused", "--tokens", "16"]])
def test_cli_without_a_gpu_says_so_in_one_sentence(monkeypatch, capsys, argv):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("tokens", ["0", "-5"])
def test_cli_tokens_must_be_positive(tokens, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--tokens", tokens])
    assert exit_info.value.code == 2
    assert "expected a positive integer" in capsys.readouterr().err


def test_cli_tokens_error_reads_like_argparse(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--tokens", "abc"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --tokens: invalid positive integer value: 'abc'" in err
    assert "_positive_int" not in err and "Traceback" not in err


class RecordingBar:
    """Stands in for tqdm's bar: keeps its total, descriptions, updates and notes."""

    def __init__(self, total, **options):
        self.total, self.options = total, options
        self.descriptions, self.updates, self.notes, self.closed = [], 0, [], False

    def set_description(self, text):
        self.descriptions.append(text)

    def update(self, n=1):
        self.updates += n

    def write(self, text, file=None):
        self.notes.append(text)
        print(text, file=file)

    def close(self):
        self.closed = True


@pytest.fixture
def bars(monkeypatch):
    """The bars the sweeps open, each a :class:`RecordingBar`."""
    from cupyrope.bench import progress

    made = []
    monkeypatch.setattr(progress, "tqdm", lambda total, **options: made.append(
        RecordingBar(total, **options)) or made[-1])
    return made


def test_progress_without_tqdm_prints_notes_to_stderr(monkeypatch, capsys):
    from cupyrope.bench import progress

    monkeypatch.setattr(progress, "tqdm", None)
    with progress.Progress(2) as bar:
        bar.case("T=8 copy")
        bar.note("T=8 copy: skipped (no GPU)")
        bar.done()
    assert capsys.readouterr().err == "T=8 copy: skipped (no GPU)\n"


def test_progress_bar_counts_cases_and_writes_notes_above_it(bars, capsys):
    from cupyrope.bench import progress

    with progress.Progress(3, enabled=False) as bar:
        bar.case("T=8 copy")
        bar.note("a note")
        bar.done()
    (made,) = bars
    assert (made.total, made.options["disable"], made.updates, made.closed) == (3, True, 1, True)
    assert made.descriptions == ["T=8 copy"] and made.notes == ["a note"]
    assert capsys.readouterr().err == "a note\n"


@pytest.fixture
def cpu_fused_sweep(monkeypatch):
    """fused_sweep on CPU tensors with a fake GPU clock: the copy takes 2 µs, the rest 4 µs."""
    from cupyrope.bench import fused

    monkeypatch.setattr(fused, "require_cuda", lambda: torch)
    real_data = fused.FusedData
    monkeypatch.setattr(fused, "FusedData", lambda tokens: real_data(tokens, device="cpu"))

    def fake_gpu_time_us(fn, *, rotate_inputs, repeats):
        fn(*rotate_inputs[0])  # the workload must run
        return 2.0 if fn.__name__ == "copy" else 4.0

    monkeypatch.setattr(fused, "gpu_time_us", fake_gpu_time_us)
    monkeypatch.setattr(fused, "graph_time_us",  # T <= 512 is timed in a CUDA graph
                        lambda fn, *, rotate_inputs: fake_gpu_time_us(
                            fn, rotate_inputs=rotate_inputs, repeats=1))
    return fused


@pytest.mark.parametrize("with_tqdm", [True, False], ids=["tqdm", "no-tqdm"])
def test_fused_sweep_shows_its_progress(cpu_fused_sweep, bars, monkeypatch, capsys, with_tqdm):
    fused = cpu_fused_sweep
    if not with_tqdm:
        from cupyrope.bench import progress

        monkeypatch.setattr(progress, "tqdm", None)
    impls = ("copy", "cupyrope-fused", "unfused-eager")
    rows = fused.fused_sweep([16], ops=("rms_norm_rope", "fp8 out"), impls=impls, repeats=1)
    assert [(r.op, r.impl, r.pct_of_copy) for r in rows] == [
        (op, impl, 100.0 if impl == "copy" else 50.0)
        for op in ("rms_norm_rope", "fp8 out") for impl in impls]
    if with_tqdm:
        (bar,) = bars
        assert bar.total == bar.updates == 6 and bar.closed
        assert bar.descriptions[:2] == ["T=16 rms_norm_rope copy", "T=16 rms_norm_rope cupyrope-fused"]
    else:
        assert bars == []


@pytest.fixture
def cpu_sweep(monkeypatch):
    """reference_sweep on CPU tensors with a fake GPU clock: the copy takes 2 µs, the rest 4 µs;
    Liger is unavailable and cupyrope-tables raises."""
    monkeypatch.setattr(sweep, "require_cuda", lambda: torch)
    monkeypatch.setattr(sweep, "RopeData", lambda shape: workloads.RopeData(shape, device="cpu"))

    def fake_gpu_time_us(fn, *, rotate_inputs, warmup, repeats):
        fn(*rotate_inputs[0])  # the workload must run
        return 2.0 if fn.__name__ == "copy" else 4.0

    monkeypatch.setattr(sweep, "gpu_time_us", fake_gpu_time_us)
    status = {impl: None for impl in workloads.PEER_IMPLS}
    status["liger-inplace"] = "liger_kernel.ops.rope cannot be imported (not installed)"
    monkeypatch.setattr(sweep, "peer_status", lambda: status)
    real_make_workload = sweep.make_workload

    def make_workload(impl, data):
        if impl == "cupyrope-tables":
            raise RuntimeError("tables broke")
        return real_make_workload(impl, data)

    monkeypatch.setattr(sweep, "make_workload", make_workload)


@pytest.mark.parametrize("with_tqdm", [True, False], ids=["tqdm", "no-tqdm"])
def test_sweep_notes_skips_and_failures_and_keeps_measuring(cpu_sweep, monkeypatch, capsys, with_tqdm):
    if with_tqdm:
        pytest.importorskip("tqdm")
    else:
        from cupyrope.bench import progress

        monkeypatch.setattr(progress, "tqdm", None)
    failures: list[str] = []
    rows = sweep.reference_sweep([8], impls=["cupyrope-tables", "cupyrope-cache", "liger-inplace"],
                                 failures=failures)
    err = capsys.readouterr().err
    assert "skipping liger-inplace: liger_kernel.ops.rope cannot be imported" in err
    assert len(failures) == 1 and failures[0].startswith("T=8 cupyrope-tables: FAILED")
    assert "RuntimeError: tables broke" in failures[0] and "T=8 cupyrope-tables: FAILED" in err
    assert [(r.impl, r.tokens, r.us, r.pct_of_copy) for r in rows] == [
        ("copy", 8, 2.0, 100.0), ("cupyrope-cache", 8, 4.0, 50.0)]
    data = workloads.RopeData(workloads.RopeShape(tokens=8), device="cpu")
    assert rows[1].gbps == pytest.approx(data.bytes_moved("cache") / 4.0 / 1e3)
    assert rows[0].max_abs_err is None
    assert workloads.error_is_acceptable(rows[1].max_abs_err, "bfloat16")


def test_sweep_bar_counts_the_cases_that_run(cpu_sweep, bars, capsys):
    sweep.reference_sweep([8, 64], impls=["cupyrope-cache", "liger-inplace"])
    (bar,) = bars
    # liger-inplace is skipped from the start: per T the copy and cupyrope-cache run.
    assert bar.total == bar.updates == 4 and bar.closed
    assert bar.descriptions == ["T=8 copy", "T=8 cupyrope-cache", "T=64 copy", "T=64 cupyrope-cache"]
    assert bar.notes[0].startswith("skipping liger-inplace:")


def _markdown_rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("|")]


def test_format_table_lists_every_row_then_the_percent_pivot():
    rows = [sweep.Row("copy", 8, 2.0, 100.0, 100.0), sweep.Row("cupyrope-cache", 8, 2.5, 90.0, 80.0, 0.0078),
            sweep.Row("copy", 64, 3.0, 120.0, 100.0), sweep.Row("cupyrope-cache", 64, 3.2, 115.0, 93.75, 0.0)]
    text = sweep.format_table(rows, "Test GPU")
    assert text.splitlines()[0].startswith("RoPE reference shape (bf16 q [T,32,128]")
    assert "on Test GPU," in text.splitlines()[0]
    table, pivot = text.split("% of SM copy (copy time / impl time):")
    cells = _markdown_rows(table)
    assert cells[0] == ["impl", "T", "µs", "GB/s", "% of SM copy", "max abs err"]
    assert [c.replace(":", "").strip("-") for c in cells[1]] == [""] * 6  # the alignment row
    assert not cells[1][0].endswith(":") and all(c.endswith(":") for c in cells[1][1:])  # numbers right
    assert cells[2:] == [["copy", "8", "2.00", "100", "100.0", ""],
                         ["cupyrope-cache", "8", "2.50", "90", "80.0", "0.0078"],
                         ["copy", "64", "3.00", "120", "100.0", ""],
                         ["cupyrope-cache", "64", "3.20", "115", "93.8", "0"]]
    pivot_cells = _markdown_rows(pivot)
    assert pivot_cells[0] == ["impl", "T=8", "T=64"]
    assert pivot_cells[2:] == [["copy", "100.0", "100.0"], ["cupyrope-cache", "80.0", "93.8"]]


def test_host_time_is_a_loop_of_n_calls_with_gc_and_threads_as_outside(monkeypatch):
    """n calls between two synchronises, the garbage collector on and torch's thread count as the
    caller has it (torch.utils.benchmark.Timer would turn off the one and set the other to 1)."""
    monkeypatch.setattr(clocks, "require_cuda", lambda: torch)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    threads = torch.get_num_threads()
    seen = []

    def call(x):
        seen.append((gc.isenabled(), torch.get_num_threads()))
        return x

    us = clocks.host_time_us(call, 300, args=(1,), warmup=10, repeats=5)
    assert us > 0
    assert len(seen) >= 10 + 5 * 300
    assert set(seen) == {(gc.isenabled(), threads)}


def test_out_workload_writes_its_preallocated_outputs():
    """``cupyrope-cache-out`` (decode and host benchmarks): apply_rope(out=...) into one output
    pair per input set, the values of the out-of-place call."""
    torch = pytest.importorskip("torch")
    from cupyrope.bench import workloads

    data = workloads.RopeData(workloads.RopeShape(tokens=3, max_position=64), device="cpu")
    work = workloads.make_workload("cupyrope-cache-out", data)
    plain = workloads.make_workload("cupyrope-cache", data)
    for args, plain_args in zip(work.arg_sets, plain.arg_sets):
        q_out, k_out = work.fn(*args)
        assert q_out is args[4] and k_out is args[5]
        expected = plain.fn(*plain_args)
        assert torch.equal(q_out, expected[0]) and torch.equal(k_out, expected[1])


@pytest.mark.parametrize("op", ["rms_norm_rope", "rope_and_cache", "norm+rope+cache",
                                "rope_and_cache HND", "rope_and_cache fp8", "fp8 out"])
def test_fused_workloads_agree_with_the_unfused_sequences(op):
    """The fused-op benchmark's workloads (cupyrope.bench.fused), on the host: the fused call and
    the unfused eager sequence give the same numbers (bf16 rounding apart), and the paged caches
    receive the same rows."""
    from cupyrope.bench import fused

    data = fused.FusedData(16, device="cpu")
    results = {}
    cache_op = op in fused.CACHE_OPS
    for impl in ("cupyrope-fused", "unfused-eager"):
        work = fused.make_fused_workload(op, impl, data)
        caches = data.caches(op) if cache_op else ()
        for cache in caches:
            cache.zero_()
        args = work.arg_sets[0]
        # Small T runs the fused op in place: every implementation works on copies.
        args = (args[0].clone(), args[1].clone(), *args[2:])
        out = work.fn(*args)
        results[impl] = [x.float() for x in out] + [cache.float().clone() for cache in caches]
    fp8 = op in ("fp8 out", "rope_and_cache fp8")
    scale = 2.0 ** -3 if fp8 else 2.0 ** -7  # one rounding of fp8 / bf16, relative
    for got, want in zip(results["cupyrope-fused"], results["unfused-eager"]):
        assert torch.all((got - want).abs() <= scale * want.abs().amax(-1, keepdim=True) + 1e-6)
    assert work.bytes_moved == data.bytes_moved(op) > 0


def test_decode_and_host_targets_are_the_contracts_ratios():
    """The performance targets as ratios to the copy of the same run: decode <= 1.15x the SM copy
    at T = 1 and 32, <= 1.05x at 512 (cache, tables), <= 1.3x computed; host <= 1.2x torch.mul in
    place and with out=, <= 1.5x out of place; no target for the copy or the peers."""
    ratio = workloads.decode_target_ratio
    assert [ratio(t, "cupyrope-cache") for t in (1, 32, 512)] == [1.15, 1.15, 1.05]
    assert [ratio(t, "cupyrope-tables") for t in (1, 32, 512)] == [1.15, 1.15, 1.05]
    assert ratio(1, "cupyrope-computed") == ratio(512, "cupyrope-computed") == 1.3
    assert ratio(1, "copy") is None and ratio(1, "liger-inplace") is None
    host = workloads.host_target_ratio
    assert host("cupyrope-cache-inplace") == host("cupyrope-cache-out") == 1.2
    assert host("cupyrope-cache") == host("cupyrope-computed") == 1.5
    assert host("copy") is None and host("torch-compile-hf") is None


def test_vllm_adapter_workload_rotates_in_place_like_apply_rope():
    """``cupyrope-vllm-inplace`` (decode and host benchmarks): compat.rotary_embedding on flat
    [T, H * D] views of the data, in place, with the values of apply_rope in place."""
    torch = pytest.importorskip("torch")
    from cupyrope.bench import workloads

    data = workloads.RopeData(workloads.RopeShape(tokens=3, max_position=64), device="cpu")
    work = workloads.make_workload("cupyrope-vllm-inplace", data)
    plain = workloads.make_workload("cupyrope-cache", data)
    for args, plain_args in zip(work.arg_sets, plain.arg_sets):
        expected = plain.fn(*plain_args)  # out of place: the data are untouched
        q, k = args[0].clone(), args[1].clone()
        q_out, k_out = work.fn(q, k, *args[2:])
        assert q_out is q and q.dim() == 2
        assert torch.equal(q_out.view(expected[0].shape), expected[0])
        assert torch.equal(k_out.view(expected[1].shape), expected[1])
    # The agreement check compares the flat outputs with the [T, H, D] reference.
    assert workloads.max_abs_error(work, data) == workloads.max_abs_error(plain, data) < 0.125
    assert workloads.host_target_ratio("cupyrope-vllm-inplace") == 1.2


# ---- cupyrope under jax.jit (cupyrope.bench.jax_steps) on XLA's CPU ---------------------------

from cupyrope.bench import jax_steps  # noqa: E402

# Tiny T and a short cache keep the compiles quick; head counts and head_dim are the reference's.
_JAX_SHAPE = workloads.RopeShape(tokens=3, max_position=4096)


@pytest.fixture(scope="module")
def jax_data():
    pytest.importorskip("jax")
    return jax_steps.JaxRopeData(_JAX_SHAPE)


@pytest.fixture(scope="module")
def jax_compiled(jax_data):
    return {impl: jax_steps.compile_step(impl, jax_data) for impl in jax_steps.JAX_IMPLS}


def test_jax_data_is_the_reference_layout(jax_data):
    q, k, positions, cache = jax_data.args
    assert (q.shape, q.dtype.name) == ((3, 32, 128), "bfloat16")
    assert (k.shape, k.dtype.name) == ((3, 8, 128), "bfloat16")
    assert positions.dtype.name == "int32" and 0 <= int(positions.min()) <= int(positions.max()) < 4096
    assert (cache.shape, cache.dtype.name) == ((4096, 128), "float32")


def test_jnp_copy_is_a_real_op_xla_runs(jax_data, jax_compiled):
    step = jax_compiled["jnp-copy"]
    text = step.step.as_text()
    # A multiply by a runtime scalar in the compiled module: neither folded nor an output that
    # is a parameter (JAX would forward it, XLA would alias it).
    assert "multiply(" in text
    entry = text[text.index("ENTRY"):]
    root = next(line for line in entry.splitlines() if "ROOT" in line)
    assert "parameter(" not in root
    q_out, k_out = step.step(*jax_data.args)
    np.testing.assert_array_equal(np.asarray(q_out), np.asarray(jax_data.q))
    np.testing.assert_array_equal(np.asarray(k_out), np.asarray(jax_data.k))


def test_jax_loop_runs_every_call_as_its_own_op(jax_data, jax_compiled):
    copy_loop = jax_compiled["jnp-copy"].loop.as_text()
    assert copy_loop.count("multiply(") >= 2 * jax_steps.LOOP_CALLS  # q and k, 20 times
    assert "while" not in copy_loop  # unrolled: no loop condition to read back
    # The loop chains the calls: 20 rotations of the HF step, done one by one, give its result.
    hf = jax_compiled["xla-hf"]
    q, k = jax_data.q, jax_data.k
    for _ in range(jax_steps.LOOP_CALLS):
        q, k = hf.step(q, k, jax_data.positions, jax_data.cache)
    q_loop, k_loop = hf.loop(*jax_data.args)
    np.testing.assert_allclose(np.asarray(q_loop, np.float32), np.asarray(q, np.float32), atol=0.07)
    np.testing.assert_allclose(np.asarray(k_loop, np.float32), np.asarray(k, np.float32), atol=0.07)


def test_jax_rotations_agree_with_the_float64_reference(jax_data, jax_compiled):
    errors = {impl: jax_steps.max_abs_error(jax_compiled[impl], jax_data)
              for impl in jax_steps.ROTATION_IMPLS}
    for impl, error in errors.items():
        assert workloads.error_is_acceptable(error, "bfloat16"), (impl, error)
        assert error > 0  # bf16 outputs: the reference is not the outputs themselves
    # On XLA's CPU both cupyrope routes lower to jax.numpy: the same numbers.
    native = jax_compiled["cupyrope-native"].step(*jax_data.args)
    callback = jax_compiled["cupyrope-callback"].step(*jax_data.args)
    for a, b in zip(native, callback):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_jax_callback_route_variable_is_set_for_the_lowering_and_restored(monkeypatch):
    monkeypatch.setenv(jax_steps.NATIVE_ENV, "1")
    with jax_steps.native_route(False):
        assert os.environ[jax_steps.NATIVE_ENV] == "0"
    assert os.environ[jax_steps.NATIVE_ENV] == "1"
    monkeypatch.setenv(jax_steps.NATIVE_ENV, "0")  # asked for globally: the native case lifts it
    with jax_steps.native_route(True):
        assert jax_steps.NATIVE_ENV not in os.environ
    assert os.environ[jax_steps.NATIVE_ENV] == "0"


def test_jax_clocks_time_dispatch_loops(jax_data, jax_compiled):
    step = jax_compiled["cupyrope-native"]
    assert jax_steps.wall_time_us(step.step, jax_data.args, calls=5, repeats=2) > 0
    assert jax_steps.loop_time_us(step.loop, jax_data.args, loops=2, repeats=2) > 0
    clock = jax_steps.JaxSyncedClock().configure(divisor=20)
    start = clock()
    clock.hold(step.step(*jax_data.args))
    assert clock() - start >= 0 and clock._pending is None


def test_jax_step_targets():
    # Decode (T <= 32): up to 2 µs slower than XLA's fusion is met, more is not.
    assert jax_steps.meets_step_target(1, 11.9, 10.0)
    assert jax_steps.meets_step_target(32, 12.0, 10.0)
    assert not jax_steps.meets_step_target(32, 12.01, 10.0)
    # Between: no slower; equal is met.
    assert jax_steps.meets_step_target(4096, 50.0, 50.0)
    assert not jax_steps.meets_step_target(4096, 50.1, 50.0)
    # T >= 16384: strictly faster.
    for tokens in (16384, 65536):
        assert not jax_steps.meets_step_target(tokens, 300.0, 300.0)
        assert jax_steps.meets_step_target(tokens, 299.9, 300.0)
    assert [jax_steps.step_target(t) for t in (1, 32, 4096, 16384, 65536)] == [
        "≤ XLA + 2 µs", "≤ XLA + 2 µs", "≤ XLA", "< XLA", "< XLA"]
    assert jax_steps.meets_gpu_time_target(1.05, 1.0)
    assert not jax_steps.meets_gpu_time_target(1.06, 1.0)


def test_jax_table_lists_every_column_and_verdict():
    rows = [
        jax_steps.JaxRow(1, wall_us={"jnp-copy": 8.0, "xla-hf": 9.0, "xla-hf-f32-angles": 9.5,
                                     "cupyrope-native": 10.5, "cupyrope-callback": 40.0},
                         gpu_us={"cupyrope-native": 1.7}, torch_gpu_us=1.65,
                         max_abs_err={"xla-hf": 0.0156, "xla-hf-f32-angles": 0.0312,
                                      "cupyrope-native": 0.0156, "cupyrope-callback": 0.0156}),
        jax_steps.JaxRow(65536, wall_us={"xla-hf": 500.0, "cupyrope-native": 500.0},
                         gpu_us={"cupyrope-native": 360.0}, torch_gpu_us=330.0),
        jax_steps.JaxRow(4096, wall_us={"jnp-copy": 30.0}),  # nothing to compare: empty cells
    ]
    text = jax_steps.format_jax_table(rows, "Test GPU", "0.0")
    for header in ("jnp copy µs", "XLA HF fusion µs", "cupyrope native µs", "cupyrope callback µs",
                   "native / XLA", "target", "native GPU µs/call", "torch path GPU µs/call",
                   "err XLA HF", "err f32 angles"):
        assert header in text
    lines = text.splitlines()
    main_rows = [line for line in lines[:lines.index("GPU µs per call (jitted loop of 20):")]
                 if line.startswith("|") and "---" not in line][1:]  # the first table's rows
    decode, big = main_rows[0], main_rows[1]
    assert decode.split("|")[1].strip() == "1" and big.split("|")[1].strip() == "65536"
    assert "1.167" in decode and "≤ XLA + 2 µs: met" in decode and "1.030 (≤ 1.05: met)" in decode
    assert "0.0312" in decode
    assert "< XLA: MISSED" in big and "(≤ 1.05: MISSED)" in big
    assert "Test GPU" in lines[0] and "jax 0.0" in lines[0]


def test_jax_sweep_on_cpu_collects_rows(monkeypatch, jax_data):
    monkeypatch.setattr(jax_steps, "require_jax_gpu", lambda: None)
    monkeypatch.setattr(jax_steps, "JaxRopeData", lambda shape: jax_data)
    monkeypatch.setattr(jax_steps, "torch_graph_time_us", lambda tokens, repeats: 2.5)
    monkeypatch.setattr(jax_steps, "dispatch_calls", lambda tokens: 3)
    failures = []
    rows = jax_steps.jax_sweep([3], impls=("jnp-copy", "cupyrope-native"), repeats=1,
                               failures=failures)
    assert failures == []
    (row,) = rows
    assert set(row.wall_us) == set(row.gpu_us) == {"jnp-copy", "cupyrope-native"}
    assert set(row.max_abs_err) == {"cupyrope-native"} and row.torch_gpu_us == 2.5


@pytest.mark.parametrize("with_tqdm", [True, False], ids=["tqdm", "no-tqdm"])
def test_jax_sweep_shows_its_progress(monkeypatch, jax_data, bars, capsys, with_tqdm):
    if not with_tqdm:
        from cupyrope.bench import progress

        monkeypatch.setattr(progress, "tqdm", None)
    monkeypatch.setattr(jax_steps, "require_jax_gpu", lambda: None)
    monkeypatch.setattr(jax_steps, "JaxRopeData", lambda shape: jax_data)
    monkeypatch.setattr(jax_steps, "dispatch_calls", lambda tokens: 3)

    def no_torch_path(tokens, repeats):
        raise jax_steps.Unavailable("no torch CUDA here")

    monkeypatch.setattr(jax_steps, "torch_graph_time_us", no_torch_path)
    rows = jax_steps.jax_sweep([3, 3], impls=("jnp-copy",), repeats=1)
    assert [set(row.wall_us) for row in rows] == [{"jnp-copy"}] * 2
    assert capsys.readouterr().err.count("T=3 torch path: skipped (no torch CUDA here)") == 2
    if with_tqdm:
        (bar,) = bars
        assert bar.total == bar.updates == 4 and bar.closed  # 2 T x (1 step + the torch path)
        assert bar.descriptions == ["T=3 jnp-copy", "T=3 torch path"] * 2
        assert len(bar.notes) == 2
    else:
        assert bars == []


def _made_up_jax_rows():
    return [jax_steps.JaxRow(t, wall_us={"jnp-copy": 8.0 * t, "xla-hf": 9.0 * t,
                                         "cupyrope-native": 8.5 * t},
                             gpu_us={"jnp-copy": 1.0 * t, "cupyrope-native": 1.2 * t},
                             torch_gpu_us=1.1 * t)
            for t in (1, 32, 4096)] + [jax_steps.JaxRow(65536)]  # a T where nothing ran


def test_plot_jax_draws_the_made_up_rows(tmp_path):
    pytest.importorskip("matplotlib")
    path = str(tmp_path / "jax.png")
    assert jax_steps.plot_jax(_made_up_jax_rows(), path, gpu_name="Test GPU") == path
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_fused_draws_the_made_up_rows(tmp_path):
    pytest.importorskip("matplotlib")
    from cupyrope.bench import fused

    rows = [fused.FusedRow(op, impl, t, 4.0, 100.0, pct)
            for op in ("rms_norm_rope", "fp8 out") for t in (4096, 16384)
            for impl, pct in (("copy", 100.0), ("cupyrope-fused", 95.0))]
    path = str(tmp_path / "fused.png")
    assert fused.plot_fused(rows, path, gpu_name="Test GPU") == path
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("with_matplotlib", [True, False], ids=["matplotlib", "no-matplotlib"])
def test_cli_jax_writes_its_table_json_and_plot(monkeypatch, tmp_path, capsys, with_matplotlib):
    if with_matplotlib:
        pytest.importorskip("matplotlib")
    else:
        monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)  # the command sets it
    monkeypatch.setattr(cli, "require_jax_gpu", lambda: None)
    monkeypatch.setattr(cli, "jax_sweep", lambda tokens, **options: _made_up_jax_rows())
    monkeypatch.setattr(cli, "jax_device_name", lambda: "Test GPU")
    monkeypatch.setattr(cli, "jax_environment", lambda: {"jax": "0.0"})
    assert cli.main(["--jax", "--tokens", "1", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "jax_sweep.md").exists() and (tmp_path / "jax_sweep.json").exists()
    captured = capsys.readouterr()
    if with_matplotlib:
        assert (tmp_path / "jax_sweep.png").exists()
        assert f"plot: {tmp_path / 'jax_sweep.png'}" in captured.out
    else:
        assert not (tmp_path / "jax_sweep.png").exists()
        assert "no plot:" in captured.err


def test_cli_jax_without_a_jax_gpu_says_so(capsys, monkeypatch):
    jax = pytest.importorskip("jax")
    devices = jax.devices

    def no_gpu_backend(backend=None):  # as JAX answers on a machine without its GPU plugin
        if backend == "gpu":
            raise RuntimeError("Unknown backend: 'gpu' requested, but no platforms that are "
                               "instances of gpu are present.")
        return devices(backend)

    monkeypatch.setattr(jax, "devices", no_gpu_backend)
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "--jax" in capsys.readouterr().out
    assert cli.main(["--jax", "--tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "JAX GPU backend" in err and err.count("\n") == 1 and "Traceback" not in err


# ---- shared scaffolding, head shapes and serving shapes -----------------------------------------

from cupyrope.bench import cases, shapes  # noqa: E402
from cupyrope.bench.fused import BLOCK_SIZE  # noqa: E402


def test_latest_data_keeps_one_key_and_frees_the_previous_first():
    import weakref

    made, alive = [], weakref.WeakSet()

    class Data:
        def __init__(self, *key):
            assert not list(alive), "the previous data must be freed before the next is made"
            made.append(key)
            alive.add(self)

    latest = cases.LatestData(Data)
    first = latest.get(4096, "bf16")
    assert latest.get(4096, "bf16") is first and made == [(4096, "bf16")]
    del first
    second = latest.get(4096, "bf16", 20)
    assert made == [(4096, "bf16"), (4096, "bf16", 20)] and list(alive) == [second]


def test_guarded_skips_only_the_peers():
    def boom():
        raise RuntimeError("no kernel")

    with pytest.raises(workloads.Unavailable, match="unfused-compile failed on this shape: "
                                                    "RuntimeError: no kernel"):
        cases.guarded("unfused-compile", boom)
    for ours in ("copy", "cupyrope-fused", "cupyrope-mla", "plain-rope"):
        with pytest.raises(RuntimeError, match="no kernel"):
            cases.guarded(ours, boom)
    with pytest.raises(workloads.Unavailable, match="not installed"):
        cases.guarded("cupyrope-cache", lambda: (_ for _ in ()).throw(
            workloads.Unavailable("not installed")))
    assert cases.guarded("copy", lambda: 3) == 3


def test_head_shapes_cover_every_head_dim_and_gqa_ratio_with_dram_sized_traffic():
    found = shapes.head_shapes()
    assert [(s.head_dim, s.num_q_heads // s.num_k_heads) for s in found] == [
        (d, r) for d in (64, 80, 96, 256) for r in (1, 4, 8)]
    for s in found:
        traffic = 2 * s.tokens * (s.num_q_heads + s.num_k_heads) * s.head_dim * 2
        assert s.num_q_heads == 32 and s.tokens & (s.tokens - 1) == 0 and s.tokens <= 65536
        assert 256 * 2**20 <= traffic <= 2**30 or (s.tokens == 65536 and traffic >= 256 * 2**20)
        assert s.tokens == 65536 or 2 * traffic > 2**30  # halved only as far as needed
    assert shapes.bandwidth_tokens(32, 4, 64) == 65536
    assert shapes.bandwidth_tokens(32, 32, 256) == 16384


def test_shard_shapes_are_the_few_heads_of_tensor_parallel_serving():
    found = shapes.shard_shapes()
    assert [(s.head_dim, s.num_q_heads, s.num_k_heads) for s in found] == [
        (d, hq, hk) for d in (80, 96, 128) for hq, hk in ((8, 1), (8, 2), (4, 1))]
    assert {s.tokens for s in found} == {65536} and not set(found) & set(shapes.head_shapes())


def test_head_shape_rows_move_the_bytes_of_their_heads():
    shape = workloads.RopeShape(tokens=6, num_q_heads=4, num_k_heads=1, head_dim=80,
                                max_position=64)
    data = workloads.RopeData(shape, device="cpu")
    work = workloads.make_workload("cupyrope-cache-inplace", data)
    q, k, positions, cache = work.arg_sets[0]
    unique_rows = len(set(positions.tolist()))
    assert work.bytes_moved == 2 * (q.nbytes + k.nbytes) + positions.nbytes + unique_rows * 80 * 4
    copy = workloads.make_workload("copy", data)
    assert copy.bytes_moved == 2 * (q.nbytes + k.nbytes)


@pytest.mark.parametrize("name", list(shapes.SERVING_LAYOUTS))
@pytest.mark.parametrize("op", shapes.SERVING_OPS)
def test_serving_fused_ops_agree_with_the_unfused_formulation_torch_compile_runs(name, op):
    """What ``unfused-compile`` compiles (RMSNorm, the Hugging Face / vLLM-native rotation with
    M-RoPE and partial rotary, index_copy_ into the caches), run eagerly on the host, gives the
    fused op's numbers up to bf16 rounding: the two sides of a serving row compute the same
    thing."""
    from cupyrope.bench import fused

    layout = shapes.SERVING_LAYOUTS[name]
    data = shapes.serving_data(name, 16, device="cpu")
    caches = data.caches(op) if op in fused.CACHE_OPS else ()
    results = []
    for fn in (shapes.serving_workload(op, "cupyrope-fused", data).fn,
               fused.unfused(op, layout.rope())):
        for cache in caches:
            cache.zero_()
        args = data.arg_sets(op)[0]
        out = fn(args[0].clone(), args[1].clone(), *args[2:])
        results.append([x.float() for x in out[:2]] + [c.float().clone() for c in caches])
    for got, want in zip(*results):
        assert torch.all((got - want).abs() <= 2.0 ** -6 * want.abs().amax(-1, keepdim=True))
    if caches:
        assert all(bool(c.abs().sum() > 0) for c in results[0][2:])


@pytest.mark.parametrize("name", list(shapes.SERVING_LAYOUTS))
def test_serving_byte_counts_are_the_arrays_bytes(name):
    """Every byte the fused op must read and write once, counted from the arrays themselves."""
    data = shapes.serving_data(name, 16, device="cpu")
    lay = data.layout
    q, k, v, positions = data.q[0], data.k[0], data.v[0], data.positions[0]
    angle_rows = 16 * lay.rot * 4  # one fp32 cache row's worth a token
    assert positions.shape == ((16,) if lay.mrope_section is None else (3, 16))
    qk = 2 * (q.nbytes + k.nbytes)  # read and written once
    assert data.bytes_moved("rms_norm_rope") == qk + positions.nbytes + angle_rows
    cache_rows = 2 * k.nbytes  # k and v rows written into the bf16 caches
    assert data.bytes_moved("rope_and_cache") == (qk + v.nbytes + cache_rows + positions.nbytes
                                                  + angle_rows + data.slots[0].nbytes)
    copy = shapes.serving_workload("rope_and_cache", "copy", data)
    assert copy.bytes_moved == data.bytes_moved("rope_and_cache")
    assert len(copy.arg_sets) == len(data.q)


def test_spec_decode_batches_are_runs_of_draft_tokens():
    """64 x 4 tokens: each sequence's draft tokens at consecutive positions and consecutive slots
    of one block, sequences at unrelated contexts, no slot written twice."""
    assert shapes.serving_tokens("spec-decode") == (256,)
    assert shapes.serving_tokens("mrope") == shapes.SERVING_TOKENS
    data = shapes.serving_data("spec-decode", 256, device="cpu")
    for positions, slots in zip(data.positions, data.slots):
        runs, slot_runs = positions.view(64, 4), slots.view(64, 4)
        assert torch.equal(runs - runs[:, :1], torch.arange(4).expand(64, 4))
        assert torch.equal(slot_runs - slot_runs[:, :1], torch.arange(4).expand(64, 4))
        assert len(set((slot_runs[:, 0] // BLOCK_SIZE).tolist())) == 64
        assert len(set(slots.tolist())) == 256 and len(set(runs[:, 0].tolist())) > 32
        assert int(slots.max()) < data.k_cache.shape[0] * BLOCK_SIZE


def test_serving_groups_and_ids_name_the_layout():
    data = shapes.serving_data("mrope-interleaved", 16, device="cpu")
    group = shapes.serving_group("rope_and_cache", "mrope-interleaved", data)
    assert group.startswith("serving rope_and_cache mrope-interleaved (CUDA graph of 20 calls): "
                            "bf16 q[16,32,128] k[16,8,128] neox interleaved M-RoPE [24, 20, 20]")
    data = shapes.serving_data("rot-quarter", 1024, device="cpu")
    assert "(eager): bf16 q[1024,16,256] k[1024,2,256] neox rotary_dim=64" in shapes.serving_group(
        "rms_norm_rope", "rot-quarter", data)


@pytest.fixture
def fake_gpu(monkeypatch):
    """The sweeps of :mod:`cupyrope.bench.shapes` on CPU data with a fake clock: the copy takes
    2 µs, torch.compile (here the eager unfused sequence) 6 µs, the rest 4 µs."""
    from cupyrope.bench import fused

    monkeypatch.setattr(shapes, "require_cuda", lambda: torch)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    real_serving_data = shapes.serving_data
    monkeypatch.setattr(shapes, "serving_data",
                        lambda name, tokens: real_serving_data(name, tokens, device="cpu"))
    monkeypatch.setattr(shapes, "RopeData", lambda shape: workloads.RopeData(shape, device="cpu"))
    monkeypatch.setattr(fused, "peer_status", lambda: {"torch-compile-hf": None})
    monkeypatch.setattr(fused, "_compiled", lambda op, rope: fused.unfused(op, rope))
    ran = []

    def fake_time_us(work, *, graph, repeats):
        work.fn(*work.arg_sets[0])  # the workload must run
        ran.append((work.name, graph))
        return {"copy": 2.0, "unfused-compile": 6.0}.get(work.name, 4.0)

    monkeypatch.setattr(cases, "time_us", fake_time_us)
    return ran


def test_serving_sweep_times_each_layout_op_and_impl(fake_gpu, capsys):
    failures = []
    rows = shapes.serving_sweep([32], layouts=("mrope", "spec-decode"), progress=False,
                                failures=failures)
    assert failures == []
    assert [(r.layout, r.op, r.tokens, r.impl) for r in rows] == [
        (name, op, t, impl) for name, t in (("mrope", 32), ("spec-decode", 256))
        for op in shapes.SERVING_OPS for impl in shapes.SERVING_IMPLS]
    assert all(graph for _, graph in fake_gpu)  # T <= 512: CUDA graphs
    assert {r.impl: r.pct_of_copy for r in rows} == {
        "copy": 100.0, "cupyrope-fused": 50.0, "unfused-compile": 100.0 / 3}
    table = shapes.format_serving_table(rows, "Test GPU")
    summary = _markdown_rows(table.split("\n\n")[1])
    assert summary[2:] == [[name, op, str(t), "50.0", "1.50x"]
                           for name, t in (("mrope", 32), ("spec-decode", 256))
                           for op in shapes.SERVING_OPS]


def test_shapes_sweep_notes_a_missing_peer_and_summarises_each_shape(fake_gpu, capsys):
    small = [workloads.RopeShape(tokens=8, num_q_heads=4, num_k_heads=k, head_dim=d,
                                 max_position=64) for d, k in ((64, 4), (80, 1))]
    rows = shapes.shapes_sweep(small, impls=("copy", "cupyrope-cache", "cupyrope-cache-inplace",
                                             "no-such-peer"), progress=False)
    assert "no-such-peer: skipped" in capsys.readouterr().err
    assert [(r.head_dim, r.num_k_heads, r.impl) for r in rows] == [
        (d, k, impl) for d, k in ((64, 4), (80, 1))
        for impl in ("copy", "cupyrope-cache", "cupyrope-cache-inplace")]
    summary = _markdown_rows(shapes.format_shapes_table(rows, "Test GPU").split("\n\n")[1])
    assert summary[2:] == [["64", "4/4", "8", "50.0", "50.0", "-", "-"],
                           ["80", "4/1", "8", "50.0", "50.0", "-", "-"]]


@pytest.mark.parametrize("option, stem", [("--shapes", "shapes_sweep"),
                                          ("--serving", "serving_sweep")])
def test_cli_shape_sweeps_write_their_table_and_json(monkeypatch, tmp_path, capsys, option, stem):
    made = [shapes.ServingRow("mrope", "rope_and_cache", "copy", 4096, 2.0, 100.0, 100.0)]
    monkeypatch.setattr(cli, "require_cuda", lambda: torch)
    monkeypatch.setattr(cli, "device_name", lambda: "Test GPU")
    monkeypatch.setattr(cli, "shapes_sweep", lambda **kw: made)
    monkeypatch.setattr(cli, "serving_sweep", lambda tokens, **kw: made)
    monkeypatch.setattr(cli, "format_shapes_table", lambda rows, name: "shapes table")
    monkeypatch.setattr(cli, "format_serving_table", lambda rows, name: "serving table")
    assert cli.main([option, "--out", str(tmp_path)]) == 0
    assert sorted(os.listdir(tmp_path)) == [f"{stem}.json", f"{stem}.md"]
    assert capsys.readouterr().out.startswith(stem.split("_")[0])


def test_benchmark_summary_shows_speedups_over_torch_compile_and_liger(monkeypatch):
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "conftest.py")
    spec = importlib.util.spec_from_file_location("bench_conftest_under_test", path)
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    record = dict(tokens=512, dtype="bfloat16", gbps=100.0, pct_of_copy=90.0)
    monkeypatch.setattr(conftest, "_RECORDS", [
        dict(group="g", impl="copy", median_us=1.8, **record),
        dict(group="g", impl="cupyrope-cache", median_us=2.0, **record),
        dict(group="g", impl="torch-compile-hf", median_us=5.0, **record),
        dict(group="g", impl="liger-inplace", median_us=3.0, **record),
        dict(group="h", impl="cupyrope-fused", median_us=4.0, **record),
        dict(group="h", impl="unfused-compile", median_us=10.0, **record)])
    rows = _markdown_rows("\n".join(conftest._summary_lines()))
    header = rows[0]
    compile_col, liger_col = header.index("× torch.compile"), header.index("× Liger")
    by_impl = {(r[0], r[1]): (r[compile_col], r[liger_col]) for r in rows[2:]}
    assert by_impl[("g", "cupyrope-cache")] == ("2.50×", "1.50×")
    assert by_impl[("h", "cupyrope-fused")] == ("2.50×", "")
    assert by_impl[("g", "copy")] == by_impl[("g", "liger-inplace")] == ("", "")
