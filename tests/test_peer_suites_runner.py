"""scripts/peer_suites/run.py on a stand-in peer test file (no GPU, no peer): cases past the time
budget are counted unrun and named in the saved rows, ``--resume`` runs exactly those (sharded
too), and ``--merge`` sums a run with its resumptions into one count per column."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[1] / "scripts" / "peer_suites" / "run.py"
CASES = 6
FILE = "tests/test_standin.py"


@pytest.fixture
def peer_tests(tmp_path) -> Path:
    """A .peer_tests folder of one FlashInfer-named file of CASES cases, one of which fails."""
    folder = tmp_path / "peer_tests"
    test_file = folder / "flashinfer" / FILE
    test_file.parent.mkdir(parents=True)
    test_file.write_text(
        "import pytest\n\n"
        f"@pytest.mark.parametrize('i', range({CASES}))\n"
        "def test_case(i):\n"
        "    assert i != 4, 'case 4 fails'\n")
    (folder / "manifest.json").write_text(json.dumps([{
        "peer": "flashinfer", "repo": "flashinfer-ai/flashinfer", "path": FILE,
        "commit": "0123456789abcdef0123456789abcdef01234567", "source": "git"}]))
    return folder


def _run(peer_tests: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUNNER), "--peer-tests", str(peer_tests),
                           "--peers", "flashinfer", "-n", "0", *args],
                          capture_output=True, text=True, timeout=300)


def _totals(output: str) -> dict:
    line = next(line for line in output.splitlines() if line.startswith("total:"))
    return {name: int(count) for name, count in
            (part.strip().rsplit(" ", 1) for part in line[len("total:"):].split(";")[0].split(","))}


def test_unrun_cases_resume_sharded_and_merge_into_one_count(peer_tests, tmp_path):
    first = tmp_path / "first.json"
    # A budget spent before pytest starts: every case is left unrun, and named.
    done = _run(peer_tests, "--budget", "1e-9", "--save", str(first))
    assert _totals(done.stdout)["unrun"] == CASES, done.stdout + done.stderr
    (row,) = json.loads(first.read_text())
    assert len(row["unrun_ids"]) == CASES and row["total"] == CASES
    assert all(case.startswith(FILE + "::test_case[") for case in row["unrun_ids"])

    def resumed(name, *args):
        path = tmp_path / name
        done = _run(peer_tests, *args, "--save", str(path))
        (row,) = json.loads(path.read_text())
        assert row["unrun_ids"] == [], done.stdout + done.stderr
        assert sum(row["counts"].values()) == len(row["resumed"]) > 0, row  # ran what it took
        return path

    def merged(*paths):
        done = _run(peer_tests, "--merge", *map(str, paths))
        return _totals(done.stdout)

    # Half of the unrun cases (a shard), then the rest: by a second --resume of both runs, or
    # by the other shard of the first.
    half = resumed("half.json", "--resume", str(first), "--shard", "0/2")
    assert merged(first, half)["unrun"] == CASES - len(json.loads(half.read_text())[0]["resumed"])
    rest = resumed("rest.json", "--resume", str(first), str(half))
    other = resumed("other.json", "--resume", str(first), "--shard", "1/2")
    everything = {"passed": CASES - 1, "failed": 1, "skipped": 0, "no adapter": 0,
                  "no CUDA": 0, "errors": 0, "unrun": 0}  # case 4's failure counted once
    assert merged(first, half, rest) == everything
    assert merged(first, half, other) == everything
    halves = [half, rest]
    # Nothing is left to resume, and a resumed run is never merged without what it resumed.
    nothing = _run(peer_tests, "--resume", str(first), *map(str, halves))
    assert nothing.returncode != 0 and "name no case left unrun" in nothing.stderr
    alone = _run(peer_tests, "--merge", str(halves[0]))
    assert alone.returncode != 0 and "merge it with the runs it resumed" in alone.stderr
