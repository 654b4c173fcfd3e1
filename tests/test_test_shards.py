"""CUPYROPE_TEST_SHARD (tests/conftest.py): the shards of one selection run each selected test
exactly once, after -m / -k, and a malformed value stops the session with a message."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
# A CPU-only file with many cases, and a -k that deselects some of them before the shards split.
TARGET = os.path.join(TESTS, "test_launch_geometry.py")


def _collected(shard: str | None, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CUPYROPE_TEST_SHARD"}
    if shard is not None:
        env["CUPYROPE_TEST_SHARD"] = shard
    return subprocess.run([sys.executable, "-m", "pytest", TARGET, "--collect-only", "-q",
                           "-p", "no:cacheprovider", "-p", "no:xdist", *args],
                          capture_output=True, text=True, env=env, cwd=os.path.dirname(TESTS),
                          timeout=300)


def _ids(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stdout + result.stderr
    return [line for line in result.stdout.splitlines() if "::" in line]


@pytest.mark.parametrize("count", [2, 3])
def test_shards_partition_the_selection(count):
    every = _ids(_collected(None, "-k", "not fast_memory"))
    assert len(every) > 2 * count
    shards = [_ids(_collected(f"{k}/{count}", "-k", "not fast_memory")) for k in range(count)]
    assert sorted(i for shard in shards for i in shard) == sorted(every)
    assert all(abs(len(shard) - len(every) / count) <= 1 for shard in shards)


@pytest.mark.parametrize("value", ["2/2", "1", "a/3", "-1/2", "1/0"])
def test_malformed_shard_stops_the_session(value):
    result = _collected(value)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR
    assert "CUPYROPE_TEST_SHARD" in result.stdout + result.stderr
    assert "K/N" in result.stdout + result.stderr
