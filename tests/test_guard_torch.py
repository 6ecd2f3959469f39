"""``guard_torch_distributed()``: a script's own ``torch.distributed`` collectives under the collective guard --
recorded with the script's call site, counted apart from zerotune's traffic, compared at the guard points --
and torch's functions put back afterwards. (A rank that skips one and stalls: tests/test_faults.py.)"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.harness import run_distributed
from tests.models import mlp_batch
from tests.test_collective_guard import _engine, _micro_step, _outcome
from zerotune.distributed.comm import comm_stats, reset_comm_stats
from zerotune.distributed.guard_torch import guard_torch_distributed


def _train(engine, steps: int) -> list[float]:
    """Micro-steps, each followed by the script's own all-reduce of its loss (an average for logging)."""
    losses = []
    for index in range(steps):
        loss = engine(**mlp_batch(index, engine.global_rank, 2))
        engine.backward(loss)
        engine.step()
        average = loss.detach().clone()
        dist.all_reduce(average)
        losses.append(average.item())
    return losses


def _own(stats: dict) -> dict:
    return {op: (s.calls, s.bytes) for op, s in stats.items() if not op.startswith("torch.distributed.")}


def _raw_collectives_recorded() -> dict:
    originals = (dist.all_reduce, dist.all_gather_object, dist.barrier)
    engine = _engine(stage=2)
    reset_comm_stats()
    _train(engine, 3)
    unguarded = _own(comm_stats())
    reset_comm_stats()
    with guard_torch_distributed():
        with guard_torch_distributed():  # nested: leaves the functions wrapped
            pass
        wrapped = dist.all_reduce is not originals[0]
        losses = _train(engine, 3)
        names: list = [None] * engine.world_size
        dist.all_gather_object(names, f"rank {engine.global_rank}")
        dist.barrier(async_op=True).wait()
    stats = comm_stats()
    recent = [entry[2] for _, _, entries, _ in engine.guards.guard.snapshot().values() for entry in entries]
    return {"wrapped": wrapped, "restored": (dist.all_reduce, dist.all_gather_object, dist.barrier) == originals,
            "raw": {op: (s.calls, s.bytes) for op, s in stats.items() if op.startswith("torch.distributed.")},
            "own": _own(stats), "own_unguarded": unguarded, "names": names, "losses": losses, "recent": recent}


def test_raw_collectives_are_recorded_counted_apart_and_torch_is_restored() -> None:
    results = run_distributed(_raw_collectives_recorded, 2)
    for result in results:
        assert result["wrapped"] and result["restored"]
        # three fp32 scalars all-reduced (twice their bytes, comm.py's convention), one object gather, one barrier
        assert result["raw"] == {"torch.distributed.all_reduce": (3, 24), "torch.distributed.all_gather_object": (1, 0),
                                 "torch.distributed.barrier": (1, 0)}, result["raw"]
        # zerotune's own collectives pass straight through: counted once, as without the wrappers
        assert result["own"] == result["own_unguarded"] and result["own"], result["own"]
        assert result["names"] == ["rank 0", "rank 1"]
        assert any(text.startswith("#") and "torch.distributed.barrier" in text and "test_guard_torch.py:" in text
                   for text in result["recent"]), result["recent"]
    assert results[0]["losses"] == results[1]["losses"]


def _same_sized_raw_collectives_from_different_lines() -> dict:
    """Rank 0 all-reduces a metric, rank 1 a different one of the same size from another line: gloo pairs them
    and sums unrelated numbers. Under the guard, the next micro-step stops both ranks."""
    engine = _engine(stage=0)
    guarded = guard_torch_distributed()

    def run() -> None:
        for index in range(4):
            _micro_step(engine, index)
            if index == 1:
                if engine.global_rank == 0:
                    dist.all_reduce(torch.ones(2))
                else:
                    dist.all_reduce(torch.zeros(2))
    try:
        return _outcome(run)
    finally:
        guarded.restore()


def test_same_sized_raw_collectives_from_different_lines_stop_every_rank_at_the_next_guard_point() -> None:
    results = run_distributed(_same_sized_raw_collectives_from_different_lines, 2)
    for result in results:
        assert result["raised"] == "CollectiveMismatch", result
        assert "torch.distributed.all_reduce float32 16 B at test_guard_torch.py:" in result["message"], result
        assert result["seconds"] < 10, result
