"""The on-disk kernel cache: reused across processes, and a corrupt entry is recompiled, not fatal."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

_CHILD = textwrap.dedent(
    """
    import time
    start = time.perf_counter()
    import numpy as np, cupy as cp, cupyrope as cr
    rng = np.random.default_rng(0)
    q = rng.standard_normal((64, 4, 96)).astype(np.float32)
    positions = rng.integers(0, 512, 64)
    out = cr.apply_rope(cp.asarray(q), positions=cp.asarray(positions), interleaved=True,
                        theta=777.0)
    cp.cuda.get_current_stream().synchronize()
    elapsed = time.perf_counter() - start
    expected = cr.apply_rope(q, positions=positions, interleaved=True, theta=777.0)
    assert np.allclose(out.get(), expected, atol=2e-6, rtol=0), "wrong result"
    print(f"{elapsed:.3f}")
    """
)


def _run_child(cache_dir: Path) -> float:
    env = dict(os.environ, CUPY_CACHE_DIR=str(cache_dir))
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return float(done.stdout.strip().splitlines()[-1])


def test_cache_is_reused_and_corrupt_entries_recompile(tmp_path):
    _run_child(tmp_path)
    entries = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert entries, "the first process left no compiled kernel on disk"
    _run_child(tmp_path)
    # A second process loads the binaries: it compiles (and writes) nothing new.
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == entries

    for path in entries:  # flip bytes in the middle of every cached binary
        data = bytearray(path.read_bytes())
        for i in range(len(data) // 2, min(len(data), len(data) // 2 + 64)):
            data[i] ^= 0xFF
        path.write_bytes(bytes(data))
    _run_child(tmp_path)  # must recompile and still compute the right answer
