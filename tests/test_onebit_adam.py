"""DeepSpeed's OneBitAdam: dense Adam during the warm-up, then 1-bit momentum averaging.

Warm-up steps reproduce the single-process optimizer (fp32, 1e-5); after ``freeze_step`` the
gradient all-reduce stops, the momentum travels as sign bits (~1/32 of its fp32 bytes), weights
stay identical on every rank and the loss keeps falling; error buffers resume bit-identically.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerotune
from tests.harness import run_distributed
from tests.models import (assert_close_traces, engine_run, gpt2_batch, gpt2_traces_across_resume, make_gpt2,
                          reference_run)
from zerotune.distributed import comm
from zerotune.optim.onebit_adam import OneBitAdam, compressed_allreduce, pack_signs, unpack_signs


def test_sign_bits_round_trip():
    x = torch.randn(64)
    assert torch.equal(unpack_signs(pack_signs(x >= 0)), (x >= 0).float() * 2 - 1)
    assert pack_signs(x >= 0).numel() == 8


def test_step_evaluates_the_closure_and_returns_its_loss():
    """torch's optimizer contract (and DeepSpeed's OnebitAdam): ``step(closure)`` re-evaluates the model with
    gradients on and returns the closure's loss."""
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = OneBitAdam([weight], lr=0.1)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = (weight ** 2).sum()
        loss.backward()
        return loss

    assert optimizer.step(closure).item() == 3.0
    assert bool((weight < 1).all())
    assert optimizer.step() is None


def _repeated_allreduce() -> tuple[list[float], list[float]]:
    """The same per-rank vector averaged 200 times: error feedback makes the running mean converge."""
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(50, generator=generator)
    worker, server = torch.zeros(64), torch.zeros(64 // world)  # padded to a multiple of 8 x world
    total = torch.zeros(50)
    for _ in range(200):
        total += compressed_allreduce(x, worker, server, dist.group.WORLD)
    mean = x.clone()
    dist.all_reduce(mean)
    return (total / 200).tolist(), (mean / world).tolist()


def test_compressed_allreduce_averages_and_error_feedback_removes_the_bias():
    results = run_distributed(_repeated_allreduce, 2, timeout=60)
    assert results[0][0] == results[1][0]  # every rank gets the same average
    running, exact = torch.tensor(results[0][0]), torch.tensor(results[0][1])
    assert (running - exact).norm() <= 0.05 * exact.norm()


LR = 1e-3  # no bias correction (as DeepSpeed's): the first updates are ~3x lr per element, then a short warm-up
           # leaves a small frozen variance; 1e-3 keeps a 5-step warm-up stable on this tiny model


def _config(freeze_step: int, stage: int = 0) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "OneBitAdam", "params": {"lr": LR, "freeze_step": freeze_step, "weight_decay": 0.01,
                                                           "cuda_aware": False, "comm_backend_name": "nccl"}}}


def _fixed_batch(step: int, micro: int, rows: int) -> dict:
    return gpt2_batch(0, micro, rows)  # one batch, memorised: a loss that must keep falling


def _run(freeze_step: int, steps: int, batches=gpt2_batch):
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=_config(freeze_step))
    comm.reset_comm_stats()
    trace = engine_run(engine, batches, steps=steps, gas=2, global_rows=4)
    flat = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    stats = {op: s.bytes for op, s in comm.comm_stats().items()}
    return trace, flat, stats


def test_warm_up_steps_match_the_single_process_optimizer():
    model = make_gpt2()
    expected = reference_run(model, OneBitAdam(model.parameters(), lr=LR, weight_decay=0.01, freeze_step=100),
                             gpt2_batch, steps=6, gas=2, global_rows=4, clip=0.0)
    for trace, _, _ in run_distributed(_run, 2, 100, 6, timeout=120):
        assert_close_traces(trace, expected, rel=1e-5)


def test_after_freeze_step_momentum_goes_as_signs_and_ranks_stay_identical():
    (dense, _, dense_stats), _ = run_distributed(_run, 2, 100, 16, _fixed_batch, timeout=120)
    (trace, flat0, stats), (_, flat1, _) = run_distributed(_run, 2, 5, 16, _fixed_batch, timeout=120)
    assert torch.equal(flat0, flat1)
    assert trace.losses[-1] < 0.7 * trace.losses[5]  # still learning after the switch at step 5 ...
    assert trace.losses[-1] <= 1.1 * dense.losses[-1]  # ... about as well as without compression
    # 5 dense steps, then 11 steps of 1-bit momentum: the gradient all-reduce stops, signs are ~1/32 of fp32
    assert stats["all_reduce"] <= dense_stats["all_reduce"] * 5 / 16 * 1.01
    assert stats["all_to_all"] <= dense_stats["all_reduce"] / 2 * 11 / 16 / 32 * 1.2


def _resume(directory: str) -> tuple[list, list]:
    return gpt2_traces_across_resume(_config(2), directory, warm_steps=4)


def test_error_buffers_resume_bit_identically(tmp_path):
    for first, second in run_distributed(_resume, 2, str(tmp_path), timeout=120):
        assert first == second


def _with_zero1() -> str:
    try:
        zerotune.initialize(model=make_gpt2(), config=_config(2, stage=1))
    except Exception as error:  # noqa: BLE001 - the message is what is tested
        return str(error)
    return "no error"


@pytest.mark.parametrize("world", [2])
def test_zero_stage_1_is_refused_naming_the_optimizer(world):
    for message in run_distributed(_with_zero1, world, timeout=60):
        assert "optimizer.type" in message and "OneBitAdam needs ZeRO stage 0" in message
