"""The benchmark package on a machine without a GPU: its command line, the sweep's control flow
(skipped peers, failing cases, rows), the markdown table and the host-time loop. The timings
themselves need a GPU (``benchmarks/``, ``python -m cupyrope.bench``); here the GPU clock is
replaced by fixed numbers and the data lives on the CPU."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tabulate")

from cupyrope.bench import cli, clocks, sweep, workloads  # noqa: E402


def test_help_works_without_a_gpu():
    result = subprocess.run([sys.executable, "-m", "cupyrope.bench", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for option in ("--tokens", "--impls", "--repeats", "--no-check", "--out", "--fused"):
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
        monkeypatch.setattr(sweep, "tqdm", None)
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


@pytest.mark.parametrize("op", ["rms_norm_rope", "rope_and_cache", "fp8 out"])
def test_fused_workloads_agree_with_the_unfused_sequences(op):
    """The fused-op benchmark's workloads (cupyrope.bench.fused), on the host: the fused call and
    the unfused eager sequence give the same numbers (bf16 rounding apart), and the paged caches
    receive the same rows."""
    from cupyrope.bench import fused

    data = fused.FusedData(16, device="cpu")
    results = {}
    for impl in ("cupyrope-fused", "unfused-eager"):
        work = fused.make_fused_workload(op, impl, data)
        data.k_cache.zero_()
        data.v_cache.zero_()
        args = work.arg_sets[0]
        if op == "rope_and_cache":  # the fused op rotates in place: work on copies
            args = (args[0].clone(), args[1].clone(), *args[2:])
        out = work.fn(*args)
        results[impl] = [x.float() for x in out] + (
            [data.k_cache.float().clone(), data.v_cache.float().clone()]
            if op == "rope_and_cache" else [])
    scale = 2.0 ** -3 if op == "fp8 out" else 2.0 ** -7  # one rounding of fp8 / bf16, relative
    for got, want in zip(results["cupyrope-fused"], results["unfused-eager"]):
        assert torch.all((got - want).abs() <= scale * want.abs().amax(-1, keepdim=True) + 1e-6)
    assert work.bytes_moved == data.bytes_moved(op) > 0


def test_decode_and_host_targets_are_the_contracts_ratios():
    """SPEC §4 as ratios to the copy of the same run: decode <= 1.15x the SM copy at T = 1 and 32,
    <= 1.05x at 512 (cache, tables), <= 1.3x computed; host <= 1.2x torch.mul in place and with
    out=, <= 1.5x out of place; no target for the copy or the peers."""
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
