"""The command line of the reference sweep: ``python -m cupyrope bench`` (or
``python -m cupyrope.bench``) prints the table and writes it with JSON and a bandwidth plot."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Sequence

from .clocks import device_name, require_cuda
from .sweep import environment, format_table, plot, reference_sweep
from .workloads import ALL_IMPLS, REFERENCE_TOKENS


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m cupyrope.bench",
         default_out: str = "cupyrope-bench") -> int:
    """Run the reference sweep with the command-line options ``argv``; 0 when every cupyrope and
    copy case ran, 1 when one failed, 2 on bad options or without a CUDA GPU."""
    parser = argparse.ArgumentParser(prog=prog, description=(
        "Reference sweep (bf16 q [T,32,128], k [T,8,128], fp32 cache, NeoX): cupyrope against an "
        "SM copy of the same bytes and the peers installed; prints the table and writes it with a "
        "bandwidth plot."))
    parser.add_argument("--tokens", type=_positive_int, nargs="+", default=list(REFERENCE_TOKENS))
    impls = [i for i in ALL_IMPLS if i != "copy"]
    parser.add_argument("--impls", nargs="+", default=None, choices=impls, metavar="IMPL",
                        help="implementations besides the SM copy, among " + ", ".join(impls)
                        + " (default: cupyrope's angle sources and every peer)")
    parser.add_argument("--repeats", type=_positive_int, default=10)
    parser.add_argument("--no-check", action="store_true", help="skip the agreement check before timing")
    parser.add_argument("--out", default=default_out,
                        help=f"folder for reference_sweep.{{md,json,png}} (default: {default_out})")
    args = parser.parse_args(argv)
    try:
        require_cuda()
    except RuntimeError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2

    failures: list[str] = []
    rows = reference_sweep(args.tokens, impls=args.impls, repeats=args.repeats, check=not args.no_check,
                           failures=failures)
    name = device_name()
    table = format_table(rows, name)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "reference_sweep.md"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(args.out, "reference_sweep.json"), "w") as f:
            json.dump({"environment": environment(), "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
        try:
            print("plot:", plot(rows, os.path.join(args.out, "reference_sweep.png"), gpu_name=name))
        except ImportError as exc:
            print(f"no plot: {exc}", file=sys.stderr)
    if failures:
        print(f"{len(failures)} cupyrope / copy case(s) failed:", *failures, sep="\n", file=sys.stderr)
        return 1
    return 0
