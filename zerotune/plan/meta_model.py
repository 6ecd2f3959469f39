"""The model to plan for, built on the meta device: shapes and dtypes, no weights, no memory.

``spec`` is a Hugging Face model id (its ``config.json`` through the hub cache), a directory holding a
``config.json``, a ``config.json`` file, or ``package.module:function`` -- a Python factory called under
``torch.device("meta")`` so the parameters it creates hold no storage.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch


class PlanModelError(ValueError):
    """The model spec names nothing buildable; the message says what was tried."""


def meta_model(spec: str, *, task: str = "causal-lm", trust_remote_code: bool = False) -> torch.nn.Module:
    if ":" in spec and not Path(spec).exists():
        return _from_factory(spec)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    source = Path(spec).parent if spec.endswith(".json") and Path(spec).is_file() else spec
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise PlanModelError(f"--model {spec!r}: no model config found there ({str(error).splitlines()[0]}); give a "
                             "Hugging Face model id (cached), a directory or config.json, or module:factory") from None
    auto = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
    with torch.device("meta"):
        return auto.from_config(config, trust_remote_code=trust_remote_code)


def _from_factory(spec: str) -> torch.nn.Module:
    module_name, _, function_name = spec.partition(":")
    try:
        factory: Any = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise PlanModelError(f"--model {spec!r}: cannot import {function_name!r} from {module_name!r} "
                             f"({error})") from None
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise PlanModelError(f"--model {spec!r}: the factory returned {type(model).__name__}, not a torch.nn.Module")
    return model


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameters, a tied weight counted once."""
    seen: dict[int, tuple[int, bool]] = {}
    for parameter in model.parameters():
        seen[id(parameter)] = (parameter.numel(), parameter.requires_grad)
    trainable = sum(n for n, grad in seen.values() if grad)
    return trainable, sum(n for n, _ in seen.values()) - trainable
