"""A LLaMA-Factory training YAML (``llamafactory-cli train x.yaml``) as a zerotune recipe, key by key.

Where a key is absent, LLaMA-Factory's own default is written into the recipe when it may differ
from zerotune's and changes the result (3 epochs, batch 8, cutoff_len 2048, LoRA on all linear
layers with alpha = 2 x rank and no dropout, gradient checkpointing on, pref_beta 0.1, simpo_gamma
0.5), so the run is the one LLaMA-Factory would do. Data sets are looked up in ``dataset_dir/dataset_info.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zerotune.finetune.foreign_keys import (
    LLAMAFACTORY_TEMPLATES,
    ForeignKeys,
    NoEffect,
    Translation,
    optimizer_of,
    scheduler_of,
    take_engine,
    take_model,
    target_modules_of,
)

_STAGES = {"sft": "sft", "dpo": "dpo", "kto": "kto", "rm": "reward"}
_PREF_LOSSES = {"sigmoid": ("dpo", "sigmoid"), "ipo": ("dpo", "ipo"), "hinge": ("dpo", "hinge"),
                "orpo": ("orpo", None), "simpo": ("simpo", None)}
_METHODS = {"lora": "lora", "full": "full", "freeze": "freeze"}

_NO_EFFECT: dict[str, NoEffect] = {
    "do_train": (lambda v: v is True, "zerotune finetune always trains; do_train: false would train nothing"),
    "overwrite_output_dir": (None, "zerotune writes into the output directory; --resume continues a run there"),
    "overwrite_cache": (None, "zerotune tokenizes in memory, without a cache"),
    "plot_loss": (None, "zerotune report OUTPUT plots the losses"),
    "report_to": (lambda v: v in ("none", [], ["none"]), "zerotune writes metrics.jsonl; tensorboard / wandb are "
                                                         "the engine section's writers in a zerotune recipe"),
    "ddp_timeout": (None, "zerotune's process groups keep their own timeout"),
    "preprocessing_num_workers": (None, "tokenization runs in the launching process"),
    "dataloader_num_workers": (None, "batches are built in the training process"),
    "save_only_model": (None, "zerotune's checkpoints hold what --resume needs; the final model is saved alone"),
    "per_device_eval_batch_size": (None, "evaluation batches do not change the metrics"),
    "eval_strategy": (lambda v: v in ("steps", "no"), "zerotune evaluates every eval_steps and at the end"),
    "save_strategy": (lambda v: v in ("steps", "no"), "zerotune saves every save_steps"),
    "logging_strategy": (lambda v: v == "steps", "zerotune logs every logging_steps"),
    "resume_from_checkpoint": (lambda v: v is None, "use zerotune finetune --resume"),
    "flash_attn": (lambda v: v in ("auto", "sdpa", "disabled", "fa2"), "the attention kernel, not the result"),
    "quantization_method": (lambda v: v == "bitsandbytes", "zerotune quantizes with bitsandbytes"),
}


def translate(keys: ForeignKeys) -> Translation:
    recipe: dict[str, Any] = {"task": "causal-lm"}
    keys.empty_keys()  # a null key is the other tool's default: one line for all of them
    take_model(keys, recipe, "model_name_or_path")
    objective = _objective(keys, recipe)
    _method(keys, recipe)
    _data(keys, recipe, objective)
    _train(keys, recipe)
    take_engine(keys, recipe)
    output_dir = keys.take("output_dir")
    keys.no_effect(_NO_EFFECT)
    return Translation("llamafactory", recipe, output_dir=output_dir)


def _objective(keys: ForeignKeys, recipe: dict[str, Any]) -> str:
    stage = keys.take("stage", "sft")
    if stage not in _STAGES:
        raise keys.error("stage", "zerotune trains sft, dpo, kto, rm")
    kind = _STAGES[stage]
    if kind == "dpo":
        pref_loss = keys.take("pref_loss", "sigmoid")
        if pref_loss not in _PREF_LOSSES:
            raise keys.error("pref_loss", f"zerotune's preference losses are {', '.join(_PREF_LOSSES)}")
        kind, loss = _PREF_LOSSES[pref_loss]
        if loss:
            keys.put(recipe, "objective.loss", loss, "pref_loss")
    for key in ("pref_loss", "pref_beta", "simpo_gamma", "pref_ftx", "kto_chosen_weight", "kto_rejected_weight",
                "dpo_label_smoothing"):
        if keys.given(key) and stage == "sft":
            raise keys.error(key, f"a preference option, but stage is {stage}")
    if keys.take("pref_ftx", 0) != 0:
        raise keys.error("pref_ftx", "zerotune adds no SFT loss to the preference loss; set pref_ftx: 0")
    if keys.given("ref_model"):
        raise keys.error("ref_model", "zerotune's reference model is the starting model itself")
    if kind != "sft":  # sft is the recipe's default objective
        keys.put(recipe, "objective.type", kind, "stage")
    options = {"pref_beta": "beta", "simpo_gamma": "gamma", "dpo_label_smoothing": "label_smoothing",
               "kto_chosen_weight": "desirable_weight", "kto_rejected_weight": "undesirable_weight"}
    for key, name in options.items():
        if keys.given(key):
            keys.put(recipe, f"objective.{name}", keys.take(key), key)
    # LLaMA-Factory's defaults, written so the run does not depend on zerotune's per-objective ones
    if kind in ("dpo", "orpo", "simpo", "kto") and not keys.given("pref_beta"):
        keys.put(recipe, "objective.beta", 0.1, "pref_beta")
    if kind == "simpo" and not keys.given("simpo_gamma"):
        keys.put(recipe, "objective.gamma", 0.5, "simpo_gamma")
    return kind


def _method(keys: ForeignKeys, recipe: dict[str, Any]) -> None:
    kind = keys.take("finetuning_type", "lora")
    if kind not in _METHODS:
        raise keys.error("finetuning_type", f"zerotune tunes {', '.join(_METHODS)}")
    bits = keys.take("quantization_bit")
    if bits is not None and (kind != "lora" or bits not in (4, 8)):
        raise keys.error("quantization_bit", "zerotune quantizes the frozen base of LoRA (QLoRA) to 4 or 8 bits")
    method_type = "qlora" if bits else kind
    keys.put(recipe, "method.type", method_type, "finetuning_type")
    lora_keys = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target", "use_dora", "use_rslora")
    freeze_keys = ("freeze_trainable_layers", "freeze_trainable_modules")
    for key in (*lora_keys, *freeze_keys):
        if keys.given(key) and (key in lora_keys) != (kind == "lora"):
            raise keys.error(key, f"not an option of finetuning_type {kind}")
    if bits:
        keys.put(recipe, "method.bits", bits, "quantization_bit")
    if kind == "lora":
        rank = keys.take("lora_rank", 8)
        keys.put(recipe, "method.r", rank, "lora_rank")
        keys.put(recipe, "method.alpha", keys.take("lora_alpha", 2 * rank if isinstance(rank, int) else rank),
                 "lora_alpha")
        keys.put(recipe, "method.dropout", keys.take("lora_dropout", 0.0), "lora_dropout")
        keys.put(recipe, "method.target_modules", target_modules_of(keys.take("lora_target", "all"), keys,
                                                                    "lora_target"), "lora_target")
        for key, name in (("use_dora", "dora"), ("use_rslora", "rslora")):
            if keys.given(key):
                keys.put(recipe, f"method.{name}", keys.take(key), key)
    elif kind == "freeze":
        keys.put(recipe, "method.trainable_layers", keys.take("freeze_trainable_layers", 2),
                 "freeze_trainable_layers")
        modules = keys.take("freeze_trainable_modules", "all")
        if modules != "all":
            keys.put(recipe, "method.trainable_modules", target_modules_of(modules, keys, "freeze_trainable_modules"),
                     "freeze_trainable_modules")


def _data(keys: ForeignKeys, recipe: dict[str, Any], objective: str) -> None:
    dataset_dir = keys.local_path(keys.take("dataset_dir", "data"), "dataset_dir", must_exist=False)
    if not keys.given("dataset"):
        raise keys.error("dataset", "LLaMA-Factory needs a dataset to train on; name one of dataset_info.json")
    info = _dataset_info(keys, dataset_dir)
    train_files, data_format = _files(keys, "dataset", info, dataset_dir, objective)
    keys.put(recipe, "data.train_files", train_files, "dataset")
    if data_format:
        keys.put(recipe, "data.format", data_format, "dataset")
    if keys.given("eval_dataset"):
        eval_files, eval_format = _files(keys, "eval_dataset", info, dataset_dir, objective)
        if eval_format != data_format:
            raise keys.error("eval_dataset", f"its formatting ({eval_format}) differs from dataset's ({data_format}); "
                                             "zerotune reads one format")
        keys.put(recipe, "data.eval_files", eval_files, "eval_dataset")
        if keys.given("val_size"):
            raise keys.error("val_size", "eval_dataset is given too; keep one of them")
    elif keys.take("val_size", 0) == 0:
        keys.note("llamafactory: val_size is 0 (LLaMA-Factory's default: no evaluation); zerotune evaluates before "
                  "and after training, so it holds out data.eval_fraction (0.1) of the training data")
    else:
        keys.put(recipe, "data.eval_fraction", keys.take("val_size"), "val_size")
    template = keys.take("template")
    if template is not None:
        if template not in LLAMAFACTORY_TEMPLATES:
            raise keys.error("template", f"zerotune's templates are {', '.join(LLAMAFACTORY_TEMPLATES)} "
                                         "(LLaMA-Factory's names)")
        keys.put(recipe, "data.template", LLAMAFACTORY_TEMPLATES[template], "template")
    keys.put(recipe, "data.max_length", keys.take("cutoff_len", 2048), "cutoff_len")
    for key, name in (("max_samples", "max_train_samples"), ("train_on_prompt", "train_on_prompt")):
        if keys.given(key):
            keys.put(recipe, f"data.{name}", keys.take(key), key)
    if keys.take("mask_history", False):
        keys.put(recipe, "data.train_on", "last_assistant", "mask_history")
    if keys.take("packing") and not keys.take("neat_packing"):
        raise keys.error("packing", "zerotune packs without cross-example attention (LLaMA-Factory's neat_packing); "
                                    "set neat_packing: true")
    if keys.take("neat_packing"):
        keys.put(recipe, "data.packing", True, "neat_packing")


def _dataset_info(keys: ForeignKeys, dataset_dir: str) -> dict[str, Any]:
    path = Path(dataset_dir) / "dataset_info.json"
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise keys.error("dataset_dir", f"cannot read {path} ({exc.__class__.__name__}); zerotune resolves "
                                        "LLaMA-Factory dataset names through it", dataset_dir) from None
    if not isinstance(info, dict):
        raise keys.error("dataset_dir", f"{path} is not a JSON object of dataset entries", dataset_dir)
    return info


def _files(keys: ForeignKeys, key: str, info: dict[str, Any], dataset_dir: str,
           objective: str) -> tuple[list[str], str | None]:
    """The local files and zerotune data.format of the comma-separated dataset names in ``key``."""
    names = keys.take(key)
    names = [n.strip() for n in names.split(",")] if isinstance(names, str) else names
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise keys.error(key, "expected dataset names (a comma-separated string or a list)")
    files: list[str] = []
    formats = set()
    for name in names:
        entry = info.get(name)
        if not isinstance(entry, dict):
            raise keys.error(key, f"{name!r} is not in {dataset_dir}/dataset_info.json")
        for remote in ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name"):
            if remote in entry:
                raise keys.error(key, f"dataset {name!r} comes from {remote}; zerotune reads LLaMA-Factory data sets "
                                      "from local files (file_name)")
        if not entry.get("file_name"):
            raise keys.error(key, f"dataset {name!r} has no file_name in dataset_info.json")
        path = Path(dataset_dir) / entry["file_name"]
        if not path.exists():
            raise keys.error(key, f"dataset {name!r}: {path} does not exist")
        files += sorted(str(p) for p in path.iterdir() if p.is_file()) if path.is_dir() else [str(path)]
        if bool(entry.get("ranking", False)) != (objective in ("dpo", "orpo", "simpo", "reward")):
            want = "no ranking" if objective in ("sft", "kto") else "ranking: true"
            raise keys.error(key, f"dataset {name!r} does not fit objective {objective}: it needs {want}")
        layout = _format(keys, key, name, entry)  # checks the columns even where the format is not set
        formats.add(None if objective == "kto" else layout)  # KTO rows (kto_tag) are the loader's to read
    if len(formats) > 1:
        raise keys.error(key, f"mixes formats {', '.join(sorted(str(f) for f in formats))}; zerotune reads one")
    return files, formats.pop()


_ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output"}
_RANKING_COLUMNS = {"chosen": "chosen", "rejected": "rejected", "kto_tag": "kto_tag"}
_SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                  "system_tag": "system"}
_MESSAGES_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
                  "system_tag": "system"}


def _format(keys: ForeignKeys, key: str, name: str, entry: dict[str, Any]) -> str | None:
    """alpaca / sharegpt / messages when the columns and tags are the layouts zerotune reads; preference data
    (ranking) keeps the loader's own detection (None)."""
    formatting = entry.get("formatting", "alpaca")
    columns = dict(entry.get("columns") or {})
    tags = dict(entry.get("tags") or {})
    ranking = {column: columns.pop(column) for column in list(columns) if column in _RANKING_COLUMNS}
    if any(ranking[c] != _RANKING_COLUMNS[c] for c in ranking):
        raise keys.error(key, f"dataset {name!r} renames its chosen/rejected columns ({ranking}); zerotune reads "
                              "columns named chosen and rejected")
    if formatting == "alpaca":
        odd = {c: v for c, v in columns.items() if _ALPACA_COLUMNS.get(c) != v}
        if tags or odd:
            raise keys.error(key, f"dataset {name!r} maps alpaca columns {odd or tags}; zerotune reads "
                                  "instruction / input / output (no history or system column)")
        return None if entry.get("ranking") else "alpaca"
    if formatting == "sharegpt":
        messages = columns.pop("messages", "conversations")
        if columns:
            raise keys.error(key, f"dataset {name!r} maps sharegpt columns {columns}; zerotune reads the messages "
                                  "column only (no system or tools column)")
        for layout, default_tags, column in (("sharegpt", _SHAREGPT_TAGS, "conversations"),
                                             ("messages", _MESSAGES_TAGS, "messages")):
            if messages == column and all(default_tags.get(t) == v for t, v in tags.items()):
                return None if entry.get("ranking") else layout
        raise keys.error(key, f"dataset {name!r}: messages column {messages!r} with tags {tags}; zerotune reads "
                              "conversations with from/value (human, gpt) or messages with role/content")
    raise keys.error(key, f"dataset {name!r} has formatting {formatting!r}; LLaMA-Factory's are alpaca and sharegpt")


def _train(keys: ForeignKeys, recipe: dict[str, Any]) -> None:
    if keys.given("max_steps") and keys.raw["max_steps"] != -1:  # HF's -1: train by epochs
        keys.put(recipe, "train.max_steps", keys.take("max_steps"), "max_steps")
        keys.take("num_train_epochs")
    else:
        keys.take("max_steps")
        keys.put(recipe, "train.epochs", keys.take("num_train_epochs", 3.0), "num_train_epochs")
    keys.put(recipe, "train.micro_batch_size", keys.take("per_device_train_batch_size", 8),
             "per_device_train_batch_size")
    simple = {"gradient_accumulation_steps": "gradient_accumulation_steps", "learning_rate": "lr",
              "warmup_ratio": "warmup_ratio", "warmup_steps": "warmup_steps", "weight_decay": "weight_decay",
              "max_grad_norm": "gradient_clipping", "seed": "seed", "logging_steps": "log_every",
              "save_steps": "save_every", "eval_steps": "eval_every", "save_total_limit": "save_total_limit",
              "neftune_noise_alpha": "neftune_noise_alpha"}
    for key, name in simple.items():
        if keys.given(key):
            keys.put(recipe, f"train.{name}", keys.take(key), key)
    if recipe["train"].get("warmup_ratio") == 0:
        del recipe["train"]["warmup_ratio"]  # LLaMA-Factory writes 0 for "none"; zerotune's is absent
    scheduler = scheduler_of(keys, "lr_scheduler_type")
    if scheduler:
        keys.put(recipe, "train.lr_scheduler", scheduler, "lr_scheduler_type")
    optimizer_of(keys, "optim")
    # LLaMA-Factory checkpoints activations unless told not to
    disabled = keys.take("disable_gradient_checkpointing", False)
    on = keys.take("gradient_checkpointing", not disabled)
    keys.put(recipe, "train.gradient_checkpointing", bool(on) and not disabled,
             "disable_gradient_checkpointing" if disabled else "gradient_checkpointing")
