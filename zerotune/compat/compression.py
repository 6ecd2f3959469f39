"""``deepspeed.compression`` / ``deepspeed.compression.helper``: the module-path helpers, compression refused.

zerotune has no compression library (quantization-aware training, pruning, layer reduction). Client
code still imports two plain helpers from ``deepspeed.compression.helper`` to walk a dotted module
path -- DeepSpeed-Chat's LoRA does (``dschat/utils/module/lora.py``) -- so those work; the library's
entry points (``init_compression``, ``redundancy_clean``) are importable and refused when called.
"""

from __future__ import annotations

from typing import Any

from zerotune.compat.refusals import refused_function

init_compression = refused_function("deepspeed.compression.init_compression")
redundancy_clean = refused_function("deepspeed.compression.redundancy_clean")


def recursive_getattr(model: Any, module_name: str) -> Any:
    """The attribute at the dotted path ``module_name`` under ``model`` (``"decoder.layers.0.fc1"``)."""
    target = model
    for part in module_name.split("."):
        target = getattr(target, part)
    return target


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Set the attribute at the dotted path ``module_name`` under ``model`` to ``module``."""
    parent, _, last = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, last, module)


__all__ = ["init_compression", "recursive_getattr", "recursive_setattr", "redundancy_clean"]
