"""An engine its user drops is freed, with its model's parameters and its gradient buffers.

Gradient hooks on parameters are the trap: a hook that holds the engine's gradient sync makes the
cycle parameter -> hook -> sync -> buckets -> parameter, which Python's collector cannot see through
(a parameter's hooks are not traversed while C++ autograd also references the tensor). Such an
engine's gradient sync lived until the process exited, holding the model, its gradient buffers and
the process groups it used. Sweeps, notebooks and test processes build many engines; each must go
away when dropped, and leave the parameters of a model its user keeps without zerotune's hooks.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import zerotune
from tests.harness import run_distributed
from tests.models import gpt2_batch, loss_of, make_gpt2, make_mlp, mlp_batch, rank_slice
from zerotune.pipe import LayerSpec, PipelineModule

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2}}


def _mse(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(outputs, labels)


def _train_two_steps(engine, kind: str) -> None:
    for step in range(2):
        if kind == "pipe":
            generator = torch.Generator().manual_seed(step)
            engine.train_batch(iter([(torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator))
                                     for _ in range(engine.gradient_accumulation_steps())]))
            continue
        batch = mlp_batch(step, 0, 4) if kind == "mlp" else gpt2_batch(step, 0, 4)
        dp_rank, dp_world = engine.mesh.rank("dp"), engine.mesh.size("dp")
        loss = loss_of(engine, rank_slice(batch, dp_rank, dp_world))
        engine.backward(loss)
        engine.step()


def _build(kind: str) -> nn.Module:
    if kind == "mlp":
        return make_mlp()
    if kind == "gpt2":
        return make_gpt2()
    return PipelineModule([LayerSpec(nn.Linear, 8, 8) for _ in range(4)], num_stages=2, loss_fn=_mse,
                          seed_layers=True, base_seed=0)


def _engine_lifetime(kind: str, config_keys: dict, keep_model: bool) -> dict:
    """Train an engine two steps and drop it (and the model unless ``keep_model``); what is still alive."""
    model = _build(kind)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": ADAMW, **config_keys}
    engine, optimizer, _, _ = zerotune.initialize(model=model, model_parameters=model.parameters(), config=config)
    _train_two_steps(engine, kind)
    engine_ref, param_ref = weakref.ref(engine), weakref.ref(next(model.parameters()))
    del engine, optimizer
    if not keep_model:
        del model
    gc.collect()
    outcome = {"engine alive": engine_ref() is not None, "parameter alive": param_ref() is not None}
    if keep_model:
        outcome["parameters with hooks"] = sum(bool(p._post_accumulate_grad_hooks) for p in model.parameters())
    return outcome


CASES = [
    pytest.param("mlp", {"zero_optimization": {"stage": 0}}, id="ddp"),
    pytest.param("mlp", {"zero_optimization": {"stage": 1}}, id="zero1"),
    pytest.param("mlp", {"zero_optimization": {"stage": 2}}, id="zero2"),
    pytest.param("mlp", {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, id="zero2-offload"),
    pytest.param("mlp", {"zero_optimization": {"stage": 3}}, id="zero3"),
    pytest.param("mlp", {"zero_optimization": {"stage": 1}, "gradient_compression": {"ratio": 0.5}}, id="topk"),
    pytest.param("pipe", {"gradient_accumulation_steps": 2}, id="pipeline"),
    pytest.param("gpt2", {"tensor_parallel": {"autotp_size": 2}}, id="tp"),
]


@pytest.mark.parametrize("kind,config_keys", CASES)
def test_a_dropped_engine_and_model_are_freed(kind, config_keys):
    for outcome in run_distributed(_engine_lifetime, 2, kind, config_keys, False, timeout=120):
        assert outcome == {"engine alive": False, "parameter alive": False}, outcome


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_model_kept_after_its_engine_is_dropped_has_no_zerotune_hooks_left(stage):
    # Not stage 3: its partitioned model needs the module hooks that gather each layer's weights,
    # so that schedule (with its gradient hooks) rightly lives as long as the model.
    config_keys = {"zero_optimization": {"stage": stage}}
    for outcome in run_distributed(_engine_lifetime, 2, "mlp", config_keys, True, timeout=120):
        assert outcome == {"engine alive": False, "parameter alive": True, "parameters with hooks": 0}, outcome


def _losses(engine, steps: range) -> list[float]:
    losses = []
    for step in steps:
        dp_rank, dp_world = engine.mesh.rank("dp"), engine.mesh.size("dp")
        loss = loss_of(engine, rank_slice(mlp_batch(step, 0, 4), dp_rank, dp_world))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _second_engine_on_a_wrapped_model(stage: int) -> dict:
    """An engine built on a model another, still-alive engine wraps trains as one built on a fresh copy."""
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": ADAMW, "zero_optimization": {"stage": stage}}
    model = make_mlp()
    first, *_ = zerotune.initialize(model=model, model_parameters=model.parameters(), config=config)
    _losses(first, range(2))
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    second, *_ = zerotune.initialize(model=model, model_parameters=model.parameters(), config=config)
    fresh_model = make_mlp()
    fresh_model.load_state_dict(weights)
    fresh, *_ = zerotune.initialize(model=fresh_model, model_parameters=fresh_model.parameters(), config=config)
    outcome = {"second": _losses(second, range(2, 5)), "fresh": _losses(fresh, range(2, 5))}
    del first  # alive until here: its hooks stayed on the parameters while the second engine trained
    return outcome


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_second_engine_on_a_model_a_live_engine_wraps_owns_its_gradients(stage):
    for outcome in run_distributed(_second_engine_on_a_wrapped_model, 2, stage, timeout=120):
        assert outcome["second"] == outcome["fresh"], outcome
