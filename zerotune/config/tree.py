"""Walking the config as a tree of dotted leaf paths.

Provenance, "auto" resolution and the check report all speak in dotted paths
(``zero_optimization.offload_optimizer.device``); this module is the one place that
maps between those paths, the section classes and plain dicts.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from .section import Section

NO_DEFAULT = object()


def section_class(annotation: Any) -> type[Section] | None:
    """The Section subclass inside a field annotation (``X``, ``Optional[X]``), if any; lists and maps of
    sections are not nested sections (see ``list_item_section`` and ``dict_value_section``)."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation
    if typing.get_origin(annotation) in (list, dict):
        return None
    for arg in typing.get_args(annotation):
        found = section_class(arg)
        if found is not None:
            return found
    return None


def list_item_section(annotation: Any) -> type[Section] | None:
    """For ``list[X]`` with X a Section: X (each item is a section of its own, e.g. layer_specs)."""
    if typing.get_origin(annotation) is list:
        args = typing.get_args(annotation)
        if args and isinstance(args[0], type) and issubclass(args[0], Section):
            return args[0]
    return None


def dict_value_section(annotation: Any) -> type[Section] | None:
    """For ``dict[str, X]`` with X a Section: X (each value is a section of its own under a user-chosen name,
    e.g. data_efficiency's ``curriculum_metrics``)."""
    if typing.get_origin(annotation) is dict:
        args = typing.get_args(annotation)
        if len(args) == 2 and isinstance(args[1], type) and issubclass(args[1], Section):
            return args[1]
    return None


def is_free_dict(annotation: Any) -> bool:
    """True for ``dict[str, Any]`` fields (optimizer/scheduler params) whose keys are user-defined."""
    return typing.get_origin(annotation) is dict


def join(prefix: str, key: str) -> str:
    """``join("fp16", "enabled") == "fp16.enabled"``; an empty prefix is the top level."""
    return f"{prefix}.{key}" if prefix else key


def iter_leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield (dotted path, value) for every leaf, in schema order.

    A section that is None (no optimizer configured) is itself a leaf; free dicts
    (``optimizer.params``) are walked key by key so each param has its own provenance.
    """
    if isinstance(node, BaseModel):
        for name in type(node).model_fields:
            yield from iter_leaves(getattr(node, name), join(prefix, name))
    elif isinstance(node, Mapping) and node:
        for key, value in node.items():
            yield from iter_leaves(value, join(prefix, str(key)))
    else:
        yield prefix, node


def field_default(path: str, root: type[Section]) -> Any:
    """The schema default of the field at ``path``, or ``NO_DEFAULT``.

    Keys inside free dicts (``optimizer.params.lr``) and required fields have none.
    """
    cls: type[Section] | None = root
    parts = path.split(".")
    for index, part in enumerate(parts):
        if cls is None or part not in cls.model_fields:
            return NO_DEFAULT
        field = cls.model_fields[part]
        if index == len(parts) - 1:
            default = field.get_default(call_default_factory=True)
            return NO_DEFAULT if default is PydanticUndefined else default
        cls = section_class(field.annotation)
    return NO_DEFAULT


def path_in(data: Mapping[str, Any], path: str) -> bool:
    """Whether the nested dict ``data`` holds a value at dotted ``path``."""
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def set_path(data: dict[str, Any], path: str, value: Any) -> None:
    """Set ``data[a][b][c] = value`` for path ``a.b.c``, creating dicts on the way."""
    parts = path.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value
