"""Reading a config file (JSON or YAML) into a plain dict.

Every failure names the file; JSON syntax errors also give line and column because
a misplaced comma in a 60-line ds_config.json is otherwise hard to find. A file larger than
:data:`MAX_CONFIG_BYTES` is refused before it is read: a config is a few kilobytes, and parsing a
200 MB one took 1.2 GiB and half a minute only to fail validation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError
from .yaml_loader import YamlExpansionError, load_yaml

YAML_SUFFIXES = (".yaml", ".yml")
MAX_CONFIG_BYTES = 16 * 2**20


def read_config_file(source: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse ``source`` as YAML (``.yaml``/``.yml``) or JSON (anything else)."""
    path = Path(source)
    size = path.stat().st_size if path.is_file() else 0
    if size > MAX_CONFIG_BYTES:
        raise ConfigError("", f"config file '{path}' is {size / 2**20:.1f} MiB; a config file may be at most "
                              f"{MAX_CONFIG_BYTES // 2**20} MiB")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("", f"config file '{path}' does not exist") from None
    except IsADirectoryError:
        raise ConfigError("", f"config file '{path}' is a directory, not a file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError("", f"config file '{path}' is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError("", f"cannot read config file '{path}': {exc.strerror or exc}") from None
    data = _parse_yaml(text, path) if path.suffix.lower() in YAML_SUFFIXES else _parse_json(text, path)
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise ConfigError("", f"config file '{path}' must hold a mapping of config keys at the top level, "
                              f"but it is {kind}")
    return data


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Like DeepSpeed: a key given twice is almost always a merge accident; json would keep the last silently.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _parse_hjson(text: str) -> tuple[Any, bool]:
    """(the data, True) when ``text`` is Hjson -- JSON's human superset (unquoted keys, comments, trailing commas),
    which DeepSpeed reads its config files as -- else (None, whether the optional hjson package is there).
    zerotune does not depend on hjson: without it a config file must be JSON or YAML."""
    try:
        import hjson  # optional
    except ImportError:
        return None, False
    try:
        return hjson.loads(text, object_pairs_hook=_reject_duplicate_keys), True
    except ValueError:  # hjson's decode error; the JSON error is the one reported
        return None, True


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _parse_json(text: str, path: Path) -> Any:
    try:
        try:
            return json.loads(text, object_pairs_hook=_reject_duplicate_keys)
        except json.JSONDecodeError as exc:
            relaxed, hjson_found = _parse_hjson(text)
            if relaxed is not None:
                return relaxed
            hint = "" if hjson_found else " (DeepSpeed also reads Hjson, with the hjson package, not installed here)"
            raise ConfigError("", f"config file '{path}' is not valid JSON: {exc.msg} at line {exc.lineno} "
                                  f"column {exc.colno}{hint}") from None
    except _DuplicateKey as exc:
        raise ConfigError("", f"config file '{path}' gives the key '{exc.key}' twice") from None
    except RecursionError:
        raise ConfigError("", f"config file '{path}' is nested too deeply to be a config") from None


def _parse_yaml(text: str, path: Path) -> Any:
    try:
        return load_yaml(text)
    except YamlExpansionError as exc:
        raise ConfigError("", f"config file '{path}' is refused: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError("", f"config file '{path}' is not valid YAML: {problem}{where}") from None
    except RecursionError:
        raise ConfigError("", f"config file '{path}' is nested too deeply to be a config") from None
