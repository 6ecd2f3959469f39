"""Answers from a finished fine-tuning run: load what ``zerotune finetune`` wrote and generate.

A run directory holds ``merged/`` (LoRA runs saved with ``--merge``), ``model/`` (full and freeze tuning)
or ``adapter/`` (LoRA / QLoRA / prefix: the base comes from the adapter's ``base_model_name_or_path``, the
recipe's model name resolved as the recipe's was -- a bundled name, a hub id or a directory --, loaded in 4 / 8
bits again for a QLoRA run, as it was trained). Prompts go through the tokenizer's chat
template when it has one -- the way the run's chat and question/answer data were rendered -- else they
are used as raw text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


class GenerationError(ValueError):
    """The run directory cannot answer; the message says what is missing."""


def load_trained(run_dir: str | Path) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) of a causal-LM run directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = Path(run_dir)
    summary = _summary(run)
    if summary.get("task", "causal-lm") != "causal-lm":
        raise GenerationError(f"{run} is a {summary['task']} run; generation needs a causal-lm run")
    for name in ("merged", "model"):
        if (run / name / "config.json").is_file():
            return AutoModelForCausalLM.from_pretrained(run / name, dtype=torch.float32).eval(), \
                AutoTokenizer.from_pretrained(run / name)
    adapter = run / "adapter"
    if not (adapter / "adapter_config.json").is_file():
        raise GenerationError(f"{run} holds no trained model (merged/, model/ or adapter/ with adapter_config.json); "
                              "point at the --output-dir of a finished zerotune finetune run")
    from peft import PeftModel

    from zerotune.finetune.models import ModelLoadError, load_model, resolve_model_path

    base_name = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base_name:
        raise GenerationError(f"{adapter}: adapter_config.json names no base model (base_model_name_or_path); the "
                              "adapter needs the model it was trained on")
    try:  # a bundled name, a hub id (the hub's cache, offline when HF_HUB_OFFLINE is set) or a directory
        base_path = resolve_model_path(base_name)
    except ModelLoadError as error:
        raise GenerationError(f"{adapter}: its base model {base_name!r} cannot be loaded here ({error}); the adapter "
                              "needs the model it was trained on") from None
    bits = summary.get("quantize_bits") if summary.get("method") == "qlora" else None
    base = load_model(base_path, "causal-lm", quantize_bits=bits)
    return PeftModel.from_pretrained(base, adapter).eval(), AutoTokenizer.from_pretrained(adapter)


def reply(model: Any, tokenizer: Any, messages: list[dict[str, str]], *, max_new_tokens: int = 64,
          temperature: float = 0.0) -> str:
    """The model's answer to the conversation ``messages`` (greedy at temperature 0)."""
    encoded = encode_prompt(tokenizer, messages)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        output = model.generate(**encoded, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                **sampling)
    return tokenizer.decode(output[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def encode_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> dict[str, torch.Tensor]:
    """``input_ids`` / ``attention_mask`` (batch of one) asking for the next assistant turn, rendered as the
    training data was: through the chat template with its generation prompt, else the turns' raw text."""
    if getattr(tokenizer, "chat_template", None) is not None:
        return dict(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True))
    return dict(tokenizer("\n".join(m["content"] for m in messages), return_tensors="pt"))


def _summary(run: Path) -> dict:
    if not run.is_dir():
        raise GenerationError(f"run directory {str(run)!r} does not exist")
    path = run / "summary.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError as error:
        raise GenerationError(f"{path} is not valid JSON ({error})") from None
