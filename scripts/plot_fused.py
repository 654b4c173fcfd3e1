"""Plot the fused-op benchmarks (benchmarks/test_fused.py) from a pytest-benchmark JSON file.

    python -m pytest benchmarks/test_fused.py --benchmark-only --benchmark-json=fused.json
    python scripts/plot_fused.py fused.json docs/fused_ops.png

One panel per fused op: % of an SM copy of the op's bytes against T, for the fused call, the
unfused eager sequence and torch.compile of the unfused sequence (higher is faster).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(json_path: str, png_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = json.load(open(json_path))["benchmarks"]
    gpu = next((r["extra_info"].get("gpu") for r in records if r["extra_info"].get("gpu")), "GPU")
    series = defaultdict(lambda: defaultdict(list))  # op -> impl -> [(T, pct)]
    for r in records:
        info = r["extra_info"]
        if not r["name"].startswith("test_fused_bandwidth") or "pct_of_copy" not in info:
            continue
        op = r["group"].split(":")[0].removeprefix("fused ")
        series[op][info["impl"]].append((info["tokens"], info["pct_of_copy"]))
    ops = sorted(series)
    fig, axes = plt.subplots(1, len(ops), figsize=(4.5 * len(ops), 3.6), sharey=True)
    for ax, op in zip(axes if len(ops) > 1 else [axes], ops):
        for impl, points in sorted(series[op].items()):
            points.sort()
            ax.plot([t for t, _ in points], [p for _, p in points], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(op)
        ax.set_xlabel("tokens T")
        ax.axhline(90, color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    (axes[0] if len(ops) > 1 else axes).set_ylabel("% of an SM copy of the op's bytes")
    (axes[-1] if len(ops) > 1 else axes).legend(fontsize=8)
    fig.suptitle(f"cupyrope fused ops, bf16 q[T,32,128] k/v[T,8,128], {gpu}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} BENCH_JSON OUT_PNG")
    main(sys.argv[1], sys.argv[2])
