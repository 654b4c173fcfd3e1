"""The accuracy report (scripts/accuracy_report.py) on the CPU: the library's angles stay at float32
rounding level at every position up to 2^24 (the accuracy contract's range), while a float32
``pos * inv_freq`` angle (Hugging Face's formulation) drifts by orders of magnitude more.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import cupyrope as cr
import repo_scripts

report_module = repo_scripts.load("accuracy_report")

U32 = 2.0**-24
# A unit vector whose cos and sin are each rounded to float32 points at most ~2^-24 * sqrt(2) rad
# away; allow a little more for the reference's own float64 angle (~2e-9 rad at 2^24).
FLOAT32_ANGLE = 2.0 * U32


@pytest.fixture(scope="module")
def llama_report():
    return report_module.measure(theta=500000.0, rotary_dim=128, max_log2=24, samples=48, seed=1,
                                 device="cpu")


def test_library_angles_stay_at_float32_rounding(llama_report):
    buckets = llama_report.buckets
    assert [b.log2 for b in buckets] == list(range(25))
    assert buckets[-1].positions.max() == 2**24 and buckets[0].positions.min() == 0
    for b in buckets:
        for source in ("table", "in-kernel"):
            assert b.angle_error[source] <= FLOAT32_ANGLE, (b.label, source, b.angle_error[source])
            # bfloat16: correctly rounded (half an ulp at the pair's norm, plus float32 arithmetic)
            assert b.ulps[("bfloat16", source)] <= 0.5 + 2**-14, (b.label, source)
            # float32: a few roundings of x1 * cos - x2 * sin
            assert b.ulps[("float32", source)] <= 4.0, (b.label, source)


def test_float32_angle_is_orders_worse_at_2p24(llama_report):
    last = llama_report.buckets[-1]
    library = max(last.angle_error["table"], last.angle_error["in-kernel"])
    fp32 = last.angle_error["fp32 angle"]
    # pos * inv_freq rounded to float32 at pos ~ 2^24: half an ulp of 2^24 (1 rad) and more
    assert fp32 > 1e-2, fp32
    assert fp32 > 1e5 * library, (fp32, library)
    assert last.ulps[("float32", "fp32 angle")] > 1e4 * last.ulps[("float32", "table")]
    assert last.ulps[("bfloat16", "fp32 angle")] > 4.0  # visible even in bfloat16 outputs
    # and it grows with the position (x ~2 per bucket): ~2^14 times worse from 2^10 to 2^24
    early = llama_report.buckets[10].angle_error["fp32 angle"]
    assert fp32 > 3000 * early, (fp32, early)


def test_report_with_a_scaling_schedule():
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    report = report_module.measure(theta=1e6, rotary_dim=64, scaling=scaling, max_log2=24, samples=16,
                                   device="cpu")
    assert report.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0, rel=1e-15)
    for b in report.buckets:
        assert b.angle_error["in-kernel"] <= FLOAT32_ANGLE and b.angle_error["table"] <= FLOAT32_ANGLE
    assert report.buckets[-1].angle_error["fp32 angle"] > 1e-3


def test_compact_table_rows_are_the_cache_rows():
    """The report builds its table at the sampled positions only: those rows are bit for bit the rows
    of cos_sin_cache, so reading them is reading the library's cache."""
    positions = np.array([0, 1, 7, 100, 4095])
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    inv_freq, attention_factor = cr.rope_frequencies(128, theta=500000.0, scaling=scaling, seq_len=4096)
    cache = cr.cos_sin_cache(4096, 128, theta=500000.0, scaling=scaling)
    x = np.zeros((len(positions), 1, 128), dtype=np.float32)
    x[..., :64] = 1.0
    device = report_module.Device("cpu")
    out = report_module.library_rotation(device, x, positions, "table", theta=500000.0, scaling=scaling,
                                         seq_len=4096, inv_freq=inv_freq,
                                         attention_factor=attention_factor)
    np.testing.assert_array_equal(out[:, 0, :], cache[positions])


def test_markdown_table(llama_report, capsys):
    text = report_module.format_markdown(llama_report)
    lines = text.splitlines()
    assert "| positions | table (float32) | in-kernel angles | float32 `pos * inv_freq` |" in lines
    assert sum(line.startswith("| 2^") for line in lines) == 2 * 25
    assert report_module.main(["--cpu", "--samples", "4", "--max-log2", "6"]) == 0
    assert "| 2^6 |" in capsys.readouterr().out
