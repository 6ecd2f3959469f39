"""Tensor-parallel inference: ``init_inference(model, config=None, **kwargs)`` -> ``InferenceEngine``.

DeepSpeed's entry point on zerotune's AutoTP (``zerotune/parallel/tensor``): the model is cast, split over the
tensor-parallel ranks in place, and served through ``engine(...)`` / ``engine.generate(...)`` with full-vocabulary
logits on every rank. ``config.py`` checks DeepSpeed's inference keys, ``injection.py`` maps DeepSpeed's
injection policies onto AutoTP rules, ``engine.py`` is the engine.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from zerotune.inference.config import InferenceConfig
from zerotune.inference.engine import InferenceEngine


def init_inference(model: nn.Module, config: Any = None, **kwargs: Any) -> InferenceEngine:
    """DeepSpeed's ``init_inference``: ``config`` (a dict, a JSON file path or an ``InferenceConfig``) and keyword
    arguments are merged (a key in both must agree), e.g. ``init_inference(model, tensor_parallel={"tp_size": 2},
    dtype=torch.bfloat16)``. Every rank of the tensor-parallel group calls it with the same model."""
    return InferenceEngine(model, InferenceConfig.from_source(config, **kwargs))


__all__ = ["InferenceConfig", "InferenceEngine", "init_inference"]
