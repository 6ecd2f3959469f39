"""LLaMA-Factory and axolotl training YAMLs run unchanged: translation, refusals, reports, --print-recipe."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from zerotune.config import ConfigError
from zerotune.finetune.foreign_recipes import detect_dialect, read_foreign
from zerotune.finetune.recipe import load_recipe, recipe_to_dict

REPO = Path(__file__).resolve().parents[1]


# --- LLaMA-Factory ---------------------------------------------------------------------------------------

LF_LORA_SFT = """\
### model
model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

### dataset
dataset: identity,alpaca_en_demo
template: llama3
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/llama3-8b/lora/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null
"""

LF_DPO = """\
model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct
stage: dpo
do_train: true
finetuning_type: lora
lora_rank: 16
lora_alpha: 32
lora_dropout: 0.05
lora_target: q_proj,v_proj
pref_beta: 0.1
pref_loss: sigmoid
dataset: dpo_en_demo
template: llama3
cutoff_len: 1024
val_size: 0.1
output_dir: saves/llama3-8b/lora/dpo
logging_steps: 10
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 5.0e-6
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
deepspeed: ds_z2.json
"""


@pytest.fixture
def lf_dir(tmp_path: Path) -> Path:
    """A LLaMA-Factory-style project: data/dataset_info.json naming alpaca, sharegpt and ranking files."""
    data = tmp_path / "data"
    data.mkdir()
    alpaca = [{"instruction": f"Say {i}", "input": "", "output": str(i)} for i in range(20)]
    (data / "identity.json").write_text(json.dumps(alpaca[:10]))
    (data / "alpaca_en_demo.json").write_text(json.dumps(alpaca[10:]))
    (data / "chat.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"},
                                                                   {"from": "gpt", "value": "hello"}]}] * 10))
    (data / "dpo_en_demo.json").write_text(json.dumps(
        [{"conversations": [{"from": "human", "value": f"q{i}"}], "chosen": {"from": "gpt", "value": "good"},
          "rejected": {"from": "gpt", "value": "bad"}} for i in range(10)]))
    info = {"identity": {"file_name": "identity.json"},
            "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
            "chat": {"file_name": "chat.json", "formatting": "sharegpt", "columns": {"messages": "conversations"}},
            "dpo_en_demo": {"file_name": "dpo_en_demo.json", "formatting": "sharegpt", "ranking": True,
                            "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}},
            "odd": {"file_name": "identity.json", "columns": {"prompt": "question", "history": "history"}},
            "hub": {"hf_hub_url": "llamafactory/alpaca_en"}}
    (data / "dataset_info.json").write_text(json.dumps(info))
    (tmp_path / "ds_z2.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    return tmp_path


def _write(directory: Path, text: str, name: str = "train.yaml", **changes) -> Path:
    raw = yaml.safe_load(text)
    for key, value in changes.items():
        if value is DROP:
            raw.pop(key, None)
        else:
            raw[key] = value
    path = directory / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


DROP = object()


def _translated(path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(path.parent)  # LLaMA-Factory / axolotl resolve relative paths against the working directory
    translation = read_foreign(path)
    assert translation is not None
    return translation


def test_dialects_are_told_apart_by_their_keys() -> None:
    assert detect_dialect({"model": {}, "task": "causal-lm"}) == "zerotune"
    assert detect_dialect({"model_name_or_path": "m", "stage": "sft"}) == "llamafactory"
    assert detect_dialect({"model_name_or_path": "m", "finetuning_type": "lora"}) == "llamafactory"
    assert detect_dialect({"base_model": "m", "datasets": []}) == "axolotl"
    assert detect_dialect({"model_name_or_path": "m"}) == "zerotune"  # then did-you-mean names model.name_or_path


def test_llamafactory_lora_sft_translates_key_by_key(lf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    translation = _translated(_write(lf_dir, LF_LORA_SFT), monkeypatch)
    data = lf_dir / "data"
    assert translation.recipe == {
        "task": "causal-lm",
        "model": {"name_or_path": "meta-llama/Meta-Llama-3-8B-Instruct", "trust_remote_code": True},
        "method": {"type": "lora", "r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"},
        "data": {"train_files": [str(data / "identity.json"), str(data / "alpaca_en_demo.json")], "format": "alpaca",
                 "template": "llama3", "max_length": 2048, "max_train_samples": 1000},
        "train": {"epochs": 3.0, "micro_batch_size": 1, "gradient_accumulation_steps": 8, "lr": 1e-4,
                  "warmup_ratio": 0.1, "log_every": 10, "save_every": 500, "lr_scheduler": "cosine",
                  "gradient_checkpointing": True},
        "engine": {"precision": "bf16"},
    }
    assert translation.output_dir == "saves/llama3-8b/lora/sft"


def test_llamafactory_no_effect_keys_are_reported_once(lf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    notes = "\n".join(_translated(_write(lf_dir, LF_LORA_SFT), monkeypatch).notes)
    for key in ("do_train: true", "overwrite_cache: true", "plot_loss: true", "overwrite_output_dir: true",
                "report_to: none", "ddp_timeout: 180000000", "preprocessing_num_workers: 16",
                "save_only_model: false"):
        assert notes.count(f"llamafactory key '{key}': no effect here") == 1, key
    assert "llamafactory keys left empty (the other tool's default; nothing to translate): resume_from_checkpoint" \
        in notes
    assert "val_size is 0" in notes


def test_llamafactory_dpo_translates_to_the_dpo_objective(lf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    translation = _translated(_write(lf_dir, LF_DPO), monkeypatch)
    recipe = translation.recipe
    assert recipe["objective"] == {"type": "dpo", "loss": "sigmoid", "beta": 0.1}
    assert recipe["method"] == {"type": "lora", "r": 16, "alpha": 32, "dropout": 0.05,
                                "target_modules": ["q_proj", "v_proj"]}
    assert recipe["data"] == {"train_files": [str(lf_dir / "data" / "dpo_en_demo.json")], "eval_fraction": 0.1,
                              "template": "llama3", "max_length": 1024}
    assert recipe["engine"] == {"precision": "bf16", "config_path": str(lf_dir / "ds_z2.json")}
    assert recipe["train"]["lr"] == 5e-6


@pytest.mark.parametrize("changes, objective", [
    ({"pref_loss": "ipo"}, {"type": "dpo", "loss": "ipo", "beta": 0.1}),
    ({"pref_loss": "orpo"}, {"type": "orpo", "beta": 0.1}),
    ({"pref_loss": "simpo", "simpo_gamma": 0.8}, {"type": "simpo", "beta": 0.1, "gamma": 0.8}),
    ({"pref_loss": "simpo", "pref_beta": DROP}, {"type": "simpo", "beta": 0.1, "gamma": 0.5}),  # LF's defaults
])
def test_llamafactory_pref_loss_picks_the_objective(lf_dir: Path, monkeypatch: pytest.MonkeyPatch, changes: dict,
                                                    objective: dict) -> None:
    assert _translated(_write(lf_dir, LF_DPO, **changes), monkeypatch).recipe["objective"] == objective


@pytest.mark.parametrize("changes, message", [
    ({"stage": "ppo"}, "llamafactory key 'stage: ppo': not supported; zerotune trains sft, dpo, kto, rm"),
    ({"stage": "dpo", "pref_ftx": 1.0}, "llamafactory key 'pref_ftx: 1.0': not supported; zerotune adds no SFT loss"),
    ({"pref_loss": "bco"}, "llamafactory key 'pref_loss: bco': not supported"),
    ({"template": "vicuna"}, "llamafactory key 'template: vicuna': not supported; zerotune's templates are"),
    ({"finetuning_type": "oft"}, "llamafactory key 'finetuning_type: oft': not supported"),
    ({"report_to": "wandb"}, "llamafactory key 'report_to: wandb': not supported"),
    ({"do_train": False}, "llamafactory key 'do_train: false': not supported"),
    ({"lr_scheduler_type": "polynomial"}, "llamafactory key 'lr_scheduler_type: polynomial': not supported"),
    ({"optim": "adamw_8bit"}, "llamafactory key 'optim: adamw_8bit': not supported"),
    ({"dataset": "hub"}, "llamafactory key 'dataset: hub': not supported; dataset 'hub' comes from hf_hub_url"),
    ({"dataset": "odd"}, "llamafactory key 'dataset: odd': not supported; dataset 'odd' maps alpaca columns"),
    ({"dataset": "nope"}, "llamafactory key 'dataset: nope': not supported; 'nope' is not in"),
    ({"packing": True}, "llamafactory key 'packing: true': not supported; zerotune packs without cross-example"),
    ({"quantization_bit": 3}, "llamafactory key 'quantization_bit: 3': not supported"),
    ({"pref_beta": 0.2}, "llamafactory key 'pref_beta: 0.2': not supported; a preference option, but stage is sft"),
    ({"use_badam": True}, "llamafactory key 'use_badam: true': not supported; not a llamafactory key zerotune "
                          "translates"),
])
def test_llamafactory_unsupported_keys_are_one_line_naming_the_key(lf_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  changes: dict, message: str) -> None:
    path = _write(lf_dir, LF_LORA_SFT, **changes)
    monkeypatch.chdir(lf_dir)
    with pytest.raises(ConfigError) as info:
        load_recipe(path)
    text = str(info.value)
    assert "\n" not in text and text.startswith("zerotune recipe: " + message), text


def test_llamafactory_kto_stage_passes_its_files(lf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = _translated(_write(lf_dir, LF_DPO, stage="kto", pref_loss=DROP, dataset="chat",
                                kto_chosen_weight=1.0, kto_rejected_weight=0.5), monkeypatch).recipe
    assert recipe["objective"] == {"type": "kto", "beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 0.5}
    assert recipe["data"]["train_files"] == [str(lf_dir / "data" / "chat.json")] and "format" not in recipe["data"]


def test_llamafactory_quantization_bit_is_qlora_and_freeze_keeps_its_layers(lf_dir: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    qlora = _translated(_write(lf_dir, LF_LORA_SFT, quantization_bit=4), monkeypatch).recipe["method"]
    assert qlora["type"] == "qlora" and qlora["bits"] == 4
    freeze = _translated(_write(lf_dir, LF_LORA_SFT, finetuning_type="full", lora_rank=DROP, lora_target=DROP,
                                dataset="chat", disable_gradient_checkpointing=True), monkeypatch).recipe
    assert freeze["method"] == {"type": "full"} and freeze["data"]["format"] == "sharegpt"
    assert freeze["train"]["gradient_checkpointing"] is False


def test_a_translated_value_that_fails_the_recipe_checks_names_the_foreign_key(
        lf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(lf_dir, LF_LORA_SFT, template=DROP, lr_scheduler_type=DROP, lora_rank="eight")
    monkeypatch.chdir(lf_dir)
    with pytest.raises(ConfigError, match=r"method.r: .*\(translated from llamafactory key 'lora_rank'\)"):
        load_recipe(path)


# --- axolotl -------------------------------------------------------------------------------------------------

AXOLOTL_QLORA = """\
base_model: NousResearch/Llama-3.2-1B
model_type: AutoModelForCausalLM
tokenizer_type: AutoTokenizer
load_in_8bit: false
load_in_4bit: true
strict: false
datasets:
  - path: data/alpaca.jsonl
    type: alpaca
dataset_prepared_path:
val_set_size: 0.1
output_dir: ./outputs/qlora-out
adapter: qlora
lora_model_dir:
sequence_len: 512
sample_packing: true
eval_sample_packing: false
lora_r: 32
lora_alpha: 16
lora_dropout: 0.05
lora_target_linear: true
lora_fan_in_fan_out:
wandb_project:
wandb_entity:
wandb_watch:
wandb_name:
wandb_log_model:
gradient_accumulation_steps: 4
micro_batch_size: 2
num_epochs: 1
optimizer: adamw_torch_fused
lr_scheduler: cosine
learning_rate: 0.0002
train_on_inputs: false
group_by_length: false
bf16: false
fp16:
tf32: false
gradient_checkpointing: true
early_stopping_patience:
resume_from_checkpoint:
local_rank:
logging_steps: 1
flash_attention: true
warmup_steps: 10
evals_per_epoch: 4
saves_per_epoch: 1
weight_decay: 0.0
fsdp:
fsdp_config:
special_tokens:
  pad_token: "<|end_of_text|>"
"""

AXOLOTL_DPO = """\
base_model: NousResearch/Llama-3.2-1B
rl: dpo
rl_beta: 0.1
chat_template: llama3
datasets:
  - path: data/prefs.jsonl
    type: chat_template.default
adapter: lora
lora_r: 16
lora_alpha: 32
lora_dropout: 0.0
lora_target_modules:
  - q_proj
  - v_proj
sequence_len: 1024
micro_batch_size: 1
gradient_accumulation_steps: 4
max_steps: 100
learning_rate: 5.0e-6
lr_scheduler: linear
warmup_ratio: 0.1
bf16: true
output_dir: ./outputs/dpo
"""


@pytest.fixture
def axolotl_dir(tmp_path: Path) -> Path:
    data = tmp_path / "axolotl" / "data"
    data.mkdir(parents=True)
    rows = [{"instruction": f"Say {i}", "input": "", "output": str(i)} for i in range(20)]
    (data / "alpaca.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prefs = [{"prompt": f"q{i}", "chosen": "good", "rejected": "bad"} for i in range(10)]
    (data / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prefs))
    return tmp_path / "axolotl"


def test_axolotl_qlora_sft_translates_key_by_key(axolotl_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    translation = _translated(_write(axolotl_dir, AXOLOTL_QLORA), monkeypatch)
    assert translation.recipe == {
        "task": "causal-lm",
        "model": {"name_or_path": "NousResearch/Llama-3.2-1B"},
        "method": {"type": "qlora", "bits": 4, "r": 32, "alpha": 16, "dropout": 0.05, "target_modules": "all-linear"},
        "data": {"train_files": [str(axolotl_dir / "data" / "alpaca.jsonl")], "format": "alpaca",
                 "eval_fraction": 0.1, "max_length": 512, "train_on_prompt": False, "packing": True},
        "train": {"epochs": 1, "micro_batch_size": 2, "gradient_accumulation_steps": 4, "lr": 2e-4,
                  "warmup_steps": 10, "weight_decay": 0.0, "log_every": 1, "gradient_checkpointing": True,
                  "lr_scheduler": "cosine"},
    }
    assert translation.output_dir == "./outputs/qlora-out"
    notes = "\n".join(translation.notes)
    for key in ("model_type: AutoModelForCausalLM", "strict: false", "flash_attention: true",
                "optimizer: adamw_torch_fused", "special_tokens.pad_token: <|end_of_text|>", "tf32: false"):
        assert notes.count(f"axolotl key '{key}': no effect here") == 1, key
    assert "axolotl key 'evals_per_epoch: 4': not translated" in notes
    assert "keys left empty" in notes and "wandb_entity" in notes and "fsdp_config" in notes


def test_axolotl_dpo_translates_to_the_dpo_objective(axolotl_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = _translated(_write(axolotl_dir, AXOLOTL_DPO), monkeypatch).recipe
    assert recipe["objective"] == {"type": "dpo", "loss": "sigmoid", "beta": 0.1}
    assert recipe["method"] == {"type": "lora", "r": 16, "alpha": 32, "dropout": 0.0,
                                "target_modules": ["q_proj", "v_proj"]}
    assert recipe["data"] == {"train_files": [str(axolotl_dir / "data" / "prefs.jsonl")], "template": "llama3",
                              "max_length": 1024}
    assert recipe["train"] == {"max_steps": 100, "micro_batch_size": 1, "gradient_accumulation_steps": 4,
                               "lr": 5e-6, "warmup_ratio": 0.1, "lr_scheduler": "linear"}
    assert recipe["engine"] == {"precision": "bf16"}


@pytest.mark.parametrize("rl, objective", [("ipo", {"type": "dpo", "loss": "ipo", "beta": 0.1}),
                                           ("orpo", {"type": "orpo", "beta": 0.1}),
                                           ("simpo", {"type": "simpo", "beta": 0.1}),
                                           ("kto", {"type": "kto", "beta": 0.1})])
def test_axolotl_rl_picks_the_objective(axolotl_dir: Path, monkeypatch: pytest.MonkeyPatch, rl: str,
                                        objective: dict) -> None:
    assert _translated(_write(axolotl_dir, AXOLOTL_DPO, rl=rl), monkeypatch).recipe["objective"] == objective


def test_axolotl_reward_model_is_the_reward_objective(axolotl_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(axolotl_dir, AXOLOTL_DPO, rl=DROP, rl_beta=DROP, reward_model=True)
    assert _translated(path, monkeypatch).recipe["objective"] == {"type": "reward"}


@pytest.mark.parametrize("changes, message", [
    ({"rl": "grpo"}, "axolotl key 'rl: grpo': not supported; zerotune trains dpo, ipo, orpo, simpo, kto"),
    ({"adapter": "ia3"}, "axolotl key 'adapter: ia3': not supported"),
    ({"optimizer": "adamw_bnb_8bit"}, "axolotl key 'optimizer: adamw_bnb_8bit': not supported"),
    ({"chat_template": "phi_3"}, "axolotl key 'chat_template: phi_3': not supported"),
    ({"fsdp": ["full_shard"]}, "axolotl key 'fsdp: [\"full_shard\"]': not supported; zerotune shards with ZeRO"),
    ({"wandb_project": "mine"}, "axolotl key 'wandb_project: mine': not supported"),
    ({"cpo_alpha": 1.0}, "axolotl key 'cpo_alpha: 1.0': not supported"),
    ({"datasets": [{"path": "data/missing.jsonl", "type": "chat_template.default"}]},
     "axolotl key 'datasets[0].path: data/missing.jsonl': not supported; no such local file"),
    ({"datasets": [{"path": "data/prefs.jsonl", "type": "chatml.intel"}]},
     "axolotl key 'datasets[0].type: chatml.intel': not supported"),
    ({"unsloth_lora_mlp": True}, "axolotl key 'unsloth_lora_mlp: true': not supported; not a axolotl key"),
])
def test_axolotl_unsupported_keys_are_one_line_naming_the_key(axolotl_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                             changes: dict, message: str) -> None:
    path = _write(axolotl_dir, AXOLOTL_DPO, **changes)
    monkeypatch.chdir(axolotl_dir)
    with pytest.raises(ConfigError) as info:
        load_recipe(path)
    text = str(info.value)
    assert "\n" not in text and text.startswith("zerotune recipe: " + message), text


# --- loading, notes, output dir, --print-recipe -------------------------------------------------------------

def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "zerotune.cli.main", "finetune", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_translated_sft_recipe_loads_and_reports_its_no_effect_keys_once(
        lf_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    path = _write(lf_dir, LF_LORA_SFT, template=DROP, lr_scheduler_type=DROP, plot_loss=False)
    monkeypatch.chdir(lf_dir)
    monkeypatch.delenv("ZEROTUNE_FOREIGN_NOTES_SHOWN", raising=False)
    recipe = load_recipe(path)
    load_recipe(path)  # a second load in the same process (the launcher, then its single rank) says nothing new
    assert recipe.method.type == "lora" and recipe.method.target_modules == "all-linear"
    assert recipe.train.gradient_checkpointing is True and recipe.engine.precision == "bf16"
    assert recipe.data.max_length == 2048 and recipe.train.epochs == 3.0
    assert capsys.readouterr().err.count("zerotune recipe: llamafactory key 'plot_loss: false': no effect here") == 1


def test_print_recipe_round_trips_a_llamafactory_yaml(lf_dir: Path) -> None:
    path = _write(lf_dir, LF_LORA_SFT, template=DROP, lr_scheduler_type=DROP)
    result = _cli(str(path), "--print-recipe", cwd=lf_dir)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["method"]["target_modules"] == "all-linear" and printed["train"]["lr"] == 1e-4
    assert "plot_loss: true': no effect here" in result.stderr and not (lf_dir / "saves").exists()
    again = lf_dir / "again.yaml"
    again.write_text(result.stdout)
    assert recipe_to_dict(load_recipe(again)) == printed


def test_print_recipe_round_trips_the_realistic_llamafactory_sft_yaml(lf_dir: Path) -> None:
    result = _cli(str(_write(lf_dir, LF_LORA_SFT)), "--print-recipe", cwd=lf_dir)
    assert result.returncode == 0, result.stderr
    again = lf_dir / "again.yaml"
    again.write_text(result.stdout)
    assert recipe_to_dict(load_recipe(again)) == yaml.safe_load(result.stdout)


@pytest.mark.parametrize("which", ["llamafactory", "axolotl"])
def test_print_recipe_round_trips_the_dpo_yamls(lf_dir: Path, axolotl_dir: Path, which: str) -> None:
    directory, text = (lf_dir, LF_DPO) if which == "llamafactory" else (axolotl_dir, AXOLOTL_DPO)
    result = _cli(str(_write(directory, text)), "--print-recipe", cwd=directory)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["objective"]["type"] == "dpo"
    again = directory / "again.yaml"
    again.write_text(result.stdout)
    assert recipe_to_dict(load_recipe(again)) == printed


def test_print_recipe_prints_a_native_recipe_normalized(tmp_path: Path) -> None:
    native = {"model": {"name_or_path": "all-MiniLM-L6-v2"}, "task": "sequence-classification",
              "data": {"bundled": "rotten_tomatoes"}, "train": {"lr": 3e-5}}
    path = tmp_path / "native.json"
    path.write_text(json.dumps(native))
    result = _cli(str(path), "--print-recipe", "--set", "train.max_steps=5", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["train"]["lr"] == 3e-5 and printed["train"]["max_steps"] == 5
    assert recipe_to_dict(load_recipe(printed)) == printed


def test_the_foreign_output_dir_is_the_default_output_dir(lf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from zerotune.finetune.arguments import DEFAULT_OUTPUT_DIR, add_arguments, resolve_output_dir

    monkeypatch.chdir(lf_dir)
    parser = add_arguments(argparse.ArgumentParser())
    path = str(_write(lf_dir, LF_LORA_SFT))
    assert resolve_output_dir(parser.parse_args([path])) == "saves/llama3-8b/lora/sft"
    assert resolve_output_dir(parser.parse_args([path, "--output-dir", "runs/x"])) == "runs/x"
    assert resolve_output_dir(parser.parse_args([])) == DEFAULT_OUTPUT_DIR


# --- did-you-mean in native recipes -------------------------------------------------------------------------

MINIMAL = {"model": {"name_or_path": "all-MiniLM-L6-v2"}, "task": "sequence-classification",
           "data": {"bundled": "rotten_tomatoes"}}


@pytest.mark.parametrize("section, key, suggestion", [
    ("train", "learning_rate", "lr"),
    ("train", "num_train_epochs", "epochs"),
    ("train", "per_device_train_batch_size", "micro_batch_size"),
    ("train", "max_grad_norm", "gradient_clipping"),
    ("engine", "gradient_checkpointing", "train.gradient_checkpointing"),
    (None, "gradient_checkpointing", "train.gradient_checkpointing"),
    (None, "learning_rate", "train.lr"),
    ("model", "model_name_or_path", "name_or_path"),
    (None, "base_model", "model.name_or_path"),
    ("data", "cutoff_len", "max_length"),
    ("data", "sequence_len", "max_length"),
    ("method", "lora_rank", "r"),
    ("method", "lora_r", "r"),
    ("engine", "deepspeed", "config_path"),
])
def test_did_you_mean_knows_other_tools_names(section: str | None, key: str, suggestion: str) -> None:
    raw = json.loads(json.dumps(MINIMAL))
    (raw.setdefault(section, {}) if section else raw)[key] = 1
    with pytest.raises(ConfigError, match=f"unknown key; did you mean '{suggestion}'"):
        load_recipe(raw)


def test_did_you_mean_train_on_prompt() -> None:
    raw = json.loads(json.dumps(MINIMAL))
    raw["data"]["train_on_prompt"] = True
    raw["train_on_prompt"] = True
    with pytest.raises(ConfigError, match="did you mean 'data.train_on_prompt'"):
        load_recipe(raw)


def test_train_gradient_checkpointing_is_a_recipe_key() -> None:
    raw = json.loads(json.dumps(MINIMAL))
    raw["train"] = {"gradient_checkpointing": True}
    assert load_recipe(raw).train.gradient_checkpointing is True


def test_a_llamafactory_yaml_trains_unchanged_into_its_output_dir(lf_dir: Path) -> None:
    """The whole path: zerotune finetune LF.yaml (2 ranks, LoRA on all linear layers, gradient checkpointing on as
    LLaMA-Factory has it), no --output-dir: the run lands in the YAML's output_dir, the notes are printed once."""
    from tests.test_finetune_causal_lm import make_tiny_llama

    model = make_tiny_llama(lf_dir / "tiny-llama")
    path = _write(lf_dir, LF_LORA_SFT, model_name_or_path="tiny-llama", template=DROP, lr_scheduler_type=DROP,
                  bf16=False, trust_remote_code=False, cutoff_len=32, per_device_train_batch_size=4,
                  gradient_accumulation_steps=1, num_train_epochs=DROP, max_steps=4, val_size=0.25,
                  output_dir="saves/tiny/lora/sft", logging_steps=2, save_steps=DROP)
    result = _cli(str(path), cwd=lf_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((lf_dir / "saves/tiny/lora/sft/summary.json").read_text())
    assert summary["method"] == "lora" and summary["steps"] == 4 and summary["model"] == str(model)
    assert (lf_dir / "saves/tiny/lora/sft/adapter").is_dir()
    assert result.stderr.count("llamafactory key 'plot_loss: true': no effect here") == 1
