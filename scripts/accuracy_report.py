"""Accuracy of RoPE angles by position, up to 2^24, against the exact float64 reference.

For positions in buckets (2^(k-1), 2^k], k = 0 .. 24 (bucket 2^0 holds positions 0 and 1), it
measures three ways of turning a position into cos/sin:

- ``table``: the library's float32 ``cos_sin_cache`` (float64 angle, cos/sin rounded once), read by
  ``apply_rope`` as a cache;
- ``in-kernel``: angles computed by ``apply_rope`` itself from theta / scaling (the NumPy path on the
  CPU: float64 angles; on a GPU: the kernel's float64 or float-float product and range reduction,
  as ``cupyrope.cuda.compiler.angle_arithmetic`` picks for the device or CUPYROPE_ANGLE_ARITHMETIC sets;
  the GPU's heading names it);
- ``fp32 angle``: Hugging Face's formulation, ``(positions.float() * inv_freq.float())`` then cos/sin
  in float32 (torch when installed, else NumPy float32).

and reports, as the maximum over the bucket's positions and all pairs:

1. the angle error in radians: the angle between the (cos, sin) a source produces and the exact
   (cos, sin) of the float64 angle ``position * inv_freq``. The library's sources are measured end
   to end, by rotating the unit pair (1, 0) with ``apply_rope`` in float32, which returns exactly the
   float32 (cos, sin) the code path used;
2. the rotation error of a bfloat16 and a float32 ``apply_rope`` on random pairs, in ulps of the
   output dtype at the pair's norm (``|out - exact| / ulp(|x|)``). The fp32-angle column rotates
   exactly in float64 with its float32 cos/sin and rounds once: the best any implementation with a
   float32 angle can do.

The library's table is built at the sampled positions only, with the same host functions as
``cos_sin_cache`` (a 2^24-row cache would need 8 GB): a cache holding those rows is read with
positions ``arange(n)``, which is exactly what a full cache would give at the sampled positions.

Usage (from the repository root; on a GPU machine the GPU columns are added)::

    python scripts/accuracy_report.py
    python scripts/accuracy_report.py --theta 500000 --rotary-dim 128 \\
        --scaling '{"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
                    "original_max_position_embeddings": 8192}'
    python scripts/accuracy_report.py --cpu --samples 64 --max-log2 16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout works

import cupyrope as cr  # noqa: E402
from cupyrope.core.dtypes import numpy_dtype, round_once  # noqa: E402
from cupyrope.core.frequencies import cos_sin_table  # noqa: E402
from cupyrope.core.schedules import scaling_type  # noqa: E402

SOURCES = ("table", "in-kernel", "fp32 angle")
ROTATION_DTYPES = ("bfloat16", "float32")
MANTISSA_BITS = {"bfloat16": 7, "float32": 23}


@dataclass
class Bucket:
    """One row of the report: positions in (2^(k-1), 2^k] (k = 0: positions 0 and 1)."""

    log2: int
    positions: np.ndarray
    angle_error: dict[str, float] = field(default_factory=dict)  # source -> radians
    ulps: dict[tuple[str, str], float] = field(default_factory=dict)  # (dtype, source) -> ulps

    @property
    def label(self) -> str:
        return f"2^{self.log2}"


def bucket_positions(max_log2: int, samples: int, rng: np.random.Generator) -> list[Bucket]:
    """Up to ``samples`` positions per bucket, always including both ends."""
    buckets = []
    for k in range(max_log2 + 1):
        low, high = (0, 1) if k == 0 else (2 ** (k - 1) + 1, 2**k)
        count = min(samples, high - low + 1)
        if count == high - low + 1:
            positions = np.arange(low, high + 1, dtype=np.int64)
        else:
            inner = rng.choice(np.arange(low + 1, high, dtype=np.int64), size=count - 2, replace=False)
            positions = np.sort(np.concatenate([[low, high], inner])).astype(np.int64)
        buckets.append(Bucket(k, positions))
    return buckets


def ulp_at(magnitude: np.ndarray, dtype: str) -> np.ndarray:
    """Spacing of ``dtype`` (bfloat16 or float32) at ``magnitude`` (normal range)."""
    _, exponent = np.frexp(np.asarray(magnitude, dtype=np.float64))
    return np.ldexp(1.0, exponent - 1 - MANTISSA_BITS[dtype])


def angle_between(cos, sin, exact_cos, exact_sin) -> np.ndarray:
    """|angle| between (cos, sin) and the exact unit vector, in radians (float64; any scale)."""
    cos, sin = np.asarray(cos, np.float64), np.asarray(sin, np.float64)
    return np.abs(np.arctan2(sin * exact_cos - cos * exact_sin, cos * exact_cos + sin * exact_sin))


# --------------------------------------------------------------------------------------------------
# where the library runs: NumPy (CPU) or CuPy (GPU)


class Device:
    def __init__(self, name: str):
        self.name = name
        if name == "gpu":
            import cupy

            self.cupy = cupy
            props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
            gpu = props["name"]
            from cupyrope.cuda.compiler import angle_arithmetic

            arithmetic = angle_arithmetic(cupy.cuda.runtime.getDevice())
            self.description = (f"GPU kernels ({gpu.decode() if isinstance(gpu, bytes) else gpu}, "
                                f"{arithmetic} in-kernel angles)")
        else:
            self.description = "CPU (NumPy path)"

    def put(self, host: np.ndarray):
        if self.name == "cpu":
            return host
        host = np.ascontiguousarray(host)
        bits = np.dtype(f"u{host.dtype.itemsize}")  # bit for bit, bfloat16 included
        return self.cupy.asarray(host.view(bits)).view(host.dtype)

    def get(self, array) -> np.ndarray:
        if self.name == "cpu":
            return np.asarray(array)
        bits = np.dtype(f"u{array.dtype.itemsize}")
        return array.view(bits).get().view(array.dtype)


def gpu_available() -> bool:
    try:
        import cupy

        return bool(cupy.is_available())
    except Exception:  # no CuPy, or a broken driver
        return False


# --------------------------------------------------------------------------------------------------
# the three sources


def library_rotation(device: Device, x: np.ndarray, positions: np.ndarray, source: str, *, theta,
                     scaling, seq_len, inv_freq, attention_factor) -> np.ndarray:
    """``apply_rope`` of x ([n, 1, rotary_dim], NeoX) on ``device`` with the library's table or its
    in-kernel angles; returns the host result."""
    if source == "table":
        # The rows cos_sin_cache(max_position) holds at these positions (same functions, same rounding).
        cos, sin = cos_sin_table(positions, inv_freq, attention_factor)
        table = round_once(np.concatenate([cos, sin], axis=-1), "float32")
        out = cr.apply_rope(device.put(x), positions=device.put(np.arange(len(positions))),
                            cos_sin_cache=device.put(table))
    else:
        # Only the length-dependent schedules take seq_len (apply_rope refuses it elsewhere).
        reads_seq_len = scaling_type(scaling, "accuracy_report") in ("dynamic", "longrope")
        out = cr.apply_rope(device.put(x), positions=device.put(positions), theta=theta,
                            scaling=scaling, seq_len=seq_len if reads_seq_len else None)
    return device.get(out)


def fp32_angle_cos_sin(positions: np.ndarray, inv_freq: np.ndarray, attention_factor: float):
    """Hugging Face's float32 formulation: ``(pos.float() * inv_freq.float()).cos() * scaling``."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        freqs = torch.from_numpy(positions).float()[:, None] * torch.from_numpy(inv_freq).float()
        cos = (freqs.cos() * attention_factor).numpy()
        sin = (freqs.sin() * attention_factor).numpy()
        return cos, sin, "torch float32"
    freqs = positions.astype(np.float32)[:, None] * inv_freq.astype(np.float32)
    af = np.float32(attention_factor)
    return np.cos(freqs) * af, np.sin(freqs) * af, "NumPy float32"


def exact_rotation(x64: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """NeoX rotation of x64 [n, 1, r] by per-position cos/sin [n, r/2], in float64."""
    half = x64.shape[-1] // 2
    x1, x2 = x64[..., :half], x64[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def pair_norm(x64: np.ndarray) -> np.ndarray:
    half = x64.shape[-1] // 2
    norm = np.hypot(x64[..., :half], x64[..., half:])
    return np.concatenate([norm, norm], axis=-1)


# --------------------------------------------------------------------------------------------------
# the measurement


@dataclass
class Report:
    device: str
    fp32_engine: str
    theta: float
    rotary_dim: int
    scaling: dict | None
    seq_len: int | None
    attention_factor: float
    buckets: list[Bucket]


def measure(*, theta=500000.0, rotary_dim=128, scaling=None, seq_len=None, max_log2=24, samples=256,
            seed=0, device="cpu") -> Report:
    """Angle and rotation errors of the three sources per position bucket on ``device``."""
    dev = Device(device)
    rng = np.random.default_rng(seed)
    if seq_len is None:
        seq_len = 2**max_log2 + 1  # a sequence that holds every position measured
    inv_freq, attention_factor = cr.rope_frequencies(rotary_dim, theta=theta, scaling=scaling,
                                                     seq_len=seq_len)
    buckets = bucket_positions(max_log2, samples, rng)
    positions = np.concatenate([b.positions for b in buckets])
    owner = np.concatenate([np.full(len(b.positions), i) for i, b in enumerate(buckets)])
    n, half = len(positions), rotary_dim // 2

    angles = positions[:, None].astype(np.float64) * inv_freq  # the exact float64 reference
    exact_cos, exact_sin = np.cos(angles) * attention_factor, np.sin(angles) * attention_factor
    common = dict(theta=theta, scaling=scaling, seq_len=seq_len, inv_freq=inv_freq,
                  attention_factor=attention_factor)

    # 1. angle error: rotating the unit pair (1, 0) in float32 returns the path's own (cos, sin)
    unit = np.zeros((n, 1, rotary_dim), dtype=np.float32)
    unit[..., :half] = 1.0
    angle_errors = {}
    for source in SOURCES[:2]:
        out = library_rotation(dev, unit, positions, source, **common)[:, 0, :]
        angle_errors[source] = angle_between(out[:, :half], out[:, half:], exact_cos, exact_sin)
    cos32, sin32, engine = fp32_angle_cos_sin(positions, inv_freq, attention_factor)
    angle_errors["fp32 angle"] = angle_between(cos32, sin32, exact_cos, exact_sin)

    # 2. rotation error of random pairs, in ulps of the output dtype at the pair's norm
    ulps = {}
    for dtype in ROTATION_DTYPES:
        x = rng.standard_normal((n, 1, rotary_dim)).astype(numpy_dtype(dtype))
        x64 = x.astype(np.float64)
        exact = exact_rotation(x64, exact_cos, exact_sin)
        scale = ulp_at(pair_norm(x64) * attention_factor, dtype)
        for source in SOURCES[:2]:
            out = library_rotation(dev, x, positions, source, **common).astype(np.float64)
            ulps[(dtype, source)] = np.abs(out - exact) / scale
        best = round_once(exact_rotation(x64, cos32.astype(np.float64), sin32.astype(np.float64)),
                          dtype).astype(np.float64)
        ulps[(dtype, "fp32 angle")] = np.abs(best - exact) / scale

    for i, bucket in enumerate(buckets):
        rows = owner == i
        bucket.angle_error = {s: float(e[rows].max()) for s, e in angle_errors.items()}
        bucket.ulps = {key: float(e[rows].max()) for key, e in ulps.items()}
    return Report(dev.description, engine, float(theta), rotary_dim, scaling, seq_len,
                  attention_factor, buckets)


def format_markdown(report: Report) -> str:
    """The report as two markdown tables (angle error in radians; rotation error in ulps)."""
    schedule = "default" if not report.scaling else json.dumps(report.scaling)
    lines = [
        f"{report.device}; theta={report.theta:g}, rotary_dim={report.rotary_dim}, scaling={schedule}, "
        f"seq_len={report.seq_len}, attention_factor={report.attention_factor:.6g}; fp32 angle via "
        f"{report.fp32_engine}",
        "",
        "Angle error (radians, max over positions in (2^(k-1), 2^k] and all pairs):",
        "",
        "| positions | table (float32) | in-kernel angles | float32 `pos * inv_freq` |",
        "|---|---|---|---|",
    ]
    for b in report.buckets:
        lines.append(f"| {b.label} | " + " | ".join(f"{b.angle_error[s]:.2e}" for s in SOURCES) + " |")
    lines += [
        "",
        "Rotation error (ulps of the output dtype at the pair's norm, max over positions and pairs):",
        "",
        "| positions | " + " | ".join(f"{dtype} {s}" for dtype in ROTATION_DTYPES for s in SOURCES) + " |",
        "|---|" + "---|" * (len(ROTATION_DTYPES) * len(SOURCES)),
    ]
    for b in report.buckets:
        cells = [_ulp_cell(b.ulps[(dtype, s)]) for dtype in ROTATION_DTYPES for s in SOURCES]
        lines.append(f"| {b.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ulp_cell(value: float) -> str:
    return f"{value:.2f}" if value < 100 else f"{value:.2e}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--theta", type=float, default=500000.0)
    parser.add_argument("--rotary-dim", type=int, default=128)
    parser.add_argument("--scaling", type=json.loads, default=None,
                        help="a Hugging Face rope_scaling dict as JSON")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="for dynamic / longrope (default: 2^max-log2 + 1)")
    parser.add_argument("--max-log2", type=int, default=24)
    parser.add_argument("--samples", type=int, default=256, help="positions per bucket")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="skip the GPU even when there is one")
    args = parser.parse_args(argv)

    devices = ["cpu"] + (["gpu"] if gpu_available() and not args.cpu else [])
    for i, device in enumerate(devices):
        report = measure(theta=args.theta, rotary_dim=args.rotary_dim, scaling=args.scaling,
                         seq_len=args.seq_len, max_log2=args.max_log2, samples=args.samples,
                         seed=args.seed, device=device)
        if i:
            print()
        print(format_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
