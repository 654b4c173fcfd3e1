"""DTensor (torch.distributed.tensor): q and k sharded over heads, or over a token dim with
positions / per-token tables sharded alike, rotate shard-locally — no collective at all — and
give the single-process result bit for bit, out of place, in place, under autograd and under
torch.compile; other placements are redistributed out of place and still right, and refused in
place.

Two CPU processes on the gloo backend (CI has no GPU), and two GPUs on NCCL where a machine has
them; every case runs in both ranks and compares with the same call on plain tensors. Collectives
are counted with DTensor's CommDebugMode.
"""

from __future__ import annotations

import os
import socket
import traceback

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cases(device):
    """name -> (q, k, call kwargs, [(array name, placement)], collectives expected (None: any))."""
    from torch.distributed.tensor import Replicate, Shard

    g = torch.Generator().manual_seed(0)
    T, HQ, HK, D, MAX = 6, 4, 2, 16, 64

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(device)

    def randint(high, shape):
        return torch.randint(0, high, shape, generator=g).to(device)

    import cupyrope as cr

    q, k = randn(T, HQ, D), randn(T, HK, D)
    positions = randint(MAX, (T,))
    cache = cr.cos_sin_cache(MAX, D, dtype="float32", like=q)
    cos, sin = randn(T, D // 2), randn(T, D // 2)
    qb, kb = randn(2, T, HQ, D), randn(2, T, HK, D)
    positions_bs = randint(MAX, (2, T))
    R = Replicate()
    return {
        # tensor parallel: heads
        "heads_cache": (q, k, dict(positions=positions, cos_sin_cache=cache),
                        dict(q=Shard(1), k=Shard(1), positions=R, cos_sin_cache=R), 0),
        "heads_computed": (q, k, dict(positions=positions, theta=500000.0),
                           dict(q=Shard(1), k=Shard(1), positions=R), 0),
        # sequence parallel: tokens, positions alike
        "tokens_cache": (q, k, dict(positions=positions, cos_sin_cache=cache),
                         dict(q=Shard(0), k=Shard(0), positions=Shard(0), cos_sin_cache=R), 0),
        "tokens_tables": (q, k, dict(cos=cos, sin=sin),
                          dict(q=Shard(0), k=Shard(0), cos=Shard(0), sin=Shard(0)), 0),
        # context parallel: [B, S, H, D] over S, positions [B, S] alike
        "context_parallel": (qb, kb, dict(positions=positions_bs, theta=10000.0),
                             dict(q=Shard(1), k=Shard(1), positions=Shard(1)), 0),
        # implicit positions (an arange along the sharded axis): gathered, still right
        "implicit_positions_tokens": (q, k, dict(theta=10000.0), dict(q=Shard(0), k=Shard(0)),
                                      None),
        # head_dim sharded: redistributed, still right
        "head_dim_sharded": (q, k, dict(positions=positions, cos_sin_cache=cache),
                             dict(q=Shard(2), k=Shard(2), positions=R, cos_sin_cache=R), None),
    }


def _distribute(mesh, x, placement):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(x, mesh, [placement])


def _check_case(mesh, name, case) -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    import cupyrope as cr

    q, k, kwargs, placements, collectives = case
    expected_q, expected_k = cr.apply_rope(q, k, **kwargs)
    args = {"q": q, "k": k, **kwargs}
    dist_args = {n: _distribute(mesh, v, placements[n]) if n in placements else v
                 for n, v in args.items()}
    dq, dk = dist_args.pop("q"), dist_args.pop("k")

    with CommDebugMode() as comm:
        q_out, k_out = cr.apply_rope(dq, dk, **dist_args)
    assert isinstance(q_out, DTensor) and isinstance(k_out, DTensor), name
    if collectives is not None:
        assert comm.get_total_counts() == collectives, (name, comm.get_comm_counts())
        assert q_out.placements == (placements["q"],), (name, q_out.placements)
    assert torch.equal(q_out.full_tensor(), expected_q), name
    assert torch.equal(k_out.full_tensor(), expected_k), name

    # In place: the local shards are rotated, the placements kept; a layout that needs
    # redistributing cannot be written in place, and DTensor says so before anything is written.
    dq2, dk2 = _distribute(mesh, q, placements["q"]), _distribute(mesh, k, placements["k"])
    if collectives is None:
        try:
            cr.apply_rope(dq2, dk2, **dist_args, inplace=True)
        except RuntimeError as exc:
            assert "in-place operations that require placement changes" in str(exc), (name, exc)
        else:
            raise AssertionError(f"{name}: in place on a layout that needs redistributing ran")
        assert torch.equal(dq2.full_tensor(), q) and torch.equal(dk2.full_tensor(), k), name
    else:
        result = cr.apply_rope(dq2, dk2, **dist_args, inplace=True)
        assert result[0] is dq2 and result[1] is dk2, name
        assert dq2.placements == (placements["q"],), name
        assert torch.equal(dq2.full_tensor(), expected_q), name
        assert torch.equal(dk2.full_tensor(), expected_k), name

    # Autograd: the gradient is the inverse rotation, placed as q.
    leaf = q.clone().requires_grad_(True)
    weight = torch.linspace(-1.0, 1.0, q.numel(), device=q.device).reshape(q.shape)
    (cr.apply_rope(leaf, None, **kwargs) * weight).sum().backward()
    dleaf = _distribute(mesh, q, placements["q"]).detach().requires_grad_(True)
    dweight = _distribute(mesh, weight, placements["q"])
    (cr.apply_rope(dleaf, None, **dist_args) * dweight).sum().backward()
    assert torch.allclose(dleaf.grad.full_tensor(), leaf.grad, rtol=0, atol=1e-6), name


def _check_fused(mesh, device) -> None:
    """rms_norm_rope over heads and over tokens, fp8 outputs over heads: shard-local (weights and
    scales replicated), bit-identical to the single-process call."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    import cupyrope as cr

    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(6, 4, 16, generator=g), torch.randn(6, 2, 16, generator=g)
    weight = torch.rand(16, generator=g) + 0.5
    positions = torch.randint(0, 64, (6,), generator=g)
    q, k, weight, positions = (x.to(device) for x in (q, k, weight, positions))
    cache = cr.cos_sin_cache(64, 16, dtype="float32", like=q)
    R = Replicate()
    calls = {
        "rms_norm_rope": lambda q, k, w, p, c: cr.rms_norm_rope(q, k, w, w, p, eps=1e-6,
                                                                cos_sin_cache=c),
        "fp8_out": lambda q, k, w, p, c: cr.apply_rope(q, k, p, cos_sin_cache=c,
                                                       out_dtype="float8_e4m3fn", q_scale=0.5,
                                                       k_scale=0.25),
    }
    layouts = {"heads": (Shard(1), R), "tokens": (Shard(0), Shard(0))}
    for op, call in calls.items():
        expected = call(q, k, weight, positions, cache)
        for layout, (qk_place, positions_place) in layouts.items():
            if op == "fp8_out" and layout == "tokens":
                continue
            name = f"{op} over {layout}"
            args = (_distribute(mesh, q, qk_place), _distribute(mesh, k, qk_place),
                    _distribute(mesh, weight, R), _distribute(mesh, positions, positions_place),
                    _distribute(mesh, cache, R))
            with CommDebugMode() as comm:
                result = call(*args)
            assert comm.get_total_counts() == 0, (name, comm.get_comm_counts())
            for out, want in zip(result, expected):
                assert isinstance(out, DTensor) and out.placements == (qk_place,), name
                # Each rank's shard against its chunk of the single-process result, as bits
                # (gloo cannot gather fp8).
                local, chunk = out.to_local(), want.chunk(WORLD, qk_place.dim)[dist.get_rank()]
                assert local.dtype == want.dtype and local.shape == chunk.shape, name
                assert torch.equal(local.view(torch.uint8), chunk.view(torch.uint8)), name


def _check_compiled(mesh, device) -> None:
    """torch.compile(fullgraph=True) of a function that rotates DTensors: one graph, the same
    placements and bits as eager (aot_eager: Inductor's CPU code generation needs a compiler)."""
    from torch.distributed.tensor import Replicate, Shard

    import cupyrope as cr

    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(6, 4, 16, generator=g), torch.randn(6, 2, 16, generator=g)
    positions = torch.randint(0, 64, (6,), generator=g)
    q, k, positions = (x.to(device) for x in (q, k, positions))
    cache = cr.cos_sin_cache(64, 16, dtype="float32", like=q)
    expected = cr.apply_rope(q, k, positions, cos_sin_cache=cache)
    step = torch.compile(lambda q, k, p, c: cr.apply_rope(q, k, p, cos_sin_cache=c),
                         fullgraph=True, backend="aot_eager")
    for place, positions_place in ((Shard(1), Replicate()), (Shard(0), Shard(0))):
        out = step(_distribute(mesh, q, place), _distribute(mesh, k, place),
                   _distribute(mesh, positions, positions_place),
                   _distribute(mesh, cache, Replicate()))
        for got, want in zip(out, expected):
            assert got.placements == (place,), (place, got.placements)
            assert torch.equal(got.full_tensor(), want), place


def _worker(rank: int, port: int, backend: str, errors) -> None:
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        device_type = "cuda" if backend == "nccl" else "cpu"
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (WORLD,))
        for name, case in _cases(device).items():
            _check_case(mesh, name, case)
        _check_fused(mesh, device)
        _check_compiled(mesh, device)
        dist.destroy_process_group()
    except BaseException:  # reported by the parent, with the rank
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


def test_dtensor_rotation_is_shard_local_and_exact():
    _run_ranks("gloo")


@pytest.mark.gpu
def test_dtensor_on_two_gpus_over_nccl():
    """The same cases with the shards on two GPUs (the CUDA kernels, NCCL for what redistributes)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA GPUs")
    if not dist.is_nccl_available():
        pytest.skip("torch.distributed without NCCL")
    _run_ranks("nccl")


def _run_ranks(backend: str) -> None:
    context = mp.get_context("spawn")
    errors = context.SimpleQueue()
    port = _free_port()
    processes = [context.Process(target=_worker, args=(rank, port, backend, errors))
                 for rank in range(WORLD)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=240)
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.kill()
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    assert not alive, "a rank hung"
    assert not messages, "\n".join(messages)
    assert all(p.exitcode == 0 for p in processes), [p.exitcode for p in processes]
