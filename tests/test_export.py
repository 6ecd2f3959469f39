"""``zerotune export``: a checkpoint at any layout becomes a Hugging Face model directory that
``from_pretrained`` loads with exactly the trained weights; LoRA runs give the adapter or the merged model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zerotune
from tests.harness import run_distributed
from tests.models import engine_run, gpt2_batch, make_gpt2
from zerotune.cli.main import main


def _config(stage: int, precision: str = "fp32") -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _train_and_save(save_dir: str, stage: int, precision: str) -> dict:
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=_config(stage, precision))
    engine_run(engine, gpt2_batch, steps=2, gas=1, global_rows=4)
    engine.save_checkpoint(save_dir)
    with zerotune.zero.GatheredParameters(list(engine.module.parameters())):
        weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    masters = {}
    if precision == "bf16" and stage == 0:
        masters = {engine.param_names[id(p)]: engine.state.weights.master_of(p).detach().clone()
                   for p in engine.state.params}
    engine.destroy()
    return {"weights": weights, "masters": masters}


@pytest.mark.parametrize("stage", [0, 3])
def test_export_writes_a_model_directory_that_from_pretrained_loads(tmp_path: Path, stage: int) -> None:
    from transformers import GPT2LMHeadModel

    trained = run_distributed(_train_and_save, 2, str(tmp_path / "ckpt"), stage, "fp32")[0]["weights"]
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "ckpt"), str(out), "--max-shard-size", "40KB"]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert "config.json" in files and "model.safetensors.index.json" in files
    assert len([f for f in files if f.startswith("model-0")]) > 1  # sharded at 40 KB
    model = GPT2LMHeadModel.from_pretrained(out)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, trained[name], rtol=0, atol=0, msg=name)


def test_export_of_a_bf16_run_converts_from_the_fp32_masters(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    saved = run_distributed(_train_and_save, 1, str(tmp_path / "ckpt"), 0, "bf16")[0]
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "fp32"), "--dtype", "fp32"]) == 0
    exported = load_file(tmp_path / "fp32" / "model.safetensors")
    for name, master in saved["masters"].items():
        torch.testing.assert_close(exported[name], master, rtol=0, atol=0, msg=name)
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["torch_dtype"] == "float32"
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    assert load_file(tmp_path / "bf16" / "model.safetensors")["transformer.wte.weight"].dtype == torch.bfloat16


def _lora_model():
    from peft import LoraConfig, get_peft_model

    model = make_gpt2()
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.0,
                                            fan_in_fan_out=True, init_lora_weights=False))


def _train_lora(save_dir: str, exclude_frozen: bool) -> dict:
    engine, *_ = zerotune.initialize(model=_lora_model(), config=_config(0))
    engine_run(engine, gpt2_batch, steps=2, gas=1, global_rows=2)
    engine.save_checkpoint(save_dir, exclude_frozen_parameters=exclude_frozen)
    adapter = {k: v.detach().clone() for k, v in engine.module.state_dict().items() if "lora_" in k}
    merged = {k: v.detach().clone() for k, v in engine.module.merge_and_unload().state_dict().items()}
    engine.destroy()
    return {"adapter": adapter, "merged": merged}


def test_lora_export_gives_the_adapter_or_the_merged_model(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import GPT2LMHeadModel

    trained = run_distributed(_train_lora, 1, str(tmp_path / "ckpt"), False)[0]
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "adapter")]) == 0
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                        "adapter_model.safetensors"]
    loaded = PeftModel.from_pretrained(make_gpt2(), tmp_path / "adapter")
    for name, tensor in loaded.state_dict().items():
        if "lora_" in name:
            torch.testing.assert_close(tensor, trained["adapter"][name], rtol=0, atol=0, msg=name)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "merged"), "--merge"]) == 0
    merged = GPT2LMHeadModel.from_pretrained(tmp_path / "merged")
    for name, tensor in merged.state_dict().items():
        torch.testing.assert_close(tensor, trained["merged"][name], rtol=1e-6, atol=1e-6, msg=name)


def test_export_refusals_are_one_line_and_leave_nothing(tmp_path: Path, capsys) -> None:
    run_distributed(_train_lora, 1, str(tmp_path / "ckpt"), True)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "merged"), "--merge"]) == 2
    assert "saved without its frozen base" in capsys.readouterr().err
    assert not (tmp_path / "merged").exists() and not (tmp_path / ".merged.partial").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "full")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "zerotune export: " in capsys.readouterr().err


def _train_prefix(save_dir: str) -> dict:
    from peft import PrefixTuningConfig, TaskType, get_peft_model

    model = get_peft_model(make_gpt2(), PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4))
    engine, *_ = zerotune.initialize(model=model, config=_config(0))
    engine_run(engine, gpt2_batch, steps=2, gas=1, global_rows=2)
    engine.save_checkpoint(save_dir, exclude_frozen_parameters=True)
    prompt = engine.module.prompt_encoder["default"].embedding.weight.detach().clone()
    engine.destroy()
    return {"prompt": prompt}


def test_prefix_tuning_export_gives_the_adapter_peft_loads(tmp_path: Path) -> None:
    from peft import PeftModel

    trained = run_distributed(_train_prefix, 1, str(tmp_path / "ckpt"))[0]
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "adapter")]) == 0
    loaded = PeftModel.from_pretrained(make_gpt2(), tmp_path / "adapter")
    torch.testing.assert_close(loaded.prompt_encoder["default"].embedding.weight, trained["prompt"], rtol=0, atol=0)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "merged"), "--merge"]) == 2
