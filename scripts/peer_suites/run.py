"""Run the peers' own RoPE test files (fetched by fetch.py into ``.peer_tests/``) against
cupyrope.compat: each file in its own pytest process, with the shims of
``scripts/peer_suites/shims/`` first on the path so that ``import flashinfer``, ``vllm`` and
``transformer_engine`` resolve to cupyrope's adapters. Prints one table per peer (passed,
failed, skipped, no adapter: a NotImplementedError raised by a shim, no CUDA, errors, unrun:
past the time budget; the cases collected, the runtime and the commit of each file), then the
calls that had no adapter and the most frequent failure messages.

    python scripts/peer_suites/run.py                       # every file, every case
    python scripts/peer_suites/run.py --max-cases 800 -n 8 --budget 200
    python scripts/peer_suites/run.py --collect-only        # imports and collection only
    python scripts/peer_suites/run.py --shard 0/3 --save s0.json   # a third of every file ...
    python scripts/peer_suites/run.py --merge s0.json s1.json s2.json   # ... the thirds summed
    python scripts/peer_suites/run.py --resume s0.json s1.json --save r.json   # what they left
    python scripts/peer_suites/run.py --merge s0.json s1.json r.json    # unrun cases run since
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIMS = HERE / "shims"
REPO = HERE.parents[1]
MARKER = "no cupyrope adapter for"
PEERS = ("vllm", "flashinfer", "te")
PLUGINS = {"vllm": ["peer_suites_plugin", "vllm_test_fixtures"]}
NO_CUDA = re.compile(r"Torch not compiled with CUDA enabled|Found no NVIDIA driver|"
                     r"No CUDA GPUs are available|no CUDA-capable device|cudaErrorNoDevice|"
                     r"cudaErrorInsufficientDriver|CUDA driver initialization failed|"
                     r"needs a CUDA device|Invalid device|invalid device ordinal")
BUDGET_REASON = "peer-suite time budget spent"  # the plugin's skip reason past a deadline
RUN_LAST = ("test_fused_rope.py", "test_rope.py")  # TE's ~9,600 and FlashInfer's ~31,000 cases
COLUMNS = ("passed", "failed", "skipped", "no adapter", "no CUDA", "errors", "unrun")


def xdist_available() -> bool:
    try:
        import xdist  # noqa: F401
    except ImportError:
        return False
    return True


def pytest_command(peer: str, peer_dir: Path, test_file: Path, args, extra: list[str]):
    command = [sys.executable, "-m", "pytest", str(test_file), "-c", str(HERE / "pytest.ini"),
               "--rootdir", str(peer_dir), "--confcutdir", str(peer_dir), "-q",
               "-p", "no:cacheprovider"]
    for plugin in PLUGINS.get(peer, ["peer_suites_plugin"]):
        command += ["-p", plugin]
    if args.k:
        command += ["-k", args.k]
    return command + extra + list(args.pytest_args)


def environment(peer: str) -> dict:
    env = dict(os.environ)
    paths = [str(SHIMS / "common"), str(SHIMS / peer), str(REPO)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def count_cases(peer, peer_dir, test_file, args, workdir) -> tuple[int, str, int]:
    """(cases collected, pytest's output, its exit status) of a ``--collect-only`` run."""
    command = pytest_command(peer, peer_dir, test_file, args, ["--collect-only"])
    done = subprocess.run(command, cwd=workdir, env=environment(peer), capture_output=True,
                          text=True)
    total = sum(1 for line in done.stdout.splitlines() if "::" in line)
    return total, done.stdout + done.stderr, done.returncode


_EXCEPTION_LINE = re.compile(r"E\s+([\w.]+(Error|Exception|Warning)\b.*)")


def first_error_line(message: str) -> str:
    """The line that names the exception (``E   torch.OutOfMemoryError: ...``), else the first
    ``E`` line (an assertion's own text), else the last line: pytest puts a failed comparison's
    operands, tensors included, on ``E`` lines before the exception."""
    for line in message.splitlines():
        named = _EXCEPTION_LINE.match(line)
        if named:
            return named[1].strip()[:160]
    for line in message.splitlines():
        if line.startswith("E "):
            return line[1:].strip()[:160]
    lines = [line for line in message.splitlines() if line.strip()]
    return (lines[-1] if lines else "")[:160]


def no_adapter_name(message: str) -> str:
    """What a shim's NoAdapter named: the rest of the first line holding the marker."""
    line = next(line for line in message.splitlines() if MARKER in line)
    return line.split(MARKER, 1)[1].strip().rstrip("'\"")


def classify(results: dict) -> tuple[Counter, Counter, Counter]:
    """(counts by column, no-adapter names, failure messages)."""
    counts, missing, messages = Counter(), Counter(), Counter()
    for case in results["cases"].values():
        outcome, message = case["outcome"], case["message"]
        if outcome in ("failed", "error"):
            if MARKER in message:
                missing[no_adapter_name(message)] += 1
                counts["no adapter"] += 1
                continue
            if NO_CUDA.search(message):
                counts["no CUDA"] += 1
                continue
            messages[first_error_line(message)] += 1
        elif outcome == "skipped" and BUDGET_REASON in message:
            counts["unrun"] += 1
            continue
        counts["errors" if outcome == "error" else outcome] += 1
    for error in results["collect_errors"]:
        if MARKER in error["message"]:
            missing[no_adapter_name(error["message"])] += 1
        messages["collection: " + first_error_line(error["message"])] += 1
        counts["errors"] += 1
    return counts, missing, messages


def unrun_ids(results: dict) -> list[str]:
    """The node ids of the cases a run left unrun (past its time budget)."""
    return sorted(case_id for case_id, case in results["cases"].items()
                  if case["outcome"] == "skipped" and BUDGET_REASON in case["message"])


def run_file(entry: dict, args, workdir: Path, deadline: float | None,
             only: list[str] | None = None) -> dict:
    """One test file's row; ``only``: run just these node ids (``--resume``), recorded in the
    row's ``resumed`` (those this run's shard took)."""
    peer = entry["peer"]
    peer_dir = args.peer_tests / peer
    test_file = peer_dir / entry["path"]
    row = {"peer": peer, "path": entry["path"], "commit": entry["commit"][:12],
           "counts": Counter(), "missing": Counter(), "messages": Counter(), "unrun_ids": []}
    start = time.perf_counter()
    if args.collect_only:
        total, output, status = count_cases(peer, peer_dir, test_file, args, workdir)
        row["total"] = total
        row["seconds"] = time.perf_counter() - start
        if status != 0:
            row["counts"]["errors"] += 1
            row["messages"][output.strip().splitlines()[-1] if output.strip() else "?"] += 1
        return row
    results_path = workdir / f"{peer}-{Path(entry['path']).stem}.json"
    extra = ["--peer-results", str(results_path)]
    if args.max_cases:
        extra += ["--peer-max-cases", str(args.max_cases), "--peer-seed", str(args.seed)]
    if args.shard:
        extra += ["--peer-shard", args.shard]
    if args.workers:
        extra += ["-n", str(args.workers)]
    if deadline:
        extra += ["--peer-deadline", str(deadline)]
    if only is not None:
        only_path = workdir / f"{peer}-{Path(entry['path']).stem}.only.json"
        only_path.write_text(json.dumps(only))
        extra += ["--peer-only", str(only_path)]
    command = pytest_command(peer, peer_dir, test_file, args, extra)
    try:
        done = subprocess.run(command, cwd=workdir, env=environment(peer), capture_output=True,
                              text=True, timeout=args.timeout or None)
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired as timeout:
        output = f"timed out after {args.timeout} s\n" + str(timeout.stdout or "")[-2000:]
    row["seconds"] = time.perf_counter() - start
    collected = Path(str(results_path) + ".collected")
    if collected.exists():
        row["total"] = int(collected.read_text())
    selected = Path(str(results_path) + ".selected")
    if only is not None:
        row["resumed"] = json.loads(selected.read_text()) if selected.exists() else []
    if results_path.exists():
        results = json.loads(results_path.read_text())
        counts, missing, messages = classify(results)
        row.update(counts=counts, missing=missing, messages=messages,
                   unrun_ids=unrun_ids(results))
        if args.failures:
            save_failures(results, entry, args.failures)
    else:  # pytest never got to write results (an internal error, a timeout)
        row["counts"]["errors"] += 1
        row["messages"][output.strip().splitlines()[-1] if output.strip() else "?"] += 1
    if args.verbose:
        print(output[-6000:])
    return row


def save_failures(results: dict, entry: dict, folder: Path) -> None:
    """Each failed or errored case of a file, by its id, with the last 80 lines of its message
    (JSON in ``folder``, one file a test file and shard), to rerun or read them."""
    failed = {case_id: "\n".join(case["message"].splitlines()[-80:])
              for case_id, case in results["cases"].items()
              if case["outcome"] in ("failed", "error") and MARKER not in case["message"]}
    if failed:
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{entry['peer']}-{Path(entry['path']).stem}-{os.getpid()}.json"
        (folder / name).write_text(json.dumps(failed, indent=1))


def print_tables(rows: list[dict], args) -> None:
    for peer in PEERS:
        peer_rows = [row for row in rows if row["peer"] == peer]
        if not peer_rows:
            continue
        print(f"\n== {peer}")
        header = ["file", "commit", *(("cases",) if args.collect_only else COLUMNS),
                  *(() if args.collect_only else ("collected",)), "seconds"]
        table = []
        for row in peer_rows:
            if args.collect_only:
                cells = [row.get("total", 0)]
            else:
                cells = [row["counts"].get(column, 0) for column in COLUMNS]
            if not args.collect_only:
                cells.append(row.get("total", ""))
            table.append([Path(row["path"]).name, row["commit"], *cells,
                          f"{row['seconds']:.1f}"])
        widths = [max(len(str(x)) for x in column) for column in zip(header, *table)]
        for line in [header, *table]:
            print("  ".join(str(x).ljust(w) for x, w in zip(line, widths)))
        for row in peer_rows:
            for name, n in row["missing"].most_common():
                print(f"  no adapter  {Path(row['path']).name}: {n} x {name}")
            for message, n in row["messages"].most_common(args.messages):
                print(f"  failure     {Path(row['path']).name}: {n} x {message}")


def save_rows(rows: list[dict], path: Path) -> None:
    """The rows of a run as JSON, for --merge and --resume (with the node ids left unrun, and
    those a resumed run took)."""
    path.write_text(json.dumps([{**row, "counts": dict(row["counts"]),
                                 "missing": dict(row["missing"]),
                                 "messages": dict(row["messages"])} for row in rows], indent=1))


def merged_rows(paths: list[Path]) -> list[dict]:
    """The rows of several saved runs (shards of the same files, and ``--resume`` runs of what
    they left unrun) summed file by file: cases counted, runtimes added; the cases collected are
    each shard's (the whole file's). A resumed row's cases leave the unrun count and ids of the
    rows it resumed."""
    merged: dict[tuple, dict] = {}
    for path in paths:
        for row in json.loads(path.read_text()):
            key = (row["peer"], row["path"], row["commit"])
            into = merged.setdefault(key, {"peer": row["peer"], "path": row["path"],
                                           "commit": row["commit"], "counts": Counter(),
                                           "missing": Counter(), "messages": Counter(),
                                           "seconds": 0.0, "unrun_ids": set(),
                                           "resumed": set(), "named": True})
            for name in ("counts", "missing", "messages"):
                into[name].update(row[name])
            into["seconds"] += row["seconds"]
            into["named"] &= "unrun_ids" in row  # (runs saved before the ids were kept: not)
            into["unrun_ids"].update(row.get("unrun_ids", ()))
            into["resumed"].update(row.get("resumed", ()))
            if "total" in row:
                into["total"] = row["total"]
    rows = []
    for into in merged.values():
        resumed, named = into.pop("resumed"), into.pop("named")
        if resumed - into["unrun_ids"]:
            raise ValueError(f"{into['peer']}/{into['path']}: a resumed run ran cases that no "
                             "run given to --merge left unrun; merge it with the runs it resumed")
        into["counts"]["unrun"] -= len(resumed)  # (a Counter item may go below 0 meanwhile)
        into["unrun_ids"] = sorted(into["unrun_ids"] - resumed)
        if named and into["counts"]["unrun"] != len(into["unrun_ids"]):
            raise ValueError(f"{into['peer']}/{into['path']}: {into['counts']['unrun']} cases "
                             f"counted unrun, {len(into['unrun_ids'])} named: merge every "
                             "shard once")
        rows.append(into)
    return rows



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-tests", type=Path, default=REPO / ".peer_tests",
                        help="the folder fetch.py filled (default .peer_tests)")
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated peers")
    parser.add_argument("--files", default="", help="comma-separated substrings of file paths")
    parser.add_argument("--max-cases", type=int, default=0,
                        help="per file, run a seeded sample of at most N cases (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-k", default="", help="pytest -k expression, passed to every file")
    parser.add_argument("-n", "--workers", default="auto" if xdist_available() else "",
                        help="pytest-xdist workers per file ('' or 0: none; default auto)")
    parser.add_argument("--budget", type=float, default=0,
                        help="seconds for the whole run: each file may start cases until its "
                             "share of the time left has passed (the rest count as unrun)")
    parser.add_argument("--file-budget", type=float, default=0,
                        help="seconds per file after which its remaining cases are not started "
                             "(counted as unrun; 0: no limit)")
    parser.add_argument("--timeout", type=float, default=0,
                        help="seconds per file after which its pytest is killed (0: none)")
    parser.add_argument("--collect-only", action="store_true",
                        help="collect every file through the shims, run nothing")
    parser.add_argument("--shard", default="",
                        help="K/N: run the cases whose place in each file's (sampled) collection "
                             "is K mod N; N runs with K = 0 .. N-1 cover every case once")
    parser.add_argument("--save", type=Path, default=None,
                        help="also write the rows of this run here (JSON), for --merge")
    parser.add_argument("--merge", type=Path, nargs="+", default=None,
                        help="run nothing: sum the rows saved by earlier runs (the shards of "
                             "the same files, --resume runs of what they left) and print their "
                             "tables")
    parser.add_argument("--resume", type=Path, nargs="+", default=None,
                        help="run only the cases that these saved runs (--save) left unrun, "
                             "in the files they ran; --save this run and --merge it with them")
    parser.add_argument("--messages", type=int, default=5, help="failure messages shown per file")
    parser.add_argument("--failures", type=Path, default=None,
                        help="write each failed case's id and message into this folder (JSON)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print pytest's output")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    if args.workers in ("0", 0):
        args.workers = ""
    if args.shard:
        shard = re.fullmatch(r"(\d+)/([1-9]\d*)", args.shard)
        if not shard or int(shard[1]) >= int(shard[2]):
            parser.error(f"--shard takes K/N with 0 <= K < N, got {args.shard!r}")
    if args.merge:
        rows = merged_rows(args.merge)
        return report(rows, args, sum(row["seconds"] for row in rows))
    manifest = json.loads((args.peer_tests / "manifest.json").read_text())
    peers = set(args.peers.split(","))
    wanted = [s for s in args.files.split(",") if s]
    entries = [e for e in manifest
               if e["peer"] in peers and Path(e["path"]).name.startswith("test_")
               and (not wanted or any(s in e["path"] for s in wanted))]
    resume = None
    if args.resume:
        saved = {(row["peer"], row["path"]): row for row in merged_rows(args.resume)}
        resume = {key: row["unrun_ids"] for key, row in saved.items() if row["unrun_ids"]}
        if not resume:
            parser.error("--resume: the saved runs name no case left unrun (none was, or they "
                         "were saved before runs kept the ids)")
        entries = [e for e in entries if (e["peer"], e["path"]) in resume]
        for e in entries:
            if saved[e["peer"], e["path"]]["commit"] != e["commit"][:12]:
                parser.error(f"--resume: {e['peer']}/{e['path']} is at {e['commit'][:12]} here, "
                             f"the saved run at {saved[e['peer'], e['path']]['commit']}: fetch "
                             "that commit")
    # Small files first: under --budget what a file leaves unused passes to the later, larger
    # ones.
    entries.sort(key=lambda e: (RUN_LAST.index(Path(e["path"]).name)
                                if Path(e["path"]).name in RUN_LAST else -1, e["peer"], e["path"]))
    start, start_wall = time.perf_counter(), time.time()
    rows = []
    with tempfile.TemporaryDirectory(prefix="peer_suites_") as tmp:
        for done, entry in enumerate(entries):
            print(f"running {entry['peer']}/{entry['path']} ...", flush=True)
            deadline = None
            if args.budget:  # the time left, shared equally by the files left
                now = time.time()
                deadline = now + (start_wall + args.budget - now) / (len(entries) - done)
            if args.file_budget:
                deadline = min(deadline or math.inf, time.time() + args.file_budget)
            only = None if resume is None else resume[(entry["peer"], entry["path"])]
            row = run_file(entry, args, Path(tmp), deadline, only)
            rows.append(row)
            print("  " + ", ".join(f"{column} {row['counts'].get(column, 0)}"
                                   for column in COLUMNS) + f"; {row['seconds']:.1f} s",
                  flush=True)
    if args.save:
        save_rows(rows, args.save)
    return report(rows, args, time.perf_counter() - start)


def report(rows: list[dict], args, seconds: float) -> int:
    """The tables and the totals line; the exit status (1 when a case failed or errored)."""
    print_tables(rows, args)
    total = Counter()
    for row in rows:
        total.update(row["counts"])
    print(f"\ntotal: " + ", ".join(f"{column} {total.get(column, 0)}" for column in COLUMNS)
          + f"; {seconds:.1f} s"
          + (f" (sampled: at most {args.max_cases} cases per file, seed {args.seed})"
             if args.max_cases else "")
          + (f" (shard {args.shard})" if args.shard else ""))
    return 1 if total.get("failed") or total.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
