"""Training: forward + backward step, GPU time per step (contract §4: backward at the bandwidth of forward).

Reference shape (bf16 q [T, 32, 128], k [T, 8, 128], int64 positions, fp32 cache, NeoX) at
T = 4096, 16384, 65536, two groups per T:

- ``train fwd / bwd``: one forward call (``cupyrope-fwd``, plain tensors: the repeat-call path) and
  one backward call as autograd issues it (``cupyrope-bwd``: ``torch.ops.cupyrope.apply_rope`` on
  the upstream gradients with ``inverse=True``, through the custom-op dispatcher). The same bytes
  move, so the same GB/s is expected; ``pct_of_copy`` against the SM copy of q + k;
- ``train fwd+bwd``: ``q_out, k_out = rope(q, k)`` then ``torch.autograd.grad`` for q and k (no
  gradient accumulation), for cupyrope eager (the custom op), cupyrope under
  ``torch.compile(fullgraph=True)`` (the forward compiled, its backward by AOTAutograd, as for
  the Hugging Face formulation), the Hugging Face formulation eager and compiled, and Liger's
  Triton kernel (in place) where installed. ``pct_of_copy`` is against two SM copies of q + k
  (forward and backward each read and write them once).

GPU time (``GPU_CLOCK``, see conftest.py); inputs and upstream gradients rotate among enough sets
that every step reads DRAM. A peer that is not installed or fails is skipped with the reason.
"""

from __future__ import annotations

import functools

import pytest

from cupyrope import bench as bm

pytestmark = pytest.mark.benchmark(timer=bm.GPU_CLOCK)

TOKENS = (4096, 16384, 65536)
SINGLE = ("cupyrope-fwd", "cupyrope-bwd")
STEPS = ("cupyrope-fwd+bwd", "cupyrope-compile-fwd+bwd", "torch-eager-hf-fwd+bwd",
         "torch-compile-hf-fwd+bwd", "liger-fwd+bwd")

CASES = [pytest.param(tokens, impl, id=f"bf16-T{tokens}-{impl}")
         for tokens in TOKENS for impl in SINGLE + STEPS]


class TrainData:
    """bm.RopeData plus upstream gradients, and leaves that require grad sharing q's and k's memory
    (the shared RopeData tensors themselves are left alone: other benchmarks reuse them)."""

    _current = None

    @classmethod
    def get(cls, tokens: int) -> "TrainData":
        if cls._current is None or cls._current.tokens != tokens:
            cls._current = None  # free the previous shape first
            cls._current = cls(tokens)
        return cls._current

    def __init__(self, tokens: int):
        import torch

        self.tokens = tokens
        self.shape = bm.RopeShape(tokens=tokens)
        per_set = 2 * self.shape.tokens * 40 * 128 * 2  # q, k and their gradients, bf16
        self.data = bm.RopeData(self.shape, num_sets=bm.input_sets_for(per_set))
        self.grads = [(torch.randn_like(q), torch.randn_like(k)) for q, k in zip(self.data.q, self.data.k)]
        self.leaves = [(q.detach().requires_grad_(True), k.detach().requires_grad_(True))
                       for q, k in zip(self.data.q, self.data.k)]


def _grad_step(rope):
    """fn(q, k, gq, gk, *rest): ``rope(q, k, *rest)`` then the gradients of q and k."""
    import torch

    def step(q, k, gq, gk, *rest):
        q_out, k_out = rope(q, k, *rest)
        return torch.autograd.grad((q_out, k_out), (q, k), (gq, gk))

    return step


def _cupyrope(q, k, positions, cache):
    import cupyrope as cr

    return cr.apply_rope(q, k, positions, cos_sin_cache=cache)


@functools.lru_cache(maxsize=1)
def _compiled_cupyrope():
    """The forward compiled (fullgraph, mode default); AOTAutograd compiles its backward."""
    import torch

    return torch.compile(_cupyrope, fullgraph=True, dynamic=False)


def make_train_workload(impl: str, train: TrainData) -> bm.Workload:
    import torch

    data = train.data
    one_call = data.bytes_moved("cache")
    if impl == "cupyrope-fwd":
        sets = [(q, k, p, data.cache) for q, k, p in zip(data.q, data.k, data.positions)]
        return bm.Workload(impl, _cupyrope, sets, one_call)
    if impl == "cupyrope-bwd":
        def backward(gq, gk, positions, cache):  # what the registered backward launches
            return torch.ops.cupyrope.apply_rope(gq, gk, positions, cache, None, None, 10000.0,
                                                 None, None, False, None, True, None, False)
        sets = [(gq, gk, p, data.cache) for (gq, gk), p in zip(train.grads, data.positions)]
        return bm.Workload(impl, backward, sets, one_call)

    steps = [(q, k, gq, gk, p) for (q, k), (gq, gk), p in
             zip(train.leaves, train.grads, data.positions)]
    if impl == "cupyrope-fwd+bwd":
        return bm.Workload(impl, _grad_step(_cupyrope), [s + (data.cache,) for s in steps], 2 * one_call)
    if impl == "cupyrope-compile-fwd+bwd":
        return bm.Workload(impl, _grad_step(_compiled_cupyrope()), [s + (data.cache,) for s in steps],
                           2 * one_call)
    if impl in ("torch-eager-hf-fwd+bwd", "torch-compile-hf-fwd+bwd"):
        reason = bm.peer_status()[impl.replace("-fwd+bwd", "")]
        if reason:
            raise bm.Unavailable(reason)
        rope = bm.hf_rope if impl.startswith("torch-eager") else bm.compiled_hf_rope()
        return bm.Workload(impl, _grad_step(rope), [s + (data.cache,) for s in steps], 2 * one_call)
    if impl == "liger-fwd+bwd":
        reason = bm.peer_status()["liger-inplace"]
        if reason:
            raise bm.Unavailable(reason)
        sets = [(q, k, gq, gk, c, s) for (q, k, gq, gk, _), (c, s) in zip(steps, data.hf_tables)]
        return bm.Workload(impl, _grad_step(bm.liger_rope), sets, 2 * data.bytes_moved("hf-tables"))
    raise ValueError(f"unknown implementation {impl!r}")


@pytest.mark.parametrize("tokens, impl", CASES)
def test_backward(rope_bench, tokens, impl):
    train = TrainData.get(tokens)
    ours = impl.startswith("cupyrope")
    try:
        work = make_train_workload(impl, train)
        plan = bm.plan_batches(work.step())
    except bm.Unavailable as exc:
        pytest.skip(str(exc))
    except Exception as exc:
        if ours:
            raise
        pytest.skip(f"{impl} failed on this shape: {type(exc).__name__}: {exc}")
    single = impl in SINGLE
    group = f"train {'fwd / bwd' if single else 'fwd+bwd'}: {train.shape.label()}"
    copies = 1 if single else 2
    benchmark = rope_bench.benchmark
    benchmark.group = group
    bm.GPU_CLOCK.configure(prime_us=plan.prime_us)
    benchmark.pedantic(work.step(), rounds=10, iterations=plan.calls, warmup_rounds=1)
    rope_bench._report(group, train.shape, impl, work, None, plan,
                       copy=lambda: copies * rope_bench._copy_eager(train.data))
