"""The fused serving ops against the unfused sequences a user writes today (contract §4, fused ops).

Reference shape (bf16 q ``[T, 32, 128]``, k and v ``[T, 8, 128]``, int64 positions in
[0, 131072), fp32 cache, NeoX), norm weights bf16, paged KV caches bf16 ``[T / 16 + 8, 16, 8,
128]`` (NHD, block_size 16, blocks shuffled), one group per op and T:

- ``rms_norm_rope``: ``cupyrope-fused`` (:func:`cupyrope.rms_norm_rope`), ``unfused-eager``
  (``torch.nn.functional.rms_norm`` of q and of k, then ``cupyrope.apply_rope``),
  ``unfused-compile`` (``torch.compile`` of RMSNorm + the Hugging Face RoPE formulation: one
  Triton kernel);
- ``rope_and_cache``: ``cupyrope-fused`` (:func:`cupyrope.rope_and_cache`), ``unfused-eager``
  (``apply_rope`` in place, then ``index_copy_`` of k and of v into the caches' slot rows),
  ``unfused-compile`` (``torch.compile`` of the HF RoPE and the two cache stores);
- ``fp8 out``: ``cupyrope-fused`` (``apply_rope(out_dtype="float8_e4m3fn")``),
  ``unfused-eager`` (``apply_rope`` then ``(x / scale).clamp(...).to(fp8)``), ``unfused-compile``;
- ``copy``: one SM copy of every byte the fused op must read and write once; ``pct_of_copy`` of
  every case is against it.

T = 4096, 16384, 65536: GPU time per eager call, inputs rotating among enough sets that every call
reads DRAM. Decode T = 1, 32, 512: GPU time per call in a CUDA graph of 20 calls, fused op in place
against ``apply_rope`` in place (``plain-rope``) on the same q and k; ``ratio_to_rope`` is the
fused time over it (target <= 1.3).
"""

from __future__ import annotations

import functools

import pytest

from cupyrope import bench as bm

pytestmark = pytest.mark.benchmark(timer=bm.GPU_CLOCK)

HQ, HK, D = 32, 8, 128
BLOCK_SIZE = 16
EPS = 1e-6
FP8_SCALE = 0.5
OPS = ("rms_norm_rope", "rope_and_cache", "fp8 out")
IMPLS = ("copy", "cupyrope-fused", "unfused-eager", "unfused-compile")
TOKENS = (4096, 16384, 65536)
DECODE_TOKENS = (1, 32, 512)

CASES = [pytest.param(op, tokens, impl, id=f"{op.replace(' ', '_')}-T{tokens}-{impl}")
         for op in OPS for tokens in TOKENS for impl in IMPLS]
DECODE_CASES = [pytest.param(op, tokens, impl, id=f"{op.replace(' ', '_')}-T{tokens}-{impl}")
                for op in OPS for tokens in DECODE_TOKENS for impl in ("plain-rope", "cupyrope-fused")]


class FusedData:
    """Input sets of one T: q, k, v, positions and slot mappings per set; one cache table, one pair
    of norm weights, one pair of paged caches (every set writes other slots of them)."""

    _current = None

    @classmethod
    def get(cls, tokens: int, num_sets: int | None = None) -> "FusedData":
        key = (tokens, num_sets)
        if cls._current is None or cls._current.key != key:
            cls._current = None  # free the previous shape first
            cls._current = cls(tokens, num_sets)
        return cls._current

    def __init__(self, tokens: int, num_sets: int | None):
        import torch

        import cupyrope as cr

        self.key = (tokens, num_sets)
        self.tokens = tokens
        self.shape = bm.RopeShape(tokens=tokens)
        per_set = 2 * tokens * (HQ + 2 * HK) * D * 2  # q, k, v read and written once, bf16
        n = num_sets or bm.input_sets_for(per_set)
        g = torch.Generator(device="cuda").manual_seed(0)

        def randn(*shape):
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

        self.q = [randn(tokens, HQ, D) for _ in range(n)]
        self.k = [randn(tokens, HK, D) for _ in range(n)]
        self.v = [randn(tokens, HK, D) for _ in range(n)]
        self.positions = [torch.randint(0, 131072, (tokens,), device="cuda", generator=g)
                          for _ in range(n)]
        self.cache = cr.cos_sin_cache(131072, D, dtype="float32", like=self.q[0])
        self.q_weight = torch.rand(D, device="cuda", generator=g).to(torch.bfloat16) + 0.5
        self.k_weight = torch.rand(D, device="cuda", generator=g).to(torch.bfloat16) + 0.5
        num_blocks = -(-tokens // BLOCK_SIZE) + 8
        self.k_cache = torch.zeros(num_blocks, BLOCK_SIZE, HK, D, device="cuda",
                                   dtype=torch.bfloat16)
        self.v_cache = torch.zeros_like(self.k_cache)
        rows = torch.arange(BLOCK_SIZE, device="cuda")
        self.slots = [(torch.randperm(num_blocks, device="cuda", generator=g)[:, None] * BLOCK_SIZE
                       + rows).flatten()[:tokens].contiguous() for _ in range(n)]

    def bytes_moved(self, op: str) -> int:
        """Every byte the fused op must read and write once (positions and cos/sin rows too)."""
        qk = self.tokens * (HQ + HK) * D * 2
        angles = self.tokens * (8 + D * 4)  # positions and one fp32 cache row per token
        if op == "rms_norm_rope":
            return 2 * qk + angles
        if op == "fp8 out":
            return qk + qk // 2 + angles
        kv = self.tokens * HK * D * 2
        return 2 * qk + kv + 2 * kv + angles + self.tokens * 8  # + v, k/v cache rows, slots


def _rms_norm(x, weight):
    import torch

    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, EPS)


def _quantize(x):
    import torch

    return (x.float() / FP8_SCALE).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def _unfused(op: str, rope):
    """The unfused sequence of ``op`` with ``rope(q, k, positions, cache) -> (q, k)``."""

    if op == "rms_norm_rope":
        def norm_rope(q, k, positions, cache, qw, kw):
            return rope(_rms_norm(q, qw), _rms_norm(k, kw), positions, cache)
        return norm_rope
    if op == "fp8 out":
        def rope_fp8(q, k, positions, cache):
            q_out, k_out = rope(q, k, positions, cache)
            return _quantize(q_out), _quantize(k_out)
        return rope_fp8

    def rope_cache(q, k, v, positions, cache, slots, k_cache, v_cache):
        q_out, k_out = rope(q, k, positions, cache)
        k_cache.view(-1, HK, D).index_copy_(0, slots, k_out)
        v_cache.view(-1, HK, D).index_copy_(0, slots, v)
        return q_out, k_out
    return rope_cache


def _cupyrope_rope(q, k, positions, cache):
    import cupyrope as cr

    return cr.apply_rope(q, k, positions, cos_sin_cache=cache)


@functools.lru_cache(maxsize=None)
def _compiled(op: str):
    import torch

    bm.compiled_hf_rope()  # raises dynamo's recompile limit for the many shapes benchmarked
    return torch.compile(_unfused(op, bm.hf_rope))  # dynamic after the second T: two compiles


def _fused(op: str, inplace: bool = False):
    import cupyrope as cr

    if op == "rms_norm_rope":
        def norm_rope(q, k, positions, cache, qw, kw):
            return cr.rms_norm_rope(q, k, qw, kw, positions, eps=EPS, cos_sin_cache=cache,
                                    inplace=inplace)
        return norm_rope
    if op == "fp8 out":
        def rope_fp8(q, k, positions, cache):
            return cr.apply_rope(q, k, positions, cos_sin_cache=cache, out_dtype="float8_e4m3fn",
                                 q_scale=FP8_SCALE, k_scale=FP8_SCALE)
        return rope_fp8

    def rope_cache(q, k, v, positions, cache, slots, k_cache, v_cache):
        return cr.rope_and_cache(q, k, v, positions, k_cache, v_cache, slots,
                                 cos_sin_cache=cache, inplace=inplace)
    return rope_cache


def _arg_sets(op: str, data: FusedData) -> list[tuple]:
    sets = []
    for i, (q, k, positions) in enumerate(zip(data.q, data.k, data.positions)):
        if op == "rms_norm_rope":
            sets.append((q, k, positions, data.cache, data.q_weight, data.k_weight))
        elif op == "fp8 out":
            sets.append((q, k, positions, data.cache))
        else:
            sets.append((q, k, data.v[i], positions, data.cache, data.slots[i], data.k_cache,
                         data.v_cache))
    return sets


def make_fused_workload(op: str, impl: str, data: FusedData) -> bm.Workload:
    nbytes = data.bytes_moved(op)
    if impl == "copy":
        return bm.sm_copy(nbytes // 2)
    if impl == "cupyrope-fused":
        fn = _fused(op)
    elif impl == "unfused-eager":
        fn = _unfused(op, _cupyrope_rope)
    elif impl == "unfused-compile":
        reason = bm.peer_status()["torch-compile-hf"]
        if reason:
            raise bm.Unavailable(reason)
        fn = _compiled(op)
    else:
        raise ValueError(f"unknown implementation {impl!r}")
    return bm.Workload(impl, fn, _arg_sets(op, data), nbytes)


@pytest.mark.parametrize("op, tokens, impl", CASES)
def test_fused_bandwidth(rope_bench, op, tokens, impl):
    data = FusedData.get(tokens)
    try:
        work = make_fused_workload(op, impl, data)
        plan = bm.plan_batches(work.step())
    except bm.Unavailable as exc:
        pytest.skip(str(exc))
    except Exception as exc:
        if impl in ("copy", "cupyrope-fused"):
            raise
        pytest.skip(f"{impl} failed on this shape: {type(exc).__name__}: {exc}")
    group = f"fused {op}: {data.shape.label()}, v [T, {HK}, {D}], paged cache bf16 block {BLOCK_SIZE}"
    benchmark = rope_bench.benchmark
    benchmark.group = group
    bm.GPU_CLOCK.configure(prime_us=plan.prime_us)
    benchmark.pedantic(work.step(), rounds=10, iterations=plan.calls, warmup_rounds=1)
    copy = bm.sm_copy(data.bytes_moved(op) // 2)
    rope_bench._report(group, data.shape, impl, work, None, plan,
                       copy=lambda: bm.gpu_time_us(copy.fn, rotate_inputs=copy.arg_sets))


_PLAIN_ROPE_US: dict[tuple, float] = {}


@pytest.mark.parametrize("op, tokens, impl", DECODE_CASES)
def test_fused_decode_graph(rope_bench, op, tokens, impl):
    data = FusedData.get(tokens, num_sets=bm.GRAPH_CALLS)
    sets = _arg_sets(op, data)
    if impl == "plain-rope":
        import cupyrope as cr

        def fn(q, k, *rest):
            return cr.apply_rope(q, k, rest[0] if op != "rope_and_cache" else rest[1],
                                 cos_sin_cache=data.cache, inplace=True)
    else:
        fn = _fused(op, inplace=op != "fp8 out")
    work = bm.Workload(impl, fn, sets, data.bytes_moved(op))
    captured = bm.capture_graph(work.fn, rotate_inputs=work.arg_sets)
    plan = bm.plan_batches(captured.replay)
    group = f"fused decode {op}, CUDA graph of {bm.GRAPH_CALLS} calls: {data.shape.label()}"
    benchmark = rope_bench.benchmark
    benchmark.group = group
    bm.GPU_CLOCK.configure(prime_us=plan.prime_us, divisor=bm.GRAPH_CALLS)
    benchmark.pedantic(captured.replay, rounds=10, iterations=plan.calls, warmup_rounds=1)
    us = rope_bench._median_us()
    if us is not None:
        if impl == "plain-rope":
            _PLAIN_ROPE_US[(op, tokens)] = us
        elif (op, tokens) in _PLAIN_ROPE_US:
            ratio = us / _PLAIN_ROPE_US[(op, tokens)]
            benchmark.extra_info["ratio_to_rope"] = round(ratio, 2)
    rope_bench._report(group, data.shape, impl, work, None, plan, copy=None)
