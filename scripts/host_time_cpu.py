"""Host time of repeat calls, measured without a GPU.

A repeat call's host time is Python: forming its key from the arguments, the recipe lookup, the
in-place guards, packing the pointers, the version bumps, then ``cuLaunchKernel``. All but the
last can be timed on any machine: CPU torch tensors answer ``get_device() = 0`` and so pass for
CUDA ones, and every recipe lookup is answered by a fake recipe that packs the pointers as a
launch does (with as many in-place guards as the real recipe holds, none of them meeting) and
counts its launches. The ratios between calls are what to compare; on a GPU's host each call
also pays the driver's launch (3-4 µs on an H200's host) and the host's own speed
(docs/perf_log.md, "The patched layers' rotation: host time").

    python scripts/host_time_cpu.py                 # every call, best of 5 x 20000, µs
    python scripts/host_time_cpu.py --calls 2000 rerotate_cache

Needs torch (CPU) and transformers (the patched layers); no GPU, no CUDA.
"""

from __future__ import annotations

import argparse
import ctypes
import struct
import sys
import threading
import time

_POINTERS = struct.Struct("<7Q")


class FakeRecipe:
    """Stands in for a LaunchRecipe: the attributes a replay reads, a launch that packs the
    pointers into parameter words under the lock, as LaunchRecipe.launch does, and a count."""

    torch = True
    vector = True
    out_dtype = None
    sin_offset = None

    def __init__(self, guards: int):
        self.in_place_checks = tuple((0, 1, -1, 0, None) for _ in range(guards))
        self.fusion_pointers = struct.Struct("<9Q")
        self._words = (ctypes.c_uint64 * 32)()
        self._fusion_words = (ctypes.c_uint64 * 32)()
        self._lock = threading.Lock()
        self.launches = 0

    def launch(self, like, q, k, q_out, k_out, positions, cos, sin, fusion=None):
        with self._lock:
            _POINTERS.pack_into(self._words, 0, q, k, q_out, k_out, positions, cos, sin)
            if fusion is not None:
                struct.Struct(f"<{len(fusion)}Q").pack_into(self._fusion_words, 0, *fusion)
            self.launches += 1


def _guards(written: int, others: int) -> int:
    """In-place guards of a recipe (cupyrope.cuda.recipes.guard_written): one a pair of a written
    operand and another present one, each pair once."""
    return written * others + written * (written - 1) // 2


def calls(batch: int = 8):
    """name -> (no-argument call, in-place guards of its recipe): decode-sized bf16 q ``[B, 1, 32,
    128]`` and k ``[B, 1, 8, 128]`` with Hugging Face's ``[B, 1, 128]`` tables, as
    benchmarks/test_hf_patch.py's host rows; a re-rotation of 32 slots."""
    import torch
    import transformers

    import cupyrope as cr
    from cupyrope.compat import hf

    torch.manual_seed(0)
    bf16 = dict(dtype=torch.bfloat16)
    q, k = torch.randn(batch, 1, 32, 128, **bf16), torch.randn(batch, 1, 8, 128, **bf16)
    cos, sin = torch.randn(batch, 1, 128, **bf16), torch.randn(batch, 1, 128, **bf16)
    width = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 num_hidden_layers=1, vocab_size=64, max_position_embeddings=8192,
                 intermediate_size=128)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**width)).to(torch.bfloat16)
    layer = model.model.layers[0].self_attn
    hf._rms_norm_form(layer.q_norm)  # what patch_hf_model finds first
    projections = ("q_proj", "k_proj")
    plain = hf._heads_last_rotation(hf.hf_apply_rotary_pos_emb, projections)
    fused = hf._norm_rotation("q_norm", "k_norm", False, hf.hf_apply_rotary_pos_emb, False,
                              projections)
    weight = layer.q_norm.weight.detach()
    cache = torch.randn(64, 16, 8, 128, **bf16)
    slots = torch.randperm(1024)[:32]
    delta = torch.randint(0, 4096, (32,))
    table = torch.randn(4096, 128)
    # rope_and_cache of B tokens ([B, H, D] rows), positions into the table, a paged cache
    tokens_q, tokens_k = q.view(batch, 32, 128), k.view(batch, 8, 128)
    v = torch.randn(batch, 8, 128, **bf16)
    positions = torch.randint(0, 4096, (batch,))
    v_cache = torch.empty_like(cache)
    slot_mapping = torch.randperm(1024)[:batch]
    return {
        "apply_rope in place": (lambda: cr.apply_rope(q, k, cos=cos, sin=sin, inplace=True),
                                _guards(2, 2)),
        "apply_rope": (lambda: cr.apply_rope(q, k, cos=cos, sin=sin), 0),
        "rope_and_cache in place": (
            lambda: cr.rope_and_cache(tokens_q, tokens_k, v, positions, cache, v_cache,
                                      slot_mapping, cos_sin_cache=table),
            _guards(4, 4)),  # q, k and both caches written; v, positions, table, slot mapping
        "rms_norm_rope in place": (lambda: cr.rms_norm_rope(q, k, weight, weight, eps=1e-6,
                                                            cos=cos, sin=sin, inplace=True),
                                   _guards(2, 4)),  # one weight tensor, keyed twice
        "patched layer": (lambda: plain(layer, q, k, cos, sin), _guards(2, 2)),
        "patched QK-norm layer": (lambda: fused(layer, q, k, cos, sin), _guards(2, 4)),
        "rerotate_cache": (lambda: cr.rerotate_cache(cache, slots, delta, cos_sin_cache=table),
                           _guards(1, 3)),
    }


def seed(call, recipe) -> int:
    """Make ``call`` once with every recipe lookup answered by ``recipe``, then keep it under the
    keys looked up; returns how many."""
    from cupyrope.cuda import recipes

    looked_up = []
    real = recipes.recipes.get
    recipes.recipes.get = lambda key: looked_up.append(key) or recipe
    try:
        call()
    finally:
        recipes.recipes.get = real
    for key in looked_up:
        recipes.recipes.put(key, recipe)
    return len(looked_up)


def measure(names=None, *, calls_a_round: int = 20000, rounds: int = 5) -> dict:
    """name -> (best µs a call, launches the fake recipe counted, calls made)."""
    import torch

    made = calls()
    names = list(names or made)
    unknown = [name for name in names if name not in made]
    if unknown:
        raise SystemExit(f"unknown calls {unknown}; known: {list(made)}")
    real_get_device = torch.Tensor.get_device
    torch.Tensor.get_device = torch.Tensor.dim  # C, never negative: a device number for the key
    try:
        fakes = {}
        with torch.no_grad():
            for name in names:
                fakes[name] = FakeRecipe(made[name][1])
                if not seed(made[name][0], fakes[name]):
                    raise SystemExit(f"{name}: the call formed no repeat key")
            results = {}
            for name in names:
                call = made[name][0]
                for fake in fakes.values():  # calls of one layout share a key (and recipe)
                    fake.launches = 0
                best = float("inf")
                for _ in range(rounds):
                    start = time.perf_counter()
                    for _ in range(calls_a_round):
                        call()
                    best = min(best, (time.perf_counter() - start) / calls_a_round * 1e6)
                launches = sum(fake.launches for fake in fakes.values())
                results[name] = (best, launches, rounds * calls_a_round)
    finally:
        torch.Tensor.get_device = real_get_device
        from cupyrope import execute

        execute.clear()  # the fake recipes must never meet a real launch
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="calls to time (default: all)")
    parser.add_argument("--calls", type=int, default=20000, help="calls a round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    for name, (us, launches, made) in measure(args.names, calls_a_round=args.calls,
                                              rounds=args.rounds).items():
        replayed = "" if launches == made else f"  (only {launches} of {made} calls replayed)"
        print(f"{name:24} {us:7.2f} µs{replayed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
