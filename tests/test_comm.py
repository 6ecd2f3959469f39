"""The collective layer: results on 2 and 4 gloo ranks, per-op byte counters, failures as CommError.

Every rank function resets the counters first: the pool's workers are reused across tests, so
they still hold whatever earlier tasks counted.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed
from zerotune.distributed import comm
from zerotune.distributed.comm import OpStats

WORLDS = [2, 4]


# ----------------------------------------------------------------------------- results


def _collective_results() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}

    summed = torch.arange(4, dtype=torch.float32) * (rank + 1)
    comm.all_reduce(summed, dist.group.WORLD)
    out["all_reduce"] = summed.tolist()

    largest = torch.tensor([float(rank), -float(rank)])
    comm.all_reduce(largest, dist.group.WORLD, op=comm.ReduceOp.MAX)
    out["all_reduce_max"] = largest.tolist()

    # Rank r contributes r + j at position j; this rank keeps chunk `rank` (2 elements) of the sum.
    scattered = torch.empty(2)
    comm.reduce_scatter_tensor(scattered, torch.arange(2 * world, dtype=torch.float32) + rank, dist.group.WORLD)
    out["reduce_scatter"] = scattered.tolist()

    gathered = torch.empty(3 * world)
    comm.all_gather_into_tensor(gathered, torch.full((3,), float(rank)), dist.group.WORLD)
    out["all_gather"] = gathered.tolist()

    sent = torch.full((2,), float(rank))
    comm.broadcast(sent, world - 1, dist.group.WORLD)
    out["broadcast_world"] = sent.tolist()

    # In a subgroup the source is an index inside the group, not a global rank.
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    mine = pairs[rank // 2]
    from_pair = torch.full((1,), 10.0 * rank)
    comm.broadcast(from_pair, 1, mine)
    out["broadcast_pair"] = from_pair.tolist()

    pending = torch.ones(5) * rank
    handle = comm.all_reduce(pending, mine, async_op=True)
    handle.wait()
    handle.wait()  # a second wait is harmless
    out["async_pair_sum"] = pending.tolist()

    out["objects"] = comm.all_gather_object({"rank": rank}, dist.group.WORLD)
    comm.barrier()
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_collective_results(world):
    per_rank = run_distributed(_collective_results, world)
    total = sum(r + 1 for r in range(world))
    for rank, out in enumerate(per_rank):
        assert out["all_reduce"] == [total * j for j in range(4)]
        assert out["all_reduce_max"] == [world - 1, 0.0]
        chunk = [world * (2 * rank + j) + sum(range(world)) for j in range(2)]
        assert out["reduce_scatter"] == chunk
        assert out["all_gather"] == [float(r) for r in range(world) for _ in range(3)]
        assert out["broadcast_world"] == [world - 1.0] * 2
        partner_hi = rank - rank % 2 + 1  # index 1 of this rank's pair
        assert out["broadcast_pair"] == [10.0 * partner_hi]
        assert out["async_pair_sum"] == [float(2 * partner_hi - 1)] * 5
        assert out["objects"] == [{"rank": r} for r in range(world)]


# ----------------------------------------------------------------------------- byte counters


def _counted_traffic() -> dict:
    world = dist.get_world_size()
    group = dist.group.WORLD
    comm.reset_comm_stats()
    before = comm.comm_stats()
    comm.all_reduce(torch.zeros(10), group)                                   # 2 x 40 bytes
    comm.all_reduce(torch.zeros(3, dtype=torch.float64), group, async_op=True).wait()  # 2 x 24 bytes
    comm.reduce_scatter_tensor(torch.empty(4), torch.zeros(4 * world), group)  # input: 16 * world bytes
    comm.all_gather_into_tensor(torch.empty(6 * world, dtype=torch.bfloat16),
                                torch.zeros(6, dtype=torch.bfloat16), group)   # output: 12 * world bytes
    comm.broadcast(torch.zeros(5, dtype=torch.int64), 0, group)                # 40 bytes
    comm.all_gather_object("not tensor traffic", group)
    stats = comm.comm_stats()
    total = comm.total_comm_bytes()
    stats["all_reduce"].calls = 999  # a snapshot: changing it must not touch the counters
    snapshot_is_copy = comm.comm_stats()["all_reduce"].calls == 2
    comm.reset_comm_stats()
    return {"before": before, "stats": stats, "total": total, "snapshot_is_copy": snapshot_is_copy,
            "after_reset": (comm.comm_stats(), comm.total_comm_bytes())}


@pytest.mark.parametrize("world", WORLDS)
def test_byte_counters(world):
    for out in run_distributed(_counted_traffic, world):
        assert out["before"] == {}
        stats = out["stats"]
        stats["all_reduce"].calls = 2  # undo the snapshot mutation before comparing
        assert stats == {
            "all_reduce": OpStats(calls=2, bytes=2 * (40 + 24)),
            "reduce_scatter": OpStats(calls=1, bytes=16 * world),
            "all_gather": OpStats(calls=1, bytes=12 * world),
            "broadcast": OpStats(calls=1, bytes=40),
        }
        assert out["total"] == 2 * (40 + 24) + 16 * world + 12 * world + 40
        assert out["snapshot_is_copy"]
        assert out["after_reset"] == ({}, 0)


def test_group_none_is_a_local_no_op_and_counts_nothing():
    """An axis of size 1: nothing to communicate, but outputs still hold this rank's data."""
    comm.reset_comm_stats()
    tensor = torch.arange(3.0)
    comm.all_reduce(tensor, None).wait()
    comm.all_reduce(tensor, None, async_op=True).wait()
    comm.broadcast(tensor, 0, None).wait()
    assert tensor.tolist() == [0.0, 1.0, 2.0]
    scattered = torch.empty(3)
    comm.reduce_scatter_tensor(scattered, torch.tensor([4.0, 5.0, 6.0]), None).wait()
    assert scattered.tolist() == [4.0, 5.0, 6.0]
    gathered = torch.empty(3)
    comm.all_gather_into_tensor(gathered, torch.tensor([7.0, 8.0, 9.0]), None).wait()
    assert gathered.tolist() == [7.0, 8.0, 9.0]
    assert comm.all_gather_object({"a": 1}, None) == [{"a": 1}]
    comm.barrier(None)  # no process group in this process: must not need one
    assert comm.comm_stats() == {}
    assert comm.total_comm_bytes() == 0


# ----------------------------------------------------------------------------- failures


def _diverging_rank() -> list[str]:
    """Rank 0 issues collectives rank 1 never joins; a 1 s group timeout turns the hang into an error."""
    short = timedelta(seconds=1)
    sync_group, async_group = dist.new_group([0, 1], timeout=short), dist.new_group([0, 1], timeout=short)
    if dist.get_rank() != 0:
        return []
    messages = []
    handle = comm.all_reduce(torch.ones(4), async_group, async_op=True)
    try:
        comm.all_reduce(torch.ones(4), sync_group)
    except comm.CommError as error:
        messages.append(str(error))
    try:
        handle.wait()
    except comm.CommError as error:
        messages.append(str(error))
    return messages


def test_a_collective_a_peer_never_joins_becomes_comm_error_naming_op_and_rank():
    messages, peer = run_distributed(_diverging_rank, 2, timeout=30)
    assert peer == []
    assert len(messages) == 2, messages
    for message in messages:
        assert message.startswith("all_reduce failed on global rank 0 (group of 2 ranks): ")
        assert "Another rank probably died, timed out or issued a different collective" in message


def _mismatched_shapes() -> dict:
    group = dist.new_group(list(range(dist.get_world_size())))
    errors = {}
    try:
        comm.reduce_scatter_tensor(torch.empty(3), torch.ones(4), group)  # needs 3 * world inputs
    except comm.CommError as error:
        errors["reduce_scatter"] = str(error)
    try:
        comm.all_gather_into_tensor(torch.empty(3), torch.ones(4), group)  # needs 4 * world outputs
    except comm.CommError as error:
        errors["all_gather"] = str(error)
    # Rejected before anything was sent: the group is still usable.
    still_works = torch.ones(2)
    comm.all_reduce(still_works, group)
    errors["after"] = still_works.tolist()
    return errors


def test_shape_errors_caught_at_launch_are_comm_errors():
    for rank, errors in enumerate(run_distributed(_mismatched_shapes, 2)):
        for op in ("reduce_scatter", "all_gather"):
            assert errors[op].startswith(f"{op} failed on global rank {rank} (group of 2 ranks): ")
        assert errors["after"] == [2.0, 2.0]
