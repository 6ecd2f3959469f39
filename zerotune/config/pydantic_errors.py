"""Turning a pydantic ValidationError into one-line ConfigError text.

pydantic reports locations that include union-member tags (``('stage', 'int')``) and
multi-line messages; users need the dotted key they wrote, the bad value and what
would be valid. The key path is recovered by walking the location through the input
dict, which also strips the tags.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from itertools import islice
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from .errors import ConfigError

_AUTO_TAG = "literal['auto']"


def translate(exc: ValidationError, raw: Mapping[str, Any], prefix: str = "") -> ConfigError:
    """The first problem of ``exc`` as a ConfigError naming its dotted key path."""
    by_path: dict[str, list[ErrorDetails]] = {}
    for error in exc.errors(include_url=False):
        path, _ = _key_path(error["loc"], raw, missing=error["type"] == "missing")
        full = ".".join(p for p in (prefix, path) if p)
        by_path.setdefault(full, []).append(error)
    path, errors = next(iter(by_path.items()))
    message = _describe(errors)
    if len(by_path) > 1:
        message += f" (and {len(by_path) - 1} more invalid key(s))"
    return ConfigError(path, message)


def _key_path(loc: tuple[Any, ...], raw: Any, *, missing: bool) -> tuple[str, Any]:
    parts: list[str] = []
    node = raw
    for item in loc:
        if isinstance(node, Mapping) and item in node:
            node = node[item]
        elif isinstance(node, list) and isinstance(item, int) and 0 <= item < len(node):
            node = node[item]
        else:
            if missing and isinstance(item, str):
                parts.append(item)
            break
        parts.append(str(item))
    return ".".join(parts), node


def _describe(errors: list[ErrorDetails]) -> str:
    if errors[0]["type"] == "missing":
        return "required key is missing"
    auto_allowed = any(_AUTO_TAG in map(str, e["loc"]) for e in errors)
    specific = [e for e in errors if _AUTO_TAG not in map(str, e["loc"])] or errors
    error = specific[0]
    text = _message(error)
    if auto_allowed:
        text += ' (or "auto")'
    return f"invalid value {show_value(error['input'])}: {text}"


def _message(error: ErrorDetails) -> str:
    kind = error["type"]
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return "expected a mapping (JSON object)"
    msg = str(error["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    return msg.replace("Input should be", "expected").splitlines()[0]


def show_value(value: Any, limit: int = 60) -> str:
    """Compact JSON-ish rendering of a user value for an error message, at most ``limit`` characters.

    The value is pruned before it is serialised: a YAML alias bomb is a small graph of shared lists that
    expands to billions of items, and serialising it whole ran for minutes and gigabytes before the error
    could be shown.
    """
    text = json.dumps(_pruned(value, _PREVIEW_DEPTH, limit), default=lambda o: repr(o)[: limit + 1])
    text = text.replace(json.dumps(_MORE), "...")
    return text if len(text) <= limit else text[: limit - 3] + "..."


_PREVIEW_DEPTH = 4  # containers nested deeper are shown as ...; the text is cut at ``limit`` anyway
_PREVIEW_ITEMS = 8  # items of one container worth serialising
_MORE = "\x00more"  # marks pruned items, rendered as a bare ... (a config string holding a NUL is implausible)
_JSON_KEYS = (str, int, float, bool, type(None))


def _pruned(value: Any, depth: int, limit: int) -> Any:
    """A small copy of ``value``: strings cut past ``limit``, containers to a few items and a few levels.
    Never circular, so ``json.dumps`` cannot fail on it."""
    if isinstance(value, str):
        return value[: limit + 1]
    if isinstance(value, Mapping):
        if depth == 0:
            return _MORE
        items = list(islice(value.items(), _PREVIEW_ITEMS + 1))
        shown = {(k if isinstance(k, _JSON_KEYS) else repr(k)[: limit + 1]): _pruned(v, depth - 1, limit)
                 for k, v in items[:_PREVIEW_ITEMS]}
        if len(items) > _PREVIEW_ITEMS:
            shown[_MORE] = _MORE
        return shown
    if isinstance(value, (list, tuple)):
        if depth == 0:
            return [_MORE]
        items = [_pruned(v, depth - 1, limit) for v in islice(value, _PREVIEW_ITEMS + 1)]
        return items[:_PREVIEW_ITEMS] + [_MORE] if len(items) > _PREVIEW_ITEMS else items
    return value
