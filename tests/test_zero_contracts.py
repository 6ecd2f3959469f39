"""The stage contract (``zerotune/zero/contracts.py``) is the only way into a ZeRO stage: every stage is a
``ZeroStage`` whose private gradient sync and master placement provide their protocols, every stage trains to
the single-process result driven through the contract's methods alone, and an engine runs on a fake stage
that knows nothing of zerotune's own (so the engine needs nothing beyond the contract)."""

from __future__ import annotations

import importlib
from typing import Any, Sequence

import pytest
import torch
import torch.distributed as dist

import zerotune
from tests.harness import run_distributed
from tests.models import (assert_close_traces, engine_run, loss_of, make_mlp, mlp_batch, mlp_param_groups,
                          make_gpt2, rank_slice, reference_run, Trace)
from zerotune.offload.master_placement import MasterPlacement as HostPlacement
from zerotune.offload.nvme_optimizer import NvmePlacement
from zerotune.zero.contracts import GradSync, MasterPlacement, TiedWeight, ZeroStage
from zerotune.zero.pieces import HeldPiece


def test_placements_provide_the_placement_contract() -> None:
    assert isinstance(HostPlacement(), MasterPlacement)
    for name in ("read_master", "write_master", "optimizer_params", "attach", "step"):
        assert callable(getattr(NvmePlacement, name))


def _contracts(stage: int) -> dict:
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=config)
    state = engine.state
    covered = [sum(piece.length for piece in pieces) for pieces in state.master_pieces()]
    real = [sum(piece.length for pieces in state.master_pieces() for piece in pieces)]
    trainable = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in state.params)
    result = {"state": isinstance(state, ZeroStage), "sync": isinstance(state._grad_sync, GradSync),
              "placement": isinstance(state._placement, MasterPlacement),
              "pieces_fit": all(c <= m.numel() for c, m in zip(covered, state.masters)),
              "held": real[0], "trainable": trainable, "units": len(state.units),
              "answers": (state.partitions_weights, state.shards_masters, state.reduces_every_backward)}
    engine.destroy()
    return result


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_provides_the_contracts_and_its_pieces_cover_the_model(stage: int) -> None:
    ranks = run_distributed(_contracts, 2, stage)
    for result in ranks:
        assert result["state"] and result["sync"] and result["placement"] and result["pieces_fit"]
        assert (result["units"] > 0) == (stage == 3)
        assert result["answers"] == (stage == 3, stage >= 1, stage >= 2)
    held = [r["held"] for r in ranks]
    # stage 0 replicates (each rank holds everything); stages 1-3 split the trainable elements exactly
    assert held == [ranks[0]["trainable"]] * 2 if stage == 0 else sum(held) == ranks[0]["trainable"]


STEPS, GAS, ROWS = 3, 2, 8
ADAMW = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}


def _through_the_contract(stage: int) -> Trace:
    """Train with the stage's contract methods only: the engine assembles it and is then left alone."""
    engine, optimizer, *_ = zerotune.initialize(model=make_mlp(), config={
        "train_micro_batch_size_per_gpu": ROWS // 2,
        "gradient_accumulation_steps": GAS, "zero_optimization": {"stage": stage}, "optimizer": ADAMW})
    state, model = engine.state, engine.module
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, norms = [], []
    for step in range(STEPS):
        total = torch.zeros(())
        for micro in range(GAS):
            state.begin_micro_step(micro == GAS - 1)
            loss = loss_of(model, rank_slice(mlp_batch(step, micro, ROWS), rank, world))
            (loss / GAS).backward()
            total += loss.detach()
        state.finish()
        grads = state.step_grads()
        norms.append(state.grad_norm(grads))
        state.step(optimizer, grads, 1.0)
        state.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / GAS / world)
    engine.destroy()
    return Trace(losses, norms)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_stage_trains_to_the_pytorch_result_through_the_contract_alone(stage: int) -> None:
    model = make_mlp()
    reference = reference_run(model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0), mlp_batch,
                              steps=STEPS, gas=GAS, global_rows=ROWS, clip=0.0)
    for trace in run_distributed(_through_the_contract, 2, stage):
        assert_close_traces(trace, reference, rel=1e-5)


class _LocalSync:
    """A gradient sync that communicates nothing: the gradients stay in ``param.grad``."""

    reduces_every_backward = False

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = list(params)

    def begin_micro_step(self, is_boundary: bool) -> None: ...
    def finish(self, ties: Sequence[TiedWeight] = ()) -> None: ...
    def settle(self) -> None: ...
    def whole_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None: return param.grad
    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
    def grad_bytes(self) -> int: return 0
    def buffer_bytes(self) -> int: return 0
    def remove_hooks(self) -> None: ...


class _OptimizerStep:
    """A placement that steps the optimizer on the parameters themselves."""

    resident, streams_grads = True, False

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()


class FakeStage(ZeroStage):
    """One process, the parameters are the masters, nothing partitioned: the least a stage can be."""

    def __init__(self, trainable: Sequence[torch.nn.Parameter]) -> None:
        self._params = list(trainable)
        self.masters = self._params
        self._grad_sync = _LocalSync(self._params)
        self._placement = _OptimizerStep()  # type: ignore[assignment]
        self.steps = 0

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self._params

    def optimizer_groups(self, groups: Sequence[dict]) -> list[dict]:
        return [dict(group) for group in groups]

    def step_grads(self) -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]

    master_grads = step_grads

    def write_weight(self, param: torch.nn.Parameter, lo: int, values: torch.Tensor) -> None:
        with torch.no_grad():
            param.view(-1)[lo:lo + values.numel()] = values

    def fragment_values(self, param: Any, optimizer: Any, key: str | None = None, *, full: bool) -> Any:
        return param.detach() if key is None else optimizer.state[param][key]

    def set_fragment_values(self, param: Any, optimizer: Any, value: torch.Tensor, key: str | None = None, *,
                            full: bool) -> None:
        raise NotImplementedError

    def fragment_grad(self, param: torch.nn.Parameter, *, full: bool) -> torch.Tensor | None:
        return param.grad

    def set_fragment_grad(self, param: torch.nn.Parameter, value: torch.Tensor, *, full: bool) -> None:
        param.grad = value

    def grad_norm(self, grads: Sequence[torch.Tensor]) -> float:
        return torch.nn.utils.get_total_norm(grads).item()

    def attach(self, grads: Sequence[torch.Tensor], coefficient: float = 1.0) -> None:
        for param, grad in zip(self._params, grads):
            param.grad = grad * coefficient
        self.steps += 1

    def update_model(self) -> None: ...
    def reload_from_model(self) -> None: ...
    def first_nonfinite_param(self, names: dict[int, str]) -> str: return "<none found>"
    def master_bytes(self) -> int: return 0
    def partitioned_param_bytes(self) -> int: return 0

    def zero_grad(self) -> None:
        self._grad_sync.zero_grad()

    def master_pieces(self) -> list[list[HeldPiece]]:
        return [[HeldPiece(p, 0, 0, p.numel())] for p in self._params]

    def weight_pieces(self) -> list:
        return []

    def state_dict(self, optimizer: Any, names: dict[int, str], *, weights: bool, masters: bool) -> dict:
        raise NotImplementedError

    def load_state_dict(self, source: Any, optimizer: Any, names: dict[int, str], *, weights: bool = True,
                        skip: set[str] = frozenset()) -> None:
        raise NotImplementedError


def test_an_incomplete_stage_cannot_be_built() -> None:
    class NoNorm(FakeStage):
        grad_norm = ZeroStage.grad_norm  # (abstract again)

    with pytest.raises(TypeError, match="grad_norm"):
        NoNorm([])


def _engine_on_a_fake_stage() -> dict:
    initialize_module = importlib.import_module("zerotune.initialize_phases")
    built: list[FakeStage] = []

    def build_fake(cfg: Any, groups: Any, trainable: Sequence[torch.nn.Parameter], *args: Any, **kwargs: Any):
        built.append(FakeStage(trainable))
        return built[0]

    real = initialize_module.build_zero_state
    initialize_module.build_zero_state = build_fake
    try:
        model = make_mlp()
        engine, *_ = zerotune.initialize(model=model, model_parameters=mlp_param_groups(model), config={
            "train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
            "optimizer": ADAMW})
    finally:  # the pool worker runs later tests: they must build real stages
        initialize_module.build_zero_state = real
    trace = engine_run(engine, mlp_batch, steps=STEPS, gas=GAS, global_rows=ROWS)
    engine.destroy()
    return {"trace": trace, "steps": built[0].steps, "is_state": engine.state is built[0]}


def test_an_engine_runs_on_a_fake_stage_through_the_contract() -> None:
    result = run_distributed(_engine_on_a_fake_stage, 1)[0]
    model = make_mlp()
    reference = reference_run(model, torch.optim.AdamW(mlp_param_groups(model), lr=0.01, weight_decay=0.0), mlp_batch, steps=STEPS,
                              gas=GAS, global_rows=ROWS, clip=1.0)
    assert result["is_state"] and result["steps"] == STEPS
    assert_close_traces(result["trace"], reference, rel=1e-5)
