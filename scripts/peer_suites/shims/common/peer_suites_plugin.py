"""pytest plugin of the peer-suite runner: samples large parametrisations
(``--peer-max-cases``), keeps named cases only (``--peer-only``: a run that finishes what an
earlier one left unrun), skips what would start after a deadline (``--peer-deadline``), writes
every case's outcome to a JSON file (``--peer-results``) for
the runner's table, and frees cached device memory after each case."""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections import defaultdict

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("peer suites")
    group.addoption("--peer-max-cases", type=int, default=0,
                    help="run at most N cases of the file, a seeded sample spread over its "
                         "test functions in proportion to their sizes (0: all)")
    group.addoption("--peer-seed", type=int, default=0, help="seed of that sample")
    group.addoption("--peer-shard", default="",
                    help="K/N: run the cases whose place in the (sampled) collection is K mod N, "
                         "so that N runs, on one machine or several, cover a file once")
    group.addoption("--peer-results", default=None, help="write each case's outcome here (JSON)")
    group.addoption("--peer-deadline", type=float, default=0,
                    help="skip (as unrun) every case that would start after this time.time()")
    group.addoption("--peer-only", default=None,
                    help="run only the cases whose node ids this JSON list holds (applied after "
                         "the sample and before the shard); the ones kept are written beside "
                         "--peer-results (.selected)")


@pytest.hookimpl(trylast=True)  # after -k / -m have deselected
def pytest_collection_modifyitems(config, items):
    results = config.getoption("--peer-results")
    if results:  # every xdist worker collects the same cases: any of them may write the count
        with open(results + ".collected", "w") as f:
            f.write(str(len(items)))
    limit = config.getoption("--peer-max-cases")
    if limit and len(items) > limit:
        _keep(config, items, _sample(config, items, limit))
    only = config.getoption("--peer-only")
    if only:
        with open(only) as f:
            _keep(config, items, set(json.load(f)))
    shard = config.getoption("--peer-shard")
    if shard:
        k, n = (int(x) for x in shard.split("/"))
        _keep(config, items, {item.nodeid for i, item in enumerate(items) if i % n == k})
    if results and only:
        with open(results + ".selected", "w") as f:
            json.dump([item.nodeid for item in items], f)


def _keep(config, items, keep) -> None:
    """Leave in ``items`` the cases whose node ids are in ``keep``, deselecting the others."""
    deselected = [item for item in items if item.nodeid not in keep]
    items[:] = [item for item in items if item.nodeid in keep]
    config.hook.pytest_deselected(items=deselected)


def _sample(config, items, limit: int) -> set:
    """The node ids of a seeded sample of at most ``limit`` cases, spread over the file's test
    functions in proportion to their sizes."""
    by_function = defaultdict(list)
    for item in items:
        by_function[item.nodeid.split("[")[0]].append(item)
    rng = random.Random(config.getoption("--peer-seed"))
    keep = set()
    for name in sorted(by_function):
        group = by_function[name]
        share = max(1, math.floor(limit * len(group) / len(items)))
        keep.update(item.nodeid for item in rng.sample(group, min(share, len(group))))
    return keep


# The runner counts cases skipped with this reason as "unrun".
BUDGET_REASON = "peer-suite time budget spent"


def pytest_runtest_setup(item):
    deadline = item.config.getoption("--peer-deadline")
    if deadline and time.time() > deadline:
        pytest.skip(BUDGET_REASON)


class _Recorder:
    def __init__(self, path):
        self.path = path
        self.cases = {}  # nodeid -> {"outcome", "message"}
        self.collect_errors = []

    def pytest_runtest_logreport(self, report):
        case = self.cases.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
        if report.skipped:
            if case["outcome"] == "passed":
                case["outcome"] = "skipped"
                case["message"] = _text(report)
        elif report.failed:
            case["outcome"] = "failed" if report.when == "call" else "error"
            case["message"] = _text(report)

    def pytest_collectreport(self, report):
        if report.failed:
            self.collect_errors.append({"nodeid": report.nodeid, "message": _text(report)})

    def pytest_sessionfinish(self, session):
        with open(self.path, "w") as f:
            json.dump({"cases": self.cases, "collect_errors": self.collect_errors}, f)


def _text(report) -> str:
    text = getattr(report, "longreprtext", "") or str(report.longrepr or "")
    return text[-4000:]


def pytest_configure(config):
    path = config.getoption("--peer-results")
    if path and not hasattr(config, "workerinput"):  # the xdist controller (or no xdist)
        config.pluginmanager.register(_Recorder(path), "peer_suites_recorder")


def pytest_runtest_teardown(item):
    """Give cached device memory back after each case: several xdist workers share one GPU, and
    the largest cases (FlashInfer's batch 989 x 204 tokens) would otherwise stay reserved in
    every worker that ran one."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()
