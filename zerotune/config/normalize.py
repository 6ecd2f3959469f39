"""Pass 2 of loading a config: walk a raw dict against a section's schema, key by key.

Aliases and legacy keys are renamed, ``_comment`` keys and accepted no-effect keys dropped (with a note),
unknown keys refused with a did-you-mean and DeepSpeed-only ones with ``NotSupportedError`` -- recursing
into sections, lists and dicts of sections. It knows sections only through ``Section``'s class attributes,
so any section module (the curriculum's schedules) can use it without importing the whole schema.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError, NotSupportedError
from .pydantic_errors import show_value
from .section import Section
from .tree import dict_value_section, is_free_dict, join, list_item_section, section_class


def normalize_keys(raw: Mapping[Any, Any], cls: type[Section], prefix: str,
                   notes: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """Rename aliases and legacy keys, drop ``_comment`` keys and accepted no-effect keys (noting them
    in ``notes``), and reject unknown or unsupported keys, recursing into sections."""
    notes = [] if notes is None else notes
    bad = next((k for k in raw if not isinstance(k, str)), None)
    if bad is not None:
        raise ConfigError(join(prefix, printable_key(bad)), f"config keys must be strings, got {type(bad).__name__} "
                                                          f"{show_value(bad)}")
    raw = cls.translate_legacy({k: v for k, v in raw.items() if not k.startswith("_")}, prefix, notes)
    result: dict[str, Any] = {}
    for key, value in raw.items():
        path = join(prefix, printable_key(key))
        if key in cls.NO_EFFECT:
            _accept_no_effect(path, value, cls.NO_EFFECT[key], notes, cls.FEATURES.get(key))
            continue
        name = cls.ALIASES.get(key, key)
        if name in cls.UNSUPPORTED:
            what = "feature" if not prefix else "option"
            kind = "block" if isinstance(value, Mapping) else "key"
            raise NotSupportedError(path, f"'{key}' is a DeepSpeed {what} zerotune does not support; remove the {kind}")
        if name not in cls.model_fields:
            raise ConfigError(path, _unknown_key_message(key, cls))
        if name in result:
            raise ConfigError(path, f"given twice, as '{name}' and its alias; keep one")
        result[name] = _normalize_value(value, cls.model_fields[name].annotation, path, notes)
    return result


def _accept_no_effect(path: str, value: Any, rule: tuple[Any, str, str], notes: list[tuple[str, str]],
                      feature: str | None = None) -> None:
    """Accept a DeepSpeed key zerotune does not model when its value changes nothing here; refuse it otherwise
    (naming the ``feature`` behind the key when the section describes it)."""
    changes_nothing, accepted, reason = rule
    if changes_nothing is not None and not changes_nothing(value):
        key = path.rsplit(".", 1)[-1]
        kind = "block" if isinstance(value, Mapping) else "key"
        named = f"'{key}' ({feature})" if feature else f"'{key}'"
        raise NotSupportedError(path, f"{named} is a DeepSpeed feature zerotune does not support; remove the {kind} "
                                      f"(accepted only as {accepted}, which has no effect)")
    notes.append((path, f"no effect here: {reason}"))


def printable_key(key: Any) -> str:
    """The key as text that keeps an error message on one line (control characters escaped)."""
    text = str(key)
    return text if text.isprintable() else json.dumps(text)


def _normalize_value(value: Any, annotation: Any, path: str, notes: list[tuple[str, str]]) -> Any:
    sub = section_class(annotation)
    if sub is not None and isinstance(value, Mapping):
        return normalize_keys(value, sub, path, notes)
    item = list_item_section(annotation)
    if item is not None and isinstance(value, list):
        return [normalize_keys(v, item, join(path, str(i)), notes) if isinstance(v, Mapping) else v
                for i, v in enumerate(value)]
    if is_free_dict(annotation) and isinstance(value, Mapping):
        bad = next((k for k in value if not isinstance(k, str)), None)
        if bad is not None:
            raise ConfigError(join(path, printable_key(bad)), f"keys must be strings, got {type(bad).__name__}")
        entry = dict_value_section(annotation)
        if entry is not None:
            return {k: normalize_keys(v, entry, join(path, printable_key(k)), notes) if isinstance(v, Mapping) else v
                    for k, v in value.items()}
    return value


def _unknown_key_message(key: str, cls: type[Section]) -> str:
    if key in cls.KNOWN_AS:
        return f"unknown key; did you mean '{cls.KNOWN_AS[key]}'? ('{key}' is another tool's name for it)"
    valid = sorted(set(cls.model_fields) | set(cls.ALIASES))
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean '{close[0]}'?"
    return "unknown key; valid keys are: " + ", ".join(valid)
