"""Never train on garbage: a non-finite gradient norm skips the step in every precision, naming the first
non-finite parameter; too many skips in a row stop the run; non-finite or meaningless hyperparameters and
empty batches are one-line errors before anything trains."""

from __future__ import annotations

import json
import logging
import math
import re

import pytest
import torch

import zerotune
from tests.harness import run_distributed
from tests.logs import recorded_messages
from tests.models import make_mlp, mlp_batch
from zerotune.cli.main import main as cli
from zerotune.config import ConfigError, load_config
from zerotune.precision.loss_scaler import NonFiniteError

LIMIT = 3


def _config(precision: str, stage: int, **extra) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "max_consecutive_skipped_steps": LIMIT,
              "steps_per_print": 1, **extra}
    if precision != "fp32":
        config[precision] = {"enabled": True}
    return config


def _poisoned_run(precision: str, stage: int) -> dict:
    engine, *_ = zerotune.initialize(model=make_mlp(), config=_config(precision, stage))
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    error, steps_done = None, 0
    with recorded_messages(level=logging.WARNING) as messages:
        try:
            for step in range(LIMIT + 2):
                batch = mlp_batch(step, 0, 2)
                batch["x"][0, 0] = math.nan  # this rank's loss and every gradient become NaN
                engine.backward(engine(**batch))
                engine.step()
                steps_done += 1
        except NonFiniteError as caught:
            error = str(caught)
    unchanged = all(torch.equal(before[n], p.detach()) for n, p in engine.module.named_parameters())
    skipped = engine.skipped_steps
    engine.destroy()
    return {"error": error, "steps_done": steps_done, "unchanged": unchanged, "skipped": skipped,
            "warnings": [m for m in messages if "skipped" in m]}


@pytest.mark.parametrize("precision, stage", [("fp32", 0), ("bf16", 2), ("fp16", 1)])
def test_non_finite_gradients_skip_steps_then_stop_the_run_in_every_precision(precision: str, stage: int) -> None:
    for result in run_distributed(_poisoned_run, 2, precision, stage):
        assert result["steps_done"] == LIMIT - 1 and result["skipped"] == LIMIT and result["unchanged"]
        assert re.match(rf"{LIMIT} optimizer steps in a row \(steps 1-{LIMIT}\) were skipped: the gradient norm "
                        rf"is (nan|inf) in {precision}; the first parameter with a non-finite gradient is 'inp.weight'",
                        result["error"]), result["error"]
    warned = run_distributed(_poisoned_run, 1, precision, stage)[0]["warnings"]
    if precision == "fp16":  # overflows are routine while the loss scale settles: counted, not warned
        assert warned == []
    else:
        assert re.fullmatch(rf"step 1 skipped: the gradient norm is (nan|inf) in {precision}; the first parameter "
                            "with a non-finite gradient is 'inp.weight', and this rank's loss is nan", warned[0])


def _unchecked_bf16_run(stage: int) -> dict:
    config = _config("bf16", stage)
    config["bf16"]["check_grad_overflow"] = False
    engine, *_ = zerotune.initialize(model=make_mlp(), config=config)
    for step in range(LIMIT + 2):  # past max_consecutive_skipped_steps: nothing is skipped, nothing stops
        batch = mlp_batch(step, 0, 2)
        batch["x"][0, 0] = math.nan
        engine.backward(engine(**batch))
        engine.step()
    finite = all(bool(torch.isfinite(p).all()) for p in engine.module.parameters())
    result = {"skipped": engine.skipped_steps, "steps": engine.global_steps, "finite": finite}
    engine.destroy()
    return result


@pytest.mark.parametrize("stage", [0, 2])
def test_bf16_check_grad_overflow_false_applies_non_finite_steps_as_deepspeed(stage: int) -> None:
    # DeepSpeed's bf16.check_grad_overflow: false -- no overflow check, the NaN reaches the weights
    for result in run_distributed(_unchecked_bf16_run, 2, stage):
        assert result == {"skipped": 0, "steps": LIMIT + 2, "finite": False}


@pytest.mark.parametrize("params, path", [
    ({"lr": math.inf}, "optimizer.params.lr"),
    ({"lr": 1e-3, "betas": [0.9, 1.5]}, "optimizer.params.betas[1]"),
    ({"lr": -1e-3}, "optimizer.params.lr"),
    ({"lr": 1e-3, "eps": math.nan}, "optimizer.params.eps"),
    ({"lr": 1e-3, "weight_decay": -0.1}, "optimizer.params.weight_decay"),
])
def test_meaningless_optimizer_numbers_are_refused_by_check_and_initialize(tmp_path, capsys, params, path) -> None:
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": params}}
    with pytest.raises(ConfigError) as caught:
        zerotune.initialize(model=make_mlp(), config=config)
    assert caught.value.path == path
    (tmp_path / "c.json").write_text(json.dumps(config))
    assert cli(["check", str(tmp_path / "c.json")]) == 2
    assert capsys.readouterr().err.startswith(f"zerotune check: zerotune config: {path}: must be")


@pytest.mark.parametrize("config, path", [
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": math.inf}}}, "scheduler.params.warmup_max_lr"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": -5}}}, "scheduler.params.total_num_steps"),
    ({"gradient_clipping": math.inf}, "gradient_clipping"),
    ({"fp16": {"enabled": True, "loss_scale": math.inf}}, "fp16.loss_scale"),
])
def test_meaningless_scheduler_clipping_and_loss_scale_numbers_are_refused(config, path) -> None:
    with pytest.raises(ConfigError) as caught:
        zerotune.initialize(model=make_mlp(), config={"train_micro_batch_size_per_gpu": 1, **config})
    assert caught.value.path == path


def test_a_recipe_learning_rate_of_infinity_is_refused() -> None:
    from zerotune.finetune.recipe import load_recipe
    from zerotune.finetune.recipe_checks import RecipeError

    with pytest.raises(RecipeError, match="train.lr"):
        load_recipe(None, overrides=["train.lr=.inf"])


def _empty_batch() -> str:
    engine, *_ = zerotune.initialize(model=make_mlp(), config=_config("fp32", 0))
    try:
        batch = mlp_batch(0, 0, 2)
        engine(**{k: v[:0] for k, v in batch.items()})
        return "no error"
    except ValueError as error:
        return str(error)
    finally:
        engine.destroy()


def test_an_empty_batch_is_an_error_naming_the_step_and_rank() -> None:
    messages = run_distributed(_empty_batch, 2)
    for rank, message in enumerate(messages):
        assert message.startswith(f"empty batch: the micro-batch of optimizer step 1, micro-step 0, on rank {rank} "
                                  "has 0 rows"), message


class _HalfUsed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 1)
        self.unused = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x).square().mean()


def _unused_parameter_run(stage: int, ignore: bool) -> str | None:
    torch.manual_seed(0)
    engine, *_ = zerotune.initialize(model=_HalfUsed(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "ignore_unused_parameters": ignore}})
    try:
        for _ in range(2):
            engine.backward(engine(torch.ones(2, 4)))
            engine.step()
    except AssertionError as error:  # DeepSpeed's check is an assert: clients catch AssertionError
        return str(error)
    finally:
        engine.destroy()
    return None


@pytest.mark.parametrize("stage, ignore", [(2, False), (2, True), (1, False)])
def test_ignore_unused_parameters_false_stops_a_stage2_run_naming_the_parameters(stage: int, ignore: bool) -> None:
    for error in run_distributed(_unused_parameter_run, 2, stage, ignore):
        if stage == 2 and not ignore:
            assert error is not None and error.startswith("zero_optimization.ignore_unused_parameters is false and 2 "
                                                          "trainable parameter(s) got no gradient in this backward: "
                                                          "unused.weight, unused.bias"), error
        else:  # the default, and stages that do not check (a note says so): zero gradients
            assert error is None
    if stage != 2:
        notes = dict(load_config({"zero_optimization": {"stage": stage, "ignore_unused_parameters": False}}).notes)
        assert notes["zero_optimization.ignore_unused_parameters"].startswith(f"no effect here at stage {stage}")
