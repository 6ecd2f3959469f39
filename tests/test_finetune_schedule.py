"""``train.lr_scheduler`` (linear / cosine / constant after a warm-up), the recipe's values in an engine section's own
schedule, and the lr the engine reports: each optimizer step's lr is the closed-form schedule, never 0 at step 1."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from zerotune.config import ConfigError
from zerotune.finetune.recipe import load_recipe, recipe_engine_config
from zerotune.optim import build_scheduler

MINIMAL = {"model": {"name_or_path": "all-MiniLM-L6-v2"}, "task": "sequence-classification",
           "data": {"bundled": "rotten_tomatoes"}}


def recipe(**sections) -> dict:
    return {**json.loads(json.dumps(MINIMAL)), **sections}


def expected_lrs(kind: str, lr: float, steps: int, warmup: int, min_ratio: float = 0.0) -> list[float]:
    """The documented closed form of optimizer step k's lr (k = 1..steps), written out independently of the code.

    With w = max(warmup, 1), steps k < w warm up: lr * k / w. From step w on: linear lr * (steps + 1 - k) /
    (steps + 1 - w) (lr at step w); constant lr; cosine (DeepSpeed's WarmupCosineLR, whose decay begins at step w
    itself) lr * (m + (1 - m) * (1 + cos(pi * (k - w + 1) / (steps + 2 - w))) / 2)."""
    w = max(warmup, 1)
    lrs = []
    for k in range(1, steps + 1):
        if k < w:
            lrs.append(lr * k / w)
        elif kind == "cosine":
            cosine = (1 + math.cos(math.pi * (k - w + 1) / (steps + 2 - w))) / 2
            lrs.append(lr * (min_ratio + (1 - min_ratio) * cosine))
        elif kind == "linear":
            lrs.append(lr * (steps + 1 - k) / (steps + 1 - w))
        else:
            lrs.append(lr)
    return lrs


def applied_lrs(scheduler_config: dict, steps: int, lr: float = 1.0) -> list[float]:
    """The lr each of ``steps`` optimizer steps trains with: read before the step, as the engine then steps the
    schedule."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = build_scheduler(scheduler_config["type"], scheduler_config["params"], optimizer)
    applied = []
    for _ in range(steps):
        applied.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    return applied


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant"])
@pytest.mark.parametrize("warmup", [{}, {"warmup_steps": 1}, {"warmup_steps": 3}, {"warmup_ratio": 0.25}])
def test_each_lr_scheduler_trains_the_closed_form_and_never_at_lr_0(kind: str, warmup: dict) -> None:
    train = {"max_steps": 12, "lr": 1.0, "lr_scheduler": kind, **warmup}
    scheduler = recipe_engine_config(load_recipe(recipe(train=train)))["scheduler"]
    assert scheduler["type"] == {"linear": "WarmupDecayLR", "cosine": "WarmupCosineLR", "constant": "WarmupLR"}[kind]
    steps_of_warmup = warmup.get("warmup_steps", round(12 * warmup.get("warmup_ratio", 0)))
    applied = applied_lrs(scheduler, 12)
    assert applied == pytest.approx(expected_lrs(kind, 1.0, 12, steps_of_warmup))
    assert min(applied) > 0
    if steps_of_warmup > 1:
        assert applied[0] == pytest.approx(1.0 / steps_of_warmup)
    else:
        assert applied[0] == pytest.approx(expected_lrs(kind, 1.0, 12, 1)[0])  # no warm-up: the peak, or just under


def test_cosine_decays_toward_min_lr_ratio_and_stays_above_it() -> None:
    train = {"max_steps": 20, "lr": 2e-4, "lr_scheduler": "cosine", "min_lr_ratio": 0.1, "warmup_steps": 4}
    scheduler = recipe_engine_config(load_recipe(recipe(train=train)))["scheduler"]
    assert scheduler["params"]["cos_min_ratio"] == 0.1
    applied = applied_lrs(scheduler, 20, lr=2e-4)
    assert applied == pytest.approx(expected_lrs("cosine", 2e-4, 20, 4, min_ratio=0.1))
    decay = applied[3:]
    assert all(a > b for a, b in zip(decay, decay[1:])) and decay[-1] > 2e-5


def test_the_total_steps_the_trainer_passes_size_the_decay() -> None:
    r = load_recipe(recipe(train={"epochs": 1, "lr": 1.0, "lr_scheduler": "cosine", "warmup_ratio": 0.1}))
    scheduler = recipe_engine_config(r, total_steps=30)["scheduler"]
    assert applied_lrs(scheduler, 30) == pytest.approx(expected_lrs("cosine", 1.0, 30, 3))
    with pytest.raises(ConfigError) as info:  # without the step count there is no cosine to draw
        recipe_engine_config(load_recipe(recipe(train={"epochs": 1, "lr_scheduler": "cosine"})))
    assert info.value.path == "train.lr_scheduler" and "train.max_steps" in str(info.value)


@pytest.mark.parametrize("train, path, words", [
    ({"lr_scheduler": "cosine", "max_steps": 5, "warmup_steps": 7}, "train.warmup_steps", "no room"),
    ({"min_lr_ratio": 0.1}, "train.min_lr_ratio", "only used with train.lr_scheduler cosine"),
    ({"lr_scheduler": "step"}, "train.lr_scheduler", "linear"),
    ({"min_lr_ratio": 1.5, "lr_scheduler": "cosine"}, "train.min_lr_ratio", "1"),
])
def test_bad_schedule_keys_are_one_line_errors(train: dict, path: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        recipe_engine_config(load_recipe(recipe(train={"max_steps": 10, **train})))
    assert info.value.path == path and words in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("key, value", [("lr_scheduler", "cosine"), ("lr_scheduler", "linear"),
                                        ("min_lr_ratio", 0.0)])
def test_lr_scheduler_with_the_engines_own_scheduler_is_a_conflict_naming_both(key: str, value) -> None:
    train = {"max_steps": 10, key: value, **({"lr_scheduler": "cosine"} if key == "min_lr_ratio" else {})}
    engine = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}
    with pytest.raises(ConfigError) as info:
        load_recipe(recipe(train=train, engine=engine))
    assert info.value.path.startswith("train.") and "engine.scheduler" in str(info.value), str(info.value)


# --- the engine section's own schedule --------------------------------------------------------------

@pytest.mark.parametrize("schedule", [
    {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}},
    {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto",
                                         "warmup_max_lr": "auto"}},
    {"type": "WarmupLR", "params": {"warmup_num_steps": "auto", "warmup_max_lr": "auto"}},
    {"type": "WarmupCosineLR"},
    {"type": "WarmupDecayLR"},
])
@pytest.mark.parametrize("warmup", [0, 2])
def test_engine_schedule_filled_from_the_recipe_never_trains_at_lr_0(schedule: dict, warmup: int) -> None:
    """The reported case: ``auto`` params over 4 steps with 2 warm-up steps trained steps 1 and 2 at lr 0."""
    r = load_recipe(recipe(train={"max_steps": 4, "lr": 1.0, "warmup_steps": warmup}, engine={"scheduler": schedule}))
    scheduler = recipe_engine_config(r)["scheduler"]
    applied = applied_lrs(scheduler, 4)
    assert min(applied) > 0, applied
    if warmup == 2:
        assert applied[0] == pytest.approx(0.5)  # step 1 is the warm-up's first step, not lr 0
    else:  # no warm-up asked for: the first step trains at the peak (cosine: its first decay step)
        cosine = 0.0001 + 0.9999 * (1 + math.cos(math.pi / 5)) / 2  # DeepSpeed's default cos_min_ratio 0.0001
        assert applied[0] == pytest.approx(1.0 if schedule["type"] != "WarmupCosineLR" else cosine)


def test_engine_schedule_without_params_is_filled_or_names_the_missing_key() -> None:
    r = load_recipe(recipe(train={"max_steps": 6, "lr": 1.0, "warmup_steps": 2},
                           engine={"scheduler": {"type": "WarmupCosineLR"}}))
    params = recipe_engine_config(r)["scheduler"]["params"]
    assert params["total_num_steps"] == 8 and params["warmup_num_steps"] == 2
    r = load_recipe(recipe(engine={"scheduler": {"type": "WarmupCosineLR"}}))  # epochs: known once data is read
    params = recipe_engine_config(r, total_steps=6)["scheduler"]["params"]
    # no warm-up: the schedule starts at iteration 2, past the 2 iterations it floors every warm-up at
    assert (params["total_num_steps"], params["last_batch_iteration"]) == (9, 2)
    with pytest.raises(ConfigError) as info:
        recipe_engine_config(r)
    text = str(info.value)
    assert info.value.path == "engine.scheduler.params.total_num_steps" and "train.max_steps" in text, text
    assert "\n" not in text


def test_engine_api_names_what_to_set_for_a_missing_schedule_key() -> None:
    from zerotune.config import load_config

    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 2, "scheduler": {"type": "WarmupCosineLR"}})
    assert info.value.path == "scheduler.params.total_num_steps" and "set scheduler.params.total_num_steps (" in str(
        info.value), str(info.value)


def test_warmup_ratio_is_compared_with_the_engines_warmup_once_the_total_is_known() -> None:
    engine = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}
    r = load_recipe(recipe(train={"epochs": 1, "warmup_ratio": 0.1}, engine=engine))  # the total is not known yet
    assert recipe_engine_config(r, total_steps=50)["scheduler"]["params"]["warmup_num_steps"] == 5
    with pytest.raises(ConfigError) as info:
        recipe_engine_config(r, total_steps=40)
    text = str(info.value)
    assert info.value.path == "train.warmup_steps"
    assert "conflicts with engine.scheduler.params.warmup_num_steps 5" in text, text


def test_explicit_engine_schedule_values_are_kept() -> None:
    engine = {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_num_steps": 3,
                                                                "warmup_max_lr": 0.5, "last_batch_iteration": -1}}}
    config = recipe_engine_config(load_recipe(recipe(train={"max_steps": 10}, engine=engine)))
    assert config["scheduler"] == engine["scheduler"]


# --- end to end: metrics.jsonl and the engine's writers agree with the schedule ---------------------

def _run_worker(recipe_path: str, output: str) -> dict:
    import argparse

    from zerotune.finetune.worker import run

    return run(argparse.Namespace(recipe=recipe_path, output_dir=output, resume=False, merge=False, overrides=[]))


def test_run_trains_each_step_at_the_scheduled_lr_and_the_writers_log_it(tmp_path: Path) -> None:
    from tests.harness import run_distributed
    from tests.test_finetune_run import write_recipe

    path = write_recipe(tmp_path, 1, max_steps=6, lr=1e-2, lr_scheduler="cosine", warmup_steps=3, eval_every=0,
                       save_every=0, log_every=3)
    raw = json.loads(path.read_text())
    raw["engine"]["csv_monitor"] = {"enabled": True}
    raw["engine"]["steps_per_print"] = 3
    path.write_text(json.dumps(raw))
    out = tmp_path / "run"
    run_distributed(_run_worker, 2, str(path), str(out), timeout=240)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["split"] == "step"]
    expected = expected_lrs("cosine", 1e-2, 6, 3)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert [r["lr"] for r in steps] == pytest.approx(expected)
    with open(out / "csv_monitor" / "Train_Samples_lr.csv") as handle:
        rows = list(csv.reader(handle))[1:]
    # the engine's writers log step N with the lr step N trained with (DeepSpeed logs the next step's)
    assert [int(row[0]) for row in rows] == [1, 2, 3, 4, 5, 6]
    assert [float(row[1]) for row in rows] == pytest.approx(expected)
