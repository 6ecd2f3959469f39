"""``load_recipe``: a recipe file / dict + ``--set`` overrides -> a checked :class:`Recipe`.

Loading mirrors the engine config's passes (``zerotune/config/loading.py``) and reuses its
machinery, so recipe errors read exactly like engine-config errors (one line, the dotted
key, did-you-mean for typos):

1. read the source into a plain dict (a LLaMA-Factory or axolotl YAML is translated into a
   recipe here, ``foreign_recipes.py``); resolve relative file paths against the recipe's
   directory (a recipe must work from any working directory);
2. apply ``--set key=value`` overrides (their relative paths resolve against the working
   directory, where the user typed them);
3. gather the DeepSpeed keys under ``engine`` into ``engine.config`` and check every key
   against the schema (``normalize_keys``: did-you-mean, aliases);
4. validate types with pydantic (``translate``: one line per error);
5. cross-field checks that name the exact key (``recipe_checks.check_recipe``);
6. reconcile the batch size with the engine config and derive the engine config once, so
   its errors (and conflicts with the recipe) surface at load time, not on the ranks.

:func:`recipe_engine_config` (``recipe_engine.py``, re-exported here) turns a recipe into the
DeepSpeed-style dict ``zerotune.initialize`` takes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from zerotune.config.errors import ConfigError
from zerotune.config.files import read_config_file
from zerotune.config.loading import (  # _plain_copy is private; reused, not duplicated
    _plain_copy,
    normalize_keys,
)
from zerotune.config.pydantic_errors import translate
from zerotune.config.tree import set_path
from zerotune.config.yaml_loader import YamlExpansionError, load_yaml
from zerotune.finetune.foreign_recipes import detect_dialect, report_notes, translate_foreign
from zerotune.finetune.recipe_checks import RecipeError, check_recipe
from zerotune.finetune.recipe_engine import (
    derive_engine_config,
    recipe_engine_config,
    reconcile_batch,
)
from zerotune.finetune.recipe_sections import (
    BUNDLED_MODELS,
    ENGINE_SHORTCUTS,
    METHOD_OPTIONS,
    METHODS,
    OBJECTIVE_OPTIONS,
    OBJECTIVES,
    EngineKeys,
    Recipe,
)

BUNDLED_RECIPES = {"default": "default_classification.yaml", "smollm2-lora": "smollm2_lora.yaml",
                   "smollm2-dpo": "smollm2_dpo.yaml"}


def bundled_recipe_path(name: str) -> Path:
    """The file of a bundled recipe: "default" (MiniLM sentiment) or "smollm2-lora" (SmolLM2 Q&A)."""
    if name not in BUNDLED_RECIPES:
        raise RecipeError("", f"unknown bundled recipe {name!r}; bundled recipes are: {', '.join(BUNDLED_RECIPES)}")
    return Path(str(resources.files("zerotune.finetune") / "recipes" / BUNDLED_RECIPES[name]))


def load_recipe(source: str | os.PathLike[str] | Mapping[str, Any] | Recipe | None = None,
                overrides: Sequence[str] = ()) -> Recipe:
    """Load, override and check a recipe; any problem is a one-line :class:`RecipeError`.

    ``source`` is a YAML/JSON file, a bundled recipe name ("default", "smollm2-lora"), a
    dict, or None for the bundled default. ``overrides`` are ``"train.lr=3e-5"`` strings;
    the value is parsed as YAML (``[a.csv, b.csv]`` is a list, ``null`` is None).
    """
    if isinstance(overrides, str):
        raise RecipeError("", f"overrides must be a list of 'key=value' strings, got the string {overrides!r}")
    translation = None
    try:
        raw, base_dir = _read_source(source)
        dialect = detect_dialect(raw)
        if dialect != "zerotune":  # a LLaMA-Factory / axolotl YAML, run unchanged
            translation = translate_foreign(raw, dialect, base_dir)
            report_notes(translation)
            raw = translation.recipe
        _resolve_paths(raw, base_dir)
        for override in overrides:
            _apply_override(raw, override)
        _switch_method(raw, overrides)
        _switch_data_source(raw, overrides)
        _resolve_paths(raw, Path.cwd())
        recipe = _validate(raw)
        check_recipe(recipe)
        reconcile_batch(recipe)
        derive_engine_config(recipe, total_steps=None, dp_world_size=None, at_load=True)
        return recipe
    except RecipeError as error:
        if translation is not None:
            raise translation.explain(error) from None
        raise
    except ConfigError as error:
        wrapped = RecipeError.of(error)
        raise (translation.explain(wrapped) if translation is not None else wrapped) from None


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """The values the recipe sets, as a plain dict that ``load_recipe`` accepts again.

    Only explicitly set values are kept: dumping defaults too would turn, say, the unused
    LoRA defaults of a full fine-tuning recipe into "options of another method" on reload.
    """
    return recipe.model_dump(mode="json", exclude_unset=True)


# --- 1. reading -------------------------------------------------------------------------

def _read_source(source: Any) -> tuple[dict[str, Any], Path]:
    """The raw dict and the directory its relative paths are relative to."""
    if source is None:
        source = bundled_recipe_path("default")
    if isinstance(source, Recipe):
        return recipe_to_dict(source), Path.cwd()
    if isinstance(source, Mapping):
        return _plain_copy(source), Path.cwd()
    if isinstance(source, str) and source in BUNDLED_RECIPES and not Path(source).exists():
        source = bundled_recipe_path(source)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        return _read_recipe_file(path), path.absolute().parent
    raise RecipeError("", "expected a recipe file path, a bundled recipe name, a dict or None, "
                          f"got {type(source).__name__}")


def _read_recipe_file(path: Path) -> dict[str, Any]:
    try:
        data = read_config_file(path)  # every unreadable / malformed-file error, naming the file
    except ConfigError as error:
        message = error.message.replace("config file", "recipe file", 1) + _bundled_hint(path)
        raise RecipeError(error.path, message) from None
    return data


def _bundled_hint(path: Path) -> str:
    if path.exists() or path.suffix:
        return ""
    return f" (bundled recipes: {', '.join(BUNDLED_RECIPES)})"


# --- 1b. relative paths -------------------------------------------------------------------

def _resolve_paths(raw: dict[str, Any], base_dir: Path) -> None:
    """Make relative file paths absolute against ``base_dir`` (values of a wrong type are left for validation)."""
    data = raw.get("data")
    if isinstance(data, dict):
        for key in ("train_files", "eval_files"):
            value = data.get(key)
            if isinstance(value, str):
                data[key] = _absolute(value, base_dir)
            elif isinstance(value, list):
                data[key] = [_absolute(item, base_dir) if isinstance(item, str) else item for item in value]
    if isinstance(data, dict) and isinstance(data.get("dataset"), str):  # a directory here, else a hub id
        if (base_dir / Path(data["dataset"]).expanduser()).is_dir():
            data["dataset"] = _absolute(data["dataset"], base_dir)
    engine = raw.get("engine")
    if isinstance(engine, dict) and isinstance(engine.get("config_path"), str):
        engine["config_path"] = _absolute(engine["config_path"], base_dir)
    model = raw.get("model")
    if isinstance(model, dict) and isinstance(model.get("name_or_path"), str):
        name = model["name_or_path"]
        # A bundled name, or a hub-style id that is not a local directory here, stays as written;
        # the model loader reports it if it is neither.
        if name not in BUNDLED_MODELS and (base_dir / Path(name).expanduser()).exists():
            model["name_or_path"] = _absolute(name, base_dir)


def _absolute(value: str, base_dir: Path) -> str:
    return os.path.normpath(base_dir / Path(value).expanduser()) if value else value


# --- 2. overrides ---------------------------------------------------------------------------

def _apply_override(raw: dict[str, Any], override: str) -> None:
    key, sep, text = override.partition("=") if isinstance(override, str) else ("", "", "")
    key = key.strip()
    if not sep or not key or not all(key.split(".")):
        raise RecipeError("", f"override {override!r} must look like section.key=value, e.g. train.lr=3e-5")
    try:
        value = load_yaml(text)
    except YamlExpansionError as exc:
        raise RecipeError(key, f"override value is refused: {exc}") from None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError(key, f"override value {text!r} is not valid YAML ({problem}); "
                               "quote it or fix the brackets") from None
    set_path(raw, key, value)


def _overridden_keys(overrides: Sequence[str]) -> set[str]:
    return {o.partition("=")[0].strip() for o in overrides if isinstance(o, str)}


def _switch_method(raw: dict[str, Any], overrides: Sequence[str]) -> None:
    """``--set method.type=prefix`` on a LoRA recipe: the recipe's options of the method it leaves (r, alpha, ...)
    go with it; likewise ``--set objective.type=orpo`` on a DPO recipe. Options the overrides themselves give are
    kept, so one that does not fit the new type is still refused by name."""
    for section, types, owned in (("method", METHODS, METHOD_OPTIONS), ("objective", OBJECTIVES, OBJECTIVE_OPTIONS)):
        block = raw.get(section)
        overridden = _overridden_keys(overrides)
        if f"{section}.type" not in overridden or not isinstance(block, dict) or not isinstance(block.get("type"), str):
            continue
        if block["type"] not in types:
            continue  # validation names it
        valid = owned.get(block["type"], ())
        for option in [key for key in block if key != "type" and key not in valid]:
            if f"{section}.{option}" not in overridden:
                del block[option]


DATA_SOURCES = ("train_files", "dataset", "bundled")


def _switch_data_source(raw: dict[str, Any], overrides: Sequence[str]) -> None:
    """``--set data.train_files=[chat.jsonl]`` on a recipe with bundled data: the recipe's own source gives way
    to the one the overrides name (two sources both given by overrides are still refused)."""
    data = raw.get("data")
    overridden = _overridden_keys(overrides)
    chosen = [key for key in DATA_SOURCES if f"data.{key}" in overridden]
    if not chosen or not isinstance(data, dict):
        return
    for key in DATA_SOURCES:
        if key not in chosen:
            data.pop(key, None)


# --- 3-4. keys and types ----------------------------------------------------------------------

def _validate(raw: dict[str, Any]) -> Recipe:
    engine = raw.get("engine")
    if isinstance(engine, Mapping):
        raw["engine"] = _fold_engine(engine)
    normalized = normalize_keys(raw, Recipe, "")
    try:
        return Recipe.model_validate(normalized)
    except ValidationError as exc:
        raise RecipeError.of(translate(exc, normalized)) from None
    except RecursionError:
        raise RecipeError("", "recipe is nested too deeply") from None


def _fold_engine(engine: Mapping[str, Any]) -> dict[str, Any]:
    """``engine: {zero_stage: 2, zero_optimization: {...}}`` -> ``{zero_stage: 2, config: {zero_optimization: ...}}``.

    Keys are checked against the engine config and the shortcuts together, so a typo of
    either gets the right did-you-mean.
    """
    keys = normalize_keys(engine, EngineKeys, "engine")
    folded = {name: keys.pop(name) for name in ENGINE_SHORTCUTS if name in keys}
    if keys:
        inline = folded.get("config") or {}
        if not isinstance(inline, Mapping):
            raise RecipeError("engine.config", "expected a mapping (JSON object) of engine config keys")
        twice = sorted(set(inline) & set(keys))
        if twice:
            raise RecipeError(f"engine.{twice[0]}", "given both directly under engine and under engine.config; "
                                                    "keep one")
        folded["config"] = {**inline, **keys}
    return folded


__all__ = [
    "BUNDLED_RECIPES",
    "Recipe",
    "RecipeError",
    "bundled_recipe_path",
    "load_recipe",
    "recipe_engine_config",
    "recipe_to_dict",
]
