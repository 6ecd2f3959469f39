"""Preference data in the layouts TRL, LLaMA-Factory and axolotl document, brought to one shape.

Paired methods (DPO, ORPO, SimPO, reward models) read rows of

  prompt / chosen / rejected           strings (TRL "standard"; axolotl's ``question`` or
                                       ``instruction`` [+ ``input``] name the prompt too)
  prompt / chosen / rejected           message lists (TRL "conversational": the prompt's turns, then
                                       one assistant turn each)
  chosen / rejected                    whole conversations sharing their opening turns (TRL's implicit
                                       prompt: the common turns are the prompt)
  conversations + chosen + rejected    LLaMA-Factory's sharegpt ranking layout (``from`` / ``value``
                                       turns, the two answers as single turns)
  messages + chosen + rejected         the prompt as ``messages``, the answers as turns or strings

and KTO reads unpaired rows: ``prompt`` / ``completion`` / ``label`` (TRL), or chat turns with a boolean
``kto_tag`` (LLaMA-Factory), or any paired layout above, unpaired (each chosen answer desirable, each
rejected one not, as TRL's ``unpair_preference_dataset`` does).

Every row becomes ``prompt`` (a list of ``{role, content}`` turns, ending with a user turn) plus
``chosen`` and ``rejected`` strings, or ``completion`` and ``label`` for KTO. A row that fits no
layout is one ``DataError`` naming the files, the row and the key.
"""

from __future__ import annotations

import random
from typing import Any

import datasets

from zerotune.finetune.data_files import DataError, describe_files
from zerotune.finetune.formats import CHAT_ROLES, SHAREGPT_ROLES

Turns = list[dict[str, str]]

PAIRED_LAYOUTS = ("prompt/chosen/rejected (strings or chat turns)", "chosen/rejected conversations",
                  "conversations + chosen + rejected (LLaMA-Factory sharegpt)", "messages + chosen + rejected",
                  "question or instruction [+ input] + chosen + rejected")
KTO_LAYOUTS = ("prompt/completion/label", "messages or conversations + kto_tag", "any paired layout (unpaired)")


def to_pairs(dataset: datasets.Dataset, files: Any) -> datasets.Dataset:
    """Rows with ``prompt`` (turns), ``chosen`` and ``rejected`` (the answers' text)."""
    where = describe_files(files)
    columns = set(dataset.column_names)
    if not {"chosen", "rejected"} <= columns:
        raise DataError(f"preference data needs 'chosen' and 'rejected' columns; {where} has "
                        f"{', '.join(dataset.column_names)} (layouts: {'; '.join(PAIRED_LAYOUTS)})")
    prompts, chosen, rejected = [], [], []
    for index, row in enumerate(dataset):
        prompt, good, bad = _pair(row, columns, index, where)
        prompts.append(prompt)
        chosen.append(good)
        rejected.append(bad)
    return datasets.Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})


def to_unpaired(dataset: datasets.Dataset, files: Any) -> datasets.Dataset:
    """Rows with ``prompt`` (turns), ``completion`` (text) and ``label`` (True: desirable), for KTO."""
    where = describe_files(files)
    columns = set(dataset.column_names)
    if {"chosen", "rejected"} <= columns:
        pairs = to_pairs(dataset, files)
        return datasets.Dataset.from_dict({
            "prompt": [*pairs["prompt"], *pairs["prompt"]],
            "completion": [*pairs["chosen"], *pairs["rejected"]],
            "label": [True] * len(pairs) + [False] * len(pairs)})
    prompts, completions, labels = [], [], []
    for index, row in enumerate(dataset):
        if {"prompt", "completion", "label"} <= columns:
            prompt = _prompt_turns(row["prompt"], index, "prompt", where)
            completion = _answer(row["completion"], index, "completion", where)
            label = row["label"]
        elif "kto_tag" in columns and columns & {"messages", "conversations"}:
            key = "messages" if "messages" in columns else "conversations"
            turns = _turns(row[key], index, key, where)
            if turns[-1]["role"] != "assistant" or len(turns) < 2:
                raise DataError(f"{where} row {index}: {key!r} must end with an assistant turn (the completion "
                                "KTO rates) after at least one prompt turn")
            prompt, completion, label = turns[:-1], turns[-1]["content"], row["kto_tag"]
        else:
            raise DataError(f"KTO data: {where} has columns {', '.join(dataset.column_names)}; expected one of: "
                            f"{'; '.join(KTO_LAYOUTS)}")
        if not isinstance(label, bool):
            raise DataError(f"{where} row {index}: the label is {label!r}; it must be true (desirable) or false")
        prompts.append(prompt)
        completions.append(completion)
        labels.append(label)
    if len(set(labels)) < 2 and labels:
        kind = "desirable" if labels[0] else "undesirable"
        raise DataError(f"KTO data: every row of {where} is {kind}; KTO needs both desirable and undesirable rows")
    return datasets.Dataset.from_dict({"prompt": prompts, "completion": completions, "label": labels})


def pairs_from_answers(questions: list[str], answers: list[str], seed: int) -> datasets.Dataset:
    """A preference set from question/answer data: each question's own answer is chosen, the answer of a
    different question (a seeded derangement) rejected -- what the bundled preference recipe trains on."""
    if len(questions) < 2:
        raise DataError("need at least two question/answer pairs to build preference pairs")
    order = list(range(len(answers)))
    random.Random(seed).shuffle(order)
    shifted = order[1:] + order[:1]  # a cycle over the shuffled order: no answer is paired with itself
    other = dict(zip(order, shifted))
    prompts, chosen, rejected = [], [], []
    for index, (question, answer) in enumerate(zip(questions, answers)):
        wrong = answers[other[index]]
        if wrong.strip() == answer.strip():
            continue  # the same text twice carries no preference
        prompts.append([{"role": "user", "content": question}])
        chosen.append(answer)
        rejected.append(wrong)
    return datasets.Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})


def preference_prompts(rows: datasets.Dataset, prompts: list[str] | None, count: int) -> list[Turns]:
    """The conversations answered at each evaluation of a preference run: ``prompts`` as single user turns,
    else the first ``count`` eval rows' prompts."""
    if prompts is not None:
        return [[{"role": "user", "content": prompt}] for prompt in prompts]
    return [list(rows[index]["prompt"]) for index in range(min(count, len(rows)))]


def _pair(row: dict[str, Any], columns: set[str], index: int, where: str) -> tuple[Turns, str, str]:
    if "prompt" in columns or "question" in columns or "instruction" in columns:
        prompt = _prompt_of(row, columns, index, where)
        return prompt, *_answers(row, index, where)
    if columns & {"conversations", "messages"}:
        key = "conversations" if "conversations" in columns else "messages"
        prompt = _turns(row[key], index, key, where)
        if prompt[-1]["role"] == "assistant":
            raise DataError(f"{where} row {index}: {key!r} ends with an assistant turn; the prompt's last turn must "
                            "be the user's (the answers are 'chosen' and 'rejected')")
        return prompt, *_answers(row, index, where)
    chosen = _turns(row["chosen"], index, "chosen", where)
    rejected = _turns(row["rejected"], index, "rejected", where)
    shared = 0
    while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0 or chosen[shared:][0]["role"] != "assistant" or len(chosen) - shared != 1 \
            or len(rejected) - shared != 1 or rejected[shared]["role"] != "assistant":
        raise DataError(f"{where} row {index}: without a 'prompt' column, 'chosen' and 'rejected' must be "
                        "conversations that share their opening turns and differ in one final assistant turn")
    return chosen[:shared], chosen[shared]["content"], rejected[shared]["content"]


def _answers(row: dict[str, Any], index: int, where: str) -> tuple[str, str]:
    return _answer(row["chosen"], index, "chosen", where), _answer(row["rejected"], index, "rejected", where)


def _prompt_of(row: dict[str, Any], columns: set[str], index: int, where: str) -> Turns:
    if "prompt" in columns:
        return _prompt_turns(row["prompt"], index, "prompt", where)
    key = "question" if "question" in columns else "instruction"
    text = row[key]
    if not isinstance(text, str) or not text.strip():
        raise DataError(f"{where} row {index}: {key!r} is {text!r}; it must be non-empty text")
    extra = row.get("input") if key == "instruction" else None
    if extra is not None and not isinstance(extra, str):
        raise DataError(f"{where} row {index}: 'input' is {extra!r}; it must be text (or empty)")
    turns = [{"role": "user", "content": f"{text}\n\n{extra}" if extra and extra.strip() else text}]
    system = row.get("system")
    return ([{"role": "system", "content": system}] if isinstance(system, str) and system.strip() else []) + turns


def _prompt_turns(value: Any, index: int, key: str, where: str) -> Turns:
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where} row {index}: {key!r} is empty")
        return [{"role": "user", "content": value}]
    turns = _turns(value, index, key, where)
    if turns[-1]["role"] == "assistant":
        raise DataError(f"{where} row {index}: {key!r} ends with an assistant turn; a prompt ends with the user's")
    return turns


def _answer(value: Any, index: int, key: str, where: str) -> str:
    """An answer given as text, as one assistant turn, or as a list holding one assistant turn."""
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list):
        turns = _turns(value, index, key, where)
        if len(turns) != 1 or turns[0]["role"] != "assistant":
            raise DataError(f"{where} row {index}: {key!r} must be one assistant turn (or text), got "
                            f"{len(turns)} turn(s) with roles {', '.join(t['role'] for t in turns)}")
        value = turns[0]["content"]
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where} row {index}: {key!r} is {value!r}; it must be non-empty text or an assistant turn")
    return value


def _turns(value: Any, index: int, key: str, where: str) -> Turns:
    """Chat turns as role/content or ShareGPT from/value objects -> [{role, content}]."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where} row {index}: {key!r} is {value!r}; it must be a non-empty list of turns")
    turns: Turns = []
    for position, turn in enumerate(value):
        if not isinstance(turn, dict):
            raise DataError(f"{where} row {index}: {key}[{position}] is {turn!r}; it must be a turn object")
        if "role" in turn:
            role, content = turn.get("role"), turn.get("content")
            valid = role in CHAT_ROLES
        else:
            role, content = SHAREGPT_ROLES.get(turn.get("from")), turn.get("value")  # type: ignore[arg-type]
            valid = role is not None
        if not valid:
            raise DataError(f"{where} row {index}: {key}[{position}] has role {turn.get('role', turn.get('from'))!r}; "
                            f"expected one of {', '.join(CHAT_ROLES)} (or ShareGPT's {', '.join(SHAREGPT_ROLES)})")
        if not isinstance(content, str):
            raise DataError(f"{where} row {index}: {key}[{position}] has no text content")
        turns.append({"role": str(role), "content": content})
    return turns
