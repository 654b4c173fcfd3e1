"""cupyrope under ``jax.jit`` against XLA's own fusion of the same step: the data, the jitted
steps, their timings, accuracy, table and plot, for ``benchmarks/test_jax.py`` and ``python -m
cupyrope bench --jax``.

Reference shape (contract §4): bf16 q ``[T, 32, 128]``, k ``[T, 8, 128]``, random int32 positions
in [0, 131072) (JAX's default int), fp32 cos/sin cache ``[131072, 128]`` from
:func:`cupyrope.cos_sin_cache` (theta 500000), NeoX. Each implementation is a jitted function of
``(q, k, positions, cache)`` returning ``(q_out, k_out)``:

- ``jnp-copy``: ``q * s`` and ``k * s`` with ``s = cache[0, 0]`` (cos 0 = 1.0 exactly), a scalar
  XLA only knows when the step runs: one SM kernel over the bytes of q and k, which XLA can neither
  fold (as it folds ``q * 1``) nor forward (as JAX forwards an output that is an input);
  ``jnp.copy`` would be an HLO copy, a DMA memcpy on the GPU rather than an SM kernel;
- ``xla-hf``: the Hugging Face formulation, ``q * cos + rotate_half(q) * sin`` in float32 and cast
  back to bf16, cos and sin the cache rows of the positions with their halves repeated; XLA fuses it;
- ``xla-hf-f32-angles``: the same with cos and sin computed as Hugging Face's rotary embedding
  computes them, from float32 angles ``float32(position) * float32 inv_freq``: no cache read, and
  angles rounded to float32 (an error of up to half an ulp of 131072 rad, 0.0039 rad, shows in the
  accuracy columns);
- ``cupyrope-native``: :func:`cupyrope.apply_rope` with the cache, under ``jax.jit``: one native
  XLA kernel call on NVIDIA GPUs (:mod:`cupyrope.frontends.jax.native`);
- ``cupyrope-callback``: the same call lowered while ``CUPYROPE_JAX_NATIVE=0``: the Python
  callback route. The variable is read when a function is lowered, so both of its compiled
  functions are lowered (``jax.jit(f).lower(...).compile()``) while it is set, and kept.

On XLA's CPU both cupyrope routes lower to jax.numpy (the variable has no effect there): the same
numbers, which is what the CPU tests check.

Measurements
------------
- wall time per jitted step in a dispatch loop (:func:`wall_time_us`): N calls of the compiled
  step on the same inputs, one ``block_until_ready`` at the end, divided by N; median of repeats;
- GPU time per call (:func:`loop_time_us`): a jitted ``jax.lax.fori_loop`` of 20 back-to-back
  calls, each call's outputs feeding the next through ``jax.lax.optimization_barrier`` (so XLA can
  neither drop, merge nor fuse two calls), unrolled (no device-to-host loop condition), timed the
  same way and divided by 20: the analogue of the torch benchmarks' CUDA graph of 20 calls. The
  torch path's GPU time for the same shape (:func:`torch_graph_time_us`: a CUDA graph of 20
  ``apply_rope`` calls on torch tensors) is taken in the same run;
- accuracy (:func:`max_abs_error`): the largest |output - float64 rotation| over the first
  :data:`ERROR_TOKENS` tokens (positions are random, so they cover the angles' range), the
  float64 rotation using exact float64 angles ``position * inv_freq`` (not the cache's float32
  rows), checked against :data:`~cupyrope.bench.workloads.CHECK_TOLERANCE`.

Targets (:func:`step_target`, :func:`meets_step_target`, :func:`meets_gpu_time_target`): a jitted
step with cupyrope (native) no slower than with XLA's fusion (``xla-hf``) at every T, within 2 µs
at decode (T <= 32), strictly faster at T >= 16384; its GPU time per call within 5% of the torch
path's.

The module imports without JAX (JAX is imported inside the functions). ``XLA_PYTHON_CLIENT_
PREALLOCATE=false`` must be set before JAX starts when torch shares the GPU (the command line and
the pytest module set it by default).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import statistics
import time
import traceback
import warnings
from typing import Callable, Sequence

import numpy as np

from .clocks import GRAPH_CALLS, graph_time_us
from .peers import Unavailable
from .progress import Progress
from .workloads import CHECK_TOLERANCE, RopeData, RopeShape, error_is_acceptable, make_workload

JAX_TOKENS = (1, 32, 4096, 16384, 65536)
JAX_IMPLS = ("jnp-copy", "xla-hf", "xla-hf-f32-angles", "cupyrope-native", "cupyrope-callback")
ROTATION_IMPLS = JAX_IMPLS[1:]  # everything but the copy: checked against the float64 rotation
LOOP_CALLS = GRAPH_CALLS        # calls per jitted loop (GPU time per call)
ERROR_TOKENS = 4096             # tokens of the accuracy check
DECODE_MAX_TOKENS = 32          # up to here a step may be DECODE_SLACK_US slower than XLA's
DECODE_SLACK_US = 2.0
STRICT_MIN_TOKENS = 16384       # from here a step must be faster than XLA's
GPU_TIME_TARGET_RATIO = 1.05    # GPU time per call against the torch path's
TORCH_PATH_IMPL = "cupyrope-cache"  # the torch workload of the same call
NATIVE_ENV = "CUPYROPE_JAX_NATIVE"  # jax_native.NATIVE_ENV (not imported: that module needs JAX)
NATIVE_CALL_TARGET = "triton_kernel_call_ffi"  # jax_native.CALL_TARGET


# ---- targets (pure) ---------------------------------------------------------------------------

def step_target(tokens: int) -> str:
    """The target of a jitted step with cupyrope at ``tokens``, as the table writes it."""
    if tokens >= STRICT_MIN_TOKENS:
        return "< XLA"
    if tokens <= DECODE_MAX_TOKENS:
        return f"≤ XLA + {DECODE_SLACK_US:g} µs"
    return "≤ XLA"


def meets_step_target(tokens: int, cupyrope_us: float, xla_us: float) -> bool:
    """Whether a step of ``cupyrope_us`` meets :func:`step_target` against XLA's ``xla_us``."""
    if tokens >= STRICT_MIN_TOKENS:
        return cupyrope_us < xla_us
    if tokens <= DECODE_MAX_TOKENS:
        return cupyrope_us <= xla_us + DECODE_SLACK_US
    return cupyrope_us <= xla_us


def meets_gpu_time_target(cupyrope_gpu_us: float, torch_gpu_us: float) -> bool:
    """Whether cupyrope's GPU time per call under jit is within 5% of the torch path's."""
    return cupyrope_gpu_us <= GPU_TIME_TARGET_RATIO * torch_gpu_us


# ---- data and steps ---------------------------------------------------------------------------

def jax_gpu_missing_reason() -> str | None:
    """None when JAX runs on a GPU here, else why not."""
    try:
        import jax
    except ImportError as exc:
        return f"the JAX benchmarks need jax ({exc})"
    try:
        jax.devices("gpu")
    except RuntimeError as exc:
        return f"the JAX benchmarks need a JAX GPU backend ({exc})"
    return None


def require_jax_gpu():
    """jax, or a RuntimeError saying what is missing to measure on a GPU."""
    reason = jax_gpu_missing_reason()
    if reason:
        raise RuntimeError(reason)
    import jax

    return jax


def jax_device_name() -> str:
    """JAX's first device's kind, e.g. ``NVIDIA H100 80GB HBM3``; ``"no JAX"`` without JAX."""
    try:
        import jax

        return jax.devices()[0].device_kind
    except Exception:  # pragma: no cover - depends on the install
        return "no JAX"


class JaxRopeData:
    """q, k, positions and the cos/sin cache of one shape, on JAX's default device.

    ``args`` is ``(q, k, positions, cache)``; ``shape.max_position`` and ``shape.theta`` build the
    cache (a small ``max_position`` keeps CPU tests quick).
    """

    def __init__(self, shape: RopeShape, *, seed: int = 0):
        import jax
        import jax.numpy as jnp

        import cupyrope as cr

        if shape.interleaved or shape.rot != shape.head_dim:
            raise ValueError("the JAX steps rotate full heads with NeoX pairing (the HF formulation)")
        self.shape = s = shape
        key_q, key_k, key_p = jax.random.split(jax.random.key(seed), 3)
        dtype = jnp.dtype(s.dtype)
        self.q = jax.random.normal(key_q, (s.tokens, s.num_q_heads, s.head_dim), dtype)
        self.k = jax.random.normal(key_k, (s.tokens, s.num_k_heads, s.head_dim), dtype)
        self.positions = jax.random.randint(key_p, (s.tokens,), 0, s.max_position, jnp.int32)
        self.cache = cr.cos_sin_cache(s.max_position, s.rot, theta=s.theta, dtype="float32",
                                      like=self.q)
        self.args = (self.q, self.k, self.positions, self.cache)
        self.qk_bytes = s.tokens * (s.num_q_heads + s.num_k_heads) * s.head_dim * dtype.itemsize

    def bytes_moved(self, impl: str) -> int:
        """Minimum bytes of one step: q and k in and out, plus positions and one fp32 cache row
        per token (none for the copy and the computed float32 angles)."""
        t = self.shape.tokens
        if impl == "jnp-copy":
            return 2 * self.qk_bytes
        if impl == "xla-hf-f32-angles":
            return 2 * self.qk_bytes + 4 * t
        return 2 * self.qk_bytes + 4 * t + 4 * t * self.shape.rot

    @functools.cached_property
    def reference(self) -> tuple[np.ndarray, np.ndarray]:
        """float64 (q, k) of the first :data:`ERROR_TOKENS` tokens rotated by the exact angles."""
        import cupyrope as cr

        n = min(ERROR_TOKENS, self.shape.tokens)
        inv_freq, factor = cr.rope_frequencies(self.shape.rot, theta=self.shape.theta)
        angles = np.asarray(self.positions[:n]).astype(np.float64)[:, None, None] * inv_freq
        cos, sin = factor * np.cos(angles), factor * np.sin(angles)
        return tuple(_rotate_half_pairs(np.asarray(x[:n]).astype(np.float64), cos, sin)
                     for x in (self.q, self.k))


def _rotate_half_pairs(x, cos, sin):
    """NeoX rotation of NumPy ``x [..., D]`` by half-width ``cos``, ``sin`` (dim j with j + D/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _hf_rotate(x, cos, sin):
    """Hugging Face's ``x * cos + rotate_half(x) * sin`` in float32 (cos, sin full width)."""
    import jax.numpy as jnp

    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated_half = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated_half * sin).astype(x.dtype)


def step_function(impl: str, shape: RopeShape) -> Callable:
    """The step ``impl`` (a key of :data:`JAX_IMPLS`): ``f(q, k, positions, cache) -> (q, k)``."""
    import jax.numpy as jnp

    import cupyrope as cr

    if impl == "jnp-copy":
        def jnp_copy(q, k, positions, cache):
            one = cache[0, 0]  # cos(0 * inv_freq) = 1.0, unknown to XLA until the step runs
            return q * one.astype(q.dtype), k * one.astype(k.dtype)
        return jnp_copy
    if impl in ("xla-hf", "xla-hf-f32-angles"):
        half = shape.rot // 2
        # Hugging Face's default inv_freq, in float32 as its rotary embedding computes it.
        inv_freq_f32 = 1.0 / (shape.theta ** (np.arange(0, shape.rot, 2, dtype=np.float32)
                                              / np.float32(shape.rot)))

        def xla_hf(q, k, positions, cache):
            if impl == "xla-hf":
                rows = cache[positions]  # [T, rotary_dim] float32
                cos, sin = rows[:, :half], rows[:, half:]
            else:
                angles = positions.astype(jnp.float32)[:, None] * inv_freq_f32
                cos, sin = jnp.cos(angles), jnp.sin(angles)
            cos = jnp.concatenate([cos, cos], axis=-1)[:, None, :]  # [T, 1, D]
            sin = jnp.concatenate([sin, sin], axis=-1)[:, None, :]
            return _hf_rotate(q, cos, sin), _hf_rotate(k, cos, sin)
        xla_hf.__name__ = impl.replace("-", "_")
        return xla_hf
    if impl in ("cupyrope-native", "cupyrope-callback"):
        def cupyrope_step(q, k, positions, cache):  # one function object per call: its own trace
            return cr.apply_rope(q, k, positions, cos_sin_cache=cache)
        return cupyrope_step
    raise ValueError(f"unknown implementation {impl!r}; known: {JAX_IMPLS}")


def chained(fn: Callable, calls: int = LOOP_CALLS) -> Callable:
    """``calls`` back-to-back calls of ``fn``, each on the previous call's (q, k): an unrolled
    ``fori_loop`` with an optimization barrier after each call, so that XLA runs every call as
    its own kernels (no fusion, merging or elision across calls)."""
    import jax

    def loop(q, k, positions, cache):
        def body(_, qk):
            return jax.lax.optimization_barrier(fn(*qk, positions, cache))
        return jax.lax.fori_loop(0, calls, body, (q, k), unroll=True)
    return loop


@contextlib.contextmanager
def native_route(native: bool):
    """Lower cupyrope's traced calls inside the block by the native XLA call (``native``) or the
    Python callback (``CUPYROPE_JAX_NATIVE=0``, its once-only warning silenced); the variable is
    restored after."""
    before = os.environ.get(NATIVE_ENV)
    if native:
        os.environ.pop(NATIVE_ENV, None)
    else:
        os.environ[NATIVE_ENV] = "0"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="cupyrope: apply_rope under jax.jit runs "
                                    "through a Python callback", category=RuntimeWarning)
            yield
    finally:
        if before is None:
            os.environ.pop(NATIVE_ENV, None)
        else:
            os.environ[NATIVE_ENV] = before


@dataclasses.dataclass
class JaxStep:
    """The compiled step of one implementation (``step``), its jitted loop of :data:`LOOP_CALLS`
    calls (``loop``, compiled on first use) and the arguments both take."""

    impl: str
    step: object
    args: tuple
    fn: Callable = dataclasses.field(repr=False)
    bytes_moved: int = 0
    _loop: object = dataclasses.field(default=None, repr=False)

    @property
    def loop(self):
        if self._loop is None:
            self._loop = _compile(chained(self.fn), self.args, self.impl)
        return self._loop


def _compile(fn: Callable, args: tuple, impl: str):
    import jax

    with native_route(impl != "cupyrope-callback"):
        compiled = jax.jit(fn).lower(*args).compile()
    _check_route(compiled, impl)
    return compiled


def _check_route(compiled, impl: str) -> None:
    """On a GPU, make sure a cupyrope step took the route its name says."""
    if not impl.startswith("cupyrope") or not _on_gpu():
        return
    native = NATIVE_CALL_TARGET in compiled.as_text()
    if native != (impl == "cupyrope-native"):
        from cupyrope.frontends.jax import native as jax_native

        raise Unavailable(f"{impl}: the compiled step {'has' if native else 'lacks'} the native "
                          f"kernel call ({jax_native.unavailable_reason() or 'no reason given'})")


def _on_gpu() -> bool:
    import jax

    return jax.default_backend() in ("gpu", "cuda")


def compile_step(impl: str, data: JaxRopeData) -> JaxStep:
    """Jit, lower and compile ``impl`` on ``data`` (see :func:`native_route` for the callback)."""
    fn = step_function(impl, data.shape)
    return JaxStep(impl, _compile(fn, data.args, impl), data.args, fn, data.bytes_moved(impl))


# ---- clocks -----------------------------------------------------------------------------------

class JaxSyncedClock:
    """A pytest-benchmark timer for jitted calls: each reading waits for the outputs the target
    last handed to :meth:`hold` (``jax.block_until_ready``), then reads ``time.perf_counter()``
    divided by ``divisor`` (20 for a loop of 20 calls: readings only subtract). Around N calls it
    gives the wall time of N dispatches and one wait, per call."""

    __name__ = "jax_synced_clock"

    def __init__(self):
        self.divisor = 1
        self._pending = None

    def configure(self, *, divisor: int = 1) -> "JaxSyncedClock":
        self.divisor, self._pending = int(divisor), None
        return self

    def hold(self, outputs) -> None:
        self._pending = outputs

    def __call__(self) -> float:
        if self._pending is not None:
            import jax

            jax.block_until_ready(self._pending)
            self._pending = None
        return time.perf_counter() / self.divisor


JAX_CLOCK = JaxSyncedClock()


def dispatch_calls(tokens: int) -> int:
    """Calls per timed dispatch loop: about 2 ms of GPU work or more, at least 10 calls."""
    return 200 if tokens <= 512 else max(10, 400_000 // tokens)


def _timed_loop(compiled, args: tuple, calls: int, *, warmup: int, repeats: int) -> list[float]:
    import jax

    for _ in range(max(1, warmup)):
        jax.block_until_ready(compiled(*args))
    samples = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        for _ in range(calls):
            out = compiled(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return samples


def wall_time_us(compiled, args: tuple, *, calls: int = 200, warmup: int = 3,
                 repeats: int = 5) -> float:
    """Median wall time per call of ``compiled(*args)``: ``calls`` dispatches, one wait, / calls."""
    return statistics.median(_timed_loop(compiled, args, calls, warmup=warmup, repeats=repeats))


def loop_time_us(compiled_loop, args: tuple, *, loops: int = 10, warmup: int = 2,
                 repeats: int = 5, calls_per_loop: int = LOOP_CALLS) -> float:
    """GPU time per call from a jitted loop of ``calls_per_loop`` chained calls: ``loops``
    dispatches of it, one wait, divided by ``loops * calls_per_loop`` (median of repeats)."""
    return wall_time_us(compiled_loop, args, calls=loops, warmup=warmup,
                        repeats=repeats) / calls_per_loop


def torch_graph_time_us(tokens: int, *, repeats: int = 10) -> float:
    """The torch path's GPU time per call for the same shape: ``apply_rope`` with the cache on
    torch tensors (int64 positions), in a CUDA graph of 20 calls on 20 input sets (fewer where a
    set already passes L2). Raises :class:`Unavailable` without torch CUDA."""
    try:
        import torch
    except ImportError as exc:
        raise Unavailable(f"the torch path needs torch ({exc})") from None
    if not torch.cuda.is_available():
        raise Unavailable("the torch path needs torch with a CUDA GPU")
    shape = RopeShape(tokens=tokens)
    data = RopeData(shape, num_sets=GRAPH_CALLS if tokens <= 512 else None)
    work = make_workload(TORCH_PATH_IMPL, data)
    try:
        return graph_time_us(work.fn, rotate_inputs=work.arg_sets, repeats=repeats)
    finally:
        del work, data
        torch.cuda.empty_cache()


# ---- accuracy ---------------------------------------------------------------------------------

def max_abs_error(step: JaxStep, data: JaxRopeData) -> float:
    """Largest |output - float64 rotation| of one call over the first :data:`ERROR_TOKENS`
    tokens, q and k (NaN counts as inf)."""
    outputs = step.step(*data.args)
    errors = []
    for got, ref in zip(outputs, data.reference):
        diff = np.abs(np.asarray(got[:ref.shape[0]]).astype(np.float64) - ref)
        errors.append(float("inf") if np.isnan(diff).any() else float(diff.max()))
    return max(errors)


# ---- the sweep and its table ------------------------------------------------------------------

@dataclasses.dataclass
class JaxRow:
    """One T: wall µs per jitted step and GPU µs per call (loop of 20) by implementation, the
    torch path's GPU µs per call (graph of 20), max abs errors against the float64 rotation."""

    tokens: int
    wall_us: dict = dataclasses.field(default_factory=dict)
    gpu_us: dict = dataclasses.field(default_factory=dict)
    torch_gpu_us: float | None = None
    max_abs_err: dict = dataclasses.field(default_factory=dict)


def _failure(bar: Progress, failures: list[str] | None, line: str) -> None:
    bar.note(line)
    if failures is not None:
        failures.append(line)


def jax_sweep(tokens: Sequence[int] = JAX_TOKENS, *, impls: Sequence[str] = JAX_IMPLS,
              repeats: int = 5, check: bool = True, torch_path: bool = True, progress: bool = True,
              failures: list[str] | None = None) -> list[JaxRow]:
    """Each implementation of :data:`JAX_IMPLS` over ``tokens``: wall time per jitted step, GPU
    time per call (loop of 20), max abs error (``check``); the torch path's GPU time
    (``torch_path``); under a progress bar (tqdm, when installed and ``progress``). A case that
    raises goes to ``failures`` and the sweep goes on."""
    require_jax_gpu()
    rows = []
    with Progress(len(tokens) * (len(impls) + bool(torch_path)), enabled=progress) as bar:
        for t in tokens:
            data = JaxRopeData(RopeShape(tokens=t))
            row = JaxRow(t)
            calls = dispatch_calls(t)
            for impl in impls:
                bar.case(f"T={t} {impl}")
                try:
                    step = compile_step(impl, data)
                    if check and impl in ROTATION_IMPLS:
                        row.max_abs_err[impl] = error = max_abs_error(step, data)
                        if not error_is_acceptable(error, data.shape.dtype):
                            bar.note(f"T={t} {impl}: max abs error {error:.3g} > "
                                     f"{CHECK_TOLERANCE[data.shape.dtype]}")
                    row.wall_us[impl] = wall_time_us(step.step, data.args, calls=calls,
                                                     repeats=repeats)
                    row.gpu_us[impl] = loop_time_us(step.loop, data.args,
                                                    loops=max(2, calls // LOOP_CALLS),
                                                    repeats=repeats)
                except Unavailable as exc:
                    bar.note(f"T={t} {impl}: skipped ({exc})")
                except Exception:
                    _failure(bar, failures, f"T={t} {impl}: FAILED\n{traceback.format_exc()}")
                finally:
                    step = None
                    bar.done()
            if torch_path:
                bar.case(f"T={t} torch path")
                try:
                    row.torch_gpu_us = torch_graph_time_us(t, repeats=2 * repeats)
                except Unavailable as exc:
                    bar.note(f"T={t} torch path: skipped ({exc})")
                except Exception:
                    _failure(bar, failures,
                             f"T={t} torch path: FAILED\n{traceback.format_exc()}")
                finally:
                    bar.done()
            rows.append(row)
            del data
    return rows


def _us(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def _err(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def target_cells(row: JaxRow, impl: str = "cupyrope-native") -> tuple[str, str]:
    """(``impl``/XLA ratio, target text with met / MISSED) of a row; empty without both times."""
    ours, xla = row.wall_us.get(impl), row.wall_us.get("xla-hf")
    if ours is None or xla is None:
        return "", ""
    verdict = "met" if meets_step_target(row.tokens, ours, xla) else "MISSED"
    return f"{ours / xla:.3f}", f"{step_target(row.tokens)}: {verdict}"


def gpu_time_cells(row: JaxRow, impl: str = "cupyrope-native") -> tuple[str, str]:
    """(``impl``/torch GPU time ratio, ``≤ 1.05: met / MISSED``); empty without both times."""
    ours, torch_us = row.gpu_us.get(impl), row.torch_gpu_us
    if ours is None or torch_us is None:
        return "", ""
    verdict = "met" if meets_gpu_time_target(ours, torch_us) else "MISSED"
    return f"{ours / torch_us:.3f}", f"≤ {GPU_TIME_TARGET_RATIO}: {verdict}"


def format_jax_table(rows: Sequence[JaxRow], gpu_name: str, jax_version: str = "") -> str:
    """Markdown: one line per T with the wall µs per jitted step of each implementation, the
    native/XLA ratio and its target, GPU µs per call (native, loop of 20) against the torch path's
    (graph of 20), and the max abs errors against the float64 rotation."""
    from tabulate import tabulate

    header = (f"apply_rope under jax.jit against XLA's fusion (bf16 q [T,32,128], k [T,8,128], "
              f"int32 positions < 131072, fp32 cache [131072,128], NeoX) on {gpu_name}"
              + (f", jax {jax_version}" if jax_version else ""))
    table = []
    for r in rows:
        ratio, target = target_cells(r)
        gpu_ratio, gpu_target = gpu_time_cells(r)
        table.append([r.tokens] + [_us(r.wall_us.get(i)) for i in JAX_IMPLS] + [ratio, target]
                     + [_us(r.gpu_us.get("cupyrope-native")), _us(r.torch_gpu_us),
                        f"{gpu_ratio} ({gpu_target})" if gpu_ratio else ""]
                     + [_err(r.max_abs_err.get(i)) for i in ROTATION_IMPLS])
    headers = (["T", "jnp copy µs", "XLA HF fusion µs", "XLA HF f32 angles µs",
                "cupyrope native µs", "cupyrope callback µs", "native / XLA", "target",
                "native GPU µs/call", "torch path GPU µs/call", "native / torch GPU",
                "err XLA HF", "err f32 angles", "err native", "err callback"])
    lines = tabulate(table, headers=headers, tablefmt="pipe", disable_numparse=True,
                     colalign=("right",) * 7 + ("left",) + ("right",) * 2 + ("left",)
                     + ("right",) * 4)
    gpu_table = tabulate([[r.tokens] + [_us(r.gpu_us.get(i)) for i in JAX_IMPLS]
                          + [_us(r.torch_gpu_us)] for r in rows],
                         headers=["T"] + list(JAX_IMPLS) + ["torch path (graph)"],
                         tablefmt="pipe", disable_numparse=True,
                         colalign=("right",) * (len(JAX_IMPLS) + 2))
    notes = ("Wall µs per jitted step: N calls on the same inputs, one block_until_ready, / N. "
             f"GPU µs per call: a jitted loop of {LOOP_CALLS} chained calls, / {LOOP_CALLS}; torch "
             f"path: a CUDA graph of {GRAPH_CALLS} apply_rope calls. Errors: max |out - float64 "
             f"rotation (exact angles)| over the first {ERROR_TOKENS} tokens of q and k.")
    return "\n".join([header, "", lines, "", f"GPU µs per call (jitted loop of {LOOP_CALLS}):",
                      "", gpu_table, "", notes])


def plot_jax(rows: Sequence[JaxRow], path: str, *, gpu_name: str) -> str:
    """Two panels against T, log-log, one line per implementation: wall µs per jitted step, and
    GPU µs per call (jitted loop of 20; the torch path's CUDA graph of 20 dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (wall, gpu) = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for ax, times in ((wall, lambda r: r.wall_us), (gpu, lambda r: r.gpu_us)):
        for impl in JAX_IMPLS:
            points = [(r.tokens, times(r)[impl]) for r in rows if impl in times(r)]
            if points:
                points.sort()
                style = dict(color="black", linestyle="--") if impl == "jnp-copy" else {}
                ax.plot([t for t, _ in points], [us for _, us in points], marker="o", label=impl,
                        **style)
    torch_points = sorted((r.tokens, r.torch_gpu_us) for r in rows if r.torch_gpu_us is not None)
    if torch_points:
        gpu.plot([t for t, _ in torch_points], [us for _, us in torch_points], marker="s",
                 color="grey", linestyle=":", label="torch path (graph)")
    ticks = sorted({r.tokens for r in rows})
    for ax, title in ((wall, "wall µs per jitted step"),
                      (gpu, f"GPU µs per call (jitted loop of {LOOP_CALLS})")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks])
        ax.set_xlabel("tokens T")
        ax.set_ylabel("µs")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"apply_rope under jax.jit against XLA's fusion, bf16 q[T,32,128] k[T,8,128], "
                 f"fp32 cache, NeoX — {gpu_name}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def jax_environment() -> dict:
    """JAX's version and devices, for the records."""
    try:
        import jax
        import jaxlib

        return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                "jax_devices": [str(d) for d in jax.devices()]}
    except Exception as exc:  # pragma: no cover - depends on the install
        return {"jax": f"unavailable ({type(exc).__name__}: {exc})"}

