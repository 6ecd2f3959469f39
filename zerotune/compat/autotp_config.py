"""``deepspeed.module_inject.autotp_config``: DeepSpeed's AutoTP partition-config objects over zerotune's rules.

DeepSpeed describes a tensor-parallel split as ``TPLayerSpec``s (regexes over parameter names, a partition
type, optionally a fused sub-parameter ``shape``) inside an ``AutoTPConfig``; zerotune's engine takes the same
``tensor_parallel.partition_config`` dict and applies it as ``LayerRule``s (``parallel/tensor/plans.py``).
These classes parse and validate that dict as DeepSpeed does; ``layer_rules`` is the one conversion to
zerotune's rules, so a spec built here splits a model exactly as the engine would.

What a spec may say that zerotune's layers can run: column / row / skip, an all-gathered column output
(``gather_output``), equal fused sub-parameters split along the output features (``shape=(n, -1)`` or
``((s, s, s), -1)`` at ``partition_dim`` 0: zerotune's ``parts``) and ``model_types``. Unequal sub-parameter
sizes (a GQA q|k|v), a split after a reshape to more than two dims (MoE experts) or along another dim than the
partition type's own are layouts zerotune's ``TPLayout`` cannot record: ``layer_rules`` refuses them naming
the spec. ``strict_mode`` (fail on a linear no spec matches) and ``lm_head_patterns`` (the layer names split by
input features when a gathered output does not divide) are read by the ``AutoTP`` class (``auto_tp.py``);
``embedding_partition_dim`` has no effect (DeepSpeed's AutoTP does not read it either).

DeepSpeed matches a pattern with ``re.match`` (anchored at the start only), as does zerotune's
``partition_config`` (``plans.from_start``): the same names match on both sides.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional, Union

from zerotune.parallel.tensor.plans import LayerRule, from_start, parts_from_shape

Shape = tuple[Union[int, tuple[int, ...]], ...]


class PartitionType(Enum):
    """How a layer is split: its output features (column), its input features (row), or not at all (skip)."""

    COLUMN = "column"
    ROW = "row"
    SKIP = "skip"


def _as_tuple(shape: Any) -> Any:
    """A JSON shape (lists) as DeepSpeed's tuples, one level of nesting kept."""
    if isinstance(shape, (list, tuple)):
        return tuple(_as_tuple(item) for item in shape)
    return shape


@dataclass
class TPLayerSpec:
    """One rule: the parameters ``patterns`` match (optionally only in ``model_types``) split as ``partition_type``.

    ``shape`` views the weight as fused sub-parameters before splitting: ``(3, -1)`` three equal ones,
    ``((q, k, v), -1)`` given sizes (nested only at ``partition_dim``)."""

    patterns: list[str]
    partition_type: PartitionType = PartitionType.COLUMN
    shape: Optional[Shape] = None
    partition_dim: Optional[int] = None
    model_types: Optional[list[str]] = None
    gather_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.partition_type, str):
            try:
                self.partition_type = PartitionType(self.partition_type.lower())
            except ValueError:
                raise ValueError(f"TPLayerSpec.partition_type must be one of "
                                 f"{[t.value for t in PartitionType]}, got {self.partition_type!r}") from None
        if self.shape is not None:
            self.shape = _as_tuple(self.shape)
            self._validate_shape()

    def _validate_shape(self) -> None:
        shape, dim = self.shape, self.get_partition_dim()
        if not isinstance(shape, tuple):
            raise ValueError("AutoTP shape must be a tuple of ints or a tuple at partition_dim.")
        if not 0 <= dim < len(shape):
            raise ValueError(f"AutoTP partition_dim {dim} is out of range for shape length {len(shape)}.")
        for index, size in enumerate(shape):
            if isinstance(size, tuple):
                if index != dim:
                    raise ValueError(f"AutoTP shape nested tuple only allowed at partition_dim={dim}, got at {index}.")
                if not size:
                    raise ValueError("AutoTP shape nested tuple cannot be empty.")
                if any(isinstance(s, tuple) for s in size):
                    raise ValueError("AutoTP shape supports only 1-level nesting at partition_dim.")
                if any(not isinstance(s, int) or isinstance(s, bool) or s <= 0 for s in size):
                    raise ValueError("AutoTP nested sub-parameter sizes must be positive integers.")
            elif isinstance(size, int) and not isinstance(size, bool):
                if size == 0 or size < -1:
                    raise ValueError("AutoTP shape dimensions must be positive integers or -1.")
            else:
                raise ValueError("AutoTP shape must contain only integers or a tuple at partition_dim.")

    def get_partition_dim(self) -> int:
        """The dim split: ``partition_dim``, else 0 for a column split and 1 for a row split (``[out, in]``)."""
        if self.partition_dim is not None:
            return self.partition_dim
        return 0 if self.partition_type == PartitionType.COLUMN else 1

    def get_sub_param_sizes(self) -> Optional[tuple[int, ...]]:
        """The given sub-parameter sizes (nested tuple at ``partition_dim``), else None."""
        if self.shape is None or self.get_partition_dim() >= len(self.shape):
            return None
        sizes = self.shape[self.get_partition_dim()]
        return sizes if isinstance(sizes, tuple) else None

    def has_unequal_sub_params(self) -> bool:
        return self.get_sub_param_sizes() is not None

    def get_num_sub_params(self) -> Optional[int]:
        """How many fused sub-parameters ``shape`` declares at ``partition_dim`` (None: not declared)."""
        if self.shape is None or self.get_partition_dim() >= len(self.shape):
            return None
        size = self.shape[self.get_partition_dim()]
        if isinstance(size, tuple):
            return len(size)
        return size if size > 0 else None

    def matches(self, param_name: str, model_type: Optional[str] = None) -> bool:
        """Whether the rule applies to ``param_name`` (regex anchored at the start) of a ``model_type`` model."""
        if self.model_types:
            if model_type is None or str(model_type).lower() not in {str(t).lower() for t in self.model_types}:
                return False
        return any(re.match(pattern, param_name) for pattern in self.patterns)


@dataclass
class AutoTPConfig:
    """DeepSpeed's ``tensor_parallel.partition_config`` as an object: rules tried in order, first match wins."""

    tp_size: int = 1
    layer_specs: list[TPLayerSpec] = field(default_factory=list)
    embedding_partition_dim: int = 1
    lm_head_patterns: list[str] = field(default_factory=lambda: ["lm_head", "embed_out"])
    use_default_specs: bool = True
    strict_mode: bool = False

    def find_matching_spec(self, param_name: str, model_type: Optional[str] = None) -> Optional[TPLayerSpec]:
        """The first spec matching ``param_name`` (DeepSpeed's and zerotune's rule: first match decides)."""
        return next((spec for spec in self.layer_specs if spec.matches(param_name, model_type)), None)

    @classmethod
    def from_dict(cls, config: dict) -> AutoTPConfig:
        """Parse the JSON form; a bad partition type or shape fails with DeepSpeed's ValueError."""
        specs = [TPLayerSpec(patterns=list(spec.get("patterns", [])),
                             partition_type=spec.get("partition_type", "column"),
                             shape=_as_tuple(spec.get("shape")), partition_dim=spec.get("partition_dim"),
                             model_types=spec.get("model_types"), gather_output=bool(spec.get("gather_output", False)))
                 for spec in config.get("layer_specs", [])]
        return cls(tp_size=config.get("tp_size", 1), layer_specs=specs,
                   embedding_partition_dim=config.get("embedding_partition_dim", 1),
                   lm_head_patterns=config.get("lm_head_patterns", ["lm_head", "embed_out"]),
                   use_default_specs=config.get("use_default_specs", True),
                   strict_mode=config.get("strict_mode", False))


def spec_parts(spec: TPLayerSpec) -> int:
    """zerotune's ``parts`` for the spec's fused sub-parameters; a layout zerotune cannot record is refused."""
    if spec.shape is None:
        return 1
    try:
        return parts_from_shape(spec.shape, spec.partition_dim, spec.partition_type.value)
    except ValueError as error:
        raise ValueError(f"AutoTP spec {spec.patterns}: {error}") from None


def layer_rules(config: AutoTPConfig, model_type: Optional[str] = None) -> tuple[LayerRule, ...]:
    """The config's specs that apply to a ``model_type`` model, as zerotune's rules (same order, same matches)."""
    rules = []
    for spec in config.layer_specs:
        if spec.model_types and (model_type is None or str(model_type).lower()
                                 not in {str(t).lower() for t in spec.model_types}):
            continue
        rules.append(LayerRule(tuple(from_start(pattern) for pattern in spec.patterns), spec.partition_type.value,
                               spec_parts(spec), gather_output=spec.gather_output))
    return tuple(rules)


__all__ = ["AutoTPConfig", "PartitionType", "TPLayerSpec", "layer_rules"]
