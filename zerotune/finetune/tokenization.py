"""Tokenization and batching for the fine-tuning tasks.

Classification rows become ``input_ids`` / ``attention_mask`` / ``labels`` without padding;
causal-LM rows are rendered with the tokenizer's chat template and trained on the answer only
(prompt tokens get ``IGNORE_INDEX``). Padding happens per batch in the collator, to the
longest row, which costs far less compute than padding every row to ``max_length``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import datasets

from zerotune.finetune.data_files import DataError, quiet_datasets

IGNORE_INDEX = -100  # label id the HF losses skip: prompt tokens and padding


def tokenize_classification(dataset: datasets.Dataset, tokenizer: Any, max_length: int) -> datasets.Dataset:
    """``input_ids`` / ``attention_mask`` [/ ``token_type_ids``] / ``labels``, truncated, unpadded.

    Padding is left to the collator (per batch, to the longest row): far less compute than
    padding every row to ``max_length`` when most sentences are short.
    """
    _check_max_length(max_length)
    has_pair = "text_pair" in dataset.column_names

    def encode(batch: dict[str, list]) -> dict[str, list]:
        encoded = tokenizer(batch["text"], batch["text_pair"] if has_pair else None, truncation=True, max_length=max_length)
        return {**encoded, "labels": batch["label"]}

    return dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc="tokenizing")


@quiet_datasets()
def tokenize_causal_lm(
    dataset: datasets.Dataset, tokenizer: Any, max_length: int, *, use_chat_template: bool = True
) -> datasets.Dataset:
    """``input_ids`` / ``attention_mask`` / ``labels`` for next-token training.

    ``text`` rows train on every token. ``prompt``/``response`` rows are rendered with the
    tokenizer's chat template (when it has one) and train only on the answer: the prompt's
    labels are ``IGNORE_INDEX``. Rows whose answer is cut off entirely by ``max_length`` carry no
    signal and are dropped.
    """
    _check_max_length(max_length)
    chat = use_chat_template and getattr(tokenizer, "chat_template", None) is not None

    def encode(batch: dict[str, list]) -> dict[str, list]:
        rows = []
        if "text" in batch:
            for text in batch["text"]:
                ids = tokenizer(text, truncation=True, max_length=max_length)["input_ids"]
                rows.append((ids, list(ids)))
        else:
            for prompt, response in zip(batch["prompt"], batch["response"]):
                prompt_ids, full_ids = _prompt_and_full_ids(tokenizer, prompt, response, chat)
                labels = [IGNORE_INDEX] * len(prompt_ids) + full_ids[len(prompt_ids) :]
                rows.append((full_ids[:max_length], labels[:max_length]))
        rows = [(ids, labels) for ids, labels in rows if any(label != IGNORE_INDEX for label in labels)]
        return {
            "input_ids": [ids for ids, _ in rows],
            "attention_mask": [[1] * len(ids) for ids, _ in rows],
            "labels": [labels for _, labels in rows],
        }

    return dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc="tokenizing")


def make_collator(tokenizer: Any, task: str = "sequence-classification") -> Callable[[list[dict]], dict]:
    """Dynamic padding per batch: pads ids and masks, and for causal LM pads labels with -100."""
    import transformers  # deferred: only the training path needs it

    if tokenizer.pad_token_id is None:
        raise DataError(
            "the tokenizer has no pad token, needed to pad batches; set one first "
            "(for GPT-style models: tokenizer.pad_token = tokenizer.eos_token)"
        )
    if task == "sequence-classification":
        return transformers.DataCollatorWithPadding(tokenizer, return_tensors="pt")
    if task == "causal-lm":
        return transformers.DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX, return_tensors="pt")
    raise DataError(f"unknown task {task!r}; expected 'sequence-classification' or 'causal-lm'")


def _prompt_and_full_ids(tokenizer: Any, prompt: str, response: str, chat: bool) -> tuple[list[int], list[int]]:
    if chat:
        user = [{"role": "user", "content": prompt}]
        prompt_ids = _as_ids(tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True))
        full_ids = _as_ids(tokenizer.apply_chat_template(user + [{"role": "assistant", "content": response}], tokenize=True))
        if full_ids[: len(prompt_ids)] != prompt_ids:
            raise DataError(
                "the tokenizer's chat template renders the prompt differently once an answer follows; "
                "set use_chat_template: false"
            )
        return prompt_ids, full_ids
    prompt_ids = tokenizer(prompt)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return prompt_ids, prompt_ids + response_ids + eos


def _as_ids(rendered: Any) -> list[int]:
    """``apply_chat_template(tokenize=True)`` returns a list or a BatchEncoding, by version."""
    return list(rendered["input_ids"]) if hasattr(rendered, "keys") else list(rendered)


def _check_max_length(max_length: int) -> None:
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 2:
        raise DataError(f"max_length must be an integer >= 2, got {max_length!r}")
