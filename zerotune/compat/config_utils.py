"""``deepspeed.runtime.config_utils``: the base class of DeepSpeed's config models and its small helpers.

Client code and DeepSpeed's own tests subclass ``DeepSpeedConfigModel`` to declare config blocks the way
DeepSpeed does: a pydantic model that forbids unknown keys, accepts a field by its name or its alias,
validates assignments, drops ``"auto"`` values unless built ``strict=True`` (the HF Trainer fills them
later), and understands *deprecated* fields declared through ``json_schema_extra``::

    old: Optional[str] = Field(None, json_schema_extra={"deprecated": True, "new_param": "new",
                                                        "new_param_fn": lambda v: [v]})

A deprecated field given in the data is logged, moved onto ``new_param`` (a dotted path may name a field of
a nested model) through ``new_param_fn``, and removed; giving both the old and the new name is an
AssertionError naming both, as in DeepSpeed. zerotune's own config sections (zerotune/config/) are separate
models with the loader's richer errors; this class is what DeepSpeed-shaped client models build on.
"""

from __future__ import annotations

import collections.abc
import json
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, field_serializer

from zerotune.monitor.logging import get_logger

__all__ = ["DeepSpeedConfigModel", "get_config_default", "pp_int", "ScientificNotationEncoder",
           "DeepSpeedConfigObject", "get_scalar_param", "get_list_param", "get_dict_param",
           "dict_raise_error_on_duplicate_keys"]

# Values a non-strict model drops so the field keeps its default; ``replace_method`` (an inference option)
# takes "auto" as a real value.
_AUTO = "auto"
_AUTO_IS_A_VALUE = frozenset({"replace_method"})


class DeepSpeedConfigModel(BaseModel):
    """A DeepSpeed config block: unknown keys refused, aliases and names both accepted, deprecated fields moved
    onto their replacements (see the module docstring)."""

    model_config = ConfigDict(
        validate_default=True,
        validate_assignment=True,  # the deprecated-field move assigns through validation
        use_enum_values=True,
        populate_by_name=True,
        extra="forbid",
        arbitrary_types_allowed=True,
        protected_namespaces=(),
    )

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if not strict:
            data = {key: value for key, value in data.items() if key in _AUTO_IS_A_VALUE or not _is_auto(value)}
        super().__init__(**data)
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated", False) and name in self.model_fields_set:
                self._move_deprecated(name, extra)

    def _move_deprecated(self, name: str, extra: dict[str, Any]) -> None:
        new_path = str(extra.get("new_param", "") or "")
        note = str(extra.get("deprecated_msg", "") or "")
        get_logger().warning("Config parameter %s is deprecated%s%s", name,
                             f" use {new_path} instead" if new_path else "", f". {note}" if note else "")
        if not new_path or not extra.get("set_new_param", True):
            return
        convert = extra.get("new_param_fn") or (lambda value: value)
        value = convert(getattr(self, name))
        del self.__dict__[name]  # the old name no longer holds a value: only the replacement does
        *parents, leaf = new_path.split(".")
        owner: Any = self
        for part in parents:
            owner = getattr(owner, part)
        assert leaf not in owner.model_fields_set, (
            f"Cannot provide deprecated parameter '{name}' and replacing parameter '{new_path}' together")
        setattr(owner, leaf, value)

    @field_serializer("dtype", check_fields=False)
    def _dtype_as_text(self, dtype: torch.dtype) -> str:
        # torch dtypes are not JSON: a model with a ``dtype`` field dumps it as "torch.float16"
        return str(dtype)


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == _AUTO


def get_config_default(config: type[BaseModel] | BaseModel, field_name: str) -> Any:
    """The declared default of ``field_name`` on a config model (class or instance); asserts it has one."""
    fields = (config if isinstance(config, type) else type(config)).model_fields
    assert field_name in fields, f"'{field_name}' is not a field in {config}"
    assert not fields[field_name].is_required(), (
        f"'{field_name}' is a required field and does not have a default value")
    return fields[field_name].get_default(call_default_factory=True)


class pp_int(int):
    """An int that prints comma-grouped ("10,000") or as a given text: defaults in generated documentation."""

    custom_print_str: str | None

    def __new__(cls, val: Any, custom_print_str: str | None = None) -> pp_int:
        made = super().__new__(cls, val)
        made.custom_print_str = custom_print_str
        return made

    def __repr__(self) -> str:
        return self.custom_print_str if self.custom_print_str else f"{int(self):,}"


class ScientificNotationEncoder(json.JSONEncoder):
    """``json.dumps(..., cls=ScientificNotationEncoder)``: numbers above 1e3 in scientific notation (bucket sizes
    read as 5.000000e+08), everything else as json writes it, indented."""

    def iterencode(self, o: Any, _one_shot: bool = False, level: int = 0) -> Any:
        step = self.indent if isinstance(self.indent, int) else 4
        inner, outer = " " * (level + 1) * step, " " * level * step
        if isinstance(o, bool):
            return "true" if o else "false"
        if isinstance(o, (int, float)):
            return f"{o:e}" if o > 1e3 else f"{o}"
        if isinstance(o, collections.abc.Mapping):
            items = ", ".join(f'\n{inner}"{key}": {self.iterencode(value, level=level + 1)}'
                              for key, value in o.items())
            return "{" + items + f"\n{outer}" + "}"
        if isinstance(o, collections.abc.Sequence) and not isinstance(o, str):
            return "[" + ", ".join(self.iterencode(value) for value in o) + "]"
        return "\n, ".join(super().iterencode(o, _one_shot))


class DeepSpeedConfigObject:
    """A plain config object whose repr is its attributes as sorted, indented JSON."""

    def repr(self) -> dict[str, Any]:
        return self.__dict__

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4, cls=ScientificNotationEncoder)


def get_scalar_param(param_dict: dict[str, Any], param_name: str, param_default_value: Any) -> Any:
    """``param_dict[param_name]``, or the default when the key is absent (a present None stays None)."""
    return param_dict.get(param_name, param_default_value)


get_list_param = get_scalar_param
get_dict_param = get_scalar_param


def dict_raise_error_on_duplicate_keys(ordered_pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """A ``json.load`` ``object_pairs_hook`` that refuses a key given twice (ValueError naming every such key)."""
    counts = collections.Counter(key for key, _ in ordered_pairs)
    repeated = [key for key, count in counts.items() if count > 1]
    if repeated:
        raise ValueError(f"Duplicate keys in DeepSpeed config: {repeated}")
    return dict(ordered_pairs)
