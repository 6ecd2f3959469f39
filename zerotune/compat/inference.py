"""``deepspeed.inference`` / ``deepspeed.inference.config``: DeepSpeed's names for zerotune's inference engine."""

from __future__ import annotations

from zerotune.inference import InferenceEngine, init_inference
from zerotune.inference.config import InferenceConfig as DeepSpeedInferenceConfig
from zerotune.inference.config import InferenceTPSection as DeepSpeedTPConfig

__all__ = ["DeepSpeedInferenceConfig", "DeepSpeedTPConfig", "InferenceEngine", "init_inference"]
