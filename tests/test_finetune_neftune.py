"""NEFTune (``train.neftune_noise_alpha``): transformers' hook on the input embeddings, noisy while training only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed
from tests.test_finetune_causal_lm import _run_worker, make_tiny_llama, write_recipe
from zerotune.config import ConfigError
from zerotune.finetune.neftune import activate_neftune, neftune_hook, noisy_embeddings
from zerotune.finetune.recipe import load_recipe

ALPHA = 5.0


def _tiny_lora_llama(tmp_path: Path):
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_tiny_llama(tmp_path / "llama"))
    return get_peft_model(model, LoraConfig(task_type=TaskType.CAUSAL_LM, r=2, target_modules=["q_proj"]))


def test_the_hook_is_transformers_own() -> None:
    from transformers.integrations.neftune import neftune_post_forward_hook

    assert neftune_hook() is neftune_post_forward_hook


def test_noise_through_a_peft_model_in_training_only_and_within_the_bound(tmp_path: Path) -> None:
    model = _tiny_lora_llama(tmp_path)
    handle = activate_neftune(model, ALPHA)
    embeddings = model.get_input_embeddings()
    assert embeddings is model.base_model.model.model.embed_tokens  # the base model's layer, through peft
    ids = torch.randint(4, embeddings.num_embeddings, (3, 10))
    clean = embeddings.weight[ids].detach()
    bound = ALPHA / (10 * embeddings.embedding_dim) ** 0.5
    model.train()
    with torch.no_grad():
        noise = embeddings(ids) - clean
    assert noise.abs().max() <= bound * (1 + 1e-5) and noise.abs().max() > 0.9 * bound
    assert noise.std() == pytest.approx(bound / 3 ** 0.5, rel=0.1)  # uniform in [-bound, bound]
    with torch.no_grad():
        assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)  # fresh noise each pass
    model.eval()
    with torch.no_grad():
        assert torch.equal(embeddings(ids), clean)
        with_hook = model(input_ids=ids).logits
        handle.remove()
        assert torch.equal(with_hook, model(input_ids=ids).logits)


def test_fallback_hook_has_the_same_bound() -> None:
    layer = torch.nn.Embedding(8, 6)
    layer.neftune_noise_alpha = 2.0
    ids = torch.arange(8).reshape(2, 4)
    clean = layer(ids).detach()
    noisy = noisy_embeddings(layer, (ids,), clean)
    assert 0 < (noisy - clean).abs().max() <= 2.0 / (4 * 6) ** 0.5
    layer.eval()
    assert noisy_embeddings(layer, (ids,), clean) is clean


@pytest.mark.parametrize("raw, path, words", [
    ({"task": "sequence-classification"}, "train.neftune_noise_alpha", "causal-lm"),
    ({"alpha": 0.0}, "train.neftune_noise_alpha", "greater than 0"),
])
def test_bad_neftune_settings_are_one_line_errors(tmp_path: Path, raw: dict, path: str, words: str) -> None:
    recipe = json.loads(write_recipe(tmp_path).read_text())
    recipe["train"]["neftune_noise_alpha"] = raw.get("alpha", ALPHA)
    if "task" in raw:
        recipe["task"] = raw["task"]
        recipe["data"] = {"bundled": "rotten_tomatoes"}
        recipe["method"] = {"type": "full"}
    with pytest.raises(ConfigError) as info:
        load_recipe(recipe)
    assert info.value.path == path and words in str(info.value), str(info.value)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_short_neftune_run_trains(tmp_path: Path, stage: int) -> None:
    path = write_recipe(tmp_path, stage=stage)
    recipe = json.loads(path.read_text())
    recipe["train"].update(neftune_noise_alpha=ALPHA, max_steps=20, eval_every=0)
    path.write_text(json.dumps(recipe))
    summary = run_distributed(_run_worker, 2, str(path), str(tmp_path / "run"), False, timeout=240)[0]
    assert summary["steps"] == 20 and summary["after"] < 0.7 * summary["before"], summary
    # the noise was on: the same first batch on the same weights, without it, has another training loss
    recipe["train"].update(neftune_noise_alpha=None, max_steps=1)
    path.write_text(json.dumps(recipe))
    run_distributed(_run_worker, 2, str(path), str(tmp_path / "clean"), False, timeout=240)

    def first_loss(run: str) -> float:
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return next(r["loss"] for r in map(json.loads, lines) if r["split"] == "step")

    assert first_loss("run") != pytest.approx(first_loss("clean"), rel=1e-6)
