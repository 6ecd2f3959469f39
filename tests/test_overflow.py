"""fp16 overflow handling: a skipped step changes nothing but the loss scale and the counters."""

from __future__ import annotations

import copy

import pytest
import torch

import zerotune
from tests.harness import run_distributed
from tests.models import make_mlp, mlp_batch, mlp_param_groups, rank_slice
from zerotune.precision.loss_scaler import DynamicLossScaler, LossScaleError


def _config(stage: int = 0, **fp16) -> dict:
    return {
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 100, "allgather_bucket_size": 50},
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}},
        "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1, **fp16},
    }


def _step(engine, step: int, poison: bool = False) -> None:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    loss = engine(**rank_slice(mlp_batch(step, 0, 2 * world), rank, world))
    engine.backward(loss * float("inf") if poison and rank == 0 else loss)
    engine.step()


def _overflow_skips_step(stage: int) -> dict:
    model = make_mlp()
    engine, optimizer, _, scheduler = zerotune.initialize(model=model, model_parameters=mlp_param_groups(model),
                                                          config=_config(stage))
    for step in range(3):
        _step(engine, step)
    weights = copy.deepcopy(model.state_dict())
    masters = [m.detach().clone() for m in engine.state.masters]
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    before = {"scale": engine.loss_scale, "skipped": engine.skipped_steps, "steps": engine.global_steps,
              "lr": engine.get_lr(), "scheduler": scheduler.state_dict()}
    _step(engine, 3, poison=True)  # only rank 0's loss overflows: every rank must skip
    after = {"scale": engine.loss_scale, "skipped": engine.skipped_steps, "steps": engine.global_steps,
             "lr": engine.get_lr(), "scheduler": scheduler.state_dict()}
    same_weights = all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    same_masters = all(torch.equal(a, b) for a, b in zip(masters, engine.state.masters))
    state_now = optimizer.state_dict()
    same_state = all(torch.equal(optimizer_state["state"][i][k], v) if isinstance(v, torch.Tensor) else
                     optimizer_state["state"][i][k] == v
                     for i, s in state_now["state"].items() for k, v in s.items())
    applied = engine.was_step_applied()
    _step(engine, 4)
    engine.destroy()
    return {"before": before, "after": after, "same_weights": same_weights, "same_masters": same_masters,
            "same_state": same_state, "applied": applied, "recovered": engine.was_step_applied()}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_overflow_step_is_skipped_bit_identically(stage: int) -> None:
    for result in run_distributed(_overflow_skips_step, 2, stage):
        before, after = result["before"], result["after"]
        assert result["same_weights"] and result["same_masters"] and result["same_state"]
        assert not result["applied"] and result["recovered"]
        assert after["scale"] == before["scale"] / 2
        assert after["skipped"] == before["skipped"] + 1
        assert after["steps"] == before["steps"] + 1
        assert after["lr"] == before["lr"] and after["scheduler"] == before["scheduler"]


def _overflow_at_minimum_scale(stage: int) -> str:
    model = make_mlp()
    model.out.weight.register_hook(lambda grad: grad * float("inf"))
    engine, _, _, _ = zerotune.initialize(model=model, model_parameters=mlp_param_groups(model),
                                          config=_config(stage, initial_scale_power=0, min_loss_scale=1))
    try:
        _step(engine, 0)
    except LossScaleError as error:
        return str(error)
    finally:
        engine.destroy()
    return "no error"


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_overflow_at_minimum_scale_names_the_parameter(stage: int) -> None:
    messages = run_distributed(_overflow_at_minimum_scale, 2, stage)
    assert all("'out.weight'" in m and "minimum loss scale" in m for m in messages), messages


def test_dynamic_scaler_follows_deepspeed_semantics() -> None:
    scaler = DynamicLossScaler.from_config(initial_scale_power=4, loss_scale_window=3, min_loss_scale=1,
                                           hysteresis=2, consecutive_hysteresis=False)
    scaler.update_scale(True)
    assert scaler.loss_scale == 16  # hysteresis 2: the first overflow only spends one delay
    scaler.update_scale(True)
    assert scaler.loss_scale == 8
    for _ in range(3):
        scaler.update_scale(False)
    assert scaler.loss_scale == 8  # loss_scale_window clean steps since the overflow ...
    scaler.update_scale(False)
    assert scaler.loss_scale == 16  # ... and the next step doubles it (DeepSpeed 0.19's count)
    assert scaler.cur_hysteresis == 2  # restored on growth
    restored = DynamicLossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored == scaler


def test_dynamic_scaler_never_goes_below_minimum() -> None:
    scaler = DynamicLossScaler.from_config(initial_scale_power=1, loss_scale_window=1000, min_loss_scale=1,
                                           hysteresis=1, consecutive_hysteresis=False)
    for _ in range(3):
        scaler.update_scale(True)
    assert scaler.loss_scale == 1 and scaler.at_minimum


@pytest.mark.parametrize("consecutive", [False, True])
def test_consecutive_hysteresis_refills_on_clean_step(consecutive: bool) -> None:
    scaler = DynamicLossScaler.from_config(initial_scale_power=4, loss_scale_window=1000, min_loss_scale=1,
                                           hysteresis=3, consecutive_hysteresis=consecutive)
    scaler.update_scale(True)
    scaler.update_scale(False)
    assert scaler.cur_hysteresis == (3 if consecutive else 2)
