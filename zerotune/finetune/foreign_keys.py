"""What the LLaMA-Factory and axolotl translations share (``foreign_llamafactory.py``, ``foreign_axolotl.py``):
the :class:`Translation` they return, the key reader that makes every foreign key translated, reported or
refused exactly once (:class:`ForeignKeys`), and the template, schedule, optimizer, precision and path helpers.
``foreign_recipes.py`` is the entry point: it tells the dialect apart and calls the dialect's ``translate``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from zerotune.finetune.recipe_checks import RecipeError

LABELS = {"llamafactory": "llamafactory", "axolotl": "axolotl"}
# A key accepted without translation: which values change nothing here (None: any), and why.
NoEffect = tuple[Optional[Callable[[Any], bool]], str]


@dataclass
class Translation:
    """A foreign YAML as a recipe dict, plus what the translation has to say about it."""

    dialect: str
    recipe: dict[str, Any]
    output_dir: Optional[str] = None
    notes: list[str] = field(default_factory=list)
    origins: dict[str, str] = field(default_factory=dict)
    """zerotune dotted key -> the foreign key it came from, so a later recipe error names both."""

    def explain(self, error: RecipeError) -> RecipeError:
        """``error`` raised on the translated recipe, naming the foreign key the value came from."""
        origin = self.origins.get(error.path) or self.origins.get(error.path.split(".")[0])
        if not origin:
            return error
        return RecipeError(error.path, f"{error.message} (translated from {LABELS[self.dialect]} key '{origin}')")


def show(value: Any) -> str:
    """A value as the YAML spelled it (true, null, [a, b]) for one-line messages."""
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str)


class ForeignKeys:
    """The foreign YAML's keys, each of which must be taken, reported or refused exactly once."""

    def __init__(self, raw: Mapping[str, Any], dialect: str, base_dir: Path) -> None:
        self.raw = dict(raw)
        self.label = LABELS[dialect]
        self.dialect = dialect
        self.base_dir = base_dir
        self.used: set[str] = set()
        self.notes: list[str] = []
        self.origins: dict[str, str] = {}

    def given(self, key: str) -> bool:
        """Set to something other than null (a null key is the other tool's default, like an absent one)."""
        return self.raw.get(key) is not None

    def take(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        value = self.raw.get(key)
        return default if value is None else value

    def put(self, recipe: dict[str, Any], target: str, value: Any, key: str) -> None:
        """Set ``recipe[target]`` (a dotted key) to ``value``, remembering the foreign ``key`` it came from."""
        section, name = target.split(".")
        recipe.setdefault(section, {})[name] = value
        self.origins[target] = key

    def error(self, key: str, why: str, value: Any = None) -> RecipeError:
        """``llamafactory key 'stage: ppo': not supported; <why>``."""
        value = self.raw.get(key) if value is None else value
        error = RecipeError("", f"{self.label} key '{key}: {show(value)}': not supported; {why}")
        error.path = key
        return error

    def note(self, text: str) -> None:
        self.notes.append(text)

    def no_effect(self, table: Mapping[str, NoEffect]) -> None:
        """Accept the ``table``'s keys with values that change nothing here (reporting each), refuse other values."""
        for key, (changes_nothing, reason) in table.items():
            if key not in self.raw or key in self.used:
                continue
            value = self.take(key)
            if self.raw[key] is not None and changes_nothing is not None and not changes_nothing(value):
                raise self.error(key, f"zerotune accepts it only where it has no effect: {reason}")
            self.note(f"{self.label} key '{key}: {show(self.raw[key])}': no effect here ({reason})")

    def empty_keys(self) -> None:
        """Keys left null (axolotl's templates list many): the other tool's default, reported in one line."""
        empty = [key for key in self.raw if self.raw[key] is None and key not in self.used]
        self.used.update(empty)
        if empty:
            self.note(f"{self.label} keys left empty (the other tool's default; nothing to translate): "
                      f"{', '.join(empty)}")

    def refuse_leftovers(self) -> None:
        for key in self.raw:
            if key not in self.used:
                raise self.error(key, f"not a {self.label} key zerotune translates (see the README's \"Recipes "
                                      "from LLaMA-Factory and axolotl\")")

    def local_path(self, value: str, key: str, must_exist: bool = True) -> str:
        """An absolute path for ``value``: relative to the working directory (as the other tools read it), else
        to the YAML's directory."""
        path = Path(value).expanduser()
        if path.is_absolute():
            candidates = [path]
        else:
            candidates = [Path.cwd() / path, self.base_dir / path]
        for candidate in candidates:
            if candidate.exists():
                return os.path.normpath(candidate)
        if must_exist:
            raise self.error(key, "no such local file or directory (relative paths are tried against the working "
                                  f"directory, then {self.base_dir})", value)
        return value


# LLaMA-Factory template names -> data.template; axolotl chat_template names likewise.
LLAMAFACTORY_TEMPLATES = {"default": "none", "empty": "none", "llama3": "llama3", "mistral": "mistral",
                          "qwen": "qwen", "qwen2": "qwen", "gemma": "gemma", "chatml": "chatml", "alpaca": "alpaca"}
AXOLOTL_CHAT_TEMPLATES = {"chatml": "chatml", "llama3": "llama3", "mistral": "mistral", "mistral_v1": "mistral",
                          "gemma": "gemma", "qwen_25": "qwen", "qwen2": "qwen", "tokenizer_default": "auto"}
SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
# Optimizer names that mean the AdamW zerotune trains with (torch's, fused or not).
ADAMW_NAMES = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw")
PRECISION_OFF = (False, None)


def precision_of(keys: ForeignKeys) -> Optional[str]:
    """``bf16: true`` / ``fp16: true`` -> engine.precision; axolotl's ``bf16: auto`` is bf16 where the accelerator
    has it (as axolotl decides), else fp32."""
    bf16, fp16 = keys.take("bf16"), keys.take("fp16")
    if bf16 not in (*PRECISION_OFF, True, "auto"):
        raise keys.error("bf16", "expected true, false or auto")
    if fp16 not in (*PRECISION_OFF, True):
        raise keys.error("fp16", "expected true or false")
    if bf16 == "auto":
        import torch

        bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        keys.note(f"{keys.label} key 'bf16: auto': {'bf16' if bf16 else 'fp32'} on this machine")
    if bf16 is True and fp16 is True:
        raise keys.error("fp16", "bf16 and fp16 are both true; set at most one")
    return "bf16" if bf16 is True else "fp16" if fp16 is True else None


def scheduler_of(keys: ForeignKeys, key: str) -> Optional[str]:
    value = keys.take(key)
    if value is None:
        return None
    if value not in SCHEDULERS:
        raise keys.error(key, f"zerotune schedules the lr as {', '.join(sorted(set(SCHEDULERS.values())))} "
                              "(after warmup)")
    return SCHEDULERS[value]


def optimizer_of(keys: ForeignKeys, key: str) -> None:
    """The AdamW names are accepted (zerotune trains with torch's AdamW) and reported; others are refused."""
    value = keys.take(key)
    if value is None:
        return
    if value not in ADAMW_NAMES:
        raise keys.error(key, f"zerotune trains with torch's AdamW ({', '.join(ADAMW_NAMES)})")
    keys.note(f"{keys.label} key '{key}: {value}': no effect here (zerotune trains with torch's AdamW)")


def target_modules_of(value: Any, keys: ForeignKeys, key: str) -> Any:
    """``all`` -> peft's ``all-linear``; a comma-separated string -> a list; a list stays."""
    if value == "all":
        return "all-linear"
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    if isinstance(value, list) and all(isinstance(name, str) for name in value):
        return list(value)
    raise keys.error(key, "expected module names (a list or a comma-separated string) or all")


def take_model(keys: ForeignKeys, recipe: dict[str, Any], key: str) -> None:
    """The model the YAML names under ``key`` (a local path resolved, a hub id kept), and trust_remote_code."""
    model = keys.take(key)
    keys.put(recipe, "model.name_or_path", keys.local_path(model, key, must_exist=False)
             if isinstance(model, str) else model, key)
    trust = keys.take("trust_remote_code")
    if trust is not None:
        keys.put(recipe, "model.trust_remote_code", trust, "trust_remote_code")


def take_engine(keys: ForeignKeys, recipe: dict[str, Any]) -> None:
    """The training precision (bf16 / fp16 flags) and a ``deepspeed:`` config file, as the engine section."""
    precision = precision_of(keys)
    if precision:
        keys.put(recipe, "engine.precision", precision, "bf16" if precision == "bf16" else "fp16")
    if keys.given("deepspeed"):
        keys.put(recipe, "engine.config_path", keys.local_path(keys.take("deepspeed"), "deepspeed"), "deepspeed")
