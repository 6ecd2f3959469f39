"""``deepspeed.runtime.zero.config``: DeepSpeed's names for the ``zero_optimization`` section.

``DeepSpeedZeroConfig(**fields)`` is zerotune's own typed section built through the config loader, so
DeepSpeed's legacy and alias keys (``cpu_offload``, ``stage3_prefetch_bucket_size``, ...) are read the way
a config file's are, and an unknown key is the same one-line error. It also answers DeepSpeed's attribute
names: the unprefixed stage-3 names (``prefetch_bucket_size`` for ``stage3_prefetch_bucket_size``, ...),
and ``offload_param`` / ``offload_optimizer`` are None unless the fields set them (DeepSpeed's "no offload
block"; zerotune's section always holds one, with device "none")."""

from __future__ import annotations

from enum import IntEnum
from typing import Any, Optional

from zerotune.config.leaf_module_section import (
    DEFAULT_LEAF_MODULE_CLASSES,
    DEFAULT_LEAF_MODULE_NAME_SUFFIXES,
    DEFAULT_LEAF_MODULE_NAMES,
    LeafModuleConfig,
)
from zerotune.config.loading import load_config
from zerotune.config.zero_section import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from zerotune.monitor.logging import get_logger

__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadParamConfig", "DeepSpeedZeroOffloadOptimizerConfig",
           "ZeroStageEnum", "DeepSpeedZeroLeafModuleConfig", "DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES",
           "DEFAULT_LEAF_MODULE_NAME_SUFFIXES"]

DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig
DeepSpeedZeroLeafModuleConfig = LeafModuleConfig  # ``deepspeed.runtime.zero.leaf_module_config``

# the keys (modern and legacy) that give each offload block
_OFFLOAD_KEYS = {"offload_param": ("offload_param", "cpu_offload_param"),
                 "offload_optimizer": ("offload_optimizer", "cpu_offload")}


class ZeroStageEnum(IntEnum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class DeepSpeedZeroConfig(ZeroConfig):
    """The ``zero_optimization`` section holding ``fields``, validated as in a config file."""

    offload_param: Optional[OffloadParamConfig] = None  # type: ignore[assignment]
    offload_optimizer: Optional[OffloadOptimizerConfig] = None  # type: ignore[assignment]

    def __init__(self, **fields: Any) -> None:
        section = load_config({"zero_optimization": fields}).zero_optimization
        values = {name: getattr(section, name) for name in type(section).model_fields}
        for block, keys in _OFFLOAD_KEYS.items():
            if not any(fields.get(key) not in (None, False) for key in keys):
                values[block] = None
        super().__init__(**values)
        if self.stage == 3 and self.elastic_checkpoint is True:  # DeepSpeed's section warns here, as this one does
            get_logger().warning("zero_optimization.elastic_checkpoint: ZeRO-3 elastic checkpointing is deprecated in "
                                 "DeepSpeed (universal checkpointing replaced it); it has no effect here: every "
                                 "zerotune checkpoint loads at another data-parallel size")


def _stage3_alias(name: str) -> property:
    return property(lambda self: getattr(self, f"stage3_{name}"), doc=f"DeepSpeed's name for stage3_{name}.")


for _name, _field in ZeroConfig.ALIASES.items():
    if _field == f"stage3_{_name}" and _field in ZeroConfig.model_fields:
        setattr(DeepSpeedZeroConfig, _name, _stage3_alias(_name))
