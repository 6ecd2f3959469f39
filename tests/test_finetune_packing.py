"""``data.packing``: short causal-LM examples packed into rows that keep every example independent."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import datasets
import pytest
import torch

from tests.harness import run_distributed
from tests.test_finetune_causal_lm import make_tiny_llama, write_recipe
from zerotune.finetune.packing import (PackingError, check_packing_support, pack_examples, packed_collator,
                                       prepare_for_packing)
from zerotune.finetune.recipe import RecipeError, load_recipe
from zerotune.finetune.tokenization import IGNORE_INDEX


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("packing") / "tiny-llama")


def _examples() -> datasets.Dataset:
    rows = [([2, 8, 9, 10, 11], [IGNORE_INDEX, IGNORE_INDEX, 9, 10, 11]), ([2, 12, 13], [IGNORE_INDEX, 12, 13]),
            ([2, 14, 15, 16], [2, 14, 15, 16]), ([2, 17, 18, 19, 20, 21], [IGNORE_INDEX] * 3 + [19, 20, 21])]
    return datasets.Dataset.from_dict({"input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows]})


def test_examples_are_packed_greedily_with_positions_restarting_and_no_label_across_a_boundary() -> None:
    packed = pack_examples(_examples(), max_length=9)
    assert packed["input_ids"] == [[2, 8, 9, 10, 11, 2, 12, 13], [2, 14, 15, 16],
                                   [2, 17, 18, 19, 20, 21]]
    assert packed["position_ids"][0] == [0, 1, 2, 3, 4, 0, 1, 2]
    assert packed["labels"][0] == [IGNORE_INDEX, IGNORE_INDEX, 9, 10, 11, IGNORE_INDEX, 12, 13]
    assert packed["labels"][1] == [IGNORE_INDEX, 14, 15, 16]  # a text row's first token is never a target anyway
    assert all(len(row) <= 9 for row in packed["input_ids"])


def test_a_packed_row_computes_exactly_what_each_example_computes_alone(llama_dir) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    prepare_for_packing(model)  # (with the model's KV cache on, transformers would let the examples see each other)
    examples = _examples()
    packed = pack_examples(examples, max_length=64)
    assert len(packed) == 1
    batch = packed_collator(pad_token_id=0)([packed[0]])
    with torch.no_grad():
        together = model(**batch)
        start, losses, targets = 0, [], []
        for ids, labels in zip(examples["input_ids"], examples["labels"]):
            alone = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]))
            torch.testing.assert_close(together.logits[0, start:start + len(ids)], alone.logits[0], rtol=1e-5, atol=1e-5)
            count = sum(label != IGNORE_INDEX for label in labels[1:])
            losses.append(alone.loss * count)
            targets.append(count)
            start += len(ids)
    assert together.loss.item() == pytest.approx((sum(losses) / sum(targets)).item(), rel=1e-5)


def test_padding_in_a_packed_batch_changes_no_real_token(llama_dir) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    prepare_for_packing(model)
    packed = pack_examples(_examples(), max_length=9)
    batch = packed_collator(pad_token_id=0)([packed[1], packed[0]])  # the short row is padded by 4
    with torch.no_grad():
        padded = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0, :4]
        alone = model(input_ids=torch.tensor([packed[1]["input_ids"]])).logits[0]
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)


def test_packing_is_refused_where_it_cannot_keep_examples_apart(tmp_path, llama_dir) -> None:
    class NoPositions(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, labels=None):  # pragma: no cover - never called
            return input_ids

    with pytest.raises(PackingError, match="data.packing: NoPositions.forward takes no position_ids"):
        check_packing_support(NoPositions)
    recipe = json.loads(write_recipe(tmp_path).read_text())
    recipe["data"]["packing"] = True
    recipe["method"] = {"type": "prefix"}
    with pytest.raises(RecipeError, match="data.packing: not with method.type prefix"):
        load_recipe(recipe)
    with pytest.raises(RecipeError, match="data.packing: only used by task 'causal-lm'"):
        load_recipe(None, ["data.packing=true"])


def _finetune(recipe: str, output: str) -> dict:
    from zerotune.finetune.worker import run

    return run(argparse.Namespace(recipe=recipe, output_dir=output, resume=False, merge=False, overrides=[]))


@pytest.mark.slow
def test_a_packed_run_trains_on_two_ranks_with_fewer_rows(tmp_path) -> None:
    path = write_recipe(tmp_path, stage=2)
    recipe = json.loads(path.read_text())
    recipe["data"].update(packing=True, max_length=64)
    recipe["train"].update(max_steps=30, eval_every=0, eval_samples=0, micro_batch_size=2)
    path.write_text(json.dumps(recipe))
    summary = run_distributed(_finetune, 2, str(path), str(tmp_path / "run"), timeout=300)[0]
    assert summary["after"] < 0.6 * summary["before"], summary
    print(f"packed LoRA (ZeRO 2): answer loss {summary['before']:.3f} -> {summary['after']:.3f}")
