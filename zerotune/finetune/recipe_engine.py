"""The engine config a recipe describes: step 6 of loading a recipe (``recipe.py``), and what the ranks run.

The engine section wins where it sets a value, the recipe fills the rest (batch, AdamW, the
``train.lr_scheduler`` schedule, clipping, the ``zero_stage`` / ``precision`` shortcuts), and a value set
differently in both places is an error naming both keys rather than a silent choice. Engine
keys the job cannot honour (model-parallel layouts) are refused here too, at load time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zerotune.config import load_config, resolve_config
from zerotune.config.batch import GAS, MICRO, TBS, solve_batch
from zerotune.config.errors import ConfigError
from zerotune.config.files import read_config_file
from zerotune.config.loading import (  # _plain_copy is private; reused, not duplicated
    _plain_copy,
    normalize_keys,
)
from zerotune.config.pydantic_errors import show_value
from zerotune.config.schema import ZeroTuneConfig
from zerotune.config.types import AUTO
from zerotune.finetune.recipe_checks import RecipeError
from zerotune.finetune.recipe_sections import Recipe
from zerotune.finetune.schedules import fill_engine_schedule, left_to_recipe, recipe_schedule
from zerotune.monitor.writers import check_writer_packages


def recipe_engine_config(recipe: Recipe, total_steps: int | None = None,
                         dp_world_size: int | None = None) -> dict[str, Any]:
    """The DeepSpeed-style config dict for ``zerotune.initialize`` that the recipe describes.

    The engine section (inline or ``config_path``) wins where it sets a value; the recipe
    fills the rest: the batch (``train.micro_batch_size``, ``gradient_accumulation_steps``),
    AdamW with ``train.lr``/``weight_decay``, the ``train.lr_scheduler`` schedule after a linear
    warm-up (``schedules.py``; a decay needs the step count -- ``train.max_steps`` or ``total_steps``),
    ``gradient_clipping``, and the ``zero_stage``/``precision`` shortcuts.
    "auto" engine values take the recipe's. A value the recipe sets explicitly and the engine
    sets differently is a RecipeError naming both. With ``dp_world_size`` the result is also
    resolved (batch triple, "auto"s) so every problem surfaces here, prefixed "engine.".
    """
    return derive_engine_config(recipe, total_steps=total_steps, dp_world_size=dp_world_size, at_load=False)


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
        load_config(left_to_recipe(normalized))
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


def reconcile_batch(recipe: Recipe) -> None:
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


def derive_engine_config(recipe: Recipe, *, total_steps: int | None, dp_world_size: int | None,
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
    if train.save_total_limit is not None:
        fill_from_train(config.setdefault("checkpoint", {}), "keep_last", "save_total_limit",
                        "engine.checkpoint.keep_last")
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
    _check_method_fits_engine(recipe, validated)
    for block in ("tensorboard", "wandb"):
        try:
            check_writer_packages(**{block: getattr(validated, block)})
        except ImportError as error:
            raise RecipeError(f"engine.{block}.enabled", str(error)) from None
    return config


WRITER_BLOCKS = ("tensorboard", "csv_monitor")
ENGINE_LINE_OFF = 2**31 - 1  # steps_per_print that never comes


def fit_engine_to_run(config: dict[str, Any], output_dir: str) -> None:
    """Put the enabled TensorBoard / CSV writers' files in the run directory (``OUTPUT/tensorboard``,
    ``OUTPUT/csv_monitor``) unless the engine section chose a path or job name, instead of DeepSpeed's
    ``./runs/DeepSpeedJobName`` relative to wherever the job was started; and leave the console to the
    job's progress bar: the engine's own step line only when the engine section sets ``steps_per_print``."""
    config.setdefault("steps_per_print", ENGINE_LINE_OFF)
    for name in WRITER_BLOCKS:
        block = config.get(name)
        if isinstance(block, dict) and block.get("enabled"):
            if not block.get("output_path"):
                block["output_path"] = output_dir
                block.setdefault("job_name", name)


def _check_method_fits_engine(recipe: Recipe, engine: Any) -> None:
    """A method or load dtype the engine layout cannot train is refused at load, naming both."""
    stage, method = engine.zero_optimization.stage, recipe.method.type
    precision = "bf16" if engine.bf16.enabled else "fp16" if engine.fp16.enabled else "fp32"
    if recipe.model.dtype in ("bf16", "fp16") and recipe.model.dtype != precision:
        raise RecipeError("model.dtype", f"{recipe.model.dtype} weights with engine.precision {precision}: the engine "
                                         f"would train {recipe.model.dtype} values as {precision}; set "
                                         f"engine.precision {recipe.model.dtype}, or model.dtype auto / fp32")
    if method == "qlora" and stage == 3:
        raise RecipeError("method.type", "qlora with ZeRO stage 3 (engine.zero_stage): stage 3 partitions every "
                                         "parameter, and the frozen base's 4/8-bit weights are packed integers "
                                         "bitsandbytes must hold whole; use zero_stage 0-2 (the adapters are tiny)")


def _fill_scheduler(config: dict[str, Any], recipe: Recipe, lr: Any, total: int | None, at_load: bool) -> None:
    """``train.lr_scheduler``'s schedule (``schedules.py``), or the recipe's values in the engine section's own."""
    if config.get("scheduler") is None:
        config["scheduler"] = recipe_schedule(recipe.train, lr, total, at_load)
    else:
        fill_engine_schedule(config["scheduler"], recipe.train, lr, total, at_load)
