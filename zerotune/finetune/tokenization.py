"""Tokenization and batching for the fine-tuning tasks.

Classification rows become ``input_ids`` / ``attention_mask`` / ``labels`` without padding;
causal-LM pairs and conversations are rendered with the tokenizer's chat template and trained on the
answers only (other tokens get ``IGNORE_INDEX``). Padding happens per batch in the collator, to the
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
        encoded = tokenizer(batch["text"], batch["text_pair"] if has_pair else None, truncation=True,
                            max_length=max_length)
        return {**encoded, "labels": batch["label"]}

    return dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc="tokenizing")


@quiet_datasets()
def tokenize_causal_lm(
    dataset: datasets.Dataset, tokenizer: Any, max_length: int, *, use_chat_template: bool = True
) -> datasets.Dataset:
    """``input_ids`` / ``attention_mask`` / ``labels`` for next-token training, from any shape of
    ``formats.py``.

    ``text`` rows train on every token. ``prompt``/``response`` rows are rendered with the tokenizer's
    chat template (when it has one) and train only on the answer. ``messages`` rows need a chat
    template and train on every assistant turn. ``input_ids`` rows are taken as given (their
    ``labels``, or every token). Rows with no trained token left within ``max_length`` are dropped;
    if that leaves nothing, the error says how long the prompts are.
    """
    _check_max_length(max_length)
    chat = use_chat_template and getattr(tokenizer, "chat_template", None) is not None
    if "messages" in dataset.column_names and not chat:
        raise DataError("the data holds chat messages, but the model's tokenizer has no chat template to render "
                        "them; use a chat (instruct) model's tokenizer, or give prompt/response or text data")
    prompt_lengths: list[int] = []

    def encode(batch: dict[str, list]) -> dict[str, list]:
        rows = []
        if "text" in batch:
            for text in batch["text"]:
                ids = tokenizer(text, truncation=True, max_length=max_length)["input_ids"]
                rows.append((ids, list(ids)))
        elif "input_ids" in batch:
            for index, ids in enumerate(batch["input_ids"]):
                labels = batch["labels"][index] if "labels" in batch else ids
                rows.append((list(ids)[:max_length], list(labels)[:max_length]))
        elif "messages" in batch:
            for turns in batch["messages"]:
                ids, labels = _conversation_ids(tokenizer, turns)
                prompt_lengths.append(next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(ids)))
                rows.append((ids[:max_length], labels[:max_length]))
        else:
            for prompt, response in zip(batch["prompt"], batch["response"]):
                prompt_ids, full_ids = _prompt_and_full_ids(tokenizer, prompt, response, chat)
                prompt_lengths.append(len(prompt_ids))
                labels = [IGNORE_INDEX] * len(prompt_ids) + full_ids[len(prompt_ids) :]
                rows.append((full_ids[:max_length], labels[:max_length]))
        rows = [(ids, labels) for ids, labels in rows if any(label != IGNORE_INDEX for label in labels)]
        return {
            "input_ids": [ids for ids, _ in rows],
            "attention_mask": [[1] * len(ids) for ids, _ in rows],
            "labels": [labels for _, labels in rows],
        }

    encoded = dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc="tokenizing")
    if len(dataset) and not len(encoded):
        longest = f" (the prompts are {min(prompt_lengths)} to {max(prompt_lengths)} tokens)" if prompt_lengths else ""
        raise DataError(f"every one of the {len(dataset)} examples has its answer beyond data.max_length = "
                        f"{max_length} tokens{longest}, so none is left to train on; raise data.max_length")
    return encoded


def _conversation_ids(tokenizer: Any, turns: list[dict]) -> tuple[list[int], list[int]]:
    """A whole conversation's ids, with labels on the assistant turns only: each assistant turn is what the
    template adds to the conversation before it (rendered with the generation prompt)."""
    ids: list[int] = []
    labels: list[int] = []
    for position, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        before = _as_ids(tokenizer.apply_chat_template(turns[:position], add_generation_prompt=True, tokenize=True))
        through = _as_ids(tokenizer.apply_chat_template(turns[:position + 1], tokenize=True))
        if before[:len(ids)] != ids or through[:len(before)] != before:
            raise DataError("the tokenizer's chat template renders a conversation's beginning differently once later "
                            "turns follow, so the assistant turns cannot be told apart; render the conversations "
                            "into a text column yourself (data.format: text)")
        labels += [IGNORE_INDEX] * (len(before) - len(ids)) + through[len(before):]
        ids = through
    rest = _as_ids(tokenizer.apply_chat_template(turns, tokenize=True))  # turns after the last answer
    if rest[:len(ids)] == ids:
        labels += [IGNORE_INDEX] * (len(rest) - len(ids))
        ids = rest
    return ids, labels


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
        full_ids = _as_ids(tokenizer.apply_chat_template(user + [{"role": "assistant", "content": response}],
                                                         tokenize=True))
        if full_ids[: len(prompt_ids)] != prompt_ids:
            raise DataError(
                "the tokenizer's chat template renders the prompt differently once an answer follows, so the answer "
                "cannot be told apart; render the pairs into a text column yourself (data.format: text)"
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
