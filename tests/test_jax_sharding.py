"""Sharded JAX calls on two host devices (cupyrope/frontends/jax/sharding.py): under jax.jit with q
and k sharded over tokens or heads, each device rotates its own shard (no all-gather, no
all-to-all in the compiled program), the outputs keep q's and k's shardings and equal the
single-device call bit for bit: apply_rope from a cache, computed angles, per-token tables and
M-RoPE, GQA heads, rms_norm_rope and fp8 outputs. Implicit positions (an arange along the last
token dim) are gathered rather than restarted per shard.

XLA reads ``--xla_force_host_platform_device_count`` when its CPU backend starts, so the cases run
in a fresh interpreter (one, for all cases: a few seconds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")

SCRIPT = r'''
import json
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import cupyrope as cr

assert len(jax.devices()) == 2, jax.devices()
rng = np.random.default_rng(0)
mesh = Mesh(np.array(jax.devices()), ("x",))
T, Hq, Hk, D = 8, 4, 2, 32


def array(shape, dtype=np.float32):
    return jnp.asarray(rng.standard_normal(shape).astype(dtype))


q, k = array((T, Hq, D)), array((T, Hk, D))
positions = jnp.asarray(rng.integers(0, 4096, T).astype(np.int32))
cache = jnp.asarray(cr.cos_sin_cache(4096, D))
cos, sin = jnp.cos(array((T, D // 2))), jnp.sin(array((T, D // 2)))
mrope = jnp.asarray(rng.integers(0, 4096, (3, T)).astype(np.int32))
weight = jnp.asarray(rng.uniform(0.5, 1.5, D).astype(np.float32))
by_tokens = (P("x"), P("x"), P("x"))
by_heads = (P(None, "x"), P(None, "x"), P())
CASES = {
    "cache_tokens": (lambda q, k, p: cr.apply_rope(q, k, p, cos_sin_cache=cache), by_tokens),
    "cache_heads": (lambda q, k, p: cr.apply_rope(q, k, p, cos_sin_cache=cache), by_heads),
    "computed_tokens": (lambda q, k, p: cr.apply_rope(q, k, p, theta=5e5), by_tokens),
    "computed_heads_interleaved": (lambda q, k, p: cr.apply_rope(q, k, p, interleaved=True,
                                                                 rotary_dim=16), by_heads),
    "tables_tokens": (lambda q, k, p: cr.apply_rope(q, k, cos=cos, sin=sin), by_tokens),
    "mrope_tokens": (lambda q, k, p: cr.apply_rope(q, k, mrope, theta=1e6, scaling={
        "rope_type": "default", "mrope_section": [4, 6, 6]}), (P("x"), P("x"), P())),
    "rms_norm_rope_tokens": (lambda q, k, p: cr.rms_norm_rope(q, k, weight, weight, p, eps=1e-6),
                             by_tokens),
    "fp8_heads": (lambda q, k, p: cr.apply_rope(q, k, p, out_dtype="float8_e4m3fn",
                                                q_scale=0.5), by_heads),
    "implicit_positions_tokens": (lambda q, k, p: cr.apply_rope(q, k, theta=1e4), by_tokens),
}
results = {}
for name, (f, specs) in CASES.items():
    args = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((q, k, positions), specs)]
    with mesh:
        jitted = jax.jit(f)
        hlo = jitted.lower(*args).compile().as_text()
        outs = jitted(*args)
    single = jax.jit(f)(q, k, positions)
    results[name] = dict(
        collectives=[c for c in ("all-gather", "all-to-all", "all-reduce", "collective-permute")
                     if c in hlo],
        same_sharding=[o.sharding.is_equivalent_to(a.sharding, o.ndim)
                       for o, a in zip(outs, args)],
        bits_equal=[bool(np.array_equal(np.asarray(o).view(np.uint8), np.asarray(s).view(np.uint8)))
                    for o, s in zip(outs, single)],
        shards=[len({tuple(map(str, s.index)) for s in o.addressable_shards}) for o in outs])
print("RESULTS" + json.dumps(results))
'''


@pytest.fixture(scope="module")
def sharded():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                           os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    line = next(line for line in run.stdout.splitlines() if line.startswith("RESULTS"))
    return json.loads(line[len("RESULTS"):])


SHARD_LOCAL = ["cache_tokens", "cache_heads", "computed_tokens", "computed_heads_interleaved",
               "tables_tokens", "mrope_tokens", "rms_norm_rope_tokens", "fp8_heads"]


@pytest.mark.parametrize("case", SHARD_LOCAL)
def test_each_device_rotates_its_shard(sharded, case):
    result = sharded[case]
    assert result["collectives"] == [], result
    assert all(result["same_sharding"]), result
    assert all(result["bits_equal"]), result
    assert result["shards"] == [2, 2], result  # the outputs stay split over both devices


def test_implicit_positions_are_not_restarted_per_shard(sharded):
    """positions=None is an arange along the sharded token dim: the call gathers that dim
    (a collective) and gives the single-device values, never a restarted arange."""
    result = sharded["implicit_positions_tokens"]
    assert all(result["bits_equal"]), result
