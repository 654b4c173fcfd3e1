"""Repeated calls reuse a cached launch recipe: it must give the same answers as a first call."""

import numpy as np
import pytest

import cupyrope as cr
from reference import reference_rope
from tolerances import as_numpy, assert_rope_close

pytestmark = pytest.mark.gpu


@pytest.fixture
def torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


def _check(out, x, positions, cache, interleaved=False):
    ref = reference_rope(as_numpy(x), as_numpy(positions), cos_sin_cache=as_numpy(cache),
                         interleaved=interleaved)
    assert_rope_close(as_numpy(out), ref, as_numpy(x), interleaved=interleaved,
                      rotary_dim=x.shape[-1])


def test_repeated_calls_use_new_data_every_time(torch_cuda):
    torch = torch_cuda
    cache = cr.cos_sin_cache(4096, 128, like=torch.empty(1, device="cuda"))
    for _ in range(4):  # same layout each time: the second call on takes the cached recipe
        q = torch.randn(33, 8, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(33, 2, 128, device="cuda", dtype=torch.bfloat16)
        positions = torch.randint(0, 4096, (33,), device="cuda")
        q_out, k_out = cr.apply_rope(q, k, positions, cos_sin_cache=cache)
        _check(q_out, q, positions, cache)
        _check(k_out, k, positions, cache)


def test_layout_changes_are_not_served_from_the_cache(torch_cuda):
    torch = torch_cuda
    cache = cr.cos_sin_cache(4096, 64, like=torch.empty(1, device="cuda"))
    positions = torch.randint(0, 4096, (17,), device="cuda")
    base = torch.randn(17, 4, 65, device="cuda", dtype=torch.float32)
    aligned = base[..., :64]
    misaligned = base[..., 1:]  # same shape and strides, pointer off by 4 bytes: scalar path
    transposed = torch.randn(4, 17, 64, device="cuda").transpose(0, 1)  # other strides
    for q in (aligned, misaligned, transposed, aligned, misaligned, transposed):
        out = cr.apply_rope(q, positions=positions, cos_sin_cache=cache)
        _check(out, q, positions, cache)


def test_in_place_replay_writes_into_the_new_tensor(torch_cuda):
    torch = torch_cuda
    cache = cr.cos_sin_cache(1024, 64, like=torch.empty(1, device="cuda"))
    for _ in range(3):
        q = torch.randn(9, 4, 64, device="cuda", dtype=torch.float16)
        original = q.clone()
        positions = torch.randint(0, 1024, (9,), device="cuda", dtype=torch.int32)
        assert cr.apply_rope(q, positions=positions, cos_sin_cache=cache, inplace=True) is q
        _check(q, original, positions, cache)


def test_cached_layout_still_refuses_q_and_k_the_same_in_place(torch_cuda):
    torch = torch_cuda
    q = torch.randn(5, 2, 32, device="cuda")
    k = torch.randn(5, 2, 32, device="cuda")
    cr.apply_rope(q, k, inplace=True)  # caches the layout
    with pytest.raises(ValueError, match="same array"):
        cr.apply_rope(q, q, inplace=True)


def test_cached_layout_still_refuses_non_bool_flags(torch_cuda):
    torch = torch_cuda
    q = torch.randn(5, 2, 32, device="cuda")
    cr.apply_rope(q, interleaved=True)
    with pytest.raises(TypeError, match="interleaved"):
        cr.apply_rope(q, interleaved=1)


def test_cupy_repeats_and_other_streams():
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(7)
    cache = cr.cos_sin_cache(2048, 96, like=cupy.empty(1))
    stream = cupy.cuda.Stream(non_blocking=True)
    for use_stream in (False, True, False, True):
        q = cupy.asarray(rng.standard_normal((21, 3, 96)).astype(np.float32))
        positions = cupy.asarray(rng.integers(0, 2048, 21))
        if use_stream:
            cupy.cuda.get_current_stream().synchronize()  # inputs were written on another stream
            with stream:
                out = cr.apply_rope(q, positions=positions, cos_sin_cache=cache, interleaved=True)
            stream.synchronize()
        else:
            out = cr.apply_rope(q, positions=positions, cos_sin_cache=cache, interleaved=True)
        _check(out, q, positions, cache, interleaved=True)
