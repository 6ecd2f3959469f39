"""A fine-tuning recipe's error type and the checks that span several of its keys.

A pydantic model validator could only report a whole section; these raise at the exact key the user
should change (exactly one of ``epochs`` / ``max_steps``, options of another method than the chosen one,
...). ``recipe.py`` runs them after loading (``recipe_sections.py`` holds the sections themselves).
"""

from __future__ import annotations

from zerotune.config.errors import ConfigError
from zerotune.finetune.chat_templates import TEMPLATES
from zerotune.finetune.recipe_sections import METHOD_OPTIONS, OBJECTIVE_OPTIONS, DataSection, Recipe


class RecipeError(ConfigError):
    """A recipe value is missing, malformed, inconsistent or unknown; ``path`` is its dotted key."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(path, message)
        text = f"zerotune recipe: {path}: {message}" if path else f"zerotune recipe: {message}"
        self.args = (text,)

    @classmethod
    def of(cls, error: ConfigError, prefix: str = "", note: str = "") -> RecipeError:
        """``error`` (raised by the engine-config machinery) as a RecipeError under ``prefix``."""
        path = ".".join(p for p in (prefix, error.path) if p)
        return cls(path, error.message + note)


def check_recipe(recipe: Recipe) -> None:
    """Constraints spanning several keys, each raised at the key the user should change."""
    _check_train(recipe)
    _check_best(recipe)
    _check_data(recipe)
    _check_method(recipe)
    _check_objective(recipe)
    _check_task(recipe)
    _check_launch(recipe)


def _check_train(recipe: Recipe) -> None:
    train = recipe.train
    if train.epochs is not None and train.max_steps is not None:
        raise RecipeError("train.max_steps", "train.epochs and train.max_steps are both set; set exactly one")
    if train.epochs is None and train.max_steps is None:
        train.epochs = 1.0
    if train.warmup_ratio is not None and "warmup_steps" in train.model_fields_set and train.warmup_steps:
        raise RecipeError("train.warmup_ratio",
                          "train.warmup_steps and train.warmup_ratio are both set; set at most one")
    if "min_lr_ratio" in train.model_fields_set and train.lr_scheduler != "cosine":
        raise RecipeError("train.min_lr_ratio", f"only used with train.lr_scheduler cosine (it is "
                                                f"{train.lr_scheduler}); remove it or set lr_scheduler cosine")
    if train.neftune_noise_alpha is not None and recipe.task != "causal-lm":
        raise RecipeError("train.neftune_noise_alpha", f"NEFTune adds noise to a causal LM's input embeddings; "
                                                       f"task is {recipe.task}: remove it or use task causal-lm")


def _check_best(recipe: Recipe) -> None:
    from zerotune.finetune.best import METRICS, evaluation_kind

    train = recipe.train
    wanted = [key for key in ("load_best_model_at_end", "early_stopping_patience") if key in train.model_fields_set
              and getattr(train, key) not in (None, False)]
    if wanted and not train.eval_every:
        raise RecipeError("train.eval_every", f"train.{wanted[0]} needs evaluations during training: set "
                                              "train.eval_every to a number of optimizer steps")
    metric = train.metric_for_best_model
    kind = evaluation_kind(recipe)
    if metric is not None and metric not in METRICS[kind]:
        what = f"task {recipe.task!r}" if kind == recipe.task else f"objective.type {recipe.objective.type!r}"
        raise RecipeError("train.metric_for_best_model", f"{metric!r} is not an eval metric of {what}; "
                                                         f"expected one of {', '.join(METRICS[kind])}")


def _check_data(recipe: Recipe) -> None:
    data = recipe.data
    sources = [key for key in ("train_files", "dataset", "bundled") if getattr(data, key) is not None]
    if len(sources) > 1:
        raise RecipeError(f"data.{sources[1]}",
                          f"data.{sources[0]} and data.{sources[1]} are both set; set exactly one")
    if not sources:
        raise RecipeError("data", "no training data: set data.train_files (local files), data.dataset (a Hugging Face "
                                  "data set id or directory) or data.bundled (rotten_tomatoes or "
                                  "chatterbot_corpus_english)")
    for key in ("dataset_config", "train_split", "eval_split"):
        if key in data.model_fields_set and data.dataset is None:
            raise RecipeError(f"data.{key}", "only used with data.dataset; remove it or set data.dataset")
    if data.eval_split is not None and "eval_fraction" in data.model_fields_set:
        raise RecipeError("data.eval_fraction", "unused when data.eval_split is given; remove one of them")
    if data.eval_files is not None and data.dataset is not None:
        raise RecipeError("data.eval_files", "with data.dataset, name its eval split in data.eval_split")
    if data.eval_files is not None and data.bundled is not None:
        raise RecipeError("data.eval_files",
                          "only with data.train_files; a bundled data set holds out data.eval_fraction")
    if (data.prompt_column is None) != (data.response_column is None):
        missing = "prompt_column" if data.prompt_column is None else "response_column"
        raise RecipeError(f"data.{missing}", "give both data.prompt_column and data.response_column "
                                             "(question/answer data), or neither (plain text)")
    if data.prompt_column is not None and data.format not in ("auto", "prompt_response"):
        raise RecipeError("data.format", f"is {data.format!r}, but data.prompt_column / data.response_column name "
                                         "prompt/response columns; set data.format: prompt_response or remove them")
    if data.eval_files is not None and "eval_fraction" in data.model_fields_set:
        raise RecipeError("data.eval_fraction", "unused when data.eval_files is given; remove one of them")
    _check_chat_format(data)


def _check_chat_format(data: DataSection) -> None:
    """data.template against the layout, and one way of naming the trained turns (train_on_prompt trains them all)."""
    if data.template == "none" and data.format in ("messages", "sharegpt"):
        raise RecipeError("data.template", f"none, but data.format {data.format!r} holds chat messages, which need a "
                                           f"chat template; set data.template to auto or one of "
                                           f"{', '.join(TEMPLATES)}")
    roles = data.roles_to_train
    if roles is not None and (data.train_on != "all_assistant"
                              or ("train_on" in data.model_fields_set and set(roles) != {"assistant"})):
        raise RecipeError("data.roles_to_train", f"{roles} conflicts with data.train_on: {data.train_on}; set only one "
                                                 "of them (roles_to_train trains every turn of its roles)")
    if data.train_on_prompt:
        narrowed = ("train_on" if data.train_on != "all_assistant" else
                    "roles_to_train" if roles is not None and set(roles) != {"assistant"} else None)
        if narrowed is not None:
            raise RecipeError(f"data.{narrowed}", f"{getattr(data, narrowed)} conflicts with data.train_on_prompt: "
                                                  "true, which trains every token of every turn; remove one of them")


def _check_method(recipe: Recipe) -> None:
    method = recipe.method
    for option in sorted(method.model_fields_set - {"type"}):
        owners = [owner for owner, options in METHOD_OPTIONS.items() if option in options]
        if method.type not in owners:
            raise RecipeError(f"method.{option}", f"a {' / '.join(owners)} option, but method.type is {method.type!r}; "
                                                  f"remove it or set method.type={owners[0]}")
    if method.type == "prefix" and recipe.data.packing:
        raise RecipeError("data.packing", "not with method.type prefix: prefix tuning feeds its virtual tokens as an "
                                          "attention cache, under which packed examples would attend to each other; "
                                          "set data.packing: false or use lora")
    if method.type == "freeze" and method.trainable_layers is None and method.trainable_modules is None:
        raise RecipeError("method.trainable_layers", "freeze tuning trains nothing unless method.trainable_layers "
                                                     "(the last N blocks) or method.trainable_modules is set")


def _check_objective(recipe: Recipe) -> None:
    objective = recipe.objective
    for option in sorted(objective.model_fields_set - {"type"}):
        owners = [owner for owner, options in OBJECTIVE_OPTIONS.items() if option in options]
        if objective.type not in owners:
            raise RecipeError(f"objective.{option}", f"a {' / '.join(owners)} option, but objective.type is "
                                                     f"{objective.type!r}; remove it or set objective.type={owners[0]}")
    if objective.type == "sft":
        return
    if recipe.task != "causal-lm":
        raise RecipeError("objective.type", f"{objective.type} trains a causal LM (task: causal-lm); task is "
                                            f"{recipe.task!r}")
    if recipe.data.packing:
        raise RecipeError("data.packing", f"not with objective.type {objective.type}: a preference batch scores "
                                          "whole answers one per row; set data.packing: false")
    for key in ("prompt_column", "response_column", "format", "text_column", "train_on_prompt", "train_on",
                "roles_to_train", "add_eos"):
        if key in recipe.data.model_fields_set:
            raise RecipeError(f"data.{key}", f"an SFT data option; objective.type {objective.type} reads preference "
                                             "rows (prompt/chosen/rejected and the other documented layouts); "
                                             "remove it")
    if objective.type == "reward" and recipe.method.type == "prefix":
        raise RecipeError("method.type", "prefix tuning with objective.type reward: the reward head is a sequence "
                                         "classifier, which peft's prefix tuning does not train here; use lora or "
                                         "full")
    if objective.type == "reward" and "eval_samples" in recipe.train.model_fields_set and recipe.train.eval_samples:
        raise RecipeError("train.eval_samples", "a reward model scores answers and generates none; set 0 or remove "
                                                "it")


_TASK_ONLY = {
    "sequence-classification": (("model", "num_labels"), ("data", "label_column"), ("data", "text_pair_column")),
    "causal-lm": (("data", "prompt_column"), ("data", "response_column"), ("data", "format"), ("data", "packing"),
                  ("data", "template"), ("data", "train_on_prompt"), ("data", "train_on"), ("data", "roles_to_train"),
                  ("data", "add_eos"),
                  ("train", "eval_samples"), ("train", "sample_prompts"), ("train", "sample_max_new_tokens")),
}


def _check_task(recipe: Recipe) -> None:
    for task, keys in _TASK_ONLY.items():
        if task == recipe.task:
            continue
        for section, key in keys:
            if key in getattr(recipe, section).model_fields_set:
                raise RecipeError(f"{section}.{key}",
                                  f"only used by task {task!r}, but task is {recipe.task!r}; remove it")


def _check_launch(recipe: Recipe) -> None:
    launch = recipe.launch
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        raise RecipeError("launch.rdzv_endpoint", f"required when launch.nnodes is {launch.nnodes} "
                                                  "(host:port of the first node)")
    if launch.node_rank is not None and launch.node_rank >= launch.nnodes:
        raise RecipeError("launch.node_rank", f"{launch.node_rank} is not below launch.nnodes {launch.nnodes}")
