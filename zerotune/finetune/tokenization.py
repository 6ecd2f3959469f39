"""Tokenization and batching for the fine-tuning tasks.

Classification rows become ``input_ids`` / ``attention_mask`` / ``labels`` without padding;
causal-LM pairs and conversations are rendered with the tokenizer's chat template (``data.template``) and
trained on the turns a :class:`LossPolicy` names -- by default the answers only (other tokens get
``IGNORE_INDEX``). Padding happens per batch in the collator, to the
longest row, which costs far less compute than padding every row to ``max_length``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import datasets

from zerotune.finetune.chat_templates import TEMPLATES
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


@dataclass(frozen=True)
class LossPolicy:
    """Which tokens of a prompt/response or chat row carry the loss (``data.train_on_prompt``,
    ``data.train_on`` / ``data.roles_to_train``) and whether text rows end with EOS (``data.add_eos``)."""

    train_on_prompt: bool = False
    """Every token of every turn (template markers included) is trained on."""
    roles: tuple[str, ...] = ("assistant",)
    """The roles whose turns are trained on (chat rows; for prompt/response rows the prompt is the user's)."""
    last_only: bool = False
    """Only the last turn of those roles is trained on (``data.train_on: last_assistant``)."""
    add_eos: bool = True
    """Text rows get the tokenizer's EOS appended (and trained on), so a completion-trained model learns to stop."""


@quiet_datasets()
def tokenize_causal_lm(
    dataset: datasets.Dataset, tokenizer: Any, max_length: int, policy: LossPolicy | None = None
) -> datasets.Dataset:
    """``input_ids`` / ``attention_mask`` / ``labels`` for next-token training, from any shape of
    ``formats.py``.

    ``text`` rows train on every token (and end with EOS unless ``policy.add_eos`` is off; truncation keeps
    room for it). ``prompt``/``response`` rows are rendered with the tokenizer's chat template when it has one
    (``chat_templates.use_template`` sets ``data.template`` on it first), else as plain text ending with EOS.
    ``messages`` rows need a chat template. Both train on the turns ``policy`` names (by default every
    assistant turn). ``input_ids`` rows are taken as given (their ``labels``, or every token). Rows with no
    trained token left within ``max_length`` are dropped; if that leaves nothing, the error says how long the
    prompts are.
    """
    _check_max_length(max_length)
    policy = policy or LossPolicy()
    chat = getattr(tokenizer, "chat_template", None) is not None
    if "messages" in dataset.column_names and not chat:
        raise DataError("the data holds chat messages, but the model's tokenizer has no chat template to render "
                        "them; set data.template to one of " + ", ".join(TEMPLATES) + " (not none), use a chat "
                        "(instruct) model's tokenizer, or give prompt/response or text data")
    prompt_lengths: list[int] = []

    def encode(batch: dict[str, list]) -> dict[str, list]:
        rows = []
        if "text" in batch:
            rows = [_text_ids(tokenizer, text, max_length, policy.add_eos) for text in batch["text"]]
        elif "input_ids" in batch:
            for index, ids in enumerate(batch["input_ids"]):
                labels = batch["labels"][index] if "labels" in batch else ids
                rows.append((list(ids)[:max_length], list(labels)[:max_length]))
        else:
            if "messages" in batch:
                conversations = batch["messages"]
            else:
                conversations = [[{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
                                 for prompt, response in zip(batch["prompt"], batch["response"])]
            for turns in conversations:
                ids, labels = (_conversation_ids(tokenizer, turns, policy) if chat
                               else _plain_pair_ids(tokenizer, turns, policy))
                prompt_lengths.append(next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(ids)))
                rows.append((ids[:max_length], labels[:max_length]))
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


def _text_ids(tokenizer: Any, text: str, max_length: int, add_eos: bool) -> tuple[list[int], list[int]]:
    """A text row, every token trained; with ``add_eos`` it ends with EOS, kept within ``max_length``."""
    eos = tokenizer.eos_token_id if add_eos else None
    ids = list(tokenizer(text, truncation=True, max_length=max_length - (eos is not None))["input_ids"])
    if eos is not None and (not ids or ids[-1] != eos):  # (a tokenizer that adds EOS itself keeps its one)
        ids.append(eos)
    return ids, list(ids)


def _trained_turns(turns: list[dict], policy: LossPolicy) -> list[int]:
    """The positions of the turns whose tokens carry the loss."""
    positions = [i for i, turn in enumerate(turns) if policy.train_on_prompt or turn["role"] in policy.roles]
    return positions[-1:] if policy.last_only and not policy.train_on_prompt else positions


def _conversation_ids(tokenizer: Any, turns: list[dict], policy: LossPolicy) -> tuple[list[int], list[int]]:
    """A whole conversation's ids, with labels on the turns ``policy`` trains: each such turn is the text the
    template adds to the conversation before it (rendered with the generation prompt before an assistant turn,
    so the assistant header stays untrained).

    The turns are found in the rendered *text* and mapped to tokens by their character offsets, so a template
    whose markers the tokenizer splits into several tokens -- which can merge across a turn's edge ("\n\n"
    is one token at the end of a text and two before a word) -- still marks the right tokens.
    """
    text = _render(tokenizer, turns)
    if policy.train_on_prompt:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return list(ids), list(ids)
    edges: list[tuple[int, int]] = []
    for position in _trained_turns(turns, policy):
        before = _render(tokenizer, turns[:position], turns[position]["role"] == "assistant") if position else ""
        through = _render(tokenizer, turns[:position + 1])
        if not (text.startswith(through) and through.startswith(before)):
            raise DataError("the tokenizer's chat template renders a conversation's beginning differently once later "
                            "turns follow, so the trained turns cannot be told apart; render the conversations "
                            "into a text column yourself (data.format: text)")
        edges.append((len(before), len(through)))
    ids, starts = _ids_and_starts(tokenizer, text, [edge for pair in edges for edge in pair])
    labels = [token if any(start <= at < end for start, end in edges) else IGNORE_INDEX
              for token, at in zip(ids, starts)]
    return ids, labels


def _render(tokenizer: Any, turns: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(turns, add_generation_prompt=generation_prompt, tokenize=False)


def _ids_and_starts(tokenizer: Any, text: str, edges: list[int]) -> tuple[list[int], list[int]]:
    """``text``'s token ids (as ``apply_chat_template`` tokenizes it) and where each token starts in it.

    A fast tokenizer gives the offsets; for a slow one each edge is placed by tokenizing the text before it,
    which works when that is a prefix of the whole text's tokens (the tokens are then given the edge as start).
    """
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoded["input_ids"]), [start for start, _ in encoded["offset_mapping"]]
    except (NotImplementedError, ValueError, TypeError):
        pass
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    starts = [0] * len(ids)
    for edge in sorted(set(edges)):
        head = list(tokenizer(text[:edge], add_special_tokens=False)["input_ids"])
        if ids[:len(head)] != head:
            raise DataError("the tokenizer splits the chat template's text differently at a turn's edge, so the "
                            "trained turns cannot be told apart; use a fast tokenizer or a template whose markers "
                            "are the tokenizer's special tokens (data.template)")
        starts[len(head):] = [edge] * (len(ids) - len(head))
    return ids, starts


def _plain_pair_ids(tokenizer: Any, turns: list[dict], policy: LossPolicy) -> tuple[list[int], list[int]]:
    """Without a chat template (``data.template: none``): the prompt as tokenized text, then the answer and EOS;
    the prompt is trained on with ``train_on_prompt`` or when ``roles_to_train`` holds ``user``."""
    prompt, response = turns[0]["content"], turns[1]["content"]
    prompt_ids = tokenizer(prompt)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    trained = _trained_turns(turns, policy)
    prompt_labels = list(prompt_ids) if 0 in trained else [IGNORE_INDEX] * len(prompt_ids)
    answer = response_ids + eos
    answer_labels = list(answer) if 1 in trained else [IGNORE_INDEX] * len(answer)
    return prompt_ids + answer, prompt_labels + answer_labels


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


def _check_max_length(max_length: int) -> None:
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 2:
        raise DataError(f"max_length must be an integer >= 2, got {max_length!r}")
