"""Plot the fused-op benchmarks (benchmarks/test_fused.py) from a pytest-benchmark JSON file.

    python -m pytest benchmarks/test_fused.py --benchmark-only --benchmark-json=fused.json
    python scripts/plot_fused.py fused.json docs/fused_ops.png

One panel per fused op: % of an SM copy of the op's bytes against T, for the fused call, the
unfused eager sequence and torch.compile of the unfused sequence (higher is faster).
"""

from __future__ import annotations

import json
import sys


def main(json_path: str, png_path: str) -> None:
    from cupyrope.bench.fused import FusedRow, plot_fused

    records = json.load(open(json_path))["benchmarks"]
    gpu = next((r["extra_info"].get("gpu") for r in records if r["extra_info"].get("gpu")), "GPU")
    rows = []
    for r in records:
        info = r["extra_info"]
        if not r["name"].startswith("test_fused_bandwidth") or "pct_of_copy" not in info:
            continue
        op = r["group"].split(":")[0].removeprefix("fused ")
        rows.append(FusedRow(op, info["impl"], info["tokens"], r["stats"]["median"] * 1e6,
                             float("nan"), info["pct_of_copy"]))
    rows.sort(key=lambda row: (row.op, row.impl))
    plot_fused(rows, png_path, gpu_name=gpu)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} BENCH_JSON OUT_PNG")
    main(sys.argv[1], sys.argv[2])
