"""DeepSpeed's constructor spellings on zerotune's engine classes.

``DeepSpeedEngine.initialize(model=..., config_params=...)`` and ``PipelineEngine(model, config=...)`` both mean
``zerotune.initialize``. The engine classes do not import ``initialize`` (it builds them), so the spellings are
attached here, by the package facade (``zerotune/__init__.py``) when zerotune is imported.
"""

from __future__ import annotations

from typing import Any

import torch

from zerotune.engine import Engine
from zerotune.initialize import initialize
from zerotune.pipe.engine import set_model_builder


def _initialize(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
    """``DeepSpeedEngine.initialize(...)`` is ``zerotune.initialize(...)``."""
    return initialize(*args, **kwargs)


def _engine_from_model(model: torch.nn.Module, **kwargs: Any) -> Any:
    return initialize(model=model, **kwargs)[0]


def install_spellings() -> None:
    """Idempotent."""
    Engine.initialize = staticmethod(_initialize)  # type: ignore[attr-defined]
    set_model_builder(_engine_from_model)


__all__ = ["install_spellings"]
