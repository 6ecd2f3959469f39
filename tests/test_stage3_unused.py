"""ZeRO-3 with parameters that some ranks do not use: a data-dependent branch, a branch one rank skips, a
module no rank uses. Every rank issues the same gathers and reduce-scatters whatever its data did, so the
run never hangs, and it reproduces single-process PyTorch (an unused parameter adds a zero gradient on
that rank) at 2 and 4 ranks."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerotune
from tests.harness import run_distributed
from tests.models import Trace, assert_close_traces

STEPS, ROWS, WIDTH = 6, 8, 16


class Branchy(nn.Module):
    """``branch`` runs only where the batch says so; ``never`` is used by no rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, WIDTH)
        self.branch = nn.Linear(WIDTH, WIDTH)
        self.never = nn.Linear(WIDTH, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor, use_branch: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if bool(use_branch.any()):
            h = h + torch.tanh(self.branch(h))
        h = torch.tanh(self.mid(h))
        return nn.functional.mse_loss(self.out(h), y)


def _batch(step: int, rank: int, world: int, rule: str) -> dict:
    generator = torch.Generator().manual_seed(100 * step + rank)
    rows = ROWS // world
    x, y = torch.randn(rows, 8, generator=generator), torch.randn(rows, 4, generator=generator)
    use = {"data": bool(x[0, 0] > 0), "rank0-only": rank == 0, "nobody": False}[rule]
    return {"x": x, "y": y, "use_branch": torch.tensor([use])}


def _reference(world: int, rule: str) -> Trace:
    model = Branchy()
    for param in model.parameters():  # an unused parameter gets a zero gradient (and is stepped), as in ZeRO
        param.grad = torch.zeros_like(param)
    return _reference_trace(model, world, lambda step, rank: _batch(step, rank, world, rule))


def _reference_trace(model: nn.Module, world: int, batch_of: Callable[[int, int], dict]) -> Trace:
    """Single-process PyTorch: each step the data-parallel mean over the ranks' slices, then AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for rank in range(world):  # each rank's slice (with its own branch decision, where there is one)
            loss = model(**batch_of(step, rank))
            (loss / world).backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        losses.append(total / world)
    return Trace(losses, norms)


def _zero3_run(rule: str, prefetch: int) -> Trace:
    world = dist.get_world_size()
    engine, trace = _zero3_trace(Branchy(), {"stage3_prefetch_bucket_size": prefetch},
                                 lambda step, rank: _batch(step, rank, world, rule))
    engine.destroy()
    return trace


def _zero3_trace(model: nn.Module, zero: dict, batch_of: Callable[[int, int], dict]) -> tuple[Any, Trace]:
    """The same steps on this rank's slices under ZeRO-3 (AdamW, every unit partitioned); the engine is returned
    for a last look (its caller destroys it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": ROWS // world, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}
    engine, *_ = zerotune.initialize(model=model, config=config)
    losses, norms = [], []
    for step in range(STEPS):
        loss = engine(**batch_of(step, rank))
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        norms.append(engine.get_global_grad_norm())
    return engine, Trace(losses, norms)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("rule", ["data", "rank0-only", "nobody"])
def test_zero3_with_parameters_unused_on_some_ranks_matches_single_process(world: int, rule: str) -> None:
    expected = _reference(world, rule)
    for prefetch in (0, 10**6):
        for trace in run_distributed(_zero3_run, world, rule, prefetch, timeout=60):
            assert_close_traces(trace, expected, rel=1e-5)


class ReturnsItsBias(nn.Linear):
    """Returns its own bias for the caller to use after this module's forward (DeepSpeed's "dangling" parameter)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return nn.functional.linear(x, self.weight), self.bias


class Dangling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, WIDTH)
        self.dangler = ReturnsItsBias(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, bias = self.dangler(torch.tanh(self.inp(x)))
        h = torch.tanh(h * bias + bias)  # the value of bias is needed in backward too
        return nn.functional.mse_loss(self.out(h), y)


def _dangling_batch(step: int, rank: int, world: int) -> dict:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return {"x": torch.randn(ROWS // world, 8, generator=generator),
            "y": torch.randn(ROWS // world, 4, generator=generator)}


def _dangling_reference(world: int) -> Trace:
    return _reference_trace(Dangling(), world, lambda step, rank: _dangling_batch(step, rank, world))


def _dangling_zero3_run() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    engine, trace = _zero3_trace(Dangling(), {}, lambda step, r: _dangling_batch(step, r, world))
    with torch.no_grad():  # an evaluation forward: the held unit is released at its end
        engine(**_dangling_batch(0, rank, world))
    released = engine.module.dangler.bias.ds_status.name
    engine.destroy()
    return {"trace": trace, "after_eval": released}


def test_zero3_keeps_a_returned_parameter_gathered_for_its_caller() -> None:
    # DanglingBias in DeepSpeed's test_zero_context_return: used after its module's forward, it must hold values
    expected = _dangling_reference(2)
    for result in run_distributed(_dangling_zero3_run, 2, timeout=60):
        assert_close_traces(result["trace"], expected, rel=1e-5)
        assert result["after_eval"] == "NOT_AVAILABLE"
