"""DeepSpeed's ``optimizer.bit16_groups_flat`` at ZeRO stages 1 and 2: the flat buffer of each param group that the
parameters are views of, where the parameters are, outside autograd, and following every step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerotune
from tests.harness import run_distributed


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_flat_buffers_are_the_parameters_storage(stage: int, dtype: str) -> None:
    run_distributed(_flat_buffers_checked, 1, stage, dtype)  # (initialize makes a process group: never in pytest's)


def _flat_buffers_checked(stage: int, dtype: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    config = {"train_batch_size": 1, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    engine, optimizer, _, _ = zerotune.initialize(model=model, config=config)
    flats = optimizer.bit16_groups_flat
    assert len(flats) == 1 and len(flats[:1]) == 1
    flat = flats[0]
    assert flat.device.type == "cpu" and flat.grad_fn is None and not flat.requires_grad
    assert flat.dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32)
    assert flat.numel() >= sum(p.numel() for p in engine.module.parameters())
    before = flat.clone()
    loss = engine(torch.randn(1, 4, dtype=flat.dtype)).float().sum()
    engine.backward(loss)
    engine.step()
    first = next(engine.module.parameters())
    assert not torch.equal(before, flats[0])  # the step updated the parameters through their flat storage
    assert torch.equal(flats[0][:first.numel()].view_as(first), first.detach())


def test_no_flat_buffers_without_zero_partitioning() -> None:
    run_distributed(_no_flat_buffers, 1)


def _no_flat_buffers() -> None:
    _, optimizer, _, _ = zerotune.initialize(model=nn.Linear(2, 2), config={
        "train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert not hasattr(optimizer, "bit16_groups_flat")
