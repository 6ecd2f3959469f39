"""An axolotl training YAML (``axolotl train x.yml``) as a zerotune recipe, key by key.

axolotl's templates list many keys left empty (``wandb_entity:``, ``fsdp:``): an empty key is axolotl's
default and is reported in one line. ``datasets[].path`` must be a local file or directory; its
``type`` picks zerotune's data.format.
"""

from __future__ import annotations

from typing import Any

from zerotune.finetune.foreign_keys import (
    AXOLOTL_CHAT_TEMPLATES,
    ForeignKeys,
    NoEffect,
    Translation,
    optimizer_of,
    scheduler_of,
    take_engine,
    take_model,
    target_modules_of,
)

_RL = {"dpo": ("dpo", "sigmoid"), "ipo": ("dpo", "ipo"), "orpo": ("orpo", None), "simpo": ("simpo", None),
       "kto": ("kto", None)}
# datasets[].type -> data.format (SFT); preference sets name a prompt strategy whose layout the loader reads.
_SFT_TYPES = {"alpaca": "alpaca", "sharegpt": "sharegpt", "completion": "text", "chat_template": "messages"}
_PREFERENCE_TYPES = ("chat_template.default", "chatml.prompt_pairs", "llama3.prompt_pairs")
_DATASET_KEYS = ("path", "type", "ds_type", "split", "data_files", "field_messages", "message_property_mappings",
                 "roles_to_train", "field")
_MODEL_CLASSES = ("AutoModelForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                  "GemmaForCausalLM")
_TOKENIZER_CLASSES = ("AutoTokenizer", "LlamaTokenizer", "LlamaTokenizerFast", "PreTrainedTokenizerFast",
                      "GemmaTokenizer", "Qwen2Tokenizer")

_NO_EFFECT: dict[str, NoEffect] = {
    "model_type": (lambda v: v in _MODEL_CLASSES, "zerotune loads causal LMs with AutoModelForCausalLM"),
    "tokenizer_type": (lambda v: v in _TOKENIZER_CLASSES, "zerotune loads the tokenizer with AutoTokenizer"),
    "strict": (lambda v: v is False, "zerotune checks every key"),
    "dataset_prepared_path": (None, "zerotune tokenizes in memory, without a prepared cache"),
    "flash_attention": (None, "the attention kernel, not the result"),
    "sdp_attention": (None, "the attention kernel, not the result"),
    "xformers_attention": (None, "the attention kernel, not the result"),
    "eval_sample_packing": (None, "zerotune evaluates example by example"),
    "tf32": (lambda v: v is False, "zerotune keeps fp32 matmuls in full fp32"),
    "group_by_length": (lambda v: v is False, "zerotune batches in shuffled order"),
    "loss_watchdog_threshold": (None, "zerotune has no loss watchdog; a normal run is the same"),
    "loss_watchdog_patience": (None, "zerotune has no loss watchdog; a normal run is the same"),
    "lora_fan_in_fan_out": (lambda v: v is False, "zerotune adapts nn.Linear-style weights"),
    "train_on_eos": (lambda v: v == "turn", "zerotune trains each assistant turn's end token, as 'turn' does"),
}


def translate(keys: ForeignKeys) -> Translation:
    recipe: dict[str, Any] = {"task": "causal-lm"}
    keys.empty_keys()  # a null key is the other tool's default: one line for all of them
    take_model(keys, recipe, "base_model")
    objective = _objective(keys, recipe)
    _method(keys, recipe)
    _data(keys, recipe, objective)
    _train(keys, recipe)
    take_engine(keys, recipe)
    for key in ("fsdp", "fsdp_config", "resume_from_checkpoint", "lora_model_dir", "wandb_project"):
        if keys.given(key) and keys.raw[key] not in ([], {}, ""):
            why = {"resume_from_checkpoint": "use zerotune finetune --resume",
                   "lora_model_dir": "zerotune starts LoRA from fresh adapters",
                   "wandb_project": "log to wandb through the engine section's wandb block of a zerotune recipe "
                                    "(--print-recipe writes one to edit)"}.get(key, "zerotune shards with ZeRO "
                                                                                    "(deepspeed:), not FSDP")
            raise keys.error(key, why)
        keys.take(key)
    _special_tokens(keys)
    output_dir = keys.take("output_dir")
    keys.no_effect(_NO_EFFECT)
    for key in [k for k in keys.raw if k.startswith("wandb_") and k not in keys.used]:
        keys.no_effect({key: (lambda v: v in ("", None), "wandb is off without wandb_project")})
    return Translation("axolotl", recipe, output_dir=output_dir)


def _objective(keys: ForeignKeys, recipe: dict[str, Any]) -> str:
    rl, reward = keys.take("rl"), keys.take("reward_model", False)
    if rl is not None and rl not in _RL:
        raise keys.error("rl", f"zerotune trains {', '.join(_RL)} (and reward_model: true)")
    if rl is not None and reward:
        raise keys.error("reward_model", "rl is set too; set one of them")
    kind, loss = _RL[rl] if rl else ("reward" if reward else "sft", None)
    if kind != "sft":  # sft is the recipe's default objective
        keys.put(recipe, "objective.type", kind, "rl" if rl else "reward_model")
    if loss:
        keys.put(recipe, "objective.loss", loss, "rl")
    options = {"rl_beta": "beta", "dpo_beta": "beta", "orpo_alpha": "beta", "cpo_alpha": None,
               "simpo_gamma": "gamma", "dpo_label_smoothing": "label_smoothing",
               "kto_desirable_weight": "desirable_weight", "kto_undesirable_weight": "undesirable_weight"}
    for key, name in options.items():
        if not keys.given(key):
            keys.take(key)
            continue
        if kind == "sft" or kind == "reward":
            raise keys.error(key, f"a preference option, but rl is not set to {', '.join(_RL)}")
        if key == "cpo_alpha":  # simpo's extra SFT term (TRL's CPO trainer); zerotune has none
            if keys.take(key) != 0:
                raise keys.error(key, "zerotune's SimPO adds no SFT loss; set cpo_alpha: 0")
            continue
        keys.put(recipe, f"objective.{name}", keys.take(key), key)
    return kind


def _method(keys: ForeignKeys, recipe: dict[str, Any]) -> None:
    adapter = keys.take("adapter")
    four, eight = keys.take("load_in_4bit", False), keys.take("load_in_8bit", False)
    if four and eight:
        raise keys.error("load_in_8bit", "load_in_4bit is true too; set one of them")
    bits = 4 if four else 8 if eight else None
    if adapter not in (None, "lora", "qlora"):
        raise keys.error("adapter", "zerotune's adapters are lora and qlora (or none: full fine-tuning)")
    if bits and adapter is None:
        key = "load_in_4bit" if bits == 4 else "load_in_8bit"
        raise keys.error(key, "zerotune trains a quantized base only under LoRA adapters (adapter: qlora)")
    if adapter == "qlora" and not bits:
        raise keys.error("adapter", "qlora needs load_in_4bit: true (or load_in_8bit)")
    lora_keys = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_linear",
                 "peft_use_dora", "peft_use_rslora")
    if adapter is None:
        for key in lora_keys:
            if keys.given(key) and keys.raw[key] is not False:
                raise keys.error(key, "a LoRA option, but adapter is not set (full fine-tuning)")
            keys.take(key)
        keys.put(recipe, "method.type", "full", "adapter")
        return
    keys.put(recipe, "method.type", "qlora" if bits else "lora", "adapter")
    if bits:
        keys.put(recipe, "method.bits", bits, "load_in_4bit" if bits == 4 else "load_in_8bit")
    for key, name in (("lora_r", "r"), ("lora_alpha", "alpha"), ("lora_dropout", "dropout"),
                      ("peft_use_dora", "dora"), ("peft_use_rslora", "rslora")):
        if keys.given(key):
            keys.put(recipe, f"method.{name}", keys.take(key), key)
    if keys.take("lora_target_linear", False):
        keys.take("lora_target_modules")
        keys.put(recipe, "method.target_modules", "all-linear", "lora_target_linear")
    elif keys.given("lora_target_modules"):
        keys.put(recipe, "method.target_modules", target_modules_of(keys.take("lora_target_modules"), keys,
                                                                    "lora_target_modules"), "lora_target_modules")


def _data(keys: ForeignKeys, recipe: dict[str, Any], objective: str) -> None:
    files, data_format, extras = _datasets(keys, "datasets", objective)
    keys.put(recipe, "data.train_files", files, "datasets")
    if data_format:
        keys.put(recipe, "data.format", data_format, "datasets")
    for name, value in extras.items():
        keys.put(recipe, f"data.{name}", value, "datasets")
    if keys.given("test_datasets"):
        eval_files, eval_format, _ = _datasets(keys, "test_datasets", objective)
        if eval_format != data_format:
            raise keys.error("test_datasets", f"type {eval_format} differs from datasets' {data_format}")
        keys.put(recipe, "data.eval_files", eval_files, "test_datasets")
    val = keys.take("val_set_size", 0)
    if val and keys.given("test_datasets"):
        raise keys.error("val_set_size", "test_datasets is given too; keep one of them")
    if not val and not keys.given("test_datasets"):
        keys.note("axolotl: val_set_size is 0 (no evaluation); zerotune evaluates before and after training, so it "
                  "holds out data.eval_fraction (0.1) of the training data")
    elif val:
        keys.put(recipe, "data.eval_fraction", val, "val_set_size")
    template = keys.take("chat_template")
    if template is not None:
        if template not in AXOLOTL_CHAT_TEMPLATES:
            raise keys.error("chat_template", f"zerotune's templates are {', '.join(AXOLOTL_CHAT_TEMPLATES)} "
                                              "(axolotl's names)")
        keys.put(recipe, "data.template", AXOLOTL_CHAT_TEMPLATES[template], "chat_template")
    keys.put(recipe, "data.max_length", keys.take("sequence_len", 2048), "sequence_len")
    if keys.given("train_on_inputs"):
        keys.put(recipe, "data.train_on_prompt", keys.take("train_on_inputs"), "train_on_inputs")
    if keys.given("roles_to_train"):
        keys.put(recipe, "data.roles_to_train", keys.take("roles_to_train"), "roles_to_train")
    if keys.given("sample_packing"):
        keys.put(recipe, "data.packing", keys.take("sample_packing"), "sample_packing")


def _datasets(keys: ForeignKeys, key: str, objective: str) -> tuple[list[str], str | None, dict[str, Any]]:
    entries = keys.take(key)
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise keys.error(key, "expected a list of {path, type} entries")
    files: list[str] = []
    formats: set[str | None] = set()
    extras: dict[str, Any] = {}
    for i, entry in enumerate(entries):
        where = f"{key}[{i}]"
        odd = sorted(set(entry) - set(_DATASET_KEYS))
        if odd:
            raise keys.error(f"{where}.{odd[0]}", "not a dataset option zerotune translates", entry[odd[0]])
        if entry.get("split", "train") != "train":
            raise keys.error(f"{where}.split", "zerotune trains on the train split of a local file", entry["split"])
        if not isinstance(entry.get("path"), str):
            raise keys.error(f"{where}.path", "expected a local file or directory", entry.get("path"))
        path = keys.local_path(entry["path"], f"{where}.path")
        data_files = entry.get("data_files")
        if data_files:
            listed = [data_files] if isinstance(data_files, str) else list(data_files)
            files += [keys.local_path(f"{path}/{name}", f"{where}.data_files") for name in listed]
        else:
            files.append(path)
        formats.add(_dataset_format(keys, where, entry, objective))
        if entry.get("roles_to_train") is not None:
            extras["roles_to_train"] = entry["roles_to_train"]
        if entry.get("field") is not None:
            extras["text_column"] = entry["field"]
        if entry.get("type") in ("chatml.prompt_pairs", "llama3.prompt_pairs"):  # the strategy names its template
            extras["template"] = entry["type"].split(".")[0]
    if len(formats) > 1:
        raise keys.error(key, f"mixes types {', '.join(sorted(str(f) for f in formats))}; zerotune reads one format")
    return files, formats.pop(), extras


def _dataset_format(keys: ForeignKeys, where: str, entry: dict[str, Any], objective: str) -> str | None:
    kind = entry.get("type")
    if objective != "sft" and objective != "reward":
        if kind not in _PREFERENCE_TYPES:
            raise keys.error(f"{where}.type", f"zerotune reads preference files as prompt/chosen/rejected columns "
                                              f"or chosen/rejected message lists: {', '.join(_PREFERENCE_TYPES)}",
                             kind)
        return None
    if objective == "reward":
        return None
    if kind not in _SFT_TYPES:
        raise keys.error(f"{where}.type", f"zerotune's SFT dataset types are {', '.join(_SFT_TYPES)}", kind)
    if kind == "chat_template":
        column = entry.get("field_messages", "messages")
        mapping = entry.get("message_property_mappings") or {"role": "role", "content": "content"}
        if column == "conversations" and mapping == {"role": "from", "content": "value"}:
            return "sharegpt"
        if column != "messages" or mapping != {"role": "role", "content": "content"}:
            raise keys.error(f"{where}.field_messages", "zerotune reads messages with role/content or "
                                                        "conversations with from/value", column)
    return _SFT_TYPES[kind]


def _special_tokens(keys: ForeignKeys) -> None:
    tokens = keys.take("special_tokens")
    if not tokens:
        return
    if not isinstance(tokens, dict) or set(tokens) - {"pad_token"}:
        raise keys.error("special_tokens", "zerotune keeps the tokenizer's special tokens; only pad_token is "
                                           "accepted (padding is masked out of the loss and attention)")
    keys.note(f"axolotl key 'special_tokens.pad_token: {tokens['pad_token']}': no effect here (zerotune pads with "
              "the tokenizer's pad token, or eos; padding is masked out of the loss and attention)")


def _train(keys: ForeignKeys, recipe: dict[str, Any]) -> None:
    if keys.given("max_steps") and keys.raw["max_steps"] != -1:
        keys.put(recipe, "train.max_steps", keys.take("max_steps"), "max_steps")
        keys.take("num_epochs")
    else:
        keys.take("max_steps")
        keys.put(recipe, "train.epochs", keys.take("num_epochs", 1), "num_epochs")
    keys.put(recipe, "train.micro_batch_size", keys.take("micro_batch_size", 1), "micro_batch_size")
    simple = {"gradient_accumulation_steps": "gradient_accumulation_steps", "learning_rate": "lr",
              "warmup_ratio": "warmup_ratio", "warmup_steps": "warmup_steps", "weight_decay": "weight_decay",
              "max_grad_norm": "gradient_clipping", "seed": "seed", "logging_steps": "log_every",
              "save_steps": "save_every", "eval_steps": "eval_every", "save_total_limit": "save_total_limit",
              "neftune_noise_alpha": "neftune_noise_alpha", "gradient_checkpointing": "gradient_checkpointing",
              "early_stopping_patience": "early_stopping_patience", "cosine_min_lr_ratio": "min_lr_ratio"}
    for key, name in simple.items():
        if keys.given(key):
            keys.put(recipe, f"train.{name}", keys.take(key), key)
    for key in ("evals_per_epoch", "saves_per_epoch"):
        if keys.given(key):  # when to evaluate / save, not what is trained: reported, not refused
            steps = "eval_steps" if key.startswith("eval") else "save_steps"
            keys.note(f"axolotl key '{key}: {keys.take(key)}': not translated (zerotune counts in optimizer steps: "
                      f"give {steps}); the run evaluates before and after training and saves the final model")
    scheduler = scheduler_of(keys, "lr_scheduler")
    if scheduler:
        keys.put(recipe, "train.lr_scheduler", scheduler, "lr_scheduler")
    optimizer_of(keys, "optimizer")
