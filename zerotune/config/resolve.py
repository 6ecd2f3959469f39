"""``resolve_config``: solve the batch triple and replace "auto" values.

Resolution works on the plain dict and re-validates it, so a value supplied through
``auto_values`` is checked exactly like one written in the file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional, TypeVar

from .batch import BATCH_KEYS, solve_batch
from .elastic_batch import SCHEDULER_CONFIG_ENV, check_scheduler_agrees, elastic_batch_sizes, plan_elastic_batch
from .elasticity import ElasticityConfigError
from .errors import ConfigError
from .loading import config_from_dict, load_config
from .pydantic_errors import show_value
from .schema import ZeroTuneConfig
from .tree import NO_DEFAULT, field_default, iter_leaves, set_path
from .types import AUTO, Auto

UNRESOLVED = "'auto' could not be resolved; set a value"
_Leaf = TypeVar("_Leaf")


def resolve_config(
    cfg: Any,
    *,
    dp_world_size: int,
    auto_values: Optional[Mapping[str, Any]] = None,
    strict: bool = True,
) -> ZeroTuneConfig:
    """A new config with the batch triple solved and "auto" leaves replaced.

    An "auto" leaf takes ``auto_values[dotted_path]`` if given, else the schema default
    where one exists; otherwise strict mode raises ConfigError naming the key and
    non-strict mode (``zerotune check``) leaves it "auto".
    """
    cfg = load_config(cfg)
    if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
        raise ConfigError("", f"dp_world_size must be a positive integer, got {show_value(dp_world_size)}")
    auto_values = dict(auto_values or {})
    data = cfg.to_dict()
    provenance = dict(cfg.provenance)

    for path, value in iter_leaves(cfg):
        if not _is_auto(value) or path in BATCH_KEYS:
            continue
        replacement = auto_values.get(path, field_default(path, ZeroTuneConfig))
        if replacement is NO_DEFAULT or _is_auto(replacement):
            if strict:
                raise ConfigError(path, UNRESOLVED)
            continue
        set_path(data, path, replacement)
        provenance[path] = "auto"

    elastic_notes = _elastic_batch(cfg, data, provenance, dp_world_size) if cfg.elasticity.enabled else []
    _resolve_batch(data, provenance, auto_values, dp_world_size, strict)
    resolved = config_from_dict(data)
    resolved._notes[:] = [*cfg._notes, *elastic_notes]
    resolved._provenance.clear()
    resolved._provenance.update({path: provenance.get(path, "default") for path, _ in iter_leaves(resolved)})
    return resolved


def _elastic_batch(cfg: ZeroTuneConfig, data: dict[str, Any], provenance: dict[str, str],
                   dp_world_size: int) -> list[tuple[str, str]]:
    """An enabled ``elasticity`` block sets the batch triple, as DeepSpeed's does: a triple given beside it would
    silently lose, so it is an error unless the block says to ignore it. Returns the notes to report."""
    section = cfg.elasticity
    given = [key for key in BATCH_KEYS if cfg.provenance.get(key) == "file"]
    if given and not section.ignore_non_elastic_batch_info:
        raise ElasticityConfigError(given[0], f"set beside an enabled elasticity block, which chooses "
                                              f"{', '.join(BATCH_KEYS)} itself; remove {', '.join(given)}, or set "
                                              "elasticity.ignore_non_elastic_batch_info true to have them ignored")
    check_scheduler_agrees(section, os.environ.get(SCHEDULER_CONFIG_ENV))
    plan = plan_elastic_batch(section, dp_world_size)
    sizes = elastic_batch_sizes(section, dp_world_size, plan)
    notes = [(key, f"no effect here: elasticity sets it to {value} (ignore_non_elastic_batch_info)")
             for key, value in zip(BATCH_KEYS, sizes) if key in given]
    for key, value in zip(BATCH_KEYS, sizes):
        data[key] = value
        provenance[key] = "inferred"
    notes.append(("elasticity", f"batch {sizes.train_batch_size} = micro batch {sizes.train_micro_batch_size_per_gpu} "
                                f"x {sizes.gradient_accumulation_steps} steps x {dp_world_size} data-parallel ranks; "
                                f"it runs unchanged on data-parallel sizes {plan.valid_world_sizes}"))
    return notes


def _resolve_batch(
    data: dict[str, Any],
    provenance: dict[str, str],
    auto_values: Mapping[str, Any],
    dp_world_size: int,
    strict: bool,
) -> None:
    """Solve the triple in ``data``; autos count as missing unless auto_values gives them."""
    for key in BATCH_KEYS:
        if _is_auto(data[key]) and key in auto_values and not _is_auto(auto_values[key]):
            data[key] = _checked_batch_value(key, auto_values[key])
            provenance[key] = "auto"
    members = [None if _is_auto(data[key]) else data[key] for key in BATCH_KEYS]
    autos = [key for key in BATCH_KEYS if _is_auto(data[key])]
    if autos and members[0] is None and members[1] is None:
        # Neither the global nor the micro batch is known: the autos really are unresolved.
        if strict:
            raise ConfigError(autos[0], UNRESOLVED)
        return
    train_batch, micro_batch, grad_accum = members
    solved = solve_batch(train_batch, micro_batch, grad_accum, dp_world_size)
    for key, value in zip(BATCH_KEYS, solved):
        if data[key] != value:
            data[key] = value
            provenance[key] = "inferred"


def resolved(value: _Leaf | Auto | None, path: str) -> _Leaf:
    """A leaf of a config ``resolve_config`` returned, typed as what it holds there: no "auto" is left, and the
    batch triple is solved. (A leaf that may stay None, such as ``comm_timeout_s``, is checked for None first.)"""
    if value is None:
        raise ConfigError(path, "has no value: the config was not resolved (resolve_config solves the batch triple)")
    if value == AUTO:
        raise ConfigError(path, UNRESOLVED)
    return value


def _checked_batch_value(key: str, value: Any) -> Any:
    # Validated again by config_from_dict; this only keeps solve_batch's arithmetic safe.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, f"invalid auto value {show_value(value)}: expected a positive integer")
    return value


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO
