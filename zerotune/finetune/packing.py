"""Packing short causal-LM examples into full-length rows (``data.packing: true``).

Chat and instruction examples are often a few dozen tokens; padded per batch, most of every batch is
padding. Packed, several examples share one row of up to ``data.max_length`` tokens and the compute goes
to real tokens. What keeps examples independent:

* ``position_ids`` restart at 0 for each example and no ``attention_mask`` is passed: transformers then
  builds a block-diagonal causal mask from the position ids (``masking_utils``), so no token attends to
  another example -- the forward of a packed row equals each example's own forward;
* the first token of each example gets no label, so no token is trained to predict the next example;
* the model runs without a KV cache (a cache disables that detection).

Models whose forward takes no ``position_ids`` cannot tell the examples apart, and prefix tuning passes
its prefix as a cache; both are refused before training. Evaluation stays unpacked (per example).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import datasets
import torch

from zerotune.finetune.models import ModelLoadError
from zerotune.finetune.tokenization import IGNORE_INDEX


class PackingError(ModelLoadError):
    """The model cannot keep packed examples apart; the message says why and what to do."""


def check_packing_support(model_class: type) -> None:
    """Before any weights load (the launcher checks the class the model's config names) and again on the
    loaded model: its forward must take ``position_ids``."""
    forward = getattr(model_class, "forward", None)
    if forward is None or "position_ids" not in inspect.signature(forward).parameters:
        raise PackingError(f"data.packing: {model_class.__name__}.forward takes no position_ids, so packed examples "
                           "could not be kept apart (they would attend to each other); set data.packing: false")


def causal_lm_class(model_path: Any, trust_remote_code: bool = False) -> type | None:
    """The causal-LM class a model directory's config names, without loading weights (None when only the
    model's own remote code knows it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    found = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return found if isinstance(found, type) else None  # (a model mapping's values are classes)


def prepare_for_packing(model: Any) -> None:
    """Refuse a model that cannot keep packed examples apart (before a method wraps it); turn its KV cache
    off for training. (Prefix tuning is refused with the recipe.)"""
    check_packing_support(type(model))
    config = getattr(model, "config", None)
    if config is not None:
        config.use_cache = False


def pack_examples(dataset: datasets.Dataset, max_length: int) -> datasets.Dataset:
    """Tokenized rows (``input_ids``, ``labels``) packed in order, greedily, into rows of at most
    ``max_length`` tokens, with ``position_ids`` restarting per example."""
    packed: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}
    row: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    for example in dataset:
        ids, labels = list(example["input_ids"]), list(example["labels"])
        if row["input_ids"] and len(row["input_ids"]) + len(ids) > max_length:
            for key in packed:
                packed[key].append(row[key])
            row = {"input_ids": [], "labels": [], "position_ids": []}
        row["input_ids"] += ids
        row["labels"] += [IGNORE_INDEX] + labels[1:]
        row["position_ids"] += list(range(len(ids)))
    if row["input_ids"]:
        for key in packed:
            packed[key].append(row[key])
    return datasets.Dataset.from_dict(packed)


def packed_collator(pad_token_id: int) -> Callable[[list[dict]], dict[str, torch.Tensor]]:
    """Right-pads packed rows: padding is one more sequence (positions from 0, no labels), which nothing
    before it can see (causal), so it changes no real token's output."""

    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(row["input_ids"]) for row in rows)
        batch: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}
        for row in rows:
            pad = longest - len(row["input_ids"])
            batch["input_ids"].append(list(row["input_ids"]) + [pad_token_id] * pad)
            batch["labels"].append(list(row["labels"]) + [IGNORE_INDEX] * pad)
            batch["position_ids"].append(list(row["position_ids"]) + list(range(pad)))
        return {key: torch.tensor(value, dtype=torch.long) for key, value in batch.items()}

    return collate
