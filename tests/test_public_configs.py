"""DeepSpeed configs as users have them (tests/data/public_configs, written from the public docs of
HF Transformers, accelerate, LLaMA-Factory, axolotl and DeepSpeed's tutorials) load unchanged:
aliases and legacy keys mapped, ``_comment`` keys skipped, keys with no effect here reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zerotune
from tests.harness import run_distributed
from tests.models import make_mlp, mlp_batch
from zerotune.config import assert_implemented, load_config, resolve_config
from zerotune.config.errors import ConfigError, NotSupportedError
from zerotune.config.tree import path_in, set_path

CONFIGS = Path(__file__).resolve().parent / "data" / "public_configs"
FILES = sorted(p.name for p in CONFIGS.glob("*.json"))
# What HF Trainer fills in for the "auto" values (batch, clipping, optimizer and schedule numbers).
TRAINER_AUTOS = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                 "optimizer.params.lr": 1e-3, "optimizer.params.betas": [0.9, 0.999], "optimizer.params.eps": 1e-8,
                 "optimizer.params.weight_decay": 0.0, "scheduler.params.warmup_min_lr": 0.0,
                 "scheduler.params.warmup_max_lr": 1e-3, "scheduler.params.warmup_num_steps": 1,
                 "scheduler.params.total_num_steps": 10, "zero_optimization.reduce_bucket_size": 1024,
                 "zero_optimization.stage3_prefetch_bucket_size": 900,
                 "zero_optimization.stage3_param_persistence_threshold": 320}


@pytest.mark.parametrize("name", FILES)
def test_public_config_loads_resolves_and_is_implemented(name: str) -> None:
    raw = load_config(CONFIGS / name)
    resolved = resolve_config(raw, dp_world_size=2, auto_values=TRAINER_AUTOS)
    assert_implemented(resolved, zero_stages=(0, 1, 2, 3))
    assert resolved.train_batch_size == resolved.train_micro_batch_size_per_gpu * 2 * resolved.gradient_accumulation_steps


@pytest.mark.parametrize("name", FILES)
def test_zerotune_check_prints_the_table_and_its_notes(name: str, capsys) -> None:
    from zerotune.cli.check import main as check

    assert check([str(CONFIGS / name), "--world-size", "2"]) == 0
    assert "zero_optimization.stage" in capsys.readouterr().out


def test_zerotune_check_command_shows_legacy_and_no_effect_notes() -> None:
    done = subprocess.run([sys.executable, "-m", "zerotune.cli.main", "check",
                           str(CONFIGS / "deepspeed_tutorial_legacy.json"), "--world-size", "2"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("notes:", 1)[1]
    assert "zero_optimization.cpu_offload: legacy key: zero_optimization.offload_optimizer.device = cpu" in notes
    assert "zero_force_ds_cpu_optimizer: no effect here" in notes


def test_aliases_legacy_keys_and_no_effect_keys_are_mapped_and_reported() -> None:
    cfg = load_config(CONFIGS / "deepspeed_tutorial_legacy.json")
    assert cfg.zero_optimization.offload_optimizer.device == "cpu" and cfg.zero_optimization.offload_optimizer.pin_memory
    notes = dict(cfg.notes)
    assert notes["zero_optimization.cpu_offload"] == "legacy key: zero_optimization.offload_optimizer.device = cpu"
    assert notes["fp16.fp16_master_weights_and_grads"].startswith("no effect here: masters and gradients are always fp32")
    assert notes["zero_force_ds_cpu_optimizer"].startswith("no effect here:")
    assert notes["zero_optimization.contiguous_gradients"].startswith("no effect here:")
    assert "_comment" not in str(cfg.to_dict())
    zero = load_config({"zero_optimization": {"stage": 3, "max_live_parameters": 7, "prefetch_bucket_size": 5,
                                              "param_persistence_threshold": 3, "max_reuse_distance": 9,
                                              "gather_16bit_weights_on_model_save": True}}).zero_optimization
    assert (zero.stage3_max_live_parameters, zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold,
            zero.stage3_max_reuse_distance, zero.stage3_gather_16bit_weights_on_model_save) == (7, 5, 3, 9, True)
    assert load_config({"zero_optimization": True}).zero_optimization.stage == 1
    assert load_config({"aio": {"intra_op_parallelism": 3}}).aio.thread_count == 3
    assert load_config({"steps_per_print": float("inf")}).steps_per_print == sys.maxsize


def test_no_effect_keys_with_a_value_that_would_matter_are_refused() -> None:
    with pytest.raises(NotSupportedError, match=r"fp16.fp16_master_weights_and_grads: 'fp16_master_weights_and_grads' "
                                                r"is a DeepSpeed feature zerotune does not support; remove the key "
                                                r"\(accepted only as false, which has no effect\)"):
        load_config({"fp16": {"fp16_master_weights_and_grads": True}})
    with pytest.raises(NotSupportedError, match=r"accepted only as \{\"enabled\": false\}"):
        load_config({"autotuning": {"enabled": True}})
    with pytest.raises(ConfigError, match="legacy key given together with 'offload_optimizer'"):
        load_config({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(ConfigError, match="did you mean 'stage3_max_live_parameters'"):
        load_config({"zero_optimization": {"stage3_max_live_parameter": 1}})  # typos keep their did-you-mean
    universal = load_config({"checkpoint": {"load_universal": True}})  # checkpoints load at any layout anyway
    assert_implemented(universal)
    assert ("checkpoint.load_universal", "no effect here: no conversion is needed: every zerotune checkpoint loads at "
            "any layout (DeepSpeed's universal-format directories are not read; its ZeRO checkpoints are)") \
        in universal.notes


def test_llamafactory_shipped_configs_extra_keys_are_accepted_with_a_note() -> None:
    """LLaMA-Factory's examples/deepspeed/ds_z2_config.json / ds_z3_config.json (0.9.5) add two keys DeepSpeed
    does not read (its config ignores unknown keys): accepted here, any value, each with its note."""
    raw = json.loads((CONFIGS / "llamafactory_ds_z3_config.json").read_text())
    raw["comms_config"] = {"verbose": False}
    raw["monitor_config"] = {"enabled": True, "tag": "DeepSpeedMonitor", "csv_monitor": {"enabled": False}}
    cfg = load_config(raw)
    notes = dict(cfg.notes)
    assert notes["comms_config"].startswith("no effect here: DeepSpeed does not read it either")
    assert notes["monitor_config"].startswith("no effect here: DeepSpeed does not read it either")
    assert not cfg.csv_monitor.enabled and not cfg.tensorboard.enabled  # no monitor is switched on by it
    assert_implemented(resolve_config(cfg, dp_world_size=2, auto_values=TRAINER_AUTOS), zero_stages=(3,))


def _train_with(name: str) -> list[float]:
    """The file as HF Trainer hands it over: the user's keys, "auto"s filled in."""
    raw = json.loads((CONFIGS / name).read_text())
    for path, value in TRAINER_AUTOS.items():
        if path_in(raw, path) and _get(raw, path) == "auto":
            set_path(raw, path, value)
    for key in ("train_batch_size", "fp16", "bf16"):
        if key == "train_batch_size" and raw.get(key) == "auto":
            del raw[key]
        elif isinstance(raw.get(key), dict) and raw[key].get("enabled") == "auto":
            raw[key]["enabled"] = False
    model = make_mlp()
    client = None if "optimizer" in raw else torch.optim.AdamW(model.parameters(), lr=1e-3)  # as the Trainer does
    engine, *_ = zerotune.initialize(model=model, optimizer=client, config=raw)
    losses = []
    for step in range(3):
        batch = mlp_batch(step, 0, engine.train_micro_batch_size_per_gpu())
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses


def _get(data: dict, path: str):
    for part in path.split("."):
        data = data[part]
    return data


@pytest.mark.parametrize("name", ["deepspeed_tutorial_legacy.json", "llamafactory_ds_z3_config.json"])
def test_public_configs_train(name: str) -> None:
    for losses in run_distributed(_train_with, 2, name):
        assert len(losses) == 3 and all(loss == loss for loss in losses)
