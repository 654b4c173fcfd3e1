"""apply_rope under jax.jit on an NVIDIA GPU: one native XLA kernel call (cupyrope.frontends.jax.native).

Every case compares the jitted result with the float64 reference; the compiled module must hold
the kernel call and no Python callback. grad, vmap (one call for the batch) and a jax.export round
trip run through the same call.
"""

from __future__ import annotations

import os

# JAX would take 75% of the GPU memory at its first array (see test_gpu_interop.py).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import cupyrope as cr  # noqa: E402
from reference import reference_inv_freq, reference_rope  # noqa: E402
from tolerances import assert_rope_close, np_dtype  # noqa: E402

pytestmark = pytest.mark.gpu

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


def random_host(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """N(0, 1) in ``dtype`` (no exact zeros)."""
    values = rng.standard_normal(shape)
    return np.where(np.abs(values) < 1e-3, 0.5, values).astype(np_dtype(dtype))

MAX_POSITION = 4096
NATIVE = "triton_kernel_call_ffi"


@pytest.fixture(scope="module")
def device():
    try:
        devices = jax.devices("cuda")
    except Exception as exc:  # no CUDA backend in this jaxlib
        pytest.skip(f"JAX has no CUDA backend ({type(exc).__name__}: {exc})")
    from cupyrope.frontends.jax import native as jax_native

    reason = jax_native.unavailable_reason()
    if reason is not None:
        pytest.fail(f"a JAX CUDA backend without the native call: {reason}")
    return devices[0]


def _hlo(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def _native_calls(f, *args) -> int:
    text = _hlo(f, *args)
    assert "callback" not in text.lower(), "a Python callback in the compiled module"
    return text.count(f'custom_call_target="{NATIVE}"')


def _angles(rng, source, token_shape, rotary_dim, interleaved, device):
    """(call kwargs on the device, reference kwargs, max |angle| for the bound)."""
    positions = rng.integers(0, MAX_POSITION, token_shape).astype(np.int32)
    if source == "cache":
        cache = cr.cos_sin_cache(MAX_POSITION, rotary_dim)  # float32, built in float64
        return (dict(positions=jax.device_put(positions, device),
                     cos_sin_cache=jax.device_put(cache, device)),
                dict(positions=positions, cos_sin_cache=cache), 0.0)
    if source == "tables":
        angles = positions[..., None] * reference_inv_freq(rotary_dim)
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        return (dict(cos=jax.device_put(cos, device), sin=jax.device_put(sin, device)),
                dict(cos=cos, sin=sin), 0.0)
    inv_freq = reference_inv_freq(rotary_dim)
    return (dict(positions=jax.device_put(positions, device), theta=10000.0),
            dict(positions=positions, theta=10000.0),
            float(np.max(np.abs(positions)) * inv_freq.max()))


CASES = {
    # name: (token shape, q heads, k heads, head_dim, rotary_dim, dtype)
    "decode": ((1,), 32, 8, 128, 128, "bfloat16"),
    "decode_32": ((32,), 32, 8, 128, 128, "float16"),
    "lean": ((3000,), 8, 2, 128, 128, "bfloat16"),
    "partial_rotary": ((300,), 4, 1, 128, 64, "float32"),
    "odd_heads": ((7,), 5, 3, 64, 64, "bfloat16"),
    "batch_seq": ((2, 9), 4, 2, 80, 80, "bfloat16"),
    "d80_48_heads": ((3,), 40, 8, 80, 80, "bfloat16"),  # decode: whole warps over 2 blocks
    "q_only": ((17,), 6, None, 128, 128, "float32"),
}


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("source", ["cache", "tables", "computed"])
@pytest.mark.parametrize("case", list(CASES))
def test_jit_is_one_native_call(device, rng, case, source, interleaved):
    token_shape, hq, hk, d, rotary_dim, dtype = CASES[case]
    if source == "tables" and rotary_dim < d:
        rotary_dim = d  # per-token tables: full rotation here (partial is the cache's case)
    xq = random_host(rng, token_shape + (hq, d), dtype)
    xk = None if hk is None else random_host(rng, token_shape + (hk, d), dtype)
    call, ref, max_angle = _angles(rng, source, token_shape, rotary_dim, interleaved, device)
    if source == "computed":
        call["rotary_dim"] = ref["rotary_dim"] = rotary_dim
    q = jax.device_put(xq, device)
    k = None if xk is None else jax.device_put(xk, device)

    arrays = {name: x for name, x in call.items() if isinstance(x, jax.Array)}
    options = {name: x for name, x in call.items() if name not in arrays}

    def f(q, k, arrays):
        return cr.apply_rope(q, k, interleaved=interleaved, **arrays, **options)

    assert _native_calls(f, q, k, arrays) == 1
    outs = jax.jit(f)(q, k, arrays)
    outs = (outs,) if k is None else outs
    for out, x in zip(outs, (xq, xk)):
        assert out.dtype == x.dtype and out.shape == x.shape
        assert_rope_close(np.asarray(out), reference_rope(x, interleaved=interleaved, **ref), x,
                          interleaved=interleaved, rotary_dim=rotary_dim, max_angle=max_angle)


def test_grad_is_the_inverse_rotation(device, rng):
    xq = random_host(rng, (6, 4, 64), "float32")
    positions = rng.integers(0, MAX_POSITION, 6).astype(np.int32)
    cache = cr.cos_sin_cache(MAX_POSITION, 64)
    weights = random_host(rng, (6, 4, 64), "float32")
    args = [jax.device_put(a, device) for a in (xq, positions, cache, weights)]

    def loss(q, positions, cache, w):
        return jnp.sum(cr.apply_rope(q, positions=positions, cos_sin_cache=cache) * w)

    grad = jax.jit(jax.grad(loss))(*args)
    # One call: the backward's inverse rotation (the loss is linear in the forward's output, so
    # XLA drops the forward call as dead code).
    assert _native_calls(jax.grad(loss), *args) == 1
    exact = reference_rope(weights, positions, cos_sin_cache=cache, inverse=True)
    assert_rope_close(np.asarray(grad), exact, weights, interleaved=False, rotary_dim=64)


def test_vmap_is_one_call_for_the_batch(device, rng):
    xq = random_host(rng, (5, 7, 4, 64), "bfloat16")
    positions = rng.integers(0, MAX_POSITION, (5, 7)).astype(np.int32)
    cache = cr.cos_sin_cache(MAX_POSITION, 64)
    args = [jax.device_put(a, device) for a in (xq, positions, cache)]

    def f(q, positions, cache):
        return jax.vmap(lambda q, p: cr.apply_rope(q, positions=p, cos_sin_cache=cache))(
            q, positions)

    assert _native_calls(f, *args) == 1
    out = np.asarray(jax.jit(f)(*args))
    for b in range(5):
        assert_rope_close(out[b], reference_rope(xq[b], positions[b], cos_sin_cache=cache),
                          xq[b], interleaved=False, rotary_dim=64)


def test_export_round_trip(device, rng):
    pytest.importorskip("flatbuffers", reason="jax.export's serialisation needs flatbuffers")
    xq = random_host(rng, (9, 4, 128), "bfloat16")
    positions = rng.integers(0, MAX_POSITION, 9).astype(np.int32)
    args = [jax.device_put(a, device) for a in (xq, positions)]

    def f(q, positions):
        return cr.apply_rope(q, positions=positions, theta=500000.0)

    exported = jax.export.export(
        jax.jit(f), platforms=("cuda",),
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(NATIVE)])(*args)
    restored = jax.export.deserialize(exported.serialize())
    again = np.asarray(restored.call(*args))
    assert np.array_equal(again.view(np.uint16), np.asarray(jax.jit(f)(*args)).view(np.uint16))
    inv_freq = reference_inv_freq(128, 500000.0)
    assert_rope_close(again, reference_rope(xq, positions, theta=500000.0), xq,
                      interleaved=False, rotary_dim=128,
                      max_angle=float(positions.max() * inv_freq.max()))


@pytest.mark.parametrize("axis", ["heads", "tokens"])
def test_sharded_runs_per_device(rng, axis):
    """q (and k) over heads, or over tokens with positions alike, on two GPUs: each device runs
    the native call on its shard (no all-gather), the result keeps q's sharding and is right."""
    devices = jax.devices("cuda") if jax.default_backend() == "gpu" else []
    if len(devices) < 2:
        pytest.skip("needs two GPUs")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(devices[:2]), ("x",))
    xq = random_host(rng, (64, 8, 128), "bfloat16")
    xk = random_host(rng, (64, 2, 128), "bfloat16")
    positions = rng.integers(0, MAX_POSITION, 64).astype(np.int32)
    cache = cr.cos_sin_cache(MAX_POSITION, 128)
    spec = PartitionSpec(None, "x", None) if axis == "heads" else PartitionSpec("x", None, None)
    q, k = (jax.device_put(x, NamedSharding(mesh, spec)) for x in (xq, xk))
    positions_spec = PartitionSpec() if axis == "heads" else PartitionSpec("x")
    sharded_positions = jax.device_put(positions, NamedSharding(mesh, positions_spec))
    sharded_cache = jax.device_put(cache, NamedSharding(mesh, PartitionSpec()))

    def f(q, k, positions, cache):
        return cr.apply_rope(q, k, positions, cos_sin_cache=cache)

    with mesh:
        text = jax.jit(f).lower(q, k, sharded_positions, sharded_cache).compile().as_text()
        outs = jax.jit(f)(q, k, sharded_positions, sharded_cache)
    assert "all-gather" not in text and "all-to-all" not in text
    assert text.count(f'custom_call_target="{NATIVE}"') == 1
    for out, x, placed in zip(outs, (xq, xk), (q, k)):
        assert out.sharding.is_equivalent_to(placed.sharding, 3)
        assert_rope_close(np.asarray(out), reference_rope(x, positions, cos_sin_cache=cache), x,
                          interleaved=False, rotary_dim=128)


# --------------------------------------------------------------------------------------------------
# The fused ops: the same native call; each result equals the eager call's on CuPy arrays (the
# same kernel, whose results the GPU suite checks against the float64 references).


def _cupy_call(op, *arrays, **options):
    cupy = pytest.importorskip("cupy")
    outs = op(*(None if a is None else cupy.asarray(np.asarray(a)) for a in arrays), **options)
    return [np.asarray(o.get()) for o in (outs if isinstance(outs, tuple) else (outs,))]


@pytest.mark.parametrize("source", ["cache", "computed"])
@pytest.mark.parametrize("tokens", [1, 700])
def test_rms_norm_rope_is_one_native_call(device, rng, tokens, source):
    xq = random_host(rng, (tokens, 8, 128), "float16")
    xk = random_host(rng, (tokens, 2, 128), "float16")
    wq, wk = random_host(rng, (128,), "float32"), random_host(rng, (128,), "float32")
    positions = rng.integers(0, MAX_POSITION, tokens).astype(np.int32)
    cache = cr.cos_sin_cache(MAX_POSITION, 128) if source == "cache" else None
    options = dict(eps=1e-6, weight_offset=1.0, interleaved=source == "computed")
    host = (xq, xk, wq, wk, positions, cache)
    args = [None if a is None else jax.device_put(a, device) for a in host]

    def f(q, k, wq, wk, positions, cache):
        return cr.rms_norm_rope(q, k, wq, wk, positions, cos_sin_cache=cache, **options)

    assert _native_calls(f, *args) == 1
    got = jax.jit(f)(*args)
    expected = _cupy_call(lambda q, k, wq, wk, p, c: cr.rms_norm_rope(
        q, k, wq, wk, p, cos_sin_cache=c, **options), *host)
    for out, want in zip(got, expected):
        assert np.array_equal(np.asarray(out), want)


def test_fp8_outputs_are_one_native_call(device, rng):
    xq = random_host(rng, (33, 8, 128), "bfloat16")
    positions = rng.integers(0, MAX_POSITION, 33).astype(np.int32)
    cache = cr.cos_sin_cache(MAX_POSITION, 128)
    scale = np.float32(0.5)
    args = [jax.device_put(a, device) for a in (xq, positions, cache, np.array(scale))]

    def f(q, positions, cache, scale):
        return cr.apply_rope(q, positions=positions, cos_sin_cache=cache,
                             out_dtype="float8_e4m3fn", q_scale=scale)

    assert _native_calls(f, *args) == 1
    out = jax.jit(f)(*args)
    assert out.dtype == jnp.float8_e4m3fn
    exact = reference_rope(xq, positions, cos_sin_cache=cache) / 0.5
    got = np.asarray(out).astype(np.float64)
    # e4m3: 3 mantissa bits, so within 2^-4 of the value (relative), saturating at 448.
    assert np.all(np.abs(got - np.clip(exact, -448, 448)) <= np.abs(exact) * 2.0 ** -4 + 2.0 ** -9)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_rope_and_cache_is_one_native_call(device, rng, layout):
    """The cache write is one native call whose new caches alias the input caches: the rows no
    slot names keep the input's values, the input (not donated) is untouched, the bits are the
    eager call's."""
    T, H, D, blocks, block_size = 12, 2, 64, 4, 8
    xq = random_host(rng, (T, 4, D), "float32")
    xk, xv = random_host(rng, (T, H, D), "float32"), random_host(rng, (T, H, D), "float32")
    shape = (blocks, block_size, H, D) if layout == "NHD" else (blocks, H, block_size, D)
    k_cache, v_cache = random_host(rng, shape, "float32"), random_host(rng, shape, "float32")
    slots = rng.permutation(blocks * block_size)[:T].astype(np.int32)
    slots[3] = -1  # padding: nothing written
    positions = rng.integers(0, MAX_POSITION, T).astype(np.int32)
    cache = cr.cos_sin_cache(MAX_POSITION, D)
    host = (xq, xk, xv, positions, k_cache, v_cache, slots, cache)
    args = [jax.device_put(a, device) for a in host]

    def f(q, k, v, positions, k_cache, v_cache, slots, cache):
        return cr.rope_and_cache(q, k, v, positions, k_cache, v_cache, slots,
                                 cos_sin_cache=cache, layout=layout, inplace=False)

    assert _native_calls(f, *args) == 1
    got = jax.jit(f)(*args)
    expected = _cupy_call(lambda q, k, v, p, kc, vc, s, c: cr.rope_and_cache(
        q, k, v, p, kc, vc, s, cos_sin_cache=c, layout=layout, inplace=False), *host)
    for out, want in zip(got, expected):
        assert np.array_equal(np.asarray(out), want)
    assert np.array_equal(np.asarray(args[4]), k_cache)  # the input cache is not donated: kept


_COMMAND_BUFFER_SCRIPT = """
import numpy as np, jax, jax.numpy as jnp
import cupyrope as cr
q = jnp.asarray(np.random.default_rng(0).standard_normal((64, 8, 128)), jnp.bfloat16)
positions = jnp.arange(64, dtype=jnp.int32)
cache = jnp.asarray(cr.cos_sin_cache(4096, 128))
def step(q, positions, cache):
    for _ in range(6):
        q = cr.apply_rope(q, positions=positions, cos_sin_cache=cache)
    return q
jax.block_until_ready(jax.jit(step)(q, positions, cache))
"""


def test_calls_are_captured_in_xla_command_buffers(device, tmp_path):
    """XLA puts the kernel calls of a jitted step into one command buffer (a CUDA graph): its
    thunk sequence, dumped by a fresh process (XLA reads its flags at start), nests them."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path}",
               XLA_PYTHON_CLIENT_PREALLOCATE="false")
    subprocess.run([sys.executable, "-c", _COMMAND_BUFFER_SCRIPT], env=env, check=True,
                   timeout=120)
    (sequence,) = tmp_path.glob("*jit_step.thunk_sequence_after_thunk_passes.txt")
    lines = sequence.read_text().splitlines()
    assert lines[0].split()[1] == "kCommandBuffer", lines[:3]
    nested = [line for line in lines[1:] if line.startswith(" ") and "kCustomCall" in line]
    assert len(nested) == 6, lines


def test_rope_and_cache_under_vmap_keeps_the_callback(device, rng):
    """jax.vmap over batched caches runs the cache write per element, through the callback (XLA
    did not keep the native call's aliasing inside the loop): every element's untouched rows are
    kept."""
    B, T, H, D, blocks, block_size = 3, 5, 2, 64, 2, 8
    xk, xv = random_host(rng, (B, T, H, D), "float32"), random_host(rng, (B, T, H, D), "float32")
    xq = random_host(rng, (B, T, 4, D), "float32")
    caches = [random_host(rng, (B, blocks, block_size, H, D), "float32") for _ in range(2)]
    slots = np.stack([rng.permutation(blocks * block_size)[:T] for _ in range(B)]).astype(np.int32)
    positions = rng.integers(0, MAX_POSITION, (B, T)).astype(np.int32)
    cache = cr.cos_sin_cache(MAX_POSITION, D)
    args = [jax.device_put(a, device) for a in (xq, xk, xv, positions, *caches, slots)]

    def f(q, k, v, positions, k_cache, v_cache, slots):
        return jax.vmap(lambda *a: cr.rope_and_cache(*a, cos_sin_cache=cache, inplace=False))(
            q, k, v, positions, k_cache, v_cache, slots)

    text = _hlo(f, *args)
    assert NATIVE not in text and "callback" in text.lower()
    *_, k_new, v_new = jax.jit(f)(*args)
    for b in range(B):
        kept = np.setdiff1d(np.arange(blocks * block_size), slots[b])
        for new, old in ((k_new, caches[0]), (v_new, caches[1])):
            rows = np.asarray(new)[b].reshape(-1, H, D)
            assert np.array_equal(rows[kept], old[b].reshape(-1, H, D)[kept])


def test_callback_route_runs_on_xla_stream_without_warnings(device, rng, monkeypatch):
    """The callback route (CUPYROPE_JAX_NATIVE=0) launches on XLA's stream through CuPy's stream
    protocol: the results are the eager ones and no call warns (CuPy 14 deprecates
    ExternalStream with a warning a call)."""
    import warnings

    monkeypatch.setenv("CUPYROPE_JAX_NATIVE", "0")
    T, H, D = 7, 4, 64
    x = random_host(rng, (T, H, D), "float32")
    positions = rng.integers(0, MAX_POSITION, T).astype(np.int32)
    cache = cr.cos_sin_cache(MAX_POSITION, D)
    q, p = jax.device_put(x, device), jax.device_put(positions, device)
    f = jax.jit(lambda q, p: cr.apply_rope(q, positions=p, cos_sin_cache=cache))
    assert NATIVE not in _hlo(f, q, p)
    f(q, p).block_until_ready()  # the first call warns once that it takes the callback route
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = np.asarray(f(q, p).block_until_ready())
    assert_rope_close(got, reference_rope(x, positions, cos_sin_cache=cache), x,
                      interleaved=False, rotary_dim=D)
