"""The command line of the reference sweep: ``python -m cupyrope bench`` (or
``python -m cupyrope.bench``) prints the table and writes it with JSON and a bandwidth plot;
``--fused`` runs the fused ops against the unfused sequences instead (:mod:`.fused`),
``--shapes`` apply_rope over head shapes and ``--serving`` the fused ops on served models' heads
(:mod:`.shapes`), ``--jax``
apply_rope under ``jax.jit`` against XLA's own fusion (:mod:`.jax_steps`)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Sequence

from .clocks import device_name, require_cuda
from .fused import FUSED_TOKENS, format_fused_table, fused_sweep, plot_fused
from .jax_steps import (JAX_TOKENS, format_jax_table, jax_device_name, jax_environment, jax_sweep,
                        plot_jax, require_jax_gpu)
from .options import build_parser
from .shapes import (SERVING_TOKENS, format_serving_table, format_shapes_table, serving_sweep,
                     shapes_sweep)
from .sweep import environment, format_table, plot, reference_sweep
from .workloads import REFERENCE_TOKENS


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m cupyrope.bench",
         default_out: str = "cupyrope-bench") -> int:
    """Run the reference sweep with the command-line options ``argv``; 0 when every cupyrope and
    copy case ran, 1 when one failed, 2 on bad options or without a CUDA GPU."""
    args = build_parser(prog=prog, default_out=default_out).parse_args(argv)
    if args.jax:  # before JAX starts: leave GPU memory to the torch path of the same run
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        if args.jax:
            require_jax_gpu()
        else:
            require_cuda()
    except RuntimeError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2

    failures: list[str] = []
    if args.jax:
        rows = jax_sweep(args.tokens or list(JAX_TOKENS), repeats=args.repeats,
                         check=not args.no_check, failures=failures)
        env = jax_environment()
        name = jax_device_name()
        table = format_jax_table(rows, name, env.get("jax", ""))
        return _report(args.out, "jax_sweep", table, rows,
                       lambda path: plot_jax(rows, path, gpu_name=name), failures, extra_env=env)
    if args.fused:
        rows = fused_sweep(args.tokens or list(FUSED_TOKENS), repeats=args.repeats,
                           failures=failures)
        name = device_name()
        return _report(args.out, "fused_sweep", format_fused_table(rows, name), rows,
                       lambda path: plot_fused(rows, path, gpu_name=name), failures)
    if args.shapes or args.serving:
        if args.shapes:
            rows = shapes_sweep(repeats=args.repeats, failures=failures)
            table, stem = format_shapes_table(rows, device_name()), "shapes_sweep"
        else:
            rows = serving_sweep(args.tokens or list(SERVING_TOKENS), repeats=args.repeats,
                                 failures=failures)
            table, stem = format_serving_table(rows, device_name()), "serving_sweep"
        return _report(args.out, stem, table, rows, None, failures)
    rows = reference_sweep(args.tokens or list(REFERENCE_TOKENS), impls=args.impls,
                           repeats=args.repeats, check=not args.no_check, failures=failures)
    name = device_name()
    return _report(args.out, "reference_sweep", format_table(rows, name), rows,
                   lambda path: plot(rows, path, gpu_name=name), failures)


def _report(out: str, stem: str, table: str, rows, draw, failures: list[str], *,
            extra_env: dict | None = None) -> int:
    """Print the table; write ``stem``.md, .json and the .png that ``draw(path)`` draws (none when
    ``draw`` is None or matplotlib is missing) into ``out`` (when given); 1 when a cupyrope or copy case failed,
    else 0."""
    print(table)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{stem}.md"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(out, f"{stem}.json"), "w") as f:
            json.dump({"environment": {**environment(), **(extra_env or {})},
                       "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
        try:
            if draw is not None:
                print("plot:", draw(os.path.join(out, f"{stem}.png")))
        except ImportError as exc:
            print(f"no plot: {exc}", file=sys.stderr)
    if failures:
        print(f"{len(failures)} cupyrope / copy case(s) failed:", *failures, sep="\n", file=sys.stderr)
        return 1
    return 0
