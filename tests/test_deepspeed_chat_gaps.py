"""What DeepSpeed-Chat (DeepSpeedExamples/applications/DeepSpeed-Chat) needs of the engine, without DeepSpeed-Chat.

scripts/deepspeed_chat_check.sh runs its step 1-3 scripts unchanged; each gap they hit is pinned here:

* ``from deepspeed.compression.helper import recursive_getattr, recursive_setattr`` (its LoRA module);
* the engine passes unknown attributes to the model, as DeepSpeed's ``__getattr__`` does (``engine.model``
  for its throughput print, ``critic.forward_value(...)``, ``rm.gradient_checkpointing_enable()``);
* ``engine.optimizer.overflow``: whether the last step overflowed and was skipped (its PPO loop reads it);
* ZeRO-3 through a model method other than ``forward`` (its reward model's ``forward_value``): the root
  unit (embeddings, final norm, value head) is gathered, so values and training equal single-process PyTorch;
* ``hybrid_engine: {"enabled": true}`` (``--enable_hybrid_engine``) is refused in one line naming the feature.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerotune
from tests.harness import run_distributed
from tests.models import make_gpt2, make_mlp, mlp_batch
from zerotune.compat.alias import install_deepspeed_alias, uninstall_deepspeed_alias
from zerotune.config import NotSupportedError, load_config


def test_compression_helper_walks_dotted_module_paths() -> None:
    install_deepspeed_alias()
    try:
        from deepspeed.compression.helper import recursive_getattr, recursive_setattr
    finally:
        uninstall_deepspeed_alias()
    model = make_mlp()
    model.block = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(4, 4))
    assert recursive_getattr(model, "block.1") is model.block[1]
    assert recursive_getattr(model, "inp.weight") is model.inp.weight
    replacement = torch.nn.Linear(4, 4)
    recursive_setattr(model, "block.1", replacement)
    assert model.block[1] is replacement
    recursive_setattr(model, "out", replacement)  # a top-level name
    assert model.out is replacement


def test_hybrid_engine_is_refused_in_one_line_naming_it() -> None:
    with pytest.raises(NotSupportedError) as info:
        load_config({"train_batch_size": 4, "hybrid_engine": {"enabled": True, "max_out_tokens": 512,
                                                              "inference_tp_size": 1}})
    message = str(info.value)
    assert "\n" not in message and "Hybrid Engine" in message and "hybrid_engine" in message
    assert '{"enabled": false}' in message
    load_config({"train_batch_size": 4, "hybrid_engine": {"enabled": False, "max_out_tokens": 512}})  # accepted


class _RewardModel(torch.nn.Module):
    """DeepSpeed-Chat's RewardModel in miniature: a backbone, a value head, and ``forward_value``."""

    def __init__(self) -> None:
        super().__init__()
        self.rwtransformer = make_gpt2().transformer
        torch.manual_seed(1)
        self.v_head = torch.nn.Linear(32, 1, bias=False)
        self.config = self.rwtransformer.config

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # never called below
        raise AssertionError("forward_value must not need forward")

    def forward_value(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.v_head(self.rwtransformer(input_ids)[0]).squeeze(-1)


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, 96, (4, 8), generator=torch.Generator().manual_seed(7 + step))


def _value_loss(values: torch.Tensor) -> torch.Tensor:
    return (values - 1.0).pow(2).mean()


def _reference(steps: int) -> tuple[list[float], list[list[float]]]:
    model = _RewardModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    losses, values = [], []
    for step in range(steps):
        with torch.no_grad():
            values.append(model.forward_value(_ids(step))[:, -1].tolist())
        loss = _value_loss(model.forward_value(_ids(step)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, values


def _forward_value_at_stage3(steps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _RewardModel()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": 0}}
    engine, *_ = zerotune.initialize(model=model, config=config)
    root = engine.state.units[0]
    facts = {"root_holds_head": any(p is model.v_head.weight for p in root.params)}
    losses, values = [], []
    for step in range(steps):
        ids = _ids(step)
        with torch.no_grad():
            values.append(engine.forward_value(ids)[:, -1].tolist())  # every rank: the whole batch
        rows = ids.shape[0] // world
        loss = _value_loss(engine.forward_value(ids[rank * rows:(rank + 1) * rows]))
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    facts.update(losses=losses, values=values)
    return facts


def test_zero3_through_a_method_other_than_forward_matches_pytorch() -> None:
    want_losses, want_values = _reference(3)
    for facts in run_distributed(_forward_value_at_stage3, 2, 3, timeout=120):
        assert facts["root_holds_head"]  # the value head lives in the root unit, gathered by no forward hook
        assert facts["losses"] == pytest.approx(want_losses, rel=1e-5)
        for got, want in zip(facts["values"], want_values):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def _passthrough_and_overflow() -> dict:
    model = make_mlp()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "fp16": {"enabled": True, "initial_scale_power": 4},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 2}}
    model.extra_method = lambda: "from the module"
    engine, optimizer, *_ = zerotune.initialize(model=model, config=config)
    facts = {"method": engine.extra_method(), "submodule": engine.inp is model.inp,
             "own_wins": engine.module is model, "flag_before": optimizer.overflow}
    try:
        engine.no_such_attribute
    except AttributeError as error:
        facts["missing"] = str(error)
    flags = []
    for step, poison in enumerate((False, True, False)):
        batch = mlp_batch(step, 0, 2)
        if poison:  # an inf input: every gradient overflows, the step is skipped
            batch["x"] = batch["x"] * float("inf")
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        flags.append((engine.optimizer.overflow, engine.was_step_applied()))
    facts["flags"] = flags
    return facts


def test_engine_passes_attributes_through_and_keeps_the_overflow_flag() -> None:
    for facts in run_distributed(_passthrough_and_overflow, 2, timeout=120):
        assert facts["method"] == "from the module" and facts["submodule"] and facts["own_wins"]
        assert "no_such_attribute" in facts["missing"] and "FrozenLayerMLP" in facts["missing"]
        assert facts["flag_before"] is False
        assert facts["flags"] == [(False, True), (True, False), (False, True)]
