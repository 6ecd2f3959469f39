"""Load the model and tokenizer a recipe names, and apply its fine-tuning method (full, LoRA / DoRA /
rsLoRA, QLoRA, prefix, freeze).

Bundled model names resolve to offline assets (``finetune.assets``); anything else is a local
Hugging Face directory, or a model id fetched through the hub's own cache. LoRA and prefix tuning go through peft: the
base weights are frozen (``requires_grad=False``), so the engine syncs and shards only the adapters' parameters.
"""

from __future__ import annotations

import json
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
        path = _from_hub(name_or_path, sorted(ASSETS))
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model.name_or_path: {path} has no config.json; "
                             "point it at a Hugging Face model directory")
    return path


def _from_hub(repo_id: str, bundled: list[str]) -> Path:
    """A Hugging Face model id through the hub's own cache: downloaded when online, the cached snapshot when
    ``HF_HUB_OFFLINE`` is set; offline and not cached is one line naming the id and how to fetch it."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    offline = constants.HF_HUB_OFFLINE
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, local_files_only=offline))
    except HFValidationError:
        raise ModelLoadError(f"model.name_or_path: {repo_id!r} is neither a bundled model ({', '.join(bundled)}), "
                             "a local directory nor a Hugging Face model id") from None
    except LocalEntryNotFoundError:
        raise ModelLoadError(f"model.name_or_path: {repo_id!r} is not in the Hugging Face cache "
                             f"({constants.HF_HUB_CACHE}) and the hub is "
                             f"{'offline (HF_HUB_OFFLINE=1)' if offline else 'unreachable'}; fetch it once where the "
                             f"hub is reachable: hf download {repo_id}") from None
    except Exception as error:  # noqa: BLE001 - a missing repo, no network: one line with the hub's reason
        raise ModelLoadError(f"model.name_or_path: {repo_id!r}: the Hugging Face hub could not provide it "
                             f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})") from None


def load_tokenizer(path: Path, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:  # causal LMs often have none; padding reuses end-of-sequence
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


DTYPES = {"auto": torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``model.dtype`` -> the dtype weights load in; "auto" is fp32: the engine casts per its precision and keeps
fp32 masters made from the checkpoint's exact values."""


def load_model(path: Path, task: str, num_labels: int | None = None, label_names: list[str] | None = None,
               quantize_bits: int | None = None, dtype: str = "auto", trust_remote_code: bool = False) -> Any:
    """The task's model head on the pretrained body, in ``DTYPES[dtype]``; ``quantize_bits`` 4 or 8 loads the
    linear layers quantized by bitsandbytes (QLoRA's frozen base); ``trust_remote_code`` lets the directory's
    own modelling code run."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from zerotune.finetune.gguf_models import drop_quantizer

    quantized = {} if quantize_bits is None else {"quantization_config": _bitsandbytes_config(quantize_bits)}
    loading = {"dtype": DTYPES[dtype], "trust_remote_code": trust_remote_code, **quantized}
    try:
        if task == "sequence-classification":
            names: dict[str, Any] = {"id2label": dict(enumerate(label_names)),
                     "label2id": {name: i for i, name in enumerate(label_names)}} if label_names else {}
            model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=num_labels, **names,
                                                                       **loading)
            return _keep_quantized_weights_as_loaded(model) if quantized else model
        model = AutoModelForCausalLM.from_pretrained(path, **loading)
        return _keep_quantized_weights_as_loaded(model) if quantized else drop_quantizer(model)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot load {task} model from {path}: {error}") from error


def _bitsandbytes_config(bits: int) -> Any:
    try:
        import bitsandbytes  # noqa: F401 - transformers needs it importable
    except ImportError:
        raise ModelLoadError("method.type qlora needs bitsandbytes: pip install bitsandbytes") from None
    from transformers import BitsAndBytesConfig

    if bits == 4:  # QLoRA's choices: NF4 with double quantization, computing in fp32 (the engine casts)
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=torch.float32)
    return BitsAndBytesConfig(load_in_8bit=True)


def _keep_quantized_weights_as_loaded(model: Any) -> Any:
    """bitsandbytes repacks a 4-bit weight in place for its CPU inference kernel the first time a module runs
    without gradients (an evaluation): the frozen base would change layout mid-run under the engine, and
    the repacking fails outright for widths that are not a multiple of its block. Keep the loaded layout."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def apply_method(model: Any, task: str, method: Any) -> Any:
    """Wrap ``model`` for the recipe's method; full fine-tuning returns it unchanged."""
    if method.type == "full":
        return model
    if method.type == "freeze":
        return freeze_except(model, task, method.trainable_layers, method.trainable_modules)
    from peft import LoraConfig, PeftConfig, PrefixTuningConfig, TaskType, get_peft_model

    task_type = TaskType.SEQ_CLS if task == "sequence-classification" else TaskType.CAUSAL_LM
    config: PeftConfig
    if method.type in ("lora", "qlora"):
        targets = method.target_modules or DEFAULT_LORA_TARGETS.get(model.config.model_type)
        if not targets:
            raise ModelLoadError(f"method.target_modules: no default LoRA targets for model type "
                                 f"'{model.config.model_type}'; name the linear layers to adapt")
        targets = targets if isinstance(targets, str) else list(targets)  # a string is one regex, or all-linear
        config = LoraConfig(task_type=task_type, r=method.r, lora_alpha=method.alpha, lora_dropout=method.dropout,
                            target_modules=targets, use_dora=method.dora, use_rslora=method.rslora)
    else:
        if task == "sequence-classification":
            check_prefix_tuning_support(model)
        config = PrefixTuningConfig(task_type=task_type, num_virtual_tokens=method.num_virtual_tokens)
    return get_peft_model(model, config)


def enable_gradient_checkpointing(model: Any) -> None:
    """``train.gradient_checkpointing``: Hugging Face's own activation checkpointing, on before the engine wraps the
    model (ZeRO's hooks then see the recomputed forward like the first one, at every stage).

    Non-reentrant (``use_reentrant: False``): the reentrant form drops the gradients of a block whose inputs do not
    require grad. With a frozen base (LoRA, prefix, freeze) the input embeddings are made to require grad, as peft's
    ``enable_input_require_grads`` does, so every checkpointed block has a graph to recompute into.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ModelLoadError(f"train.gradient_checkpointing: {type(base).__name__} does not support Hugging Face "
                             "gradient checkpointing; set train.gradient_checkpointing: false")
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.x's name; the old one warns
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if any(not p.requires_grad for p in model.parameters()):
        base.enable_input_require_grads()


def freeze_except(model: torch.nn.Module, task: str, layers: int | None, modules: list[str] | str | None
                  ) -> torch.nn.Module:
    """Freeze tuning: only the last ``layers`` transformer blocks (then the final norm too), the modules
    ``modules`` names (a list of names or one regex over module names), and a classification head --
    newly initialised, it must train -- keep ``requires_grad``."""
    import re

    names = dict(model.named_modules())
    chosen: list[str] = []
    if layers is not None:
        blocks = _transformer_blocks(model)
        if layers > len(blocks):
            raise ModelLoadError(f"method.trainable_layers: {layers}, but the model has {len(blocks)} blocks")
        chosen += [name for name, _ in blocks[-layers:]]
        chosen += [name for name in names if name.endswith(("model.norm", "final_layer_norm", "ln_f"))]
    if modules is not None:
        pattern = re.compile(modules) if isinstance(modules, str) else None
        matched = [name for name in names if name and (pattern.fullmatch(name) if pattern else
                                                        any(name == m or name.endswith("." + m) for m in modules))]
        if not matched:
            raise ModelLoadError(f"method.trainable_modules: {modules!r} matches no module of the model (e.g. "
                                 f"{', '.join(list(names)[1:6])})")
        chosen += matched
    if task == "sequence-classification":
        chosen += [name for name in names if name.split(".")[-1] in ("score", "classifier", "pre_classifier")]
    for param in model.parameters():
        param.requires_grad = False
    for name in chosen:
        for param in names[name].parameters():
            param.requires_grad = True
    return model


def _transformer_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's repeated blocks: the longest ModuleList whose children are all of one class."""
    best: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > len(best) \
                and len({type(child) for child in module}) == 1:
            best = [(f"{name}.{index}", child) for index, child in enumerate(module)]
    if not best:
        raise ModelLoadError("method.trainable_layers: found no list of transformer blocks in the model; name the "
                             "modules to train with method.trainable_modules")
    return best


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


def save_model(model: Any, tokenizer: Any, output_dir: Path, *, merge: bool,
               merged_dtype: torch.dtype | None = None, base_name: str | None = None) -> list[Path]:
    """Write the model in Hugging Face format (safetensors); for adapters also the peft adapter, and with
    ``merge`` the adapter merged into its base, its floating tensors in ``merged_dtype`` (the run's training
    precision: a bf16 run's merged model is bf16, as its base was trained).

    ``base_name`` -- the recipe's ``model.name_or_path`` (a bundled name, a hub id or the user's path) -- is the
    adapter's ``base_model_name_or_path``, so the adapter loads on another machine; peft would write the
    directory the base was loaded from, a local cache path. Call on rank 0 with whole parameters
    (``save_trained_model`` gathers them at ZeRO stage 3).
    """
    written = []
    is_peft = hasattr(model, "peft_config")
    if is_peft:  # an adapter is its trainable tensors (LoRA factors, prompt encoder, modules_to_save)
        adapter_dir = output_dir / "adapter"
        trainable = {name: p.detach().clone().contiguous() for name, p in model.named_parameters() if p.requires_grad}
        model.save_pretrained(adapter_dir, safe_serialization=True, state_dict=trainable)
        if base_name is not None:  # after saving: peft reads the base's config from the name while it saves
            _name_base(adapter_dir, base_name)
        tokenizer.save_pretrained(adapter_dir)
        written.append(adapter_dir)
    if not is_peft or merge:
        final = model.merge_and_unload() if is_peft else model
        model_dir = output_dir / ("merged" if is_peft else "model")
        state = _detached_state_dict(final)
        if is_peft and merged_dtype is not None:
            state = {name: t.to(merged_dtype) if t.is_floating_point() else t for name, t in state.items()}
            final.config.dtype = merged_dtype
        final.save_pretrained(model_dir, safe_serialization=True, state_dict=state)
        tokenizer.save_pretrained(model_dir)
        written.append(model_dir)
    return written


def save_trained_model(engine: Any, tokenizer: Any, output_dir: Path, *, merge: bool,
                       base_name: str | None = None) -> list[Path]:
    """``save_model`` for any ZeRO stage; every rank calls it.

    At stage 3 a full fine-tune is streamed one unit at a time (``model.safetensors`` + config), an
    adapter gathers only the trainable tensors, and a merged export gathers the whole model on
    every rank for the duration of the merge.
    """
    rank, model = engine.global_rank, engine.module
    units = engine.state.units
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else None
    if not engine.state.partitions_weights:
        return save_model(model, tokenizer, output_dir, merge=merge, merged_dtype=dtype,
                          base_name=base_name) if rank == 0 else []
    if not hasattr(model, "peft_config"):
        model_dir = output_dir / "model"
        save_consolidated(model, units, model_dir / "model.safetensors", rank=rank)
        if rank == 0:
            model.config.save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
        return [model_dir]
    needed = [p for p in model.parameters() if merge or p.requires_grad]
    with GatheredParameters(needed):
        return save_model(model, tokenizer, output_dir, merge=merge, merged_dtype=dtype,
                          base_name=base_name) if rank == 0 else []


def _name_base(adapter_dir: Path, base_name: str) -> None:
    """Write ``base_name`` as ``base_model_name_or_path`` into every adapter config peft wrote under ``adapter_dir``."""
    for path in adapter_dir.rglob("adapter_config.json"):
        config = json.loads(path.read_text())
        config["base_model_name_or_path"] = base_name
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _detached_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Own copies of every tensor: under ZeRO the parameters are views of one flat buffer, which
    safetensors would refuse (or deduplicate) as shared memory."""
    return {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
