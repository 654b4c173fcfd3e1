"""The repeat-call key: list-valued scaling dicts (LongRoPE, M-RoPE) still hash, and any change
of an option or of an array's layout changes the key (no GPU needed: keys from fake metadata)."""

import pytest

from cupyrope.cuda import recipes


class _Fake:
    """Stands in for a CUDA array: call_key only reads metadata through gpu_array_key."""


@pytest.fixture(autouse=True)
def fake_gpu_arrays(monkeypatch):
    """Fakes are the CUDA arrays; anything else is not (as gpu_array_key says of host arrays)."""
    monkeypatch.setattr(recipes, "gpu_array_key",
                        lambda x: ((x.shape, x.strides, "bfloat16", 0, 0), 4096 * id(x) % 2**40)
                        if isinstance(x, _Fake) else None)


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


def test_out_arrays_are_keyed_and_guarded_like_written_operands():
    q = _array((4, 2, 64), (128, 64, 1))
    out = _array((4, 2, 64), (128, 64, 1))
    strided_out = _array((4, 2, 64), (256, 64, 1))
    options = (10000.0, None, False, None, False, False, None)
    plain = recipes.call_key(q, None, None, None, None, None, options)
    into = recipes.call_key(q, None, None, None, None, None, options, (out,))
    assert plain[0] != into[0] and len(into[1]) == 8  # six operands, q_out, k_out
    assert into[0] != recipes.call_key(q, None, None, None, None, None, options, (strided_out,))[0]
    assert recipes.call_key(q, None, None, None, None, None, options, (out, out, out)) is None

    class Recipe:
        pass

    recipe = Recipe()
    spans = [(0, 100), None, None, None, None, None, (0, 100), None]  # q, q_out
    recipes.guard_written(recipe, spans, [1000, 0, 0, 0, 0, 0, 2000, 0], (6, 7))
    assert recipes._meets_as_checked(recipe, [5000, 0, 0, 0, 0, 0, 9000, 0])
    assert not recipes._meets_as_checked(recipe, [5000, 0, 0, 0, 0, 0, 5050, 0])  # out over q


def _fused_key(q, k, rope=None, **fusion):
    rope = {"cos_sin_cache": None, "cos": None, "sin": None, "theta": 10000.0, "scaling": None,
            "interleaved": False, "rotary_dim": None, "inverse": False, "inplace": False,
            "seq_len": None, **(rope or {})}
    fusion = {"norm": True, "q_weight": _array((64,), (1,)), "k_weight": _array((64,), (1,)),
              "eps": 1e-6, "weight_offset": 0.0, "out_dtype": None, "q_scale": None,
              "k_scale": None, **fusion}
    return recipes.fused_call_key("rms_norm_rope", q, k, None, rope, fusion)


def test_fused_keys_hold_every_operand_and_option():
    q, k = _array((4, 2, 64), (128, 64, 1)), _array((4, 1, 64), (64, 64, 1))
    base = _fused_key(q, k)
    assert base is not None and len(base[1]) == len(recipes.FUSED_OPERANDS)
    others = [
        _fused_key(q, k, eps=1e-5),
        _fused_key(q, k, weight_offset=0),  # the same value as an int: another type
        _fused_key(q, k, weight_offset=1.0),
        _fused_key(q, k, rope={"inplace": True}),
        _fused_key(q, k, rope={"scaling": {"rope_type": "linear", "factor": 2.0}}),
        _fused_key(q, k, q_weight=_array((64,), (2,))),  # a strided weight
        _fused_key(q, k, out_dtype="float8_e4m3fn", q_scale=0.5, k_scale=0.5),
        _fused_key(q, k, out_dtype="float8_e4m3fn", q_scale=0.25, k_scale=0.5),
        _fused_key(q, k, out_dtype="float8_e4m3fn", q_scale=_array((), ()), k_scale=0.5),
    ]
    keys = [base[0]] + [other[0] for other in others]
    assert len(set(keys)) == len(keys)
    assert recipes.fused_call_key("apply_rope", q, k, None, {}, {})[0] != base[0]
    # A scale array's pointer is patched on a replay; a number is part of the key.
    scaled = _fused_key(q, k, out_dtype="float8_e4m3fn", q_scale=_array((), ()), k_scale=0.5)
    assert scaled[1][recipes.FUSED_OPERANDS.index("q_scale")] != 0
    assert scaled[1][recipes.FUSED_OPERANDS.index("k_scale")] == 0


def test_fused_keys_leave_arrays_in_option_places_to_the_full_path():
    import numpy as np

    q, k = _array((4, 2, 64), (128, 64, 1)), _array((4, 1, 64), (64, 64, 1))
    assert _fused_key(q, k, eps=np.float32(1e-6)) is None  # an array-like where a number goes
    assert _fused_key(q, k, q_scale=np.ones(1, np.float32)) is None  # a host array as a scale
    assert _fused_key(q, k, rope={"theta": [1.0]}) is None  # unhashable


# The fast key: formed from a public function's own arguments before its dicts are built.


def _fast_key(q, k, *, eps=1e-6, weight_offset=0.0, q_scale=None, k_scale=None, scaling=None,
              inplace=False, out_dtype=None, q_weight=None, norm_over="head"):
    w = _array((64,), (1,)) if q_weight is None else q_weight
    arrays = (q, k, None, None, None, None, w, w, q_scale, k_scale)
    options = (eps, weight_offset, 10000.0, scaling, False, None, False, inplace, None, out_dtype,
               norm_over)
    return recipes.fast_fused_key("rms_norm_rope", arrays, options)


def test_fast_keys_hold_every_operand_option_and_type():
    q, k = _array((4, 2, 64), (128, 64, 1)), _array((4, 1, 64), (64, 64, 1))
    base = _fast_key(q, k)
    assert base is not None and len(base[1]) == len(recipes.FUSED_OPERANDS)
    assert base[0] == _fast_key(q, k)[0]  # the same layout and options: the same key
    others = [
        _fast_key(q, k, eps=1e-5),
        _fast_key(q, k, weight_offset=0),  # the same value as an int: another type
        _fast_key(q, k, weight_offset=1.0),
        _fast_key(q, k, inplace=True),
        _fast_key(q, k, inplace=1),  # the full path refuses it: never replayed as True
        _fast_key(q, k, norm_over="all_heads"),
        _fast_key(q, k, q_weight=_array((64,), (2,))),  # a strided weight
        _fast_key(_array((4, 2, 64), (64, 256, 1)), k),  # transposed q
        _fast_key(q, k, out_dtype="float8_e4m3fn", q_scale=0.5, k_scale=0.5),
        _fast_key(q, k, out_dtype="float8_e4m3fn", q_scale=0.25, k_scale=0.5),
        _fast_key(q, k, out_dtype="float8_e4m3fn", q_scale=0.25, k_scale=1),
        _fast_key(q, k, out_dtype="float8_e4m3fn", q_scale=_array((), ()), k_scale=0.5),
    ]
    keys = [base[0]] + [other[0] for other in others]
    assert len(set(keys)) == len(keys)
    assert recipes.fast_fused_key("rope_and_cache", (q, k), ())[0] != \
        recipes.fast_fused_key("rms_norm_rope", (q, k), ())[0]
    # Pointers in FUSED_OPERANDS order, as the general key's: a replay patches them alike.
    scaled = _fast_key(q, k, out_dtype="float8_e4m3fn", q_scale=_array((), ()), k_scale=0.5)
    general = _fused_key(q, k, out_dtype="float8_e4m3fn", q_scale=0.5, k_scale=0.5)
    index = recipes.FUSED_OPERANDS.index
    assert scaled[1][index("q_scale")] != 0 and scaled[1][index("k_scale")] == 0
    assert scaled[1][:2] == general[1][:2] and scaled[1][index("v"):] == [0, 0, 0, 0]


def test_fast_keys_leave_every_call_the_full_path_must_see():
    import numpy as np

    q, k = _array((4, 2, 64), (128, 64, 1)), _array((4, 1, 64), (64, 64, 1))
    assert _fast_key(q, k, scaling={"rope_type": "linear", "factor": 2.0}) is None  # a dict
    assert _fast_key(q, k, eps=np.float32(1e-6)) is None  # an array-like where a number goes
    assert _fast_key(q, k, out_dtype=np.dtype("float16")) is None  # a dtype object
    assert _fast_key(q, k, q_scale="per_head") is None  # the full path makes the scale arrays
    assert _fast_key(q, k, q_scale=True) is None  # a bool scale: the full path refuses it
    assert _fast_key(q, k, q_scale=np.ones(1, np.float32)) is None  # a host array as a scale
    assert _fast_key(q, np.ones((4, 1, 64))) is None  # a host array as an operand


def test_tensors_that_require_grad_are_keyed_only_with_grad_mode_off(monkeypatch):
    """A parameter (requires_grad) is a plain operand under torch.no_grad(), as the full path
    takes it; with grad mode on its call is autograd's and forms no key. (CPU tensors stand in
    for CUDA ones: get_device answers 0.)"""
    torch = pytest.importorskip("torch")
    from cupyrope.core import arrays as array_info

    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    for kind in (torch.Tensor, torch.nn.Parameter):  # as the first sight of each type records
        monkeypatch.setitem(array_info.GPU_KINDS, kind, "torch")
    q, k = torch.zeros(4, 2, 64), torch.zeros(4, 1, 64)
    weight = torch.nn.Parameter(torch.ones(64))
    arrays = (q, k, None, None, None, None, weight, weight)
    options = (1e-6, 0.0, 10000.0, None, False, None, False, True, None, None, "head")
    assert recipes.fast_fused_key("rms_norm_rope", arrays, options) is None
    with torch.no_grad():
        keyed = recipes.fast_fused_key("rms_norm_rope", arrays, options)
        detached = recipes.fast_fused_key("rms_norm_rope", arrays[:6] + (weight.detach(),) * 2,
                                          options)
    assert keyed is not None and keyed[1] == detached[1]
    with torch.inference_mode():
        assert recipes.fast_fused_key("rms_norm_rope", arrays, options) == keyed
    q.requires_grad_(True)
    assert recipes.call_key(q, None, None, None, None, None,
                            (10000.0, None, False, None, False, False, None)) is None
    with torch.no_grad():
        assert recipes.call_key(q, None, None, None, None, None,
                                (10000.0, None, False, None, False, False, None)) is not None


def test_fused_replays_refuse_inference_tensors_they_would_write_outside_inference_mode():
    """A fused repeat call writes q and k (in place) and the caches: where one of them is an
    inference tensor and inference mode is off, torch would refuse the write, so the replay
    leaves the call to the full path (which raises torch's error) and launches nothing; absent
    caches and an out-of-place call's inputs are not written. (CPU tensors stand in for CUDA
    ones; the recipe records its launches.)"""
    torch = pytest.importorskip("torch")

    class Recipe:
        in_place_checks, torch, vector, out_dtype = (), True, False, None

        def __init__(self):
            self.launches = 0

        def launch(self, *args):
            self.launches += 1

    pointers = [0] * len(recipes.FUSED_OPERANDS)
    plain = [torch.zeros(2, 4, 8) for _ in range(4)]
    with torch.inference_mode():
        frozen = torch.zeros(2, 4, 8)
    cases = [  # (q, k, caches, inplace, replays)
        (plain[0], plain[1], None, True, True),
        (frozen, plain[1], None, True, False),
        (plain[0], frozen, None, True, False),
        (plain[0], None, None, True, True),
        (frozen, plain[1], None, False, True),  # out of place: q is only read
        (plain[0], plain[1], (plain[2], frozen), False, False),
        (plain[0], plain[1], (frozen, None), True, False),
        (plain[0], plain[1], (plain[2], None), True, True),
    ]
    for q, k, caches, inplace, replays in cases:
        recipe = Recipe()
        result = recipes.replay_fused(recipe, q, k, caches, pointers, inplace)
        assert (result is not None) is replays and recipe.launches == int(replays), (
            q is frozen, k is frozen, caches, inplace)
        with torch.inference_mode():  # inside, torch takes the writes
            assert recipes.replay_fused(recipe, q, k, caches, pointers, inplace) is not None
    versions = plain[0]._version, plain[1]._version
    recipes.replay_fused(Recipe(), plain[0], plain[1], None, pointers, True)
    assert (plain[0]._version, plain[1]._version) == (versions[0] + 1, versions[1] + 1)


@pytest.mark.parametrize("norm_over, inplace", [("head", True), ("head", False),
                                                ("all_heads", True)])
def test_rms_norm_rope_repeat_forms_the_public_functions_key(monkeypatch, norm_over, inplace):
    """``api.rms_norm_rope_repeat`` (a patched Hugging Face layer's repeat call) replays under
    exactly the fast key that ``rms_norm_rope`` forms for the same call, so it replays what that
    call kept and nothing else; none under torch.compile tracing. (CPU tensors stand in for CUDA
    ones: get_device answers 0; the replay is recorded, not run.)"""
    torch = pytest.importorskip("torch")
    from cupyrope import api, execute
    from cupyrope.core import arrays as array_info

    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    for kind in (torch.Tensor, torch.nn.Parameter):
        monkeypatch.setitem(array_info.GPU_KINDS, kind, "torch")
    replayed = []
    monkeypatch.setattr(execute, "replay_fast",
                        lambda found, *rest: replayed.append((found, rest)) or ("replayed",))
    q, k = torch.zeros(2, 3, 4, 64, dtype=torch.bfloat16), torch.zeros(2, 3, 2, 64,
                                                                       dtype=torch.bfloat16)
    cos, sin = torch.zeros(2, 3, 64, dtype=torch.bfloat16), torch.ones(2, 3, 64,
                                                                      dtype=torch.bfloat16)
    width = 64 if norm_over == "head" else 4 * 64
    q_weight = torch.nn.Parameter(torch.ones(width, dtype=torch.bfloat16))
    k_weight = torch.nn.Parameter(torch.ones(width // 2 if norm_over != "head" else width,
                                             dtype=torch.bfloat16))
    with torch.no_grad():
        public = api.rms_norm_rope(q, k, q_weight, k_weight, eps=1e-6, weight_offset=1.0,
                                   cos=cos, sin=sin, norm_over=norm_over, inplace=inplace)
        repeat = api.rms_norm_rope_repeat(q, k, q_weight, k_weight, 1e-6, 1.0, cos, sin,
                                          norm_over, inplace)
    assert public == repeat == ("replayed",)
    (public_key, public_rest), (repeat_key, repeat_rest) = replayed
    assert public_key == repeat_key and public_rest == repeat_rest
    # another eps, weight_offset or inplace is another key
    with torch.no_grad():
        api.rms_norm_rope_repeat(q, k, q_weight, k_weight, 1e-5, 1.0, cos, sin, norm_over,
                                 inplace)
        api.rms_norm_rope_repeat(q, k, q_weight, k_weight, 1e-6, 0.0, cos, sin, norm_over,
                                 inplace)
        api.rms_norm_rope_repeat(q, k, q_weight, k_weight, 1e-6, 1.0, cos, sin, norm_over,
                                 not inplace)
    assert len({found[0] for found, _ in replayed}) == 4
    monkeypatch.setattr(api, "_compiling", lambda: True)
    assert api.rms_norm_rope_repeat(q, k, q_weight, k_weight, 1e-6, 1.0, cos, sin, norm_over,
                                    inplace) is None
    assert len(replayed) == 5


# rerotate_cache's key: formed from its own arguments as given.


def _rerotate_key(cache, slots, delta, table=None, k_scale=None, *, theta=10000.0,
                  scaling=None, interleaved=False, rotary_dim=None, layout="NHD",
                  cache_dtype=None, seq_len=None):
    return recipes.rerotate_key((cache, slots, delta, table, k_scale),
                                (theta, scaling, interleaved, rotary_dim, layout, cache_dtype,
                                 seq_len))


def test_rerotate_keys_hold_every_operand_option_and_number():
    cache = _array((8, 16, 4, 128), (8192, 512, 128, 1))
    slots, delta = _array((40,), (1,)), _array((40,), (1,))
    table = _array((512, 128), (128, 1))
    base = _rerotate_key(cache, slots, delta, table)
    assert base is not None and len(base[1]) == len(recipes.REROTATE_OPERANDS)
    assert base[0] == _rerotate_key(cache, slots, delta, table)[0]
    others = [
        _rerotate_key(cache, slots, delta),  # computed angles
        _rerotate_key(cache, slots, delta, table, layout="HND"),
        _rerotate_key(cache, slots, delta, table, interleaved=True),
        _rerotate_key(cache, slots, delta, table, rotary_dim=64),
        _rerotate_key(cache, slots, delta, theta=500000.0),
        _rerotate_key(cache, slots, delta, theta=500000),  # the same value as an int
        _rerotate_key(cache, slots, delta, scaling={"rope_type": "linear", "factor": 2.0}),
        _rerotate_key(cache, slots, delta, scaling={"rope_type": "linear", "factor": 4.0}),
        _rerotate_key(cache, slots, delta, table, k_scale=0.25),
        _rerotate_key(cache, slots, delta, table, k_scale=0.5),
        _rerotate_key(cache, slots, delta, table, k_scale=1),  # an int scale: another type
        _rerotate_key(cache, slots, delta, table, k_scale=_array((), ())),
        _rerotate_key(cache, slots, delta, table, cache_dtype="float8_e4m3fn"),
        _rerotate_key(cache, slots, _array((40,), (2,)), table),  # a strided delta
        _rerotate_key(cache, slots, _array((1,), (1,)), table),  # one delta for every slot
        _rerotate_key(cache, _array((39,), (1,)), _array((39,), (1,)), table),
        _rerotate_key(cache, slots, 7, table),  # an int delta: by value
        _rerotate_key(cache, slots, 8, table),
        _rerotate_key(cache, slots, 7.0, table),  # refused by the full path: its own key
    ]
    keys = [base[0]] + [other[0] for other in others]
    assert len(set(keys)) == len(keys)
    # Pointers in REROTATE_OPERANDS order; numbers point at nothing.
    index = recipes.REROTATE_OPERANDS.index
    scaled = _rerotate_key(cache, slots, 7, table, k_scale=0.5)
    assert scaled[1][index("delta")] == 0 and scaled[1][index("k_scale")] == 0
    assert scaled[1][index("k_cache")] == base[1][index("k_cache")] != 0


def test_rerotate_keys_leave_every_call_the_full_path_must_see():
    import numpy as np

    cache = _array((8, 16, 4, 128), (8192, 512, 128, 1))
    slots = _array((40,), (1,))
    assert _rerotate_key(cache, slots, True) is None  # a bool delta: the full path refuses it
    assert _rerotate_key(cache, slots, "7") is None
    assert _rerotate_key(cache, slots, np.int64(7)) is None  # NumPy numbers: the full path
    assert _rerotate_key(cache, slots, np.arange(40)) is None  # a host array
    assert _rerotate_key(cache, slots, 7, k_scale="per_head") is None
    assert _rerotate_key(cache, slots, 7, k_scale=np.float32(0.5)) is None
    assert _rerotate_key(cache, slots, 7, cache_dtype=np.dtype("uint8")) is None  # a dtype
    assert _rerotate_key(cache, slots, 7, rotary_dim=[64]) is None  # not a plain option
    assert _rerotate_key(cache, slots, 7, scaling={"rope_type": ["x"], "f": {1}}) is None
    assert _rerotate_key(np.zeros((8, 16, 4, 128)), slots, 7) is None  # a host cache
