"""``train.gradient_checkpointing``: Hugging Face activation checkpointing, on in the model, the same losses."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tests.harness import run_distributed
from tests.test_finetune_run import write_recipe


def _tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=16))


def _is_checkpointing(model) -> bool:
    return model.is_activation_checkpointing if hasattr(model, "is_activation_checkpointing") \
        else model.is_gradient_checkpointing


def test_gradient_checkpointing_is_on_in_the_model_and_a_frozen_base_feeds_it_inputs_that_need_grad() -> None:
    from types import SimpleNamespace

    import torch

    from zerotune.finetune.models import apply_method, enable_gradient_checkpointing

    full = _tiny_bert()
    enable_gradient_checkpointing(full)
    assert _is_checkpointing(full)
    calls = []
    full.bert.encoder.layer[0].attention.register_forward_hook(lambda *args: calls.append(1))
    full.train()
    full(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([1])).loss.backward()
    assert len(calls) == 2  # the block ran again in the backward pass: its activations were not kept

    lora = apply_method(_tiny_bert(), "sequence-classification",
                        SimpleNamespace(type="lora", r=2, alpha=4, dropout=0.0, target_modules=["query", "value"],
                                        dora=False, rslora=False))
    enable_gradient_checkpointing(lora)
    assert _is_checkpointing(lora.get_base_model())
    embeddings = lora.get_base_model().get_input_embeddings()(torch.tensor([[1, 2, 3]]))
    assert embeddings.requires_grad  # enable_input_require_grads: checkpointed blocks get a graph to recompute into


def test_gradient_checkpointing_refuses_a_model_without_it() -> None:
    import torch

    from zerotune.finetune.models import ModelLoadError, enable_gradient_checkpointing

    with pytest.raises(ModelLoadError, match="train.gradient_checkpointing: Linear does not support"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2))


def _losses_without_and_with(recipe: str, output: str) -> tuple[list[float], list[float]]:
    from zerotune.finetune.worker import run

    losses = []
    for name, overrides in (("plain", []), ("checkpointed", ["train.gradient_checkpointing=true"])):
        run(argparse.Namespace(recipe=recipe, output_dir=f"{output}/{name}", resume=False, merge=False,
                               overrides=overrides))
        lines = [json.loads(line) for line in Path(f"{output}/{name}/metrics.jsonl").read_text().splitlines()]
        losses.append([line["loss"] for line in lines if line["split"] == "step"])
    return losses[0], losses[1]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradient_checkpointing_gives_the_same_losses_at_every_zero_stage(tmp_path: Path, stage: int) -> None:
    recipe = write_recipe(tmp_path, stage, max_steps=6, eval_every=0, save_every=0)
    plain, checkpointed = run_distributed(_losses_without_and_with, 2, str(recipe), str(tmp_path / "run"),
                                          timeout=300)[0]
    assert len(plain) == 6
    assert checkpointed == pytest.approx(plain, rel=1e-5, abs=1e-6)
