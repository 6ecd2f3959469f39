"""The collective-sequence guard: ranks whose collectives diverge all stop with CollectiveMismatch, in
seconds, naming each rank's phase and last collectives -- before gloo pairs unrelated collectives (which
aborts the process, exchanges garbage or hangs for 30 minutes). Ranks started with different configs
stop at initialize, naming the key. Each injected fault below is one a real script makes."""

from __future__ import annotations

import time

import pytest
import torch

import zerotune
from tests.harness import run_distributed
from tests.models import make_mlp, mlp_batch
from zerotune.distributed.comm import CommError
from zerotune.distributed.guard import CollectiveGuard, CollectiveMismatch, setup_differences


def _engine(stage: int, gas: int = 1, **extra: object):
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "steps_per_print": 1000,
              "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              **extra}
    return zerotune.initialize(model=make_mlp(), config=config)[0]


def _micro_step(engine, index: int) -> None:
    engine.backward(engine(**mlp_batch(index, engine.global_rank, 2)))
    engine.step()


def _outcome(run) -> dict:
    """Run the faulty loop; what this rank raised and how long after the loop began."""
    started = time.monotonic()
    try:
        run()
    except CollectiveMismatch as error:
        return {"raised": "CollectiveMismatch", "message": str(error), "seconds": time.monotonic() - started}
    except CommError as error:
        return {"raised": "CommError", "message": str(error), "seconds": time.monotonic() - started}
    return {"raised": None, "message": "", "seconds": time.monotonic() - started}


def _skipped_micro_step(tmp: str) -> dict:
    """Rank 1 skips its fourth micro-batch (a `continue` on a bad sample), then both save a checkpoint."""
    engine = _engine(stage=1, gas=2)

    def run() -> None:
        for index in range(6):
            if engine.global_rank == 1 and index == 3:
                continue
            _micro_step(engine, index)
        engine.save_checkpoint(tmp)
    return _outcome(run)


def _extra_step(tmp: str, stage: int) -> dict:
    """The last rank runs one optimizer step more than the others, then all save a checkpoint."""
    engine = _engine(stage=stage)

    def run() -> None:
        for index in range(3 + (engine.global_rank == engine.world_size - 1)):
            _micro_step(engine, index)
        engine.save_checkpoint(tmp)
    return _outcome(run)


def _save_on_one_rank(tmp: str, interval: int = 1) -> dict:
    """`if rank == 0: engine.save_checkpoint(...)` -- DeepSpeed hangs; every rank must call it. ``interval``:
    micro-steps per guard exchange (more than one where exchanges cost over 1% of the time)."""
    engine = _engine(stage=0)
    engine.guards.guard.interval = interval

    def run() -> None:
        for index in range(4):
            _micro_step(engine, index)
            if index == 1 and engine.global_rank == 0:
                engine.save_checkpoint(tmp)
    return _outcome(run)


def _different_collectives_of_one_size() -> dict:
    """Rank 0 all-reduces 8 floats where rank 1 reduce-scatters 8: gloo pairs them silently (garbage); the
    next guard point stops both, naming both call sites."""
    engine = _engine(stage=2)

    def run() -> None:
        _micro_step(engine, 0)
        if engine.global_rank == 0:
            zerotune.comm.all_reduce(torch.ones(8))
        else:
            zerotune.comm.reduce_scatter_tensor(torch.zeros(4), torch.ones(8))
        _micro_step(engine, 1)
    return _outcome(run)


@pytest.mark.parametrize("fault", ["skipped micro-step", "extra step", "save_checkpoint on one rank",
                                   "save_checkpoint on one rank, one exchange per 2 micro-steps",
                                   "different collectives of one size"])
def test_diverging_ranks_all_raise_collective_mismatch_naming_each_ranks_phase(fault: str, tmp_path) -> None:
    if fault == "skipped micro-step":
        results = run_distributed(_skipped_micro_step, 2, str(tmp_path))
        expected = ["rank 0 is about to run backward (step 2, micro-step 5)",
                    "rank 1 is about to run save_checkpoint (step 2, micro-step 5)"]
    elif fault == "extra step":
        results = run_distributed(_extra_step, 2, str(tmp_path), 2)
        expected = ["rank 0 is about to run save_checkpoint (step 3, micro-step 3)",
                    "rank 1 is about to run backward (step 3, micro-step 3)"]
    elif fault.startswith("save_checkpoint on one rank"):
        results = run_distributed(_save_on_one_rank, 2, str(tmp_path), 2 if "2 micro-steps" in fault else 1)
        expected = ["rank 0 is about to run save_checkpoint (step 2, micro-step 2)",
                    "rank 1 is about to run backward (step 2, micro-step 2)"]
    else:
        results = run_distributed(_different_collectives_of_one_size, 2)
        expected = ["all_reduce float32 64 B at test_collective_guard.py:",
                    "reduce_scatter float32 32 B at test_collective_guard.py:"]
    for rank, result in enumerate(results):
        assert result["raised"] == "CollectiveMismatch", (rank, result)
        for line in expected:
            assert line in result["message"], (rank, result["message"])
        assert result["seconds"] < 10, result
    assert results[0]["message"] == results[1]["message"]  # every rank reaches the same verdict
    print(f"{fault}: every rank raised within {max(r['seconds'] for r in results):.2f} s of the loop's start\n"
          + results[0]["message"])


@pytest.mark.slow
def test_an_extra_stage3_step_on_one_of_four_ranks_stops_all_four(tmp_path) -> None:
    results = run_distributed(_extra_step, 4, str(tmp_path), 3, timeout=120)
    for rank, result in enumerate(results):
        assert result["raised"] == "CollectiveMismatch", (rank, result)
        assert "rank 3 is about to run forward (step 3, micro-step 3)" in result["message"]
        assert "rank 0 is about to run save_checkpoint (step 3, micro-step 3)" in result["message"]


def _started_with(key: str, values: list) -> str:
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2}}
    rank = torch.distributed.get_rank()
    section, name = key.split(".")
    config[section] = {**config[section], name: values[rank]}
    try:
        zerotune.initialize(model=make_mlp(), config=config)
    except CollectiveMismatch as error:
        return str(error)
    return "initialize did not raise"


@pytest.mark.parametrize("key, values", [("zero_optimization.reduce_bucket_size", [4096, 2048]),
                                         ("zero_optimization.stage", [2, 3])])
def test_ranks_started_with_different_configs_stop_at_initialize_naming_the_key(key: str, values: list) -> None:
    for message in run_distributed(_started_with, 2, key, values):
        assert "ranks were started with different configs" in message, message
        assert f"{key}: rank 0 has {values[0]!r}, rank 1 has {values[1]!r}" in message, message


def _different_models() -> str:
    model = make_mlp()
    if torch.distributed.get_rank() == 1:
        model.out = torch.nn.Linear(model.out.in_features, 5)
    try:
        zerotune.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2,
                                                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    except CollectiveMismatch as error:
        return str(error)
    return "initialize did not raise"


def test_ranks_with_different_models_stop_at_initialize_naming_the_parameter() -> None:
    for message in run_distributed(_different_models, 2):
        assert "out.weight (4, 16) float32" in message and "out.weight (5, 16) float32" in message, message


def _guard_off() -> dict:
    engine = _engine(stage=3, collective_guard=False)
    active = engine.guards.guard.active
    for index in range(2):
        _micro_step(engine, index)
    return {"active": active}


def test_collective_guard_false_turns_it_off() -> None:
    assert run_distributed(_guard_off, 2) == [{"active": False}] * 2


def test_the_verdict_depends_only_on_the_exchanged_rows() -> None:
    guard = CollectiveGuard()
    guard.rank = 0
    same = torch.stack([guard.vector("backward", 1, 2)] * 3)
    assert CollectiveGuard.disagreements(same) == []
    other_phase = same.clone()
    other_phase[2] = guard.vector("save_checkpoint", 1, 2)
    assert CollectiveGuard.disagreements(other_phase) == ["phase"]
    assert setup_differences([{"a": {"b": 1}, "c": 2}, {"a": {"b": 1}, "c": 3}]) == ["  c: rank 0 has 2, rank 1 has 3"]
    per_machine = [{"zero_optimization": {"offload_param": {"nvme_path": f"/local/{rank}"}}, "comm_timeout_s": rank,
                    "tensorboard": {"output_path": f"/logs/{rank}"}} for rank in range(2)]
    assert setup_differences(per_machine) == []  # swap and log paths, timeouts: each machine its own


def test_micro_steps_per_exchange_double_while_the_exchanges_cost_over_1_percent_and_halve_back() -> None:
    """Every rank decides at the same exchange from the same rows (each rank's cost share is in its row), so the
    ranks keep exchanging at the same micro-steps."""
    from zerotune.distributed.guard import COST, WINDOW

    guard = CollectiveGuard()

    def window(cost_ppm: list[int]) -> list[int]:
        rows = torch.stack([guard.vector("backward", 1, 2)] * len(cost_ppm))
        rows[:, COST] = torch.tensor(cost_ppm)
        assert CollectiveGuard.disagreements(rows) == []  # the cost column differs by rank and is not compared
        seen = []
        for _ in range(WINDOW):
            guard.adapt(rows)
            seen.append(guard.interval)
        return seen

    assert window([3000, 9000]) == [1] * WINDOW  # 0.9% on the costlier rank: within the 1% budget
    assert window([3000, 15000]) == [1] * (WINDOW - 1) + [2]  # 1.5%: decided at the window's last exchange
    assert window([20000, 100]) == [2] * (WINDOW - 1) + [4]
    assert window([5000, 100]) == [4] * WINDOW  # 0.5%: keeps the interval
    assert window([2000, 1000]) == [4] * (WINDOW - 1) + [2]  # under a quarter of the budget: halves
    for _ in range(8):
        window([0, 0])
    assert guard.interval == 1
    for _ in range(10):
        window([10**6, 0])
    assert guard.interval == 64  # at most
