"""``deepspeed.elasticity`` (and its ``config``, ``elasticity`` and ``constants`` modules): DeepSpeed's elastic
batch API over zerotune's own search (``zerotune/config/elastic_batch.py``).

A resource scheduler calls ``compute_elastic_config`` to learn which rank counts a job may be scaled to; the
engine applies the same block itself (``elasticity.enabled`` in the config). Both read one block the same way,
so the batch the scheduler plans for is the batch the job trains with.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from packaging.version import InvalidVersion, Version

from zerotune.compat.alias_hook import DEEPSPEED_VERSION
from zerotune.compat.refusals import refused_class
from zerotune.compat.torch_version import required_torch_version
from zerotune.config.elastic_batch import (
    SCHEDULER_CONFIG_ENV,
    check_scheduler_agrees,
    elastic_micro_batch,
    plan_elastic_batch,
)
from zerotune.config.elasticity import (
    LATEST_ELASTICITY_VERSION,
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    check_enabled_elasticity,
    elasticity_from_dict,
)
from zerotune.config.elasticity import ElasticityConfig as ElasticitySection
from zerotune.monitor.logging import get_logger

# deepspeed.elasticity.{config, elasticity, constants} are all this module under the alias.
config = elasticity = constants = sys.modules[__name__]

ELASTICITY = "elasticity"
ENABLED = "enabled"
ENABLED_DEFAULT = False
MINIMUM_DEEPSPEED_VERSION = "0.3.8"
"""The first DeepSpeed release with elasticity: a scheduler targeting an older one cannot run the job elastic."""
DEEPSPEED_ELASTICITY_CONFIG = SCHEDULER_CONFIG_ENV

DSElasticAgent = refused_class("deepspeed.elasticity.DSElasticAgent")


class ElasticityConfig:
    """DeepSpeed's ``ElasticityConfig(param_dict)``: an ``elasticity`` block validated by zerotune's section and
    read under DeepSpeed's attribute names (``max_acceptable_batch_size`` for ``max_train_batch_size``,
    ``micro_batches`` for ``micro_batch_sizes``, ``prefer_larger_batch_size`` for ``prefer_larger_batch``)."""

    def __init__(self, param_dict: Mapping[str, Any]) -> None:
        section = elasticity_from_dict(param_dict)
        if section.enabled:
            check_enabled_elasticity(section)
        self.section = section
        self.enabled = section.enabled
        self.max_acceptable_batch_size = section.max_train_batch_size
        self.micro_batches = list(section.micro_batch_sizes)
        self.min_gpus, self.max_gpus = section.min_gpus, section.max_gpus
        self.model_parallel_size = section.model_parallel_size
        self.num_gpus_per_node = section.num_gpus_per_node
        self.min_time = section.min_time
        self.version = section.version
        self.prefer_larger_batch_size = section.prefer_larger_batch
        self.ignore_non_elastic_batch_info = section.ignore_non_elastic_batch_info

    def repr(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key != "section"}

    def __repr__(self) -> str:
        return f"ElasticityConfig({self.section.model_dump()})"


def elasticity_enabled(ds_config: Mapping[str, Any]) -> bool:
    """Whether the config asks for elastic training."""
    block = ds_config.get(ELASTICITY)
    return isinstance(block, Mapping) and block.get(ENABLED, ENABLED_DEFAULT) is True


def ensure_immutable_elastic_config(runtime_elastic_config_dict: Mapping[str, Any]) -> None:
    """Refuse a block that differs from the one the resource scheduler scales the job by
    (``DEEPSPEED_ELASTICITY_CONFIG``); warn when no scheduler said which block it uses."""
    scheduler_json = os.environ.get(SCHEDULER_CONFIG_ENV)
    if scheduler_json is None:
        get_logger().log(logging.WARNING, "%s is not set: cannot check that the resource scheduler scales this job "
                                          "to rank counts the elastic batch divides into", SCHEDULER_CONFIG_ENV)
        return
    check_scheduler_agrees(elasticity_from_dict(runtime_elastic_config_dict), scheduler_json)


def compute_elastic_config(ds_config: Mapping[str, Any], target_deepspeed_version: str, world_size: int = 0,
                           return_microbatch: bool = False) -> tuple:
    """``(train_batch_size, valid_world_sizes)`` of the config's enabled elasticity block, and the micro batch as
    a third item when ``world_size`` is given (an ``ElasticityIncompatibleWorldSize`` if the batch does not run
    on it) or ``return_microbatch`` is true (version 0.2). Version 0.2 reads the world size from ``WORLD_SIZE``
    when none is given. Every problem is an ``ElasticityError`` naming the key."""
    if not isinstance(ds_config, Mapping):
        raise ValueError(f"ds_config: expected a config dict, got {type(ds_config).__name__}")
    if ELASTICITY not in ds_config:
        raise ElasticityConfigError(ELASTICITY, "missing: add the block to run an elastic training job")
    cfg = elasticity_from_dict(ds_config[ELASTICITY])
    if not cfg.enabled:
        raise ElasticityConfigError("elasticity.enabled", "is false: set it to true to run an elastic training job")
    check_enabled_elasticity(cfg)  # a missing key before a missing world size
    _check_target_version(target_deepspeed_version)
    current = world_size or (_world_size_from_env() if cfg.version == 0.2 else 0)
    plan = plan_elastic_batch(cfg, current)
    get_logger().info("elasticity: batch %d runs on world sizes %s", plan.train_batch_size, plan.valid_world_sizes)
    if world_size > 0:
        return plan.train_batch_size, plan.valid_world_sizes, elastic_micro_batch(cfg, plan, world_size)
    if return_microbatch:
        if cfg.version == 0.1:
            raise ElasticityConfigError("elasticity", "return_microbatch with version 0.1 needs world_size: the "
                                                      "micro batch depends on the number of ranks")
        return plan.train_batch_size, plan.valid_world_sizes, plan.micro_batch
    return plan.train_batch_size, plan.valid_world_sizes


def is_torch_elastic_compatible() -> bool:
    """Whether torch has the elastic agent DeepSpeed's launcher builds on (torch 1.11+; zerotune needs 2.4)."""
    return required_torch_version(min_version=1.11)


def _check_target_version(target: str) -> None:
    try:
        too_old = Version(str(target)) < Version(MINIMUM_DEEPSPEED_VERSION)
    except InvalidVersion:
        raise ElasticityError(ELASTICITY, f"target DeepSpeed version {target!r} is not a version number") from None
    if too_old:
        raise ElasticityError(ELASTICITY, f"target DeepSpeed version {target} predates elasticity (first in "
                                          f"{MINIMUM_DEEPSPEED_VERSION}; this runtime answers as {DEEPSPEED_VERSION})")


def _world_size_from_env() -> int:
    value = os.environ.get("WORLD_SIZE")
    if value is None or not value.isdigit() or int(value) < 1:
        raise ElasticityConfigError("elasticity.version", f"0.2 needs the number of ranks: pass world_size or set "
                                                          f"WORLD_SIZE (it is {value!r})")
    return int(value)


__all__ = ["DEEPSPEED_ELASTICITY_CONFIG", "DSElasticAgent", "ELASTICITY", "ENABLED", "ENABLED_DEFAULT",
           "ElasticityConfig", "ElasticityConfigError", "ElasticityError", "ElasticityIncompatibleWorldSize",
           "ElasticitySection", "LATEST_ELASTICITY_VERSION", "MINIMUM_DEEPSPEED_VERSION", "compute_elastic_config",
           "elasticity_enabled", "ensure_immutable_elastic_config", "is_torch_elastic_compatible"]
