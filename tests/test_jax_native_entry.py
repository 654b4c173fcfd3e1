"""The entries of XLA's native kernel call (cupyrope.frontends.jax.native), planned and compiled without a GPU.

For each kind of launch the planner picks (decode, lean and general rotation, computed angles, the
fused lean and general kernels, fp8 outputs, the cache write) the native launch is planned from
XLA's shapes, its block padded to whole warps, and its flat-argument entry compiled by NVRTC for
sm_80 and sm_90: the entry exists under its name, takes XLA's buffers, the sin offset and every
parameter-struct word, and keeps the struct in registers (no local memory, no stack frame, no
spill).
"""

from __future__ import annotations

import re

import pytest

from nvrtc_build import compile_entry

jax = pytest.importorskip("jax")

from test_kernel_compile import _FRAME_RE, _nvrtc_or_skip  # noqa: E402

from cupyrope.frontends.jax import native as jax_native  # noqa: E402
from cupyrope.core.fused_plan import plan_fused  # noqa: E402
from cupyrope.core.plan import plan_rope  # noqa: E402
from cupyrope.cuda import launch  # noqa: E402

pytestmark = pytest.mark.nvrtc

MAX_POSITION = 4096


def _avals(**shapes):
    return {name: jax.ShapeDtypeStruct(shape, dtype) for name, (shape, dtype) in shapes.items()}


def _rope(tokens, hq, hk, d, dtype, source, positions=None, **options):
    shapes = dict(q=((tokens, hq, d), dtype), k=((tokens, hk, d), dtype),
                  positions=(positions or (tokens,), "int32"))
    if source == "cache":
        shapes["cos_sin_cache"] = ((MAX_POSITION, options.pop("rotary_dim", d)), "float32")
    avals = _avals(**shapes)
    infos = jax_native.planning_infos(list(avals.values()), tuple(avals), 0)
    plan = plan_rope(infos["q"], infos["k"], infos["positions"],
                     cos_sin_cache=infos.get("cos_sin_cache"), **options)
    return plan, avals, [avals["q"], avals["k"]]


def _fused(where, tokens, dtype, scaling=None, rotary_dim=128, weight_dtype="float32", **fusion):
    shapes = dict(q=((tokens, 8, 128), dtype), k=((tokens, 2, 128), dtype),
                  positions=((3, tokens) if scaling else (tokens,), "int32"))
    if scaling is None:
        shapes["cos_sin_cache"] = ((MAX_POSITION, rotary_dim), "float32")
    heads = fusion.get("norm_over") == "all_heads"  # weights of every head
    if where == "rms_norm_rope" or heads:
        shapes.update(q_weight=((8 * 128 if heads else 128,), weight_dtype),
                      k_weight=((2 * 128 if heads else 128,), weight_dtype))
    if where == "rope_and_cache":
        shapes.update(v=((tokens, 2, 128), dtype), k_cache=((16, 8, 2, 128), dtype),
                      v_cache=((16, 8, 2, 128), dtype), slot_mapping=((tokens,), "int32"))
    avals = _avals(**shapes)
    infos = jax_native.planning_infos(list(avals.values()), tuple(avals), 0)
    for name in ("k_cache", "v_cache"):
        if name in infos:
            infos[name].writable = True
    rope = dict(cos_sin_cache=infos.get("cos_sin_cache"), cos=None, sin=None, theta=10000.0,
                scaling=scaling, interleaved=False, rotary_dim=None, inverse=False,
                inplace=False, seq_len=None)
    arrays = {name: infos[name] for name in ("q_weight", "k_weight", "v", "k_cache", "v_cache",
                                             "slot_mapping") if name in infos}
    plan = plan_fused(where, infos["q"], infos["k"], infos["positions"], rope=rope,
                      fusion=dict(fusion, **arrays), validate=False)
    out_dtype = fusion.get("out_dtype") or dtype
    outs = [jax.ShapeDtypeStruct(avals[n].shape, out_dtype) for n in ("q", "k")]
    return plan, avals, outs


CASES = {
    # name: (plan, avals, output avals), the kernel the plan must pick
    "decode_cache": (lambda: _rope(1, 32, 8, 128, "bfloat16", "cache"), "rope_decode_kernel"),
    "decode_computed_padded": (lambda: _rope(3, 7, 1, 80, "bfloat16", "computed"),
                               "rope_decode_kernel"),
    "decode_cache_split_heads": (lambda: _rope(3, 40, 8, 80, "bfloat16", "cache"),
                                 "rope_decode_kernel"),  # 5 x 48 threads: whole warps need 2 blocks
    "lean_cache": (lambda: _rope(3000, 8, 2, 128, "float16", "cache"), "rope_lean_kernel"),
    "lean_computed": (lambda: _rope(3000, 8, 2, 128, "bfloat16", "computed"),
                      "rope_lean_kernel"),
    "lean_partial": (lambda: _rope(300, 4, 1, 128, "float32", "cache", rotary_dim=64),
                     "rope_lean_kernel"),
    "general_mrope": (lambda: _rope(300, 4, 1, 128, "bfloat16", "computed", positions=(3, 300),
                                    scaling={"rope_type": "default",
                                             "mrope_section": [16, 24, 24]}),
                      "rope_kernel"),
    "fused_norm": (lambda: _fused("rms_norm_rope", 700, "bfloat16", norm=True, eps=1e-6,
                                  weight_offset=1.0), "rope_fused_lean_kernel"),
    "fused_fp8": (lambda: _fused("apply_rope", 33, "bfloat16", out_dtype="float8_e4m3fn",
                                 q_scale=0.5, k_scale=0.5), "rope_fused_decode_kernel"),
    "fused_cache": (lambda: _fused("rope_and_cache", 12, "float16"), "rope_fused_decode_kernel"),
    "fused_cache_lean": (lambda: _fused("rope_and_cache", 3000, "float16"),
                         "rope_fused_lean_kernel"),
    "fused_norm_decode": (lambda: _fused("rms_norm_rope", 5, "bfloat16", norm=True, eps=1e-6,
                                         weight_offset=1.0, weight_dtype="bfloat16"),
                          "rope_fused_decode_kernel"),
    # The fused decode kernel reads weights of q's dtype: float32 ones take the lean kernel.
    "fused_norm_float32_weights": (lambda: _fused("rms_norm_rope", 5, "bfloat16", norm=True,
                                                  eps=1e-6, weight_offset=1.0),
                                   "rope_fused_lean_kernel"),
    "fused_lean_mrope": (lambda: _fused("rms_norm_rope", 40, "bfloat16", eps=1e-6,
                                        weight_offset=0.0,
                                        scaling={"rope_type": "default",
                                                 "mrope_section": [16, 24, 24]}),
                         "rope_fused_lean_kernel"),
    # Dims past rotary_dim, normalised with the rest: the lean fused kernel's partial
    # specialisation (NeoX: head_dim a multiple of rotary_dim), else the general fused kernel.
    "fused_lean_partial": (lambda: _fused("rms_norm_rope", 40, "bfloat16", eps=1e-6,
                                          weight_offset=0.0, rotary_dim=64),
                           "rope_fused_lean_kernel"),
    "fused_general_partial": (lambda: _fused("rms_norm_rope", 40, "bfloat16", eps=1e-6,
                                             weight_offset=0.0, rotary_dim=96),
                              "rope_fused_kernel"),
    # The norm over all heads: the lean all-heads kernel (every dim rotated), with the cache
    # write too; a partial rotation on the general kernel's all-heads variant.
    "fused_all_heads": (lambda: _fused("rms_norm_rope", 700, "bfloat16", norm=True, eps=1e-6,
                                       weight_offset=0.0, weight_dtype="bfloat16",
                                       norm_over="all_heads"),
                        "rope_fused_lean_all_heads_kernel"),
    "fused_all_heads_cache": (lambda: _fused("rope_and_cache", 33, "float16", norm=True,
                                             eps=1e-6, weight_offset=1.0,
                                             norm_over="all_heads"),
                              "rope_fused_lean_all_heads_kernel"),
    "fused_all_heads_partial": (lambda: _fused("rms_norm_rope", 40, "bfloat16", norm=True,
                                               eps=1e-6, weight_offset=0.0, rotary_dim=64,
                                               norm_over="all_heads"),
                                "rope_fused_all_heads_kernel"),
}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("case", list(CASES))
def test_native_entry_plans_and_compiles(case, arch):
    nvrtc = _nvrtc_or_skip()
    build, kernel = CASES[case]
    plan, avals, outs = build()
    native = jax_native.plan_native_launch(plan, outs, tuple(avals), num_regs=lambda spec: 48,
                                           multiprocessors=132, angle_arithmetic="float64")
    spec, block = native.spec, native.block
    assert spec.kernel.name_expression.split("<")[0].endswith(kernel), spec.kernel.name_expression
    threads = block[0] * block[1] * block[2]
    assert threads % 32 == 0 and threads <= 256 and block[0] == spec.block[0]
    if spec.kernel.decode:  # one thread per head (v's too): every head keeps its thread
        fusion = plan.fusion
        v_heads = fusion.v.shape[1] if fusion is not None and fusion.writes_cache else 0
        assert block[2] == 1 and (block[1] * native.grid[1]
                                  >= plan.num_q_heads + plan.num_k_heads + v_heads)
    names = [n for n in native.buffers if n is not None]
    assert names[:len(avals)] == list(avals)  # XLA's operand order
    assert ("inv_freq" in names) == (native.inv_freq is not None)

    source, options = jax_native.entry_program(spec, block, native.buffers, "float64")
    name = jax_native.kernel_name(spec, block, native.buffers)
    log, ptx = compile_entry(nvrtc, source, "cupyrope_xla.cu", options, arch, case)
    entry = re.search(rf"\.entry {name}\((.*?)\)", ptx, re.S)
    assert entry, f"{case}: no entry {name} in the PTX"
    words = sum(s.dtype.itemsize // 8 for s in (spec.params, spec.fusion_params) if s is not None)
    assert entry.group(1).count(".param") == len(native.buffers) + 1 + words
    # The struct is reassembled in registers: no local memory in the PTX, and (where this NVRTC's
    # ptxas reports frames) no stack frame and no spill.
    assert ".local" not in ptx, f"{case}: the entry uses local memory"
    frames = [tuple(int(g) for g in m.groups()) for m in _FRAME_RE.finditer(log)]
    assert all(f == (0, 0, 0) for f in frames), (case, frames, log[-2000:])


def test_unavailable_reason_names_what_is_missing(monkeypatch):
    """The callback route is kept (and the warning says why) where asked for, or where this
    jaxlib predates the kernel call the native lowering was built against."""
    import jaxlib

    monkeypatch.setenv(jax_native.NATIVE_ENV, "0")
    assert jax_native.NATIVE_ENV in jax_native.unavailable_reason()
    monkeypatch.delenv(jax_native.NATIVE_ENV)
    monkeypatch.setattr(jaxlib, "__version__", "0.10.2")
    assert "0.10.2 is older than 0.11" in jax_native.unavailable_reason()
