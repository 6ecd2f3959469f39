"""The layouts causal-LM examples come in, detected from the columns and brought to one of four shapes.

People bring what their tools wrote: OpenAI / TRL chat ``messages`` (role / content turns), ShareGPT
``conversations`` (from / value), alpaca ``instruction`` / ``input`` / ``output``, prompt / response
pairs, plain ``text``, or ``input_ids`` they tokenized themselves. Each is checked row by row here (an
error names the files, the row and the key) and rewritten to

  text:      ``text``                       (loss on every token)
  pair:      ``prompt``, ``response``       (loss on the response)
  messages:  ``messages`` [{role, content}] (loss on the assistant turns, through the chat template)
  tokens:    ``input_ids`` [, ``labels``]   (as given)

so tokenization has one path per shape, whatever the source.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

import datasets

from zerotune.finetune.data_files import DataError, describe_files

FORMATS = ("auto", "text", "prompt_response", "alpaca", "messages", "sharegpt", "tokens")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
CHAT_ROLES = ("system", "user", "assistant")


def detect_format(columns: Sequence[str], prompt_column: str | None) -> str:
    """The layout the columns announce (``prompt_column`` given: prompt / response pairs)."""
    present = set(columns)
    if prompt_column is not None:
        return "prompt_response"
    if "messages" in present:
        return "messages"
    if "conversations" in present:
        return "sharegpt"
    if {"instruction", "output"} <= present:
        return "alpaca"
    if {"prompt", "response"} <= present:
        return "prompt_response"
    if "input_ids" in present:
        return "tokens"
    return "text"


def to_canonical(dataset: datasets.Dataset, fmt: str, files: Sequence[str], *, text_column: str = "text",
                 prompt_column: str | None = None, response_column: str | None = None) -> datasets.Dataset:
    """``dataset`` in one of the four shapes (module docstring), every row checked."""
    where = describe_files(files)
    if fmt == "auto":
        fmt = detect_format(dataset.column_names, prompt_column)
    if fmt == "text":
        _require(dataset, {"text": text_column}, fmt, where)
        return _strings(dataset, {"text": text_column}, where)
    if fmt == "prompt_response":
        columns = {"prompt": prompt_column or "prompt", "response": response_column or "response"}
        _require(dataset, columns, fmt, where)
        return _strings(dataset, columns, where)
    if fmt == "alpaca":
        _require(dataset, {"instruction": "instruction", "output": "output"}, fmt, where)
        return _alpaca(dataset, where)
    if fmt in ("messages", "sharegpt"):
        column = "messages" if fmt == "messages" else "conversations"
        _require(dataset, {"chat": column}, fmt, where)
        turns = [_chat_turns(row, index, column, fmt, where) for index, row in enumerate(dataset[column])]
        return datasets.Dataset.from_dict({"messages": turns})
    if fmt == "tokens":
        _require(dataset, {"token": "input_ids"}, fmt, where)
        return _tokens(dataset, where)
    raise DataError(f"data.format {fmt!r} is not one of {', '.join(FORMATS)}")


def _require(dataset: datasets.Dataset, columns: dict[str, str], fmt: str, where: str) -> None:
    """Each ``{role: column}`` the layout needs must be there: else one line with the columns there are."""
    for role, column in columns.items():
        if column not in dataset.column_names:
            close = difflib.get_close_matches(column, dataset.column_names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise DataError(f"{role} column {column!r} not found in {where}; available columns: "
                            f"{', '.join(dataset.column_names)}{hint} (data.format {fmt!r}; the layouts: messages, "
                            "conversations (sharegpt), instruction/input/output (alpaca), prompt/response or "
                            "data.prompt_column + data.response_column, input_ids (tokens), text or data.text_column)")


def _strings(dataset: datasets.Dataset, columns: dict[str, str], where: str) -> datasets.Dataset:
    out = {}
    for canonical, column in columns.items():
        values = dataset[column]
        for index, value in enumerate(values):
            if not isinstance(value, str) or not value.strip():
                raise DataError(f"{where} row {index}: {column!r} is {_shown(value)}; it must be non-empty text")
        out[canonical] = values
    return datasets.Dataset.from_dict(out)


def _alpaca(dataset: datasets.Dataset, where: str) -> datasets.Dataset:
    """Alpaca's prompt is the instruction, then the input (when there is one) after a blank line."""
    inputs = dataset["input"] if "input" in dataset.column_names else [None] * len(dataset)
    prompts, responses = [], []
    for index, (instruction, extra, output) in enumerate(zip(dataset["instruction"], inputs, dataset["output"])):
        for key, value in (("instruction", instruction), ("output", output)):
            if not isinstance(value, str) or not value.strip():
                raise DataError(f"{where} row {index}: {key!r} is {_shown(value)}; it must be non-empty text")
        if extra is not None and not isinstance(extra, str):
            raise DataError(f"{where} row {index}: 'input' is {_shown(extra)}; it must be text (or empty)")
        prompts.append(f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction)
        responses.append(output)
    return datasets.Dataset.from_dict({"prompt": prompts, "response": responses})


def _chat_turns(turns: Any, index: int, column: str, fmt: str, where: str) -> list[dict[str, str]]:
    """One conversation as [{role, content}] with roles system / user / assistant; at least one answer."""
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where} row {index}: {column!r} is {_shown(turns)}; it must be a list of turns")
    role_key, content_key = ("role", "content") if fmt == "messages" else ("from", "value")
    normalized = []
    for position, turn in enumerate(turns):
        key = f"{column}[{position}]"
        if not isinstance(turn, dict):
            raise DataError(f"{where} row {index}: {key} is {_shown(turn)}; it must be an object with "
                            f"{role_key!r} and {content_key!r}")
        role, content = turn.get(role_key), turn.get(content_key)
        known = CHAT_ROLES if fmt == "messages" else tuple(SHAREGPT_ROLES)
        if role not in known:
            raise DataError(f"{where} row {index}: {key}.{role_key} is {_shown(role)}; expected one of "
                            f"{', '.join(known)}")
        if not isinstance(content, str):
            raise DataError(f"{where} row {index}: {key}.{content_key} is {_shown(content)}; it must be text")
        normalized.append({"role": role if fmt == "messages" else SHAREGPT_ROLES[role], "content": content})
    if not any(turn["role"] == "assistant" and turn["content"].strip() for turn in normalized):
        raise DataError(f"{where} row {index}: {column!r} has no non-empty assistant turn to train on")
    return normalized


def _tokens(dataset: datasets.Dataset, where: str) -> datasets.Dataset:
    out: dict[str, list] = {"input_ids": dataset["input_ids"]}
    if "labels" in dataset.column_names:
        out["labels"] = dataset["labels"]
    for index, ids in enumerate(out["input_ids"]):
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise DataError(f"{where} row {index}: 'input_ids' is {_shown(ids)}; it must be a non-empty list of "
                            "token ids (integers >= 0)")
        if "labels" in out and (not isinstance(out["labels"][index], list) or len(out["labels"][index]) != len(ids)):
            raise DataError(f"{where} row {index}: 'labels' must be a list as long as 'input_ids' ({len(ids)})")
    return datasets.Dataset.from_dict(out)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
