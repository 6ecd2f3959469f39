"""Turning a pydantic ValidationError into one-line ConfigError text.

pydantic reports locations that include union-member tags (``('stage', 'int')``) and
multi-line messages; users need the dotted key they wrote, the bad value and what
would be valid. The key path is recovered by walking the location through the input
dict, which also strips the tags.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from .errors import ConfigError

_AUTO_TAG = "literal['auto']"


def translate(exc: ValidationError, raw: Mapping[str, Any], prefix: str = "") -> ConfigError:
    """The first problem of ``exc`` as a ConfigError naming its dotted key path."""
    by_path: dict[str, list[dict[str, Any]]] = {}
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


def _describe(errors: list[dict[str, Any]]) -> str:
    if errors[0]["type"] == "missing":
        return "required key is missing"
    auto_allowed = any(_AUTO_TAG in map(str, e["loc"]) for e in errors)
    specific = [e for e in errors if _AUTO_TAG not in map(str, e["loc"])] or errors
    error = specific[0]
    text = _message(error)
    if auto_allowed:
        text += ' (or "auto")'
    return f"invalid value {show_value(error['input'])}: {text}"


def _message(error: dict[str, Any]) -> str:
    kind = error["type"]
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return "expected a mapping (JSON object)"
    msg = str(error["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    return msg.replace("Input should be", "expected").splitlines()[0]


def show_value(value: Any, limit: int = 60) -> str:
    """Compact JSON-ish rendering of a user value for an error message."""
    try:
        text = json.dumps(value, default=repr)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
