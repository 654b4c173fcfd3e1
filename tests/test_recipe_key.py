"""The repeat-call key: list-valued scaling dicts (LongRoPE, M-RoPE) still hash, and any change
of an option or of an array's layout changes the key (no GPU needed: keys from fake metadata)."""

import pytest

from cupyrope import recipes


class _Fake:
    """Stands in for a CUDA array: call_key only reads metadata through gpu_array_key."""


@pytest.fixture(autouse=True)
def fake_gpu_arrays(monkeypatch):
    monkeypatch.setattr(recipes, "gpu_array_key",
                        lambda x: ((x.shape, x.strides, "bfloat16", 0, 0), 4096 * id(x) % 2**40))


def _array(shape, strides):
    a = _Fake()
    a.shape, a.strides = shape, strides
    return a


def _key(q, scaling=None, interleaved=False):
    options = (10000.0, scaling, interleaved, None, False, False, None)
    return recipes.call_key(q, None, None, None, None, None, options)


def test_list_valued_scaling_keys_hash_and_differ():
    q = _array((4, 2, 64), (128, 64, 1))
    a = _key(q, {"rope_type": "default", "mrope_section": [8, 12, 12]})
    b = _key(q, {"rope_type": "default", "mrope_section": [12, 8, 12]})
    assert a is not None and b is not None
    hash(a[0]), hash(b[0])
    assert a[0] != b[0]


def test_layout_and_options_change_the_key():
    q = _array((4, 2, 64), (128, 64, 1))
    transposed = _array((4, 2, 64), (64, 256, 1))
    assert _key(q)[0] != _key(transposed)[0]
    assert _key(q)[0] != _key(q, interleaved=True)[0]
    assert _key(q, interleaved=1) is None  # a non-bool flag goes to the full path and its check


def test_in_place_replays_only_where_ranges_meet_as_the_full_path_checked():
    class Recipe:
        pass

    spans = [(0, 100), (0, 50), None, (0, 8), None, None]  # q, k, positions, cache
    recipe = Recipe()
    recipes.guard_in_place(recipe, spans, [1000, 2000, 0, 4000, 0, 0])  # all apart when checked
    assert recipes._meets_as_checked(recipe, [5000, 9000, 0, 3000, 0, 0])  # still apart
    assert not recipes._meets_as_checked(recipe, [5000, 5050, 0, 3000, 0, 0])  # q and k now meet
    assert not recipes._meets_as_checked(recipe, [5000, 9000, 0, 5096, 0, 0])  # the cache in q
    # fused QKV: k's range inside q's, checked exactly at a distance of 64 bytes
    recipes.guard_in_place(recipe, spans, [1000, 1064, 0, 4000, 0, 0])
    assert recipes._meets_as_checked(recipe, [7000, 7064, 0, 9000, 0, 0])
    assert not recipes._meets_as_checked(recipe, [7000, 7032, 0, 9000, 0, 0])
