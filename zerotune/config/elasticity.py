"""``elasticity``: DeepSpeed's elastic batch block, and the errors of elastic training.

An elastic job may be rescheduled onto another number of ranks. For its training to stay the same
run, the global batch must not change with the rank count: ``elasticity`` names the largest global
batch acceptable and the micro batches a rank can take, and ``config/elastic_batch.py`` picks one
global batch that divides into as many data-parallel sizes as possible (each rank then takes a
listed micro batch and accumulates the rest). With ``enabled: true`` that choice replaces the batch
triple, as in DeepSpeed.

The section checks each value on its own when the config loads; ``check_enabled_elasticity`` checks
what only matters once the block is used (required keys, ranges against each other), as DeepSpeed
does only for an enabled block.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import BeforeValidator, Field, StrictBool, ValidationError, field_validator

from .errors import ConfigError
from .normalize import normalize_keys
from .pydantic_errors import show_value, translate
from .section import Section
from .types import NonNegFloat, PosInt

ELASTICITY_VERSIONS = (0.1, 0.2)
"""The versions of the batch search: 0.1 over ranks, 0.2 over nodes (with model parallelism)."""
LATEST_ELASTICITY_VERSION = ELASTICITY_VERSIONS[-1]


class ElasticityError(ConfigError):
    """Elastic training cannot go ahead with this block (DeepSpeed's base class of its elasticity errors).

    A ``ConfigError`` too, so the one ``except ConfigError`` of zerotune's callers and CLI catches it."""


class ElasticityConfigError(ElasticityError):
    """The elasticity block is missing a key, holds an invalid value, or contradicts the rest of the config."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The job runs on a number of ranks the elastic batch does not divide into."""


def _version_number(value: Any) -> Any:
    """DeepSpeed reads the version with ``float()``: 0.2 and "0.2" both mean version 0.2."""
    if isinstance(value, bool):
        raise ValueError(f"expected a version number ({_versions_text()}), got boolean {str(value).lower()}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"expected a version number ({_versions_text()})") from None
    raise ValueError(f"expected a version number ({_versions_text()}), got {type(value).__name__}")


def _versions_text() -> str:
    return " or ".join(str(v) for v in ELASTICITY_VERSIONS)


class ElasticityConfig(Section):
    """``elasticity``: the global batch of an elastic job, chosen to fit many data-parallel sizes."""

    NO_EFFECT_FIELDS: ClassVar[dict[str, str]] = {
        "min_time": "read by the resource scheduler that rescales the job, not by the runtime (nor DeepSpeed's)",
    }

    enabled: StrictBool = False
    """Let the elastic batch replace train_batch_size, the micro batch and gradient accumulation."""
    max_train_batch_size: PosInt = 2000
    """The largest acceptable global batch (required when enabled); the chosen batch is at most this."""
    micro_batch_sizes: Annotated[list[PosInt], Field(min_length=1)] = Field(default_factory=lambda: [2, 4, 6])
    """Micro batches a rank may take (required when enabled); the chosen one divides the batch per rank."""
    min_gpus: PosInt = 1
    """The fewest ranks the job may run on."""
    max_gpus: PosInt = 10000
    """The most ranks the job may run on."""
    min_time: NonNegFloat = 0
    """Minutes the job runs before the scheduler may rescale it; 0: unknown."""
    version: Annotated[float, BeforeValidator(_version_number)] = LATEST_ELASTICITY_VERSION
    """The batch search: 0.1 counts ranks; 0.2 counts whole nodes and allows model parallelism."""
    prefer_larger_batch: StrictBool = True
    """Of the batches that fit equally many sizes, take the largest (false: the smallest)."""
    ignore_non_elastic_batch_info: StrictBool = False
    """Let train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps stay in the config
    (then ignored) instead of being an error when the block is enabled."""
    model_parallel_size: PosInt = 1
    """Ranks per model replica (version 0.2); the data-parallel size is the rank count divided by it."""
    num_gpus_per_node: PosInt = 1
    """Ranks per node (version 0.2): the search counts whole nodes."""

    @field_validator("version")
    @classmethod
    def _known_version(cls, value: float) -> float:
        if value > LATEST_ELASTICITY_VERSION:
            raise ValueError(f"version {value} is newer than the latest elasticity version "
                             f"{LATEST_ELASTICITY_VERSION}; expected {_versions_text()}")
        if value not in ELASTICITY_VERSIONS:
            raise ValueError(f"expected {_versions_text()}")
        return value


def elasticity_from_dict(block: Any, path: str = "elasticity") -> ElasticityConfig:
    """The block validated as the section, every problem an ``ElasticityConfigError`` naming its key under
    ``path`` (for blocks read outside a whole config: a scheduler's, DeepSpeed's API)."""
    if not isinstance(block, Mapping):
        raise ElasticityConfigError(path, f"expected a mapping (JSON object), got {show_value(block)}")
    try:
        normalized = normalize_keys(block, ElasticityConfig, path)
    except ConfigError as unknown:  # an unknown key, with its did-you-mean
        raise ElasticityConfigError(unknown.path, unknown.message) from None
    try:
        return ElasticityConfig.model_validate(normalized)
    except ValidationError as exc:
        invalid = translate(exc, normalized, path)
        raise ElasticityConfigError(invalid.path, invalid.message) from None


def check_enabled_elasticity(cfg: ElasticityConfig, path: str = "elasticity") -> None:
    """What an enabled block needs beyond each value being valid on its own (DeepSpeed's checks, each
    error naming the key to change)."""
    missing = [key for key in ("max_train_batch_size", "micro_batch_sizes") if key not in cfg.model_fields_set]
    if missing:
        raise ElasticityConfigError(f"{path}.{missing[0]}", "required when elasticity is enabled "
                                                            "(the largest global batch and the micro batches a rank "
                                                            "may take)")
    if cfg.max_gpus < cfg.min_gpus:
        raise ElasticityConfigError(f"{path}.max_gpus", f"{cfg.max_gpus} is below min_gpus {cfg.min_gpus}")
    if cfg.model_parallel_size > 1 and cfg.version != 0.2:
        raise ElasticityConfigError(f"{path}.model_parallel_size",
                                    f"{cfg.model_parallel_size} needs version 0.2 (version {cfg.version} searches "
                                    "data parallelism only); set version 0.2 or model_parallel_size 1")
    if cfg.version == 0.2 and cfg.num_gpus_per_node % cfg.model_parallel_size != 0:
        raise ElasticityConfigError(f"{path}.num_gpus_per_node",
                                    f"{cfg.num_gpus_per_node} is not divisible by model_parallel_size "
                                    f"{cfg.model_parallel_size}: version 0.2 keeps model replicas within a node")
    # Version 0.2 searches per node: the batch of one node's data-parallel ranks must hold a micro batch.
    per_node = cfg.num_gpus_per_node // cfg.model_parallel_size if cfg.version == 0.2 else 1
    limit = cfg.max_train_batch_size // per_node
    too_large = [m for m in cfg.micro_batch_sizes if m > limit]
    if too_large:
        divided = f" / {per_node} data-parallel ranks per node = {limit}" if per_node > 1 else ""
        raise ElasticityConfigError(f"{path}.micro_batch_sizes", f"{too_large} exceed max_train_batch_size "
                                                                 f"{cfg.max_train_batch_size}{divided}")


__all__ = ["ELASTICITY_VERSIONS", "LATEST_ELASTICITY_VERSION", "ElasticityConfig", "ElasticityConfigError",
           "ElasticityError", "ElasticityIncompatibleWorldSize", "check_enabled_elasticity", "elasticity_from_dict"]
