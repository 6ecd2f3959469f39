"""initialize() and the engine's DeepSpeed-facing API: configs from args, autos, accessors, data, monitors."""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zerotune
from tests.harness import run_distributed
from tests.logs import recorded_messages
from tests.models import make_gpt2, make_mlp, mlp_batch, mlp_param_groups, rank_slice
from zerotune.config import ConfigError, NotSupportedYetError

REPO = Path(__file__).resolve().parents[1]


def _base(**extra) -> dict:
    return {"train_batch_size": 8, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, **extra}


def _train_steps(engine, steps: int) -> None:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for step in range(steps):
        for micro in range(engine.gradient_accumulation_steps()):
            rows = engine.train_micro_batch_size_per_gpu() * world
            engine.backward(engine(**rank_slice(mlp_batch(step, micro, rows), rank, world)))
            engine.step()


def _from_args(config_path: str) -> dict:
    parser = zerotune.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", config_path])
    model = make_mlp()
    engine, optimizer, loader, scheduler = zerotune.initialize(args=args, model=model,
                                                               model_parameters=mlp_param_groups(model))
    _train_steps(engine, 2)
    accessors = {
        "module_is_model": engine.module is model, "device": str(engine.device), "local_rank": engine.local_rank,
        "global_rank": engine.global_rank, "world_size": engine.world_size, "global_steps": engine.global_steps,
        "global_samples": engine.global_samples, "skipped_steps": engine.skipped_steps,
        "gas": engine.gradient_accumulation_steps(), "micro": engine.train_micro_batch_size_per_gpu(),
        "batch": engine.train_batch_size(), "stage": engine.zero_optimization_stage(), "fp16": engine.fp16_enabled(),
        "bf16": engine.bfloat16_enabled(), "lr": engine.get_lr(), "optimizer_is_engines": optimizer is engine.optimizer,
        "loader": loader, "scheduler": scheduler, "boundary": engine.is_gradient_accumulation_boundary(),
        "norm_is_float": isinstance(engine.get_global_grad_norm(), float),
    }
    engine.zero_grad()
    engine.eval()
    accessors["training_after_eval"] = engine.module.training
    engine.train()
    engine.destroy()
    return accessors


def test_config_from_args_and_deepspeed_accessors(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_base()))
    results = run_distributed(_from_args, 2, str(path))
    for rank, got in enumerate(results):
        assert got == {
            "module_is_model": True, "device": "cpu", "local_rank": rank, "global_rank": rank, "world_size": 2,
            "global_steps": 2, "global_samples": 16, "skipped_steps": 0, "gas": 2, "micro": 2, "batch": 8,
            "stage": 0, "fp16": False, "bf16": False, "lr": [0.02, 0.005], "optimizer_is_engines": True,
            "loader": None, "scheduler": None, "boundary": False, "norm_is_float": True, "training_after_eval": False,
        }


def _initialize_error(config: dict, with_args: bool = False) -> tuple[str, str]:
    args = argparse.Namespace(deepspeed_config="x.json") if with_args else None
    try:
        zerotune.initialize(args=args, model=make_mlp(), config=config)
    except ConfigError as error:
        return type(error).__name__, str(error)
    return "no error", ""


def test_unsupported_yet_and_unresolvable_auto_fail_at_initialize() -> None:
    kind, message = run_distributed(_initialize_error, 2, _base(memory_breakdown=True))[0]
    assert kind == NotSupportedYetError.__name__ and "memory_breakdown" in message
    assert "not supported yet" in message
    auto_batch = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                  "gradient_accumulation_steps": "auto"}
    kind, message = run_distributed(_initialize_error, 2, auto_batch)[0]
    assert kind == "ConfigError" and "train_batch_size" in message and "auto" in message
    kind, message = run_distributed(_initialize_error, 2, _base(), True)[0]
    assert kind == "ConfigError" and "x.json" in message


def _hf_auto_config() -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": 5}},
        "zero_optimization": {"stage": 0, "reduce_bucket_size": "auto"},
    }
    engine, optimizer, _, scheduler = zerotune.initialize(model=make_gpt2(), config=config)
    resolved = engine._config
    group = optimizer.param_groups[0]
    result = {"batch": engine.train_batch_size(), "gas": engine.gradient_accumulation_steps(),
              "betas": tuple(group["betas"]), "eps": group["eps"],
              "bucket": resolved.zero_optimization.reduce_bucket_size,
              "bucket_source": resolved.provenance["zero_optimization.reduce_bucket_size"],
              "warmup_max_lr": scheduler.state_dict().get("max_lrs", scheduler.state_dict().get("warmup_max_lr"))}
    engine.destroy()
    return result


def test_hf_style_auto_values_resolve_at_initialize() -> None:
    result = run_distributed(_hf_auto_config, 2)[0]
    assert result["batch"] == 4 and result["gas"] == 1
    assert result["betas"] == (0.9, 0.999) and result["eps"] == 1e-8
    assert result["bucket"] == 32 * 32 and result["bucket_source"] == "auto"


def _train_batch_with_dataloader() -> dict:
    dataset = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 4))
    model = make_mlp()

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x, y):
            return self.inner(x, y)

    engine, _, loader, _ = zerotune.initialize(model=Wrapped(), training_data=dataset,
                                               config=_base(train_batch_size=16))
    losses = [engine.train_batch().item() for _ in range(3)]
    seen = sum(len(batch[0]) for batch in loader)
    engine.destroy()
    return {"losses": losses, "steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "rows_per_rank": seen, "batch_rows": len(next(iter(loader))[0])}


def test_train_batch_runs_full_steps_over_the_sharded_dataloader() -> None:
    for result in run_distributed(_train_batch_with_dataloader, 2):
        assert result["steps"] == 3 and result["micro_steps"] == 6
        assert result["rows_per_rank"] == 32 and result["batch_rows"] == 4
        assert all(isinstance(v, float) for v in result["losses"])


def _client_optimizer_and_scheduler(kind: str) -> dict:
    model = make_mlp()
    if kind == "instance":
        optimizer = torch.optim.SGD(mlp_param_groups(model), lr=0.1)
    else:
        def optimizer(groups):
            return torch.optim.SGD(groups, lr=0.1)
    config = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "bf16": {"enabled": True}}
    engine, opt, _, sched = zerotune.initialize(
        model=model, optimizer=optimizer, model_parameters=mlp_param_groups(model), config=config,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    before = model.out.weight.detach().clone()
    _train_steps(engine, 2)
    masters_fp32 = all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    result = {"lrs": engine.get_lr(), "changed": not torch.equal(before, model.out.weight),
              "masters_fp32": masters_fp32, "model_bf16": model.out.weight.dtype == torch.bfloat16,
              "scheduler_type": type(sched).__name__}
    engine.destroy()
    return result


@pytest.mark.parametrize("kind", ["instance", "callable"])
def test_client_optimizer_and_scheduler_run_on_fp32_masters(kind: str) -> None:
    result = run_distributed(_client_optimizer_and_scheduler, 2, kind)[0]
    # each param group's own lr (0.02, 0.005) wins over the constructor's 0.1; StepLR halved it twice
    assert result["lrs"] == [0.02 * 0.25, 0.005 * 0.25]
    assert result["changed"] and result["masters_fp32"] and result["model_bf16"]
    assert result["scheduler_type"] == "StepLR"


def _lr_scaling() -> list:
    config = _base(lr_scaling={"rule": "linear", "base_batch_size": 4},
                   scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 1}})
    with recorded_messages() as records:
        engine, *_ = zerotune.initialize(model=make_mlp(), config=config)
        _train_steps(engine, 2)
        lr = engine.get_lr()
        engine.destroy()
    return [lr, [m for m in records if "lr_scaling" in m]]


def test_linear_lr_scaling_is_applied_and_logged() -> None:
    lr, messages = run_distributed(_lr_scaling, 2)[0]
    assert lr == [pytest.approx(0.02)]  # 0.01 x train_batch_size 8 / base 4, through the schedule too
    assert len(messages) == 1 and "x2" in messages[0]


def _monitors(out_dir: str) -> list[str]:
    config = _base(steps_per_print=2, wall_clock_breakdown=True,
                   tensorboard={"enabled": True, "output_path": out_dir, "job_name": "tb"},
                   csv_monitor={"enabled": True, "output_path": out_dir, "job_name": "csv"})
    with recorded_messages() as records:
        engine, *_ = zerotune.initialize(model=make_mlp(), config=config)
        _train_steps(engine, 4)
        engine.destroy()
    return [m for m in records if m.startswith("step ")]


def test_step_log_breakdown_and_scalar_writers(tmp_path: Path) -> None:
    lines = run_distributed(_monitors, 2, str(tmp_path))
    assert len(lines[0]) == 2 and lines[1] == []  # one line per steps_per_print window, rank 0 only
    for part in ("step 4", "loss", "lr", "grad norm", "samples/s", "forward", "backward", "reduce", "step:"):
        assert part in lines[0][-1], (part, lines[0][-1])
    with open(tmp_path / "csv" / "Train_Samples_train_loss.csv") as handle:
        rows = list(csv.reader(handle))
    assert rows[0][0] == "step" and [r[0] for r in rows[1:]] == ["1", "2", "3", "4"]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))


def _world_of_one() -> dict:
    model = make_mlp()
    engine, *_ = zerotune.initialize(model=model, model_parameters=mlp_param_groups(model), config=_base())
    _train_steps(engine, 2)
    engine.destroy()
    return {"world": engine.world_size, "steps": engine.global_steps, "group_size": engine.mesh.size("dp")}


def test_world_size_one_runs_the_same_code_path() -> None:
    assert run_distributed(_world_of_one, 1)[0] == {"world": 1, "steps": 2, "group_size": 1}


@pytest.mark.slow
def test_bundled_example_runs_unchanged_deepspeed_script_under_zerotune_run(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "zerotune.cli.main", "run", "--nproc_per_node", "2",
               str(REPO / "examples" / "train_gpt2.py"), "--deepspeed_config", str(REPO / "examples" / "ds_config.json"),
               "--output_dir", str(tmp_path / "ckpt")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    line = [l for l in done.stdout.splitlines() if l.startswith("held-out next-token accuracy")][0]
    before, after = float(line.split()[3]), float(line.split()[6])
    assert after > before + 0.2, line
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step150"
