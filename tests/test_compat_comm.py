"""``zerotune.comm`` (``deepspeed.comm``): DeepSpeed's signatures on real gloo ranks, every call counted."""

from __future__ import annotations

import pytest
import torch

import zerotune.comm as dist
from tests.harness import run_distributed


def _collectives() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.reset_comm_stats()
    out: dict = {"rank": rank, "world": world, "local_rank": dist.get_local_rank(), "initialized": dist.is_initialized()}

    t = torch.full((3,), float(rank + 1))
    assert dist.all_reduce(t) is None  # group=None is the world; synchronous calls return None
    out["all_reduce"] = t.tolist()

    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out["max"] = t.tolist()

    t = torch.full((2,), float(rank))
    dist.broadcast(t, src=world - 1)  # src is a global rank
    out["broadcast"] = t.tolist()

    parts = [torch.empty(2) for _ in range(world)]
    dist.all_gather(parts, torch.full((2,), float(rank)))
    out["all_gather"] = [p.tolist() for p in parts]

    flat = torch.empty(2 * world)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank)))
    out["all_gather_into_tensor"] = flat.tolist()

    mine = torch.empty(2)
    dist.reduce_scatter_tensor(mine, torch.arange(2.0 * world))
    out["reduce_scatter_tensor"] = mine.tolist()

    t = torch.full((1,), float(rank + 1))
    dist.reduce(t, dst=0)
    out["reduce_on_0"] = t.tolist() if rank == 0 else None

    received = torch.empty(world)
    dist.all_to_all_single(received, torch.full((world,), float(rank)))
    out["all_to_all_single"] = received.tolist()

    gathered = [torch.empty(1) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((1,), float(rank)), gathered, dst=0)
    out["gather"] = [g.item() for g in gathered] if rank == 0 else None

    got = torch.empty(1)
    dist.scatter(got, [torch.full((1,), 10.0 + r) for r in range(world)] if rank == 0 else None, src=0)
    out["scatter"] = got.item()

    if rank == 0:
        dist.isend(torch.tensor([42.0]), dst=1).wait()
    elif rank == 1:
        box = torch.empty(1)
        dist.irecv(box, src=0).wait()
        out["p2p"] = box.item()

    handle = dist.all_reduce(torch.ones(1), async_op=True)
    handle.wait()
    out["async_completed"] = handle.is_completed()

    sub = dist.new_group([0, 1])
    out["sub_ranks"] = dist.get_all_ranks_from_group(sub)
    out["global_of_1"] = dist.get_global_rank(sub, 1)
    dist.barrier()
    dist.monitored_barrier()
    out["stats"] = {op: (s.calls, s.bytes) for op, s in dist.comm_stats().items()}
    return out


def test_deepspeed_comm_signatures_on_two_ranks() -> None:
    results = run_distributed(_collectives, 2)
    for rank, out in enumerate(results):
        assert out["rank"] == rank and out["world"] == 2 and out["initialized"]
        assert out["local_rank"] == rank
        assert out["all_reduce"] == [3.0] * 3 and out["max"] == [2.0, 2.0]
        assert out["broadcast"] == [1.0, 1.0]
        assert out["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert out["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
        assert out["reduce_scatter_tensor"] == ([0.0, 2.0] if rank == 0 else [4.0, 6.0])
        assert out["all_to_all_single"] == [0.0, 1.0]
        assert out["scatter"] == 10.0 + rank
        assert out["async_completed"] and out["sub_ranks"] == [0, 1] and out["global_of_1"] == 1
        # every call went through zerotune's counted layer (all_reduce counts 2 x bytes)
        assert out["stats"]["all_reduce"] == (3, 2 * (12 + 8 + 4))
        assert out["stats"]["broadcast"][0] == 1 and out["stats"]["all_gather"][0] == 2
    assert results[0]["reduce_on_0"] == [3.0] and results[0]["gather"] == [0.0, 1.0]
    assert results[1]["p2p"] == 42.0


def test_queries_before_initialization_answer_for_one_process() -> None:
    if not torch.distributed.is_initialized():  # the pytest process itself never joins a group
        assert (dist.get_rank(), dist.get_world_size(), dist.is_initialized()) == (0, 1, False)
        with pytest.raises(dist.CommError, match="not initialized: call zerotune.comm.init_distributed"):
            dist.all_reduce(torch.ones(1))
    assert dist.is_available()
    assert dist.has_all_gather_into_tensor() and dist.has_reduce_scatter_tensor()
