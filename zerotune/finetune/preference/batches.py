"""Preference rows -> token ids -> padded batches.

A row's prompt is rendered the way SFT renders it (the tokenizer's chat template with the generation
prompt, or plain text where there is none); each answer is what the template adds after that prompt
(with its end-of-turn token), or the answer's text plus EOS without a template. Paired batches hold
the chosen sequences first and the rejected ones after them, so one forward scores both (as TRL does);
``completion_mask`` marks the answer tokens whose log-probabilities the losses sum.

KTO rows carry a second, *mismatched* sequence -- the prompt with another row's answer -- from which the
batch's KL reference point is estimated; the pairing is fixed when the data is tokenized (row i takes
row i+1's answer), so reference log-probabilities of it can be computed once.
"""

from __future__ import annotations

from typing import Any, Callable

import datasets
import torch

from zerotune.finetune.data_files import DataError


def tokenize_pairs(dataset: datasets.Dataset, tokenizer: Any, max_length: int) -> datasets.Dataset:
    """``prompt_ids``, ``chosen_ids``, ``rejected_ids`` per row; answers cut to fit ``max_length`` with the
    prompt, rows whose prompt leaves no room for an answer token dropped (an error if none is left)."""
    rows: dict[str, list] = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
    longest_prompt = 0
    for prompt, chosen, rejected in zip(dataset["prompt"], dataset["chosen"], dataset["rejected"]):
        prompt_ids = prompt_token_ids(tokenizer, prompt)
        longest_prompt = max(longest_prompt, len(prompt_ids))
        room = max_length - len(prompt_ids)
        if room < 1:
            continue
        rows["prompt_ids"].append(prompt_ids)
        rows["chosen_ids"].append(answer_token_ids(tokenizer, prompt, prompt_ids, chosen)[:room])
        rows["rejected_ids"].append(answer_token_ids(tokenizer, prompt, prompt_ids, rejected)[:room])
    _check_rows_left(len(dataset), len(rows["prompt_ids"]), max_length, longest_prompt)
    return datasets.Dataset.from_dict(rows)


def tokenize_unpaired(dataset: datasets.Dataset, tokenizer: Any, max_length: int) -> datasets.Dataset:
    """KTO rows: ``prompt_ids``, ``completion_ids``, ``label``, and ``kl_completion_ids`` (the next row's
    answer, cut to fit after this row's prompt)."""
    prompts, completions, labels = [], [], []
    longest_prompt = 0
    for prompt, completion, label in zip(dataset["prompt"], dataset["completion"], dataset["label"]):
        prompt_ids = prompt_token_ids(tokenizer, prompt)
        longest_prompt = max(longest_prompt, len(prompt_ids))
        if max_length - len(prompt_ids) < 1:
            continue
        prompts.append(prompt_ids)
        completions.append(answer_token_ids(tokenizer, prompt, prompt_ids, completion)[:max_length - len(prompt_ids)])
        labels.append(bool(label))
    _check_rows_left(len(dataset), len(prompts), max_length, longest_prompt)
    mismatched = [completions[(i + 1) % len(completions)][:max_length - len(prompts[i])] for i in range(len(prompts))]
    return datasets.Dataset.from_dict({"prompt_ids": prompts, "completion_ids": completions, "label": labels,
                                       "kl_completion_ids": mismatched})


def prompt_token_ids(tokenizer: Any, prompt: list[dict[str, str]]) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is not None:
        return _as_ids(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))
    return list(tokenizer("\n\n".join(turn["content"] for turn in prompt))["input_ids"])


def answer_token_ids(tokenizer: Any, prompt: list[dict[str, str]], prompt_ids: list[int], answer: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        return list(tokenizer(answer, add_special_tokens=False)["input_ids"]) + eos
    full = _as_ids(tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": answer}], tokenize=True))
    if full[:len(prompt_ids)] != prompt_ids:
        raise DataError("the tokenizer's chat template renders the prompt differently once an answer follows, so the "
                        "answer cannot be told apart; use a template that renders turns in order (data.template)")
    return full[len(prompt_ids):]


def paired_collator(pad_id: int) -> Callable[[list[dict]], dict[str, torch.Tensor]]:
    """Rows -> ``input_ids``, ``attention_mask``, ``completion_mask`` of shape ``(2 x rows, longest)``: the
    chosen sequences, then the rejected ones; reference log-probs (when the rows carry them) ride along."""

    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        sequences = [(row["prompt_ids"], row["chosen_ids"]) for row in rows]
        sequences += [(row["prompt_ids"], row["rejected_ids"]) for row in rows]
        batch = _pad(sequences, pad_id)
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            if key in rows[0]:
                batch[key] = torch.tensor([row[key] for row in rows], dtype=torch.float32)
        return batch

    return collate


def unpaired_collator(pad_id: int) -> Callable[[list[dict]], dict[str, torch.Tensor]]:
    """KTO rows -> the rated sequences (``input_ids`` ...) and the mismatched ones (``kl_input_ids`` ...)."""

    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        batch = _pad([(row["prompt_ids"], row["completion_ids"]) for row in rows], pad_id)
        mismatched = _pad([(row["prompt_ids"], row["kl_completion_ids"]) for row in rows], pad_id)
        batch.update({f"kl_{key}": value for key, value in mismatched.items()})
        batch["label"] = torch.tensor([row["label"] for row in rows], dtype=torch.bool)
        for key in ("ref_logps", "ref_kl_logps"):
            if key in rows[0]:
                batch[key] = torch.tensor([row[key] for row in rows], dtype=torch.float32)
        return batch

    return collate


def _pad(sequences: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(prompt) + len(answer) for prompt, answer in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    completion = torch.zeros((len(sequences), width), dtype=torch.long)
    for index, (prompt, answer) in enumerate(sequences):
        length = len(prompt) + len(answer)
        ids[index, :length] = torch.tensor(prompt + answer, dtype=torch.long)
        attention[index, :length] = 1
        completion[index, len(prompt):length] = 1
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def _check_rows_left(before: int, after: int, max_length: int, longest_prompt: int) -> None:
    if before and not after:
        raise DataError(f"every one of the {before} preference rows has a prompt of data.max_length = {max_length} "
                        f"tokens or more (the longest is {longest_prompt}), leaving no room for an answer; raise "
                        "data.max_length")


def _as_ids(rendered: Any) -> list[int]:
    """``apply_chat_template(tokenize=True)`` returns a list or a BatchEncoding, by version."""
    return list(rendered["input_ids"]) if hasattr(rendered, "keys") else list(rendered)
