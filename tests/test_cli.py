"""``python -m cupyrope``: the demo's verdict, argument errors, --version, and ``bench`` without a
GPU; ``compile``'s arguments and its work split; ``warmup`` without a GPU. These run on any machine (the demo takes the NumPy path there)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import types

import pytest

import cupyrope as cr
from cupyrope import __main__ as cli


def run(*args):
    return subprocess.run([sys.executable, "-m", "cupyrope", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_demo_passes_the_accuracy_contract(dtype):
    result = run("--tokens", "32", "--dtype", dtype, "--cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("PASS") == 2 and "FAIL" not in result.stdout
    assert "all rows within the accuracy contract" in result.stdout


def test_demo_is_the_default_command():
    result = run("demo", "--tokens", "8", "--cpu")
    assert result.returncode == 0 and "PASS" in result.stdout


@pytest.mark.parametrize("tokens", ["0", "-5", "many"])
def test_tokens_must_be_a_positive_int(tokens):
    result = run("--tokens", tokens)
    assert result.returncode == 2
    assert "argument --tokens: expected a positive integer" in result.stderr
    assert "Traceback" not in result.stderr


def test_version():
    result = run("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"cupyrope {cr.__version__}"


def test_the_demo_fails_loudly_on_an_error_beyond_the_bound(monkeypatch, capsys):
    monkeypatch.setattr(cli, "ULP_BOUND", {"bfloat16": 0.0, "float16": 0.0, "float32": 0.0})
    assert cli.main(["--tokens", "16", "--cpu", "--dtype", "float32"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_bench_without_a_gpu_says_so_in_one_sentence(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_gpu_available", lambda: False)
    assert cli.main(["bench", "--tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "need a CUDA GPU" in err and err.count("\n") == 1


def test_bench_without_cupy_ends_in_one_sentence_not_a_traceback():
    # What a plain `pip install` (no CUDA extra) meets: no CuPy at all.
    probe = ("import sys; sys.modules['cupy'] = None; from cupyrope.__main__ import main; "
             "sys.exit(main(['bench']))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("python -m cupyrope bench: the benchmarks need a CUDA GPU")
    assert "CuPy is not installed" in result.stderr and result.stderr.count("\n") == 1


def test_bench_hands_its_arguments_to_the_benchmark_cli(monkeypatch):
    calls = []
    fake = types.ModuleType("cupyrope.bench.cli")
    fake.main = lambda argv, prog, default_out: calls.append((argv, prog, default_out)) or 0
    monkeypatch.setitem(sys.modules, "cupyrope.bench.cli", fake)
    monkeypatch.setattr(cli, "_gpu_available", lambda: True)
    assert cli.main(["bench", "--tokens", "1", "8"]) == 0
    assert calls == [(["--tokens", "1", "8"], "python -m cupyrope bench", "cupyrope-bench")]
    # Options the demo also has, "--opt=value" forms and positionals keep their order.
    rest = ["--repeats", "3", "--tokens", "8", "--out=sweep", "--no-check", "--cpu", "-h"]
    assert cli.main(["bench", *rest]) == 0
    assert calls[-1] == (rest, "python -m cupyrope bench", "cupyrope-bench")


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "abc"], "argument --tokens: invalid positive integer value: 'abc'"),
    (["--tokens", "0"], "argument --tokens: expected a positive integer, got 0"),
    (["--repeats", "2", "--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bench_rejects_bad_arguments_before_it_looks_for_a_gpu(monkeypatch, capsys, argv, message):
    looked = []
    monkeypatch.setattr(cli, "_gpu_available", lambda: looked.append(True) or False)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", *argv])
    assert exit_info.value.code == 2 and looked == []
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m cupyrope bench ") and message in err
    assert "need a CUDA GPU" not in err and "_positive_int" not in err


def test_bench_with_a_bad_argument_prints_a_usage_error_on_any_machine():
    result = run("bench", "--tokens", "abc")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "argument --tokens: invalid positive integer value: 'abc'" in result.stderr
    assert "need a CUDA GPU" not in result.stderr


def test_an_unknown_command_is_an_invalid_choice(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["frobnicate"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'frobnicate' (choose from 'demo', 'compile', 'bench')" in err
    assert "unrecognized arguments" not in err


def _parsers(parser: argparse.ArgumentParser):
    """``parser`` and, depth first, the parsers of its sub-commands."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_option_of_every_command_has_help():
    from cupyrope.bench.options import build_parser

    roots = [cli._parser(), build_parser(prog="python -m cupyrope bench", default_out="out")]
    missing = []
    for parser in (p for root in roots for p in _parsers(root)):
        actions = list(parser._actions)
        for action in parser._actions:
            actions += getattr(action, "_choices_actions", [])  # a sub-command's help line
        missing += [f"{parser.prog}: {'/'.join(a.option_strings) or a.dest}" for a in actions
                    if not a.help or a.help == argparse.SUPPRESS]
    assert missing == []


def test_the_demo_refuses_arguments_it_does_not_know():
    result = run("--tokens", "8", "--cpu", "--repeats", "3")
    assert result.returncode == 2
    assert "unrecognized arguments: --repeats 3" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("command", [[], ["demo"], ["compile"], ["bench"]])
def test_help_cites_no_file_that_does_not_ship(command):
    result = run(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: python -m cupyrope{''.join(' ' + c for c in command)} ")
    assert "SPEC" not in result.stdout and "\u00a7" not in result.stdout
    assert not re.search(r"\b[\w/.-]+\.(md|rst|txt)\b", result.stdout), result.stdout


def test_warmup_without_a_gpu_raises_one_clear_error():
    cupy = pytest.importorskip("cupy")
    if cupy.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="warmup: no usable CUDA GPU was found"):
        cr.warmup()


def test_compile_without_a_gpu_says_so_in_one_sentence(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_gpu_available", lambda: False)
    assert cli.main(["compile", "--jobs", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m cupyrope compile: compiling for a GPU needs a CUDA GPU")
    assert err.count("\n") == 1


@pytest.mark.parametrize("jobs", ["0", "-3", "two"])
def test_compile_jobs_must_be_a_positive_int(jobs):
    result = run("compile", "--jobs", jobs)
    assert result.returncode == 2 and "--jobs: expected a positive integer" in result.stderr


def test_compile_hands_every_specialisation_to_exactly_one_worker(monkeypatch):
    from cupyrope.cuda import compiler, kernel_cache

    compiled = []
    monkeypatch.setattr(compiler, "get_kernel", lambda spec, device_id: compiled.append(spec))

    class InProcessPool:  # the process pool's map, run here in the order it hands jobs out
        def __init__(self, jobs, mp_context):
            assert jobs == 5 and mp_context.get_start_method() == "spawn"

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            return False

        def map(self, fn, *iterables, chunksize):
            assert chunksize == 1  # one at a time: a free worker takes the next longest
            return map(fn, *iterables)

    monkeypatch.setattr(kernel_cache.concurrent.futures, "ProcessPoolExecutor", InProcessPool)
    count = kernel_cache.fill_kernel_cache(device=0, jobs=5)
    assert count == len(compiler.ALL_SPECIALISATIONS) == len(compiled)
    assert sorted(map(repr, compiled)) == sorted(map(repr, compiler.ALL_SPECIALISATIONS))
    ranks = [kernel_cache.compile_cost_rank(spec) for spec in compiled]
    assert ranks == sorted(ranks, reverse=True) and ranks[0] > ranks[-1]  # the longest first
    assert compiled[0].all_heads
    with pytest.raises(ValueError, match="jobs must be at least 1, got 0"):
        kernel_cache.fill_kernel_cache(device=0, jobs=0)
