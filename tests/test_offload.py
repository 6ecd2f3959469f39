"""Offload changes where state lives, never the numbers: offloaded runs equal the non-offloaded ones.

Each case trains twice on the same ranks with the same data -- without and with offload -- and
compares losses and global gradient norms exactly (fp32) and the final weights bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import zerotune
from tests.harness import run_distributed
from tests.models import engine_run, gpt2_batch, make_gpt2, make_mlp, mlp_batch, mlp_param_groups

STEPS, GAS = 5, 2


ADAMW = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}


def _config(stage: int, precision: str, offload: dict, optimizer: dict = ADAMW) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.5,
              "optimizer": optimizer, "steps_per_print": 1000,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 200,
                                    "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 2000,
                                    **offload}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _train(model_name: str, stage: int, precision: str, offload: dict, optimizer: dict = ADAMW) -> dict:
    world = torch.distributed.get_world_size()
    if model_name == "mlp":
        model, batch_fn = make_mlp(), mlp_batch
        params = mlp_param_groups(model)
    else:
        model, batch_fn = make_gpt2(), gpt2_batch
        params = model.parameters()
    engine, *_ = zerotune.initialize(model=model, model_parameters=params,
                                     config=_config(stage, precision, offload, optimizer))
    trace = engine_run(engine, batch_fn, steps=STEPS, gas=GAS, global_rows=2 * world)
    with zerotune.zero.GatheredParameters(list(model.parameters())):
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    masters_on = {m.device.type for m in engine.state.masters}
    engine.destroy()
    return {"trace": trace, "weights": weights, "masters_on": masters_on, "separate": engine.state.separate,
            "staged_steps": engine.state._placement.staged_steps}


def _compare(model_name: str, stage: int, precision: str, offload: dict, optimizer: dict = ADAMW) -> dict:
    plain = _train(model_name, stage, precision, {}, optimizer)
    offloaded = _train(model_name, stage, precision, offload, optimizer)
    same_weights = all(torch.equal(plain["weights"][k], v) for k, v in offloaded["weights"].items())
    return {"plain": plain["trace"], "offloaded": offloaded["trace"], "same_weights": same_weights,
            "masters_on": offloaded["masters_on"], "separate": offloaded["separate"],
            "staged_steps": offloaded["staged_steps"]}


CPU = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("model_name", ["mlp", "gpt2"])
def test_cpu_optimizer_offload_reproduces_the_run_exactly(model_name: str, stage: int) -> None:
    result = run_distributed(_compare, 2, model_name, stage, "fp32", CPU, timeout=120)[0]
    assert result["offloaded"].losses == result["plain"].losses
    assert result["offloaded"].grad_norms == result["plain"].grad_norms
    assert result["same_weights"] and result["separate"] and result["masters_on"] == {"cpu"}
    # stages 2 and 3 copy each gradient to the host as backward finishes it (stage 1 reduces only at the step)
    assert result["staged_steps"] == (STEPS if stage > 1 else 0)


@pytest.mark.parametrize("stage", [2, 3])
def test_cpu_optimizer_offload_in_bf16_reproduces_the_run_exactly(stage: int) -> None:
    result = run_distributed(_compare, 2, "gpt2", stage, "bf16", CPU, timeout=120)[0]
    assert result["offloaded"].losses == result["plain"].losses
    assert result["same_weights"]


def test_cpu_parameter_offload_at_stage3_reproduces_the_run_exactly() -> None:
    offload = {"offload_param": {"device": "cpu", "pin_memory": True}, **CPU}
    for model_name in ("mlp", "gpt2"):
        result = run_distributed(_compare, 2, model_name, 3, "fp32", offload, timeout=120)[0]
        assert result["offloaded"].losses == result["plain"].losses
        assert result["offloaded"].grad_norms == result["plain"].grad_norms
        assert result["same_weights"]


def _nvme(path: str, buffer_count: int = 4) -> dict:
    return {"offload_optimizer": {"device": "nvme", "nvme_path": path, "buffer_count": buffer_count},
            "sub_group_size": 97}  # many small, unevenly sized chunks


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("model_name", ["mlp", "gpt2"])
def test_nvme_optimizer_offload_reproduces_the_run_exactly(tmp_path, model_name: str, stage: int) -> None:
    result = run_distributed(_compare, 2, model_name, stage, "fp32", _nvme(str(tmp_path)), timeout=180)[0]
    assert result["offloaded"].losses == result["plain"].losses
    assert result["offloaded"].grad_norms == result["plain"].grad_norms
    assert result["same_weights"]
    assert list(tmp_path.glob("zerotune_optimizer_rank*/*.swp"))  # the state did live in files


def test_nvme_optimizer_offload_with_read_ahead_buffers_in_bf16(tmp_path) -> None:
    result = run_distributed(_compare, 2, "gpt2", 3, "bf16", _nvme(str(tmp_path), buffer_count=9), timeout=180)[0]
    assert result["offloaded"].losses == result["plain"].losses
    assert result["same_weights"]


def _nvme_resume(nvme: str, save_dir: str, stage: int) -> dict:
    world = torch.distributed.get_world_size()
    config = _config(stage, "fp32", _nvme(nvme))
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=config)
    engine_run(engine, gpt2_batch, steps=2, gas=GAS, global_rows=2 * world)
    engine.save_checkpoint(save_dir)
    expected = engine_run(engine, gpt2_batch, steps=2, gas=GAS, global_rows=2 * world)
    engine.destroy()
    config["zero_optimization"]["offload_optimizer"]["nvme_path"] = nvme + "_fresh"
    engine, *_ = zerotune.initialize(model=make_gpt2(seed=3), config=config)
    engine.load_checkpoint(save_dir)
    resumed = engine_run(engine, gpt2_batch, steps=2, gas=GAS, global_rows=2 * world)
    engine.destroy()
    return {"expected": expected, "resumed": resumed}


@pytest.mark.parametrize("stage", [2, 3])
def test_nvme_offloaded_checkpoint_resumes_exactly(tmp_path, stage: int) -> None:
    result = run_distributed(_nvme_resume, 2, str(tmp_path / "nvme"), str(tmp_path / "ckpt"), stage, timeout=180)[0]
    assert result["resumed"].losses == result["expected"].losses
    assert result["resumed"].grad_norms == result["expected"].grad_norms


def _nvme_everything(path: str) -> dict:
    return {"offload_param": {"device": "nvme", "nvme_path": path, "buffer_count": 3, "buffer_size": 20000},
            "offload_optimizer": {"device": "nvme", "nvme_path": path}, "sub_group_size": 200}


@pytest.mark.parametrize("model_name", ["mlp", "gpt2"])
def test_nvme_parameter_and_optimizer_offload_at_stage3_reproduces_the_run_exactly(tmp_path, model_name: str) -> None:
    result = run_distributed(_compare, 2, model_name, 3, "fp32", _nvme_everything(str(tmp_path)), timeout=180)[0]
    assert result["offloaded"].losses == result["plain"].losses
    assert result["offloaded"].grad_norms == result["plain"].grad_norms
    assert result["same_weights"]
    assert list(tmp_path.glob("zerotune_params_rank*/unit*_trainable.swp"))


def _damaged_swap_file(path: str, damage: str) -> str:
    engine, *_ = zerotune.initialize(model=make_mlp(), config=_config(3, "fp32", _nvme_everything(path)))
    victim = sorted((__import__("pathlib").Path(path) / f"zerotune_params_rank{torch.distributed.get_rank()}").glob("*.swp"))[-1]
    if damage == "deleted":
        victim.unlink()
    else:
        with open(victim, "r+b") as handle:
            handle.truncate(3)
    try:
        engine_run(engine, mlp_batch, steps=1, gas=1, global_rows=4)
        return "no error"
    except Exception as error:  # noqa: BLE001 - the test inspects the message
        return f"{type(error).__name__}: {error}|{victim}"


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_damaged_swap_file_is_an_error_naming_it(tmp_path, damage: str) -> None:
    message = run_distributed(_damaged_swap_file, 2, str(tmp_path), damage, timeout=120)[0]
    text, victim = message.rsplit("|", 1)
    assert "SwapFileError" in text and victim in text, text


def test_nvme_parameter_offload_alone_in_fp32_reproduces_the_run_exactly(tmp_path) -> None:
    offload = {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3, "buffer_size": 20000}}
    result = run_distributed(_compare, 2, "gpt2", 3, "fp32", offload, timeout=180)[0]
    assert result["offloaded"].losses == result["plain"].losses
    assert result["same_weights"]


def _too_small_buffers(path: str) -> str:
    offload = {"offload_param": {"device": "nvme", "nvme_path": path, "buffer_count": 2, "buffer_size": 10}}
    try:
        zerotune.initialize(model=make_gpt2(), config=_config(3, "fp32", offload))
        return "no error"
    except ValueError as error:
        return str(error)


def test_swap_buffers_smaller_than_a_shard_are_a_clear_error(tmp_path) -> None:
    message = run_distributed(_too_small_buffers, 2, str(tmp_path))[0]
    assert "zero_optimization.offload_param.buffer_size is 10 elements" in message and "raise it" in message


@pytest.mark.parametrize("optimizer", [{"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
                                       {"type": "Adagrad", "params": {"lr": 0.05}}], ids=["SGD", "Adagrad"])
def test_nvme_optimizer_offload_with_other_optimizers_reproduces_the_run_exactly(tmp_path, optimizer: dict) -> None:
    result = run_distributed(_compare, 2, "mlp", 2, "fp32", _nvme(str(tmp_path)), optimizer, timeout=180)[0]
    assert result["offloaded"].losses == result["plain"].losses
    assert result["same_weights"]
