"""LoRA and prefix tuning through the fine-tuning job, with every implemented ZeRO stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import run_distributed
from tests.test_finetune_run import _run_worker, write_recipe


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lora_trains_only_adapters_and_saves_adapter_and_merged_model(tmp_path: Path, stage: int) -> None:
    recipe = write_recipe(tmp_path, stage, lr=1e-2, max_steps=36)
    overrides = ["method.type=lora", "method.r=4", "method.alpha=8", "method.target_modules=[query,value]"]
    out = tmp_path / "run"
    summary = run_distributed(_run_worker, 2, str(recipe), str(out), False, overrides, timeout=240)[0]
    assert summary["method"] == "lora" and summary["after"] > summary["before"]
    from peft import AutoPeftModelForSequenceClassification

    adapter = AutoPeftModelForSequenceClassification.from_pretrained(out / "adapter")
    lora_weights = [p for n, p in adapter.named_parameters() if "lora_" in n]
    assert lora_weights and all(p.numel() > 0 for p in lora_weights)  # real tensors, never torch.Size([0])


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_merge_writes_a_plain_loadable_model(tmp_path: Path, stage: int) -> None:
    recipe = write_recipe(tmp_path, stage, lr=1e-2)
    out = tmp_path / "run"
    run_distributed(_merge_run, 2, str(recipe), str(out), timeout=240)
    from transformers import AutoModelForSequenceClassification

    merged = AutoModelForSequenceClassification.from_pretrained(out / "merged")
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    assert json.loads((out / "summary.json").read_text())["method"] == "lora"


def _merge_run(recipe: str, output: str) -> dict:
    import argparse

    from zerotune.finetune.worker import run

    return run(argparse.Namespace(recipe=recipe, output_dir=output, resume=False, merge=True,
                                  overrides=["method.type=lora", "method.target_modules=[query,value]"]))


def test_prefix_tuning_for_classification_is_a_clear_error_when_the_model_cannot_take_it() -> None:
    from transformers import BertConfig, BertForSequenceClassification

    from zerotune.finetune.models import ModelLoadError, check_prefix_tuning_support

    model = BertForSequenceClassification(BertConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1,
                                                     num_attention_heads=1, intermediate_size=8))
    with pytest.raises(ModelLoadError, match="prefix tuning for sequence classification needs .* "
                                             "BertForSequenceClassification does not"):
        check_prefix_tuning_support(model)
