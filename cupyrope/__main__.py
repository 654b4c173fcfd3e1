"""``python -m cupyrope``: rotate a Llama-sized batch and check it against float64.

Runs on the GPU when CuPy sees one, otherwise on the NumPy path, and prints for each angle source
the largest error against an exact float64 rotation, in units of the output dtype's ulp.
``python -m cupyrope bench`` runs the benchmark sweep (GPU): a table of time, GB/s and % of an SM
copy for cupyrope and the peers installed, and a bandwidth plot in ./cupyrope-bench/.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import cupyrope as cr
from cupyrope.dtypes import numpy_dtype


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.is_available()
    except Exception:  # no CuPy, or CuPy without a usable driver
        return False


def _exact(x64: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """float64 NeoX rotation of x64 [T, H, D] by angles [T, D/2]."""
    half = x64.shape[-1] // 2
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    x1, x2 = x64[..., :half], x64[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _ulps(out: np.ndarray, exact: np.ndarray, dtype: str) -> float:
    """Largest |out - exact| in ulps of the output dtype at |exact|."""
    mantissa = {"bfloat16": 7, "float16": 10, "float32": 23, "float64": 52}[dtype]
    exponent = np.floor(np.log2(np.maximum(np.abs(exact), 2.0**-14)))
    return float(np.max(np.abs(out - exact) / 2.0 ** (exponent - mantissa)))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        # The reference benchmark sweep (needs a GPU and torch): table, JSON and bandwidth plot.
        from cupyrope.benchmarking import main as bench

        return bench(argv[1:], prog="python -m cupyrope bench", default_out="cupyrope-bench")
    parser = argparse.ArgumentParser(
        prog="python -m cupyrope", description=__doc__,
        epilog="python -m cupyrope bench [--tokens ...] runs the benchmark sweep instead.")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--cpu", action="store_true", help="use the NumPy path even with a GPU")
    args = parser.parse_args(argv)

    on_gpu = _gpu_available() and not args.cpu
    T, Hq, Hk, D, theta, max_position = args.tokens, 32, 8, 128, 500000.0, 131072
    rng = np.random.default_rng(0)
    dtype = numpy_dtype(args.dtype)
    q_host = rng.standard_normal((T, Hq, D)).astype(dtype)
    k_host = rng.standard_normal((T, Hk, D)).astype(dtype)
    positions_host = rng.integers(0, max_position, T)

    if on_gpu:
        import cupy

        xp = cupy
        device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["name"]
        where = f"GPU ({device.decode() if isinstance(device, bytes) else device})"
    else:
        xp = np
        where = "CPU (NumPy path; no usable CUDA GPU found)" if not args.cpu else "CPU (NumPy path)"
    print(f"cupyrope {cr.__version__} on {where}")
    print(f"q [{T}, {Hq}, {D}], k [{T}, {Hk}, {D}] {args.dtype}, NeoX, random positions in "
          f"[0, {max_position}), theta={theta:g}\n")

    q, k, positions = xp.asarray(q_host), xp.asarray(k_host), xp.asarray(positions_host)
    cache = cr.cos_sin_cache(max_position, D, theta=theta, like=q)
    inv_freq, _ = cr.rope_frequencies(D, theta=theta)
    angles = positions_host[:, None].astype(np.float64) * inv_freq
    exact_q = _exact(q_host.astype(np.float64), angles)
    exact_k = _exact(k_host.astype(np.float64), angles)

    rows = [
        ("cos_sin_cache (float32, built in float64)", dict(cos_sin_cache=cache)),
        ("angles computed from theta (float64 reduction)", dict(theta=theta)),
    ]
    print(f"{'angle source':44s} {'first call':>11s} {'per call':>10s} {'max err q':>10s} "
          f"{'max err k':>10s}")
    for name, kwargs in rows:
        start = time.perf_counter()
        q_out, k_out = cr.apply_rope(q, k, positions, **kwargs)
        _sync(xp)
        first = time.perf_counter() - start
        start, repeats = time.perf_counter(), 5
        for _ in range(repeats):
            cr.apply_rope(q, k, positions, **kwargs)
        _sync(xp)
        per_call = (time.perf_counter() - start) / repeats
        q_np = _to_host(q_out).astype(np.float64)
        k_np = _to_host(k_out).astype(np.float64)
        print(f"{name:44s} {first * 1e3:9.1f}ms {per_call * 1e3:8.2f}ms "
              f"{_ulps(q_np, exact_q, args.dtype):7.2f}ulp {_ulps(k_np, exact_k, args.dtype):7.2f}ulp")

    back = cr.apply_rope(q_out, positions=positions, theta=theta, inverse=True)
    err = float(np.max(np.abs(_to_host(back).astype(np.float64) - q_host.astype(np.float64))))
    print(f"\ninverse=True undoes the rotation: max |q - inverse(rotate(q))| = {err:.3g}")
    return 0


def _sync(xp) -> None:
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def _to_host(x) -> np.ndarray:
    return x.get() if hasattr(x, "get") else np.asarray(x)


if __name__ == "__main__":
    sys.exit(main())
