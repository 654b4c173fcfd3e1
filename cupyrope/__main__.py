"""``python -m cupyrope``: the demo, and the benchmark sweep.

``python -m cupyrope [demo] [--tokens N] [--dtype D] [--cpu]`` rotates a Llama-sized batch (on the
GPU when CuPy sees one, else on the NumPy path) with each angle source and checks it against an
exact float64 rotation: the largest error in ulps of the output dtype at the magnitude of each
pair (|x1| + |x2|, the accuracy contract's bound) and a verdict. It exits 1 if a row fails.

``python -m cupyrope compile [--jobs N]`` compiles every kernel specialisation for the current GPU
into CuPy's disk cache, one process per core (a deployment image's build step, or before a test run
spread over many processes), so that later processes only load binaries.

``python -m cupyrope bench [...]`` runs the benchmark sweep on a GPU (``--help`` lists its options):
time, GB/s and % of an SM copy of the same bytes for cupyrope and the peers installed, a table, JSON
and a bandwidth plot.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import cupyrope as cr
from cupyrope.core.dtypes import numpy_dtype

# The accuracy contract, in ulps of the output dtype at |x1| + |x2| of the pair: 16-bit outputs are
# at most one ulp from the correctly rounded value; float32 within a few ulps.
ULP_BOUND = {"bfloat16": 1.0, "float16": 1.0, "float32": 4.0}
MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23}


def _gpu_available() -> bool:
    try:
        import cupy

        return bool(cupy.is_available())
    except Exception:  # no CuPy, or CuPy without a usable driver
        return False


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _exact(x64: np.ndarray, angles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 NeoX rotation of x64 [T, H, D] by angles [T, D/2], and each element's pair
    magnitude |x1| + |x2|."""
    half = x64.shape[-1] // 2
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    x1, x2 = x64[..., :half], x64[..., half:]
    rotated = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    pair = np.abs(x1) + np.abs(x2)
    return rotated, np.concatenate([pair, pair], axis=-1)


def _ulps(out: np.ndarray, exact: np.ndarray, pair: np.ndarray, dtype: str) -> float:
    """Largest |out - exact| in ulps of the output dtype at the pair's magnitude."""
    exponent = np.floor(np.log2(np.maximum(pair, 2.0**-14)))
    return float(np.max(np.abs(out - exact) / 2.0 ** (exponent - MANTISSA_BITS[dtype])))


COMMANDS = ("demo", "compile", "bench")
BENCH_PROG, BENCH_OUT = "python -m cupyrope bench", "cupyrope-bench"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cupyrope",
        description="Rotary Position Embedding kernels: the demo (default) or the benchmark sweep.")
    parser.add_argument("--version", action="version", version=f"cupyrope {cr.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}",
                                     help="the command (default: demo)")
    demo = commands.add_parser("demo", help="rotate a Llama-sized batch and check it against float64")
    demo.add_argument("--tokens", type=_positive_int, default=4096, help="tokens (default 4096)")
    demo.add_argument("--dtype", default="bfloat16", choices=sorted(ULP_BOUND),
                      help="dtype of q, k and the outputs (default bfloat16)")
    demo.add_argument("--cpu", action="store_true", help="use the NumPy path even with a GPU")
    compile_ = commands.add_parser(
        "compile", help="compile every kernel for this GPU into the disk cache, in parallel")
    compile_.add_argument("--jobs", type=_positive_int, default=None,
                          help="worker processes (default: one per core)")
    # The sweep's options, --help included, belong to cupyrope.bench.options: main() checks every
    # argument after "bench" (parse_known_args leaves them over) with that parser, then hands them
    # to cupyrope.bench.cli.
    commands.add_parser("bench", add_help=False,
                        help="the benchmark sweep on a GPU (python -m cupyrope bench --help)")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The demo is the default command: no arguments, or options only. A first word that is no
    # option is a command, and argparse names an unknown one as an invalid choice.
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["demo", *argv]
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return _bench(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "compile":
        return _compile(args)
    return _demo(args)


def _compile(args) -> int:
    if not _gpu_available():
        print("python -m cupyrope compile: compiling for a GPU needs a CUDA GPU with CuPy, and no "
              "usable GPU was found here (CuPy is not installed, or cupy.is_available() is false)",
              file=sys.stderr)
        return 2
    from cupyrope.cuda.kernel_cache import fill_kernel_cache

    start = time.perf_counter()
    count = fill_kernel_cache(jobs=args.jobs)
    print(f"compiled {count} kernel specialisations into the disk cache in "
          f"{time.perf_counter() - start:.1f} s")
    return 0


def _bench(argv) -> int:
    if "-h" not in argv and "--help" not in argv:  # help needs no GPU: the sweep's parser shows it
        from cupyrope.bench.options import build_parser  # imported only for this command

        # Bad arguments end in argparse's usage error (exit 2) before the GPU is looked for.
        build_parser(prog=BENCH_PROG, default_out=BENCH_OUT).parse_args(argv)
        if not _gpu_available():
            print(f"{BENCH_PROG}: the benchmarks need a CUDA GPU with CuPy and torch, and no "
                  "usable GPU was found here (CuPy is not installed, or cupy.is_available() is "
                  "false)", file=sys.stderr)
            return 2
    from cupyrope.bench.cli import main as bench_main

    return bench_main(argv, prog=BENCH_PROG, default_out=BENCH_OUT)


def _demo(args) -> int:
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
        op_name = f"GPU ({device.decode() if isinstance(device, bytes) else device})"
    else:
        xp = np
        op_name = "CPU (NumPy path; no usable CUDA GPU found)" if not args.cpu else "CPU (NumPy path)"
    print(f"cupyrope {cr.__version__} on {op_name}")
    print(f"q [{T}, {Hq}, {D}], k [{T}, {Hk}, {D}] {args.dtype}, NeoX, random positions in "
          f"[0, {max_position}), theta={theta:g}\n")

    q, k, positions = xp.asarray(q_host), xp.asarray(k_host), xp.asarray(positions_host)
    cache = cr.cos_sin_cache(max_position, D, theta=theta, like=q)
    inv_freq, _ = cr.rope_frequencies(D, theta=theta)
    angles = positions_host[:, None].astype(np.float64) * inv_freq
    exact_q, pair_q = _exact(q_host.astype(np.float64), angles)
    exact_k, pair_k = _exact(k_host.astype(np.float64), angles)

    rows = [
        ("cos_sin_cache (float32, built in float64)", dict(cos_sin_cache=cache)),
        ("angles computed from theta (float64 reduction)", dict(theta=theta)),
    ]
    bound = ULP_BOUND[args.dtype]
    print(f"{'angle source':48s} {'first call':>11s} {'per call':>10s} {'err q':>9s} {'err k':>9s}"
          f"  verdict (<= {bound:g} ulp at |x1|+|x2|)")
    failed = 0
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
        err_q = _ulps(_to_host(q_out).astype(np.float64), exact_q, pair_q, args.dtype)
        err_k = _ulps(_to_host(k_out).astype(np.float64), exact_k, pair_k, args.dtype)
        ok = max(err_q, err_k) <= bound
        failed += not ok
        print(f"{name:48s} {first * 1e3:9.1f}ms {per_call * 1e3:8.2f}ms {err_q:6.2f}ulp "
              f"{err_k:6.2f}ulp  {'PASS' if ok else 'FAIL'}")

    back = cr.apply_rope(q_out, positions=positions, theta=theta, inverse=True)
    err = float(np.max(np.abs(_to_host(back).astype(np.float64) - q_host.astype(np.float64))))
    print(f"\ninverse=True undoes the rotation: max |q - inverse(rotate(q))| = {err:.3g}")
    print("all rows within the accuracy contract" if not failed else f"{failed} row(s) FAILED")
    return 1 if failed else 0


def _sync(xp) -> None:
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def _to_host(x) -> np.ndarray:
    return x.get() if hasattr(x, "get") else np.asarray(x)


if __name__ == "__main__":
    sys.exit(main())
