"""The elastic batch search (pure arithmetic), as DeepSpeed's elasticity versions 0.1 and 0.2 define it.

A global batch B runs on w data-parallel ranks when some allowed micro batch m has m * w dividing B
(each rank then accumulates B / (m * w) micro batches). The search wants the B at most
``max_train_batch_size`` that runs on the most rank counts within [min_gpus, max_gpus]. Candidates are
each micro batch, and their least common multiple, scaled by the largest highly composite number that
keeps them under the maximum: highly composite numbers have more divisors than any smaller number, so
they are where the many-divisor batches lie.

Version 0.2 runs the same search over nodes (a node holds ``num_gpus_per_node / model_parallel_size``
data-parallel ranks), and for a rank count outside the result it falls back to the largest batch the
current data-parallel size divides.

The result is deterministic for a block: a scheduler and every rank compute the same batch.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from typing import NamedTuple, Optional

from .batch import BatchSizes
from .elasticity import (
    ElasticityConfig,
    ElasticityConfigError,
    ElasticityIncompatibleWorldSize,
    check_enabled_elasticity,
    elasticity_from_dict,
)

# The highly composite numbers up to 720720: scaled by a micro batch, enough for global batches into the
# hundreds of thousands.
HIGHLY_COMPOSITE = (1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560,
                    10080, 15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200,
                    332640, 498960, 554400, 665280, 720720)

SCHEDULER_CONFIG_ENV = "DEEPSPEED_ELASTICITY_CONFIG"
"""Where a resource scheduler hands the job the elasticity block it scales by (DeepSpeed's name)."""


class ElasticPlan(NamedTuple):
    """What the search chose."""

    train_batch_size: int
    """The global batch, the same on every valid rank count."""
    valid_world_sizes: list[int]
    """The data-parallel sizes the batch divides into, ascending."""
    micro_batch: Optional[int]
    """Version 0.2: the micro batch for the current rank count (None if none divides); 0.1: None."""


def plan_elastic_batch(cfg: ElasticityConfig, current_world_size: int = 0) -> ElasticPlan:
    """Search the global batch of an enabled block; version 0.2 needs the current rank count."""
    check_enabled_elasticity(cfg)
    if cfg.version == 0.1:
        batch, valid = _search(cfg.micro_batch_sizes, cfg.max_train_batch_size, cfg.min_gpus, cfg.max_gpus,
                               cfg.prefer_larger_batch)
        if not valid:
            raise ElasticityConfigError("elasticity.min_gpus", f"no world size from {cfg.min_gpus} to {cfg.max_gpus} "
                                                               f"runs a batch of at most {cfg.max_train_batch_size} in "
                                                               f"micro batches {cfg.micro_batch_sizes}; lower min_gpus "
                                                               "or raise max_train_batch_size")
        return ElasticPlan(batch, valid, None)
    if current_world_size < 1:
        raise ElasticityConfigError("elasticity.version", "0.2 needs the current number of ranks (world size) to "
                                                          "choose the batch; none was given")
    return _plan_over_nodes(cfg, current_world_size)


def elastic_micro_batch(cfg: ElasticityConfig, plan: ElasticPlan, world_size: int) -> int:
    """The largest allowed micro batch for ``world_size`` ranks; an error if the plan does not run there."""
    if world_size not in plan.valid_world_sizes:
        raise ElasticityIncompatibleWorldSize(
            "elasticity", f"the elastic batch {plan.train_batch_size} does not run on world size {world_size}; "
                          f"valid world sizes: {plan.valid_world_sizes}")
    per_rank = plan.train_batch_size // world_size
    fitting = [m for m in cfg.micro_batch_sizes if per_rank % m == 0]
    if not fitting:
        raise ElasticityIncompatibleWorldSize(
            "elasticity.micro_batch_sizes", f"none of {cfg.micro_batch_sizes} divides the batch per rank "
                                            f"{per_rank} (elastic batch {plan.train_batch_size} on {world_size} ranks)")
    return max(fitting)


def elastic_batch_sizes(cfg: ElasticityConfig, dp_world_size: int, plan: Optional[ElasticPlan] = None) -> BatchSizes:
    """The batch triple an enabled block sets for ``dp_world_size`` data-parallel ranks (DeepSpeed's engine counts
    data-parallel ranks as the world size); ``plan``: the block's plan for that size, if already searched."""
    plan = plan or plan_elastic_batch(cfg, dp_world_size)
    micro = elastic_micro_batch(cfg, plan, dp_world_size)
    return BatchSizes(plan.train_batch_size, micro, plan.train_batch_size // (micro * dp_world_size))


def check_scheduler_agrees(cfg: ElasticityConfig, scheduler_json: Optional[str]) -> None:
    """Refuse to run when the scheduler scales the job by another block than the one the job runs with: it
    would move the job to rank counts this batch does not divide into. ``scheduler_json`` is the block the
    scheduler saw (``DEEPSPEED_ELASTICITY_CONFIG``); None: no scheduler said, nothing to compare."""
    if scheduler_json is None:
        return
    try:
        block = json.loads(scheduler_json)
    except ValueError as exc:
        raise ElasticityConfigError(SCHEDULER_CONFIG_ENV, f"is not JSON ({exc})") from None
    seen = elasticity_from_dict(block, SCHEDULER_CONFIG_ENV)
    for key in ("max_train_batch_size", "micro_batch_sizes", "version"):
        if getattr(seen, key) != getattr(cfg, key):
            raise ElasticityConfigError(f"elasticity.{key}",
                                        f"{getattr(cfg, key)} differs from the {getattr(seen, key)} the resource "
                                        f"scheduler scales the job by ({SCHEDULER_CONFIG_ENV})")


def _search(micro_batches: list[int], max_batch: int, min_gpus: int, max_gpus: int,
            prefer_larger: bool) -> tuple[int, list[int]]:
    """Version 0.1: the candidate batch that runs on the most rank counts in [min_gpus, max_gpus] (ties: the
    larger batch, or the smaller one), and those counts (none: the caller decides)."""
    candidates = set()
    for base in [*micro_batches, math.lcm(*micro_batches)]:
        if base >= max_batch:
            candidates.add(base)
        else:
            candidates.add(base * max(h for h in HIGHLY_COMPOSITE if h <= max_batch // base))
    sign = 1 if prefer_larger else -1
    scored = [(len(valid), sign * batch, batch, valid)
              for batch in candidates for valid in [_valid_world_sizes(batch, micro_batches, min_gpus, max_gpus)]]
    _, _, batch, valid = max(scored)
    return batch, valid


def _valid_world_sizes(batch: int, micro_batches: list[int], min_gpus: int, max_gpus: int) -> list[int]:
    """Rank counts w in [min_gpus, max_gpus] with some micro batch m such that m * w divides ``batch``: the
    divisors of batch / m for each micro batch m dividing the batch."""
    valid: set[int] = set()
    for micro in set(micro_batches):
        if batch % micro == 0:
            valid.update(d for d in _divisors(batch // micro) if min_gpus <= d <= max_gpus)
    return sorted(valid)


def _divisors(n: int) -> set[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return {*small, *(n // d for d in small)}


def _plan_over_nodes(cfg: ElasticityConfig, current: int) -> ElasticPlan:
    """Version 0.2: search over nodes, in units of one node's data-parallel ranks."""
    if current < cfg.model_parallel_size:
        raise ElasticityIncompatibleWorldSize("elasticity.model_parallel_size",
                                              f"world size {current} holds no model replica of "
                                              f"{cfg.model_parallel_size} ranks")
    per_node = cfg.num_gpus_per_node // cfg.model_parallel_size
    # Node bounds round down; 0 (fewer ranks than a node) falls back to the search's own bounds, as DeepSpeed.
    max_nodes_batch = cfg.max_train_batch_size // per_node
    min_nodes = cfg.min_gpus // cfg.num_gpus_per_node or 1
    max_nodes = cfg.max_gpus // cfg.num_gpus_per_node or max_nodes_batch // min(cfg.micro_batch_sizes)
    node_batch, nodes = _search(cfg.micro_batch_sizes, max_nodes_batch, min_nodes, max_nodes,
                                cfg.prefer_larger_batch)
    batch = node_batch * per_node
    valid = [n * per_node for n in nodes]
    if current // cfg.model_parallel_size in valid:
        return ElasticPlan(batch, valid, _node_micro_batch(cfg, batch, current))
    # Not a size the search found: the largest batch the current data-parallel size divides, one micro batch
    # each, as many accumulation steps as fit under the maximum.
    # (A world size that is not a multiple of the model-parallel size gives a fractional data-parallel size
    # here; DeepSpeed computes with it and truncates the result, and so does this.)
    data_parallel = Fraction(current, cfg.model_parallel_size)
    fits = [math.floor(cfg.max_train_batch_size / (m * data_parallel)) * m * data_parallel
            for m in cfg.micro_batch_sizes]
    batch = int(max(fits) if cfg.prefer_larger_batch else min(fits))
    return ElasticPlan(batch, [int(data_parallel)], _node_micro_batch(cfg, batch, current))


def _node_micro_batch(cfg: ElasticityConfig, batch: int, current: int) -> Optional[int]:
    """The micro batch version 0.2 reports: of those dividing the batch per rank, the largest (or, not
    preferring larger batches, the first listed)."""
    fitting = [m for m in cfg.micro_batch_sizes if batch // current % m == 0]
    if not fitting:
        return None
    return max(fitting) if cfg.prefer_larger_batch else fitting[0]


__all__ = ["HIGHLY_COMPOSITE", "SCHEDULER_CONFIG_ENV", "ElasticPlan", "check_scheduler_agrees",
           "elastic_batch_sizes", "elastic_micro_batch", "plan_elastic_batch"]
