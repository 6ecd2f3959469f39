"""The one YAML loader for configs, recipes and ``--set`` values: safe, YAML 1.2 floats, bounded aliases.

Two things PyYAML's ``safe_load`` gets wrong for a config:

- ``5e-5`` is the string "5e-5" (YAML 1.1 floats need a dot), and every learning rate is written that way;
- aliases are shared, not copied, so ``[&a [x, x, ...], &b [*a, *a, ...], ...]`` loads in microseconds into
  a graph that expands to billions of values, and whatever walks it next (validation, an error message)
  runs for minutes and gigabytes. A document whose values, aliases expanded, exceed :data:`MAX_YAML_VALUES`
  is refused while loading, before anything walks it.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

MAX_YAML_VALUES = 100_000
"""Scalars, lists and mappings a document may hold once its aliases are expanded (a real config holds a
few hundred)."""


class YamlExpansionError(ValueError):
    """The document expands to more than :data:`MAX_YAML_VALUES` values, or an alias refers to itself."""


class ConfigYamlLoader(yaml.SafeLoader):
    """SafeLoader reading ``5e-5`` as a float (YAML 1.2) and refusing documents that expand past the bound."""

    def compose_document(self) -> Any:
        node = super().compose_document()
        _check_expansion(node)
        return node


ConfigYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    """Parse one YAML document with :class:`ConfigYamlLoader`.

    Raises ``yaml.YAMLError`` for a syntax error, :class:`YamlExpansionError` past the bound and
    ``RecursionError`` for absurd nesting; callers add the file or key to the message.
    """
    return yaml.load(text, Loader=ConfigYamlLoader)  # noqa: S506 - a SafeLoader


def _check_expansion(root: Any) -> None:
    # Each node is sized once (aliases share node objects), so this costs the document's length,
    # not its expansion.
    sizes: dict[int, int | None] = {}

    def size(node: Any) -> int:
        if id(node) in sizes:
            known = sizes[id(node)]
            if known is None:
                raise YamlExpansionError("an alias refers to the list or mapping that contains it")
            return known
        sizes[id(node)] = None  # in progress: meeting it again is a cycle
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(key) + size(value) for key, value in node.value)
        if total > MAX_YAML_VALUES:
            raise YamlExpansionError(f"it holds more than {MAX_YAML_VALUES} values once its aliases are "
                                     "expanded (the bound for a config)")
        sizes[id(node)] = total
        return total

    if root is not None:
        size(root)
