"""``load_recipe``: a recipe file / dict + ``--set`` overrides -> a checked :class:`Recipe`.

Loading mirrors the engine config's passes (``zerotune/config/loading.py``) and reuses its
machinery, so recipe errors read exactly like engine-config errors (one line, the dotted
key, did-you-mean for typos):

1. read the source into a plain dict; resolve relative file paths against the recipe's
   directory (a recipe must work from any working directory);
2. apply ``--set key=value`` overrides (their relative paths resolve against the working
   directory, where the user typed them);
3. gather the DeepSpeed keys under ``engine`` into ``engine.config`` and check every key
   against the schema (``normalize_keys``: did-you-mean, aliases);
4. validate types with pydantic (``translate``: one line per error);
5. cross-field checks that name the exact key (``recipe_sections.check_recipe``);
6. reconcile the batch size with the engine config and derive the engine config once, so
   its errors (and conflicts with the recipe) surface at load time, not on the ranks.

:func:`recipe_engine_config` turns a recipe into the DeepSpeed-style dict ``zerotune.initialize``
takes: the engine section wins where it sets a value, the recipe fills the rest, and a value
set differently in both places is an error rather than a silent choice.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from zerotune.config import load_config, resolve_config
from zerotune.config.batch import GAS, MICRO, TBS, solve_batch
from zerotune.config.errors import ConfigError
from zerotune.config.files import YAML_SUFFIXES, read_config_file
from zerotune.config.loading import (  # _plain_copy is private; reused, not duplicated
    _plain_copy,
    normalize_keys,
)
from zerotune.config.pydantic_errors import show_value, translate
from zerotune.config.schema import ZeroTuneConfig
from zerotune.config.tree import set_path
from zerotune.config.types import AUTO
from zerotune.finetune.recipe_sections import (
    BUNDLED_MODELS,
    ENGINE_SHORTCUTS,
    EngineKeys,
    Recipe,
    RecipeError,
    check_recipe,
)

BUNDLED_RECIPES = {"default": "default_classification.yaml", "smollm2-lora": "smollm2_lora.yaml"}


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
    try:
        raw, base_dir = _read_source(source)
        _resolve_paths(raw, base_dir)
        for override in overrides:
            _apply_override(raw, override)
        _resolve_paths(raw, Path.cwd())
        recipe = _validate(raw)
        check_recipe(recipe)
        _reconcile_batch(recipe)
        _derive_engine_config(recipe, total_steps=None, dp_world_size=None, at_load=True)
        return recipe
    except RecipeError:
        raise
    except ConfigError as error:
        raise RecipeError.of(error) from None


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


class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader that reads ``5e-5`` as a float (YAML 1.2) instead of the string "5e-5" (YAML 1.1).

    Every learning rate is written that way; PyYAML's YAML 1.1 float needs a dot.
    """


_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _read_recipe_file(path: Path) -> dict[str, Any]:
    try:
        data = read_config_file(path)  # every unreadable / malformed-file error, naming the file
    except ConfigError as error:
        message = error.message.replace("config file", "recipe file", 1) + _bundled_hint(path)
        raise RecipeError(error.path, message) from None
    if path.suffix.lower() in YAML_SUFFIXES:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_Yaml12Loader)  # noqa: S506 - a SafeLoader
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
        value = yaml.load(text, Loader=_Yaml12Loader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError(key, f"override value {text!r} is not valid YAML ({problem}); "
                               "quote it or fix the brackets") from None
    set_path(raw, key, value)


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


# --- 6. the engine config ---------------------------------------------------------------------

def recipe_engine_config(recipe: Recipe, total_steps: int | None = None,
                         dp_world_size: int | None = None) -> dict[str, Any]:
    """The DeepSpeed-style config dict for ``zerotune.initialize`` that the recipe describes.

    The engine section (inline or ``config_path``) wins where it sets a value; the recipe
    fills the rest: the batch (``train.micro_batch_size``, ``gradient_accumulation_steps``),
    AdamW with ``train.lr``/``weight_decay``, a linear-warmup schedule (WarmupDecayLR to 0 at
    the last step when the step count is known -- ``train.max_steps`` or ``total_steps`` --
    else WarmupLR), ``gradient_clipping``, and the ``zero_stage``/``precision`` shortcuts.
    "auto" engine values take the recipe's. A value the recipe sets explicitly and the engine
    sets differently is a RecipeError naming both. With ``dp_world_size`` the result is also
    resolved (batch triple, "auto"s) so every problem surfaces here, prefixed "engine.".
    """
    return _derive_engine_config(recipe, total_steps=total_steps, dp_world_size=dp_world_size, at_load=False)


def _engine_base_config(recipe: Recipe) -> dict[str, Any]:
    """The engine config the recipe gives (inline or from its file), keys normalized, values validated."""
    engine = recipe.engine
    note = ""
    if engine.config_path is not None:
        if engine.config:
            raise RecipeError("engine.config_path", "given together with inline engine keys "
                                                    f"({', '.join(sorted(engine.config))}); use one of them")
        try:
            raw = read_config_file(engine.config_path)
        except ConfigError as error:
            raise RecipeError("engine.config_path", error.message) from None
        note = f" (in engine config file '{engine.config_path}')"
    else:
        raw = _plain_copy(engine.config)
    try:
        normalized = normalize_keys(raw, ZeroTuneConfig, "")
        load_config(normalized)
    except ConfigError as error:
        raise RecipeError.of(error, "engine", note) from None
    _refuse_model_parallelism(normalized, note)
    return normalized


# (config path, what it turns on). The job shards its data over every rank as data-parallel
# replicas and saves whole HF / peft models, so a tensor-, sequence- or pipeline-parallel layout
# would feed replicas of one shard different data; those modes are the engine API's for now.
_MODEL_PARALLEL_KEYS = (
    (("tensor_parallel", "autotp_size"), "tensor parallelism"),
    (("sequence_parallel_size",), "sequence parallelism"),
    (("pipeline", "stages"), "pipeline parallelism"),
)


def _refuse_model_parallelism(config: Mapping[str, Any], note: str) -> None:
    for path, mode in _MODEL_PARALLEL_KEYS:
        value: Any = config
        for key in path:
            value = value.get(key) if isinstance(value, Mapping) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            raise RecipeError(
                "engine." + ".".join(path),
                f"{value}{note}: zerotune finetune runs data parallel only (ZeRO 0-3, offload, compression); "
                f"{mode} is available to your own training script through zerotune.initialize "
                "(see the README). Remove the key or set it to 1")


def _given(block: Mapping[str, Any], key: str) -> Any:
    """The engine's value of ``key``, or None when it is absent or "auto" (left to the recipe)."""
    value = block.get(key)
    return None if _is_auto(value) else value


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


def _conflict(recipe_key: str, recipe_value: Any, engine_key: str, engine_value: Any) -> RecipeError:
    return RecipeError(recipe_key, f"{show_value(recipe_value)} conflicts with {engine_key} "
                                   f"{show_value(engine_value)}; set it in one place")


def _reconcile_batch(recipe: Recipe) -> None:
    """Make ``recipe.train``'s batch the one the engine will run, so the data loader and engine agree.

    The engine config may fix the micro batch, the accumulation or the global batch; the
    global batch is solved with the data-parallel size the launch section implies.
    """
    config = _engine_base_config(recipe)
    train = recipe.train
    values = {}
    for field, key in (("micro_batch_size", MICRO), ("gradient_accumulation_steps", GAS)):
        mine = getattr(train, field) if field in train.model_fields_set else None
        theirs = _given(config, key)
        if mine is not None and theirs is not None and mine != theirs:
            raise _conflict(f"train.{field}", mine, f"engine.{key}", theirs)
        values[field] = theirs if theirs is not None else mine
    total_batch = _given(config, TBS)
    if total_batch is not None:
        dp = recipe.launch.nproc_per_node * recipe.launch.nnodes
        try:
            _, values["micro_batch_size"], values["gradient_accumulation_steps"] = solve_batch(
                total_batch, values["micro_batch_size"], values["gradient_accumulation_steps"], dp)
        except ConfigError as error:
            raise RecipeError(f"engine.{TBS}", f"{error.message} (data-parallel size = launch.nproc_per_node "
                                               "x launch.nnodes)") from None
    for field, value in values.items():
        if value is not None and value != getattr(train, field):
            setattr(train, field, value)


def _fill(block: dict[str, Any], key: str, value: Any, *, recipe_key: str, explicit: bool, engine_key: str,
          add_missing: bool = True, shown: Any = None) -> None:
    """Put the recipe's ``value`` at ``block[key]`` unless the engine set it; conflicting explicit values raise."""
    if _is_auto(block.get(key)) or (add_missing and key not in block):
        block[key] = value
    elif key in block and explicit and block[key] != value:
        raise _conflict(recipe_key, value if shown is None else shown, engine_key, block[key])


def _derive_engine_config(recipe: Recipe, *, total_steps: int | None, dp_world_size: int | None,
                          at_load: bool) -> dict[str, Any]:
    config = _engine_base_config(recipe)
    train, engine = recipe.train, recipe.engine
    explicit = train.model_fields_set

    def fill_from_train(block: dict[str, Any], key: str, field: str, engine_key: str, add_missing: bool = True) -> None:
        _fill(block, key, getattr(train, field), recipe_key=f"train.{field}", explicit=field in explicit,
              engine_key=engine_key, add_missing=add_missing)

    fill_from_train(config, MICRO, "micro_batch_size", f"engine.{MICRO}")
    fill_from_train(config, GAS, "gradient_accumulation_steps", f"engine.{GAS}")
    fill_from_train(config, "gradient_clipping", "gradient_clipping", "engine.gradient_clipping")
    if config.get("optimizer") is None:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": train.lr, "weight_decay": train.weight_decay}}
    params = config["optimizer"].setdefault("params", {})
    fill_from_train(params, "lr", "lr", "engine.optimizer.params.lr")
    fill_from_train(params, "weight_decay", "weight_decay", "engine.optimizer.params.weight_decay")
    _fill_scheduler(config, recipe, params["lr"], train.max_steps or total_steps, at_load)
    if engine.zero_stage is not None:
        _fill(config.setdefault("zero_optimization", {}), "stage", engine.zero_stage, recipe_key="engine.zero_stage",
              explicit=True, engine_key="engine.zero_optimization.stage")
    if engine.precision is not None:
        for name in ("bf16", "fp16"):
            _fill(config.setdefault(name, {}), "enabled", engine.precision == name, recipe_key="engine.precision",
                  explicit=True, engine_key=f"engine.{name}.enabled", shown=engine.precision)
    try:
        validated = load_config(config)
        if dp_world_size is not None:
            resolve_config(validated, dp_world_size=dp_world_size)
    except ConfigError as error:
        raise RecipeError.of(error, "engine") from None
    return config


def _fill_scheduler(config: dict[str, Any], recipe: Recipe, lr: Any, total: int | None, at_load: bool) -> None:
    """Linear warmup to ``lr`` then (with a known step count) linear decay to 0, as HF Trainer does."""
    train = recipe.train
    if train.warmup_ratio is None:
        warmup = train.warmup_steps
    elif total is not None:
        warmup = round(train.warmup_ratio * total)
    elif at_load:
        warmup = 0  # the trainer passes total_steps once it knows the data size
    else:
        raise RecipeError("train.warmup_ratio", "needs the total number of optimizer steps: set train.max_steps "
                                                "(or pass total_steps to recipe_engine_config)")
    warmup_explicit = train.warmup_ratio is not None or "warmup_steps" in train.model_fields_set
    scheduler = config.get("scheduler")
    if scheduler is None:
        # Without warmup the "warmup" holds lr flat: the schedule floors warmup_num_steps at 2 and
        # would otherwise spend the first step at lr 0.
        params = {"warmup_min_lr": 0.0 if warmup else lr, "warmup_max_lr": lr, "warmup_num_steps": warmup,
                  "warmup_type": "linear"}
        if total is not None:
            config["scheduler"] = {"type": "WarmupDecayLR", "params": {"total_num_steps": total, **params}}
        else:
            config["scheduler"] = {"type": "WarmupLR", "params": params}
        return
    # The engine's own schedule: only its "auto" values are filled (an absent key may not be one of its arguments).
    params = scheduler.setdefault("params", {})
    prefix = "engine.scheduler.params"
    _fill(params, "warmup_num_steps", warmup, recipe_key="train.warmup_steps", explicit=warmup_explicit,
          engine_key=f"{prefix}.warmup_num_steps", add_missing=False)
    _fill(params, "warmup_max_lr", lr, recipe_key="train.lr", explicit=False, engine_key="", add_missing=False)
    if total is not None:
        _fill(params, "total_num_steps", total, recipe_key="train.max_steps", explicit=train.max_steps is not None,
              engine_key=f"{prefix}.total_num_steps", add_missing=False)


__all__ = [
    "BUNDLED_RECIPES",
    "Recipe",
    "RecipeError",
    "bundled_recipe_path",
    "load_recipe",
    "recipe_engine_config",
    "recipe_to_dict",
]
