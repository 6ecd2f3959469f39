"""Load the model and tokenizer a recipe names, and apply its fine-tuning method (full, LoRA, prefix).

Bundled model names resolve to offline assets (``finetune.assets``); anything else is a local
Hugging Face directory. LoRA and prefix tuning go through peft: the base weights are frozen
(``requires_grad=False``), so the engine syncs and shards only the adapters' parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from zerotune.zero.stage3.gathered import GatheredParameters
from zerotune.zero.stage3.saving import save_consolidated

# LoRA targets when the recipe does not name them, by the model's ``config.model_type``.
DEFAULT_LORA_TARGETS = {
    "bert": ["query", "key", "value", "dense"],
    "roberta": ["query", "key", "value", "dense"],
    "distilbert": ["q_lin", "k_lin", "v_lin", "out_lin"],
    "gpt2": ["c_attn", "c_proj"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj"],
}


class ModelLoadError(ValueError):
    """The recipe's model cannot be loaded; the message names the path and what is missing."""


def resolve_model_path(name_or_path: str) -> Path:
    """A bundled model name -> its fetched asset directory; otherwise a local directory with a config.json.

    Bundled GGUF models resolve to their dequantized Hugging Face copy in the asset cache
    (``finetune.gguf_models``), so every later step loads an ordinary model directory.
    """
    from zerotune.finetune.assets import ASSETS, asset_path
    from zerotune.finetune.gguf_models import dequantized_model_dir, is_gguf_asset

    if is_gguf_asset(name_or_path):  # a GGUF file: dequantized once into a cached HF directory
        return dequantized_model_dir(name_or_path)
    if name_or_path in ASSETS:
        return asset_path(name_or_path)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"model.name_or_path: {name_or_path!r} is neither a bundled model "
                             f"({', '.join(sorted(ASSETS))}) nor a local directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model.name_or_path: {path} has no config.json; point it at a Hugging Face model directory")
    return path


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:  # causal LMs often have none; padding reuses end-of-sequence
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: Path, task: str, num_labels: int | None = None, label_names: list[str] | None = None) -> Any:
    """The task's model head on the pretrained body, in fp32 (the engine casts per its precision)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from zerotune.finetune.gguf_models import drop_quantizer

    try:
        if task == "sequence-classification":
            id2label = {i: name for i, name in enumerate(label_names)} if label_names else None
            return AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=num_labels, id2label=id2label,
                label2id={name: i for i, name in id2label.items()} if id2label else None, dtype=torch.float32)
        return drop_quantizer(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot load {task} model from {path}: {error}") from error


def apply_method(model: Any, task: str, method: Any) -> Any:
    """Wrap ``model`` for the recipe's method; full fine-tuning returns it unchanged."""
    if method.type == "full":
        return model
    from peft import LoraConfig, PrefixTuningConfig, TaskType, get_peft_model

    task_type = TaskType.SEQ_CLS if task == "sequence-classification" else TaskType.CAUSAL_LM
    if method.type == "lora":
        targets = method.target_modules or DEFAULT_LORA_TARGETS.get(model.config.model_type)
        if not targets:
            raise ModelLoadError(f"method.target_modules: no default LoRA targets for model type "
                                 f"'{model.config.model_type}'; name the linear layers to adapt")
        config = LoraConfig(task_type=task_type, r=method.r, lora_alpha=method.alpha, lora_dropout=method.dropout,
                            target_modules=list(targets))
    else:
        if task == "sequence-classification":
            check_prefix_tuning_support(model)
        config = PrefixTuningConfig(task_type=task_type, num_virtual_tokens=method.num_virtual_tokens)
    return get_peft_model(model, config)


def check_prefix_tuning_support(model: torch.nn.Module) -> None:
    """peft's prefix tuning for classification passes learned keys/values as ``past_key_values``:
    the model (or its backbone) must take that argument -- transformers 5 models take ``cache``."""
    import inspect

    backbone = getattr(model, getattr(model, "base_model_prefix", ""), model)
    for module in (model, backbone):
        if "past_key_values" in inspect.signature(module.forward).parameters:
            return
    raise ModelLoadError(f"method.type: prefix tuning for sequence classification needs a model whose forward takes "
                         f"past_key_values, and {type(model).__name__} does not (peft's requirement; transformers 5 "
                         f"models take 'cache'); use method.type lora, or prefix tuning with task causal-lm")


def trainable_summary(model: torch.nn.Module) -> str:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return f"{trainable / 1e6:.2f}M of {total / 1e6:.2f}M parameters trainable ({100 * trainable / max(total, 1):.1f}%)"


def save_model(model: Any, tokenizer: Any, output_dir: Path, *, merge: bool) -> list[Path]:
    """Write the model in Hugging Face format (safetensors); for adapters also the peft adapter.

    Call on rank 0 with whole parameters (``save_trained_model`` gathers them at ZeRO stage 3).
    """
    written = []
    is_peft = hasattr(model, "peft_config")
    if is_peft:  # an adapter is its trainable tensors (LoRA factors, prompt encoder, modules_to_save)
        adapter_dir = output_dir / "adapter"
        trainable = {name: p.detach().clone().contiguous() for name, p in model.named_parameters() if p.requires_grad}
        model.save_pretrained(adapter_dir, safe_serialization=True, state_dict=trainable)
        tokenizer.save_pretrained(adapter_dir)
        written.append(adapter_dir)
    if not is_peft or merge:
        final = model.merge_and_unload() if is_peft else model
        model_dir = output_dir / ("merged" if is_peft else "model")
        final.save_pretrained(model_dir, safe_serialization=True, state_dict=_detached_state_dict(final))
        tokenizer.save_pretrained(model_dir)
        written.append(model_dir)
    return written


def save_trained_model(engine: Any, tokenizer: Any, output_dir: Path, *, merge: bool) -> list[Path]:
    """``save_model`` for any ZeRO stage; every rank calls it.

    At stage 3 a full fine-tune is streamed one unit at a time (``model.safetensors`` + config), an
    adapter gathers only the trainable tensors, and a merged export gathers the whole model on
    every rank for the duration of the merge.
    """
    rank, model = engine.global_rank, engine.module
    units = engine.state.units  # stage 3's partitioned units (empty below)
    if not units:
        return save_model(model, tokenizer, output_dir, merge=merge) if rank == 0 else []
    if not hasattr(model, "peft_config"):
        model_dir = output_dir / "model"
        save_consolidated(model, units, model_dir / "model.safetensors", rank=rank)
        if rank == 0:
            model.config.save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
        return [model_dir]
    needed = [p for p in model.parameters() if merge or p.requires_grad]
    with GatheredParameters(needed):
        return save_model(model, tokenizer, output_dir, merge=merge) if rank == 0 else []


def _detached_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Own copies of every tensor: under ZeRO the parameters are views of one flat buffer, which
    safetensors would refuse (or deduplicate) as shared memory."""
    return {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
