"""scripts/host_time_cpu.py on the CPU: every repeat call it times replays its recipe (the key
formed from the arguments as given finds the recipe its first call kept, the guards pass, the
launch packs the pointers), for apply_rope, rms_norm_rope, the patched Hugging Face layers and
rerotate_cache; and the fake recipes are forgotten afterwards."""

from __future__ import annotations

import pytest

import repo_scripts

pytest.importorskip("torch")
pytest.importorskip("transformers")

host_time = repo_scripts.load("host_time_cpu")


def test_every_timed_call_replays_and_nothing_is_left_behind():
    import torch

    from cupyrope.cuda import recipes

    get_device = torch.Tensor.get_device
    results = host_time.measure(calls_a_round=20, rounds=2)
    assert set(results) == {"apply_rope in place", "apply_rope", "rope_and_cache in place",
                            "rms_norm_rope in place", "patched layer", "patched QK-norm layer",
                            "rerotate_cache"}
    for name, (us, launches, made) in results.items():
        assert launches == made == 40, name
        assert 0 < us < 1e4, name
    assert len(recipes.recipes) == 0  # no fake recipe may meet a real launch later
    assert torch.Tensor.get_device is get_device


def test_guards_count_each_pair_once():
    # in place apply_rope: q and k written, cos and sin read: (q, k), q / k with each table
    assert host_time._guards(2, 2) == 5
    assert host_time._guards(1, 3) == 3  # a re-rotation: the cache against slots, delta, table
