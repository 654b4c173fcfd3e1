"""The one tolerance table of the test suite, and the comparison against the float64 reference.

Allowed error of one output element (docs/contract.md §3), for an element of the pair (x1, x2)::

    |out - ref| <= ulp_out(max(|ref|, |out|))                      # the final rounding to the output dtype
                 + C_COMPUTE * eps_compute * (|x1| + |x2|)         # float32 (or float64) arithmetic
                 + eps_table * (|x1| + |x2|)                        # only if the library rounded cos/sin
                 + ANGLE_EPS * max_angle * (|x1| + |x2|)           # float64 angle known to ~1 ulp
                 + extra_pair_rel * (|x1| + |x2|)                   # chained ops (round trips) only

``ulp_out`` is the spacing of the output dtype at that magnitude (bf16 2^(e-7), fp16 2^(e-10) with the
subnormal floor 2^-24, fp32 2^(e-23), fp64 2^(e-52)); ``eps_compute`` is the unit roundoff of the
arithmetic dtype (float32: 2^-24, float64 for float64 outputs: 2^-53); ``eps_table`` is the unit
roundoff (half an ulp, relative) of the table dtype. NaN must appear exactly where the reference has NaN,
and dims >= rotary_dim must be bit-identical to the input.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "TOLERANCES",
    "C_COMPUTE",
    "ANGLE_EPS",
    "np_dtype",
    "dtype_name",
    "ulp",
    "unit_roundoff",
    "compute_eps",
    "pair_magnitude",
    "rope_bound",
    "as_numpy",
    "assert_rope_close",
    "assert_bits_equal",
    "max_abs_angle",
]

# mantissa bits (explicit), smallest normal exponent, and the dtype arithmetic runs in for such outputs.
TOLERANCES = {
    "float16": {"mantissa_bits": 10, "min_exponent": -14, "compute": "float32"},
    "bfloat16": {"mantissa_bits": 7, "min_exponent": -126, "compute": "float32"},
    "float32": {"mantissa_bits": 23, "min_exponent": -126, "compute": "float32"},
    "float64": {"mantissa_bits": 52, "min_exponent": -1022, "compute": "float64"},
}

C_COMPUTE = 4.0  # a handful of roundings in x1*cos - x2*sin (and in forming cos/sin in the compute dtype)
ANGLE_EPS = 2.0**-50  # the reference's own float64 angle pos*inv_freq is only known to a few ulps


def np_dtype(name) -> np.dtype:
    """np.dtype for a dtype name ("bfloat16" comes from ml_dtypes)."""
    if str(name) == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def dtype_name(dtype) -> str:
    name = np_dtype(dtype).name
    if name not in TOLERANCES:
        raise KeyError(f"no tolerance for dtype {name}")
    return name


def unit_roundoff(dtype) -> float:
    """Half an ulp, relative: 2^-11 fp16, 2^-8 bf16, 2^-24 fp32, 2^-53 fp64."""
    return 2.0 ** -(TOLERANCES[dtype_name(dtype)]["mantissa_bits"] + 1)


def compute_eps(out_dtype) -> float:
    """Unit roundoff of the arithmetic used for this output dtype (float32, or float64 for float64)."""
    return unit_roundoff(TOLERANCES[dtype_name(out_dtype)]["compute"])


def ulp(magnitude, dtype) -> np.ndarray:
    """Spacing of ``dtype`` at |magnitude| (float64 array); subnormal spacing below the normal range."""
    entry = TOLERANCES[dtype_name(dtype)]
    a = np.abs(np.asarray(magnitude, dtype=np.float64))
    _, e2 = np.frexp(np.where(np.isfinite(a), a, 0.0))  # a = m * 2**e2, m in [0.5, 1)
    exponent = np.where(a > 0, np.maximum(e2 - 1, entry["min_exponent"]), entry["min_exponent"])
    return np.ldexp(1.0, exponent - entry["mantissa_bits"])


def as_numpy(a) -> np.ndarray:
    """NumPy view / copy of a NumPy, CuPy, torch or JAX array (bfloat16 kept as ml_dtypes.bfloat16)."""
    if isinstance(a, np.ndarray):
        return a
    module = type(a).__module__.split(".")[0]
    if module == "cupy":
        return a.get()
    if module == "torch":
        t = a.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            import ml_dtypes

            import torch

            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(a)


def pair_magnitude(x, rotary_dim: int, interleaved: bool) -> np.ndarray:
    """|x1| + |x2| of the pair each rotated element belongs to: shape x.shape[:-1] + (rotary_dim,)."""
    x64 = np.abs(as_numpy(x).astype(np.float64))
    half = rotary_dim // 2
    mag = np.empty(x64.shape[:-1] + (rotary_dim,), dtype=np.float64)
    for j in range(half):
        a, b = (2 * j, 2 * j + 1) if interleaved else (j, j + half)
        s = x64[..., a] + x64[..., b]
        mag[..., a] = s
        mag[..., b] = s
    return mag


def rope_bound(
    out,
    ref,
    x,
    *,
    interleaved: bool,
    rotary_dim: int,
    table_dtype=None,
    max_angle: float = 0.0,
    extra_pair_rel: float = 0.0,
) -> np.ndarray:
    """The allowed |out - ref| of every rotated element (shape [..., rotary_dim])."""
    out_np = as_numpy(out)
    out_dtype = out_np.dtype
    o = np.abs(out_np[..., :rotary_dim].astype(np.float64))
    r = np.abs(np.asarray(ref, dtype=np.float64)[..., :rotary_dim])
    mag = pair_magnitude(x, rotary_dim, interleaved)
    rel = C_COMPUTE * compute_eps(out_dtype) + ANGLE_EPS * float(max_angle) + float(extra_pair_rel)
    if table_dtype is not None:
        rel += unit_roundoff(table_dtype)
    return ulp(np.fmax(o, r), out_dtype) + rel * mag


def assert_bits_equal(actual, expected, what: str = "array") -> None:
    """Bit-for-bit equality (so -0.0 vs 0.0 and NaN payloads count)."""
    a = np.ascontiguousarray(as_numpy(actual))
    e = np.ascontiguousarray(as_numpy(expected))
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert a.dtype == e.dtype, f"{what}: dtype {a.dtype} != {e.dtype}"
    a_bits = a.view(np.dtype(f"u{a.dtype.itemsize}"))
    e_bits = e.view(np.dtype(f"u{e.dtype.itemsize}"))
    if not np.array_equal(a_bits, e_bits):
        bad = np.argwhere(a_bits != e_bits)
        idx = tuple(bad[0])
        raise AssertionError(
            f"{what}: {len(bad)} element(s) differ bitwise; first at {idx}: got {a[idx]!r}, expected {e[idx]!r}"
        )


def assert_rope_close(
    out,
    ref,
    x,
    *,
    interleaved: bool,
    rotary_dim: int,
    table_dtype=None,
    max_angle: float = 0.0,
    extra_pair_rel: float = 0.0,
) -> None:
    """Check a RoPE output against the float64 reference ``ref`` computed from input ``x``.

    - same shape, and the output dtype is the input's;
    - NaN exactly where ``ref`` is NaN, finite wherever ``ref`` is finite;
    - rotated dims within ``rope_bound`` (pass ``table_dtype`` when the library rounded cos/sin to a
      table dtype that the reference did not see, ``max_angle`` = the largest |angle| in play when the
      angles come from positions * inv_freq);
    - dims >= rotary_dim bit-identical to ``x``.
    On failure the worst element is reported: index, out, ref, bound and its pair's inputs.
    """
    out_np = as_numpy(out)
    x_np = as_numpy(x)
    ref = np.asarray(ref, dtype=np.float64)
    assert out_np.shape == x_np.shape == ref.shape, (
        f"shape mismatch: out {out_np.shape}, x {x_np.shape}, ref {ref.shape}"
    )
    assert out_np.dtype == x_np.dtype, f"output dtype {out_np.dtype} != input dtype {x_np.dtype}"
    rd = int(rotary_dim)

    if rd < out_np.shape[-1]:
        assert_bits_equal(out_np[..., rd:], x_np[..., rd:], what=f"pass-through dims [{rd}:]")

    o = out_np[..., :rd].astype(np.float64)
    r = ref[..., :rd]
    o_nan = np.isnan(o)
    r_nan = np.isnan(r)
    if not np.array_equal(o_nan, r_nan):
        bad = np.argwhere(o_nan != r_nan)
        idx = tuple(bad[0])
        raise AssertionError(
            f"NaN pattern differs at {len(bad)} element(s); first at {idx}: out={o[idx]!r}, ref={r[idx]!r}"
        )
    finite = ~r_nan
    if not np.all(np.isfinite(o[finite])):
        bad = np.argwhere(finite & ~np.isfinite(o))
        idx = tuple(bad[0])
        raise AssertionError(f"non-finite output at {idx}: out={o[idx]!r}, ref={r[idx]!r}")
    if o.size == 0:
        return

    bound = rope_bound(
        out_np, ref, x_np, interleaved=interleaved, rotary_dim=rd, table_dtype=table_dtype,
        max_angle=max_angle, extra_pair_rel=extra_pair_rel,
    )
    err = np.where(finite, np.abs(o - r), 0.0)
    ratio = np.where(finite, err / bound, 0.0)
    worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    if ratio[worst] > 1.0:
        n_bad = int(np.count_nonzero(ratio > 1.0))
        d = worst[-1]
        half = rd // 2
        if interleaved:
            a, b = (d, d + 1) if d % 2 == 0 else (d - 1, d)
        else:
            a, b = (d, d + half) if d < half else (d - half, d)
        lead = worst[:-1]
        x1 = float(x_np[lead + (a,)])
        x2 = float(x_np[lead + (b,)])
        raise AssertionError(
            f"{n_bad} of {o.size} rotated element(s) out of tolerance "
            f"(dtype {out_np.dtype}, table {table_dtype}, interleaved={interleaved}, rotary_dim={rd}); "
            f"worst at index {tuple(int(i) for i in worst)}: out={o[worst]!r} ref={r[worst]!r} "
            f"|err|={err[worst]:.3e} bound={bound[worst]:.3e} ({ratio[worst]:.3g}x); "
            f"pair dims ({a}, {b}) x=({x1!r}, {x2!r})"
        )


def max_abs_angle(positions, inv_freq) -> float:
    """Largest |position * inv_freq| (for the ``max_angle`` term)."""
    p = np.asarray(positions)
    if p.size == 0:
        return 0.0
    return float(np.max(np.abs(p.astype(np.float64)))) * float(np.max(np.abs(np.asarray(inv_freq))))

