"""``load_config``: dict / JSON / YAML / config object -> validated ZeroTuneConfig.

Loading happens in four passes, each with one job:
1. read the source into a plain dict (files.py);
2. walk it against the schema: rename aliases, reject unknown keys with a did-you-mean
   and DeepSpeed-only blocks with NotSupportedError (pydantic's own "extra forbidden"
   would name neither the alternative nor the reason);
3. validate types and ranges with pydantic, translating its errors to one line;
4. cross-section checks and provenance.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from .data_types import check_grad_accum_dtype
from .errors import ConfigError
from .files import read_config_file
from .normalize import normalize_keys, printable_key
from .numbers import check_hyperparameters
from .pydantic_errors import show_value, translate
from .schema import ZeroTuneConfig
from .tree import iter_leaves, path_in
from .types import AUTO


def load_config(source: Any) -> ZeroTuneConfig:
    """Validate ``source`` into a ZeroTuneConfig; "auto" values are kept unresolved.

    Raises ConfigError (NotSupportedError for DeepSpeed features zerotune lacks) for
    any problem, always naming the key or file.
    """
    if isinstance(source, ZeroTuneConfig):
        return source
    if isinstance(source, Mapping):
        raw = _plain_copy(source)
    elif isinstance(source, (str, os.PathLike)):
        raw = read_config_file(source)
    else:
        raise ConfigError(
            "", f"expected a dict, a JSON/YAML file path or a ZeroTuneConfig, got {type(source).__name__}"
        )
    return config_from_dict(raw)


def config_from_dict(raw: dict[str, Any]) -> ZeroTuneConfig:
    """Passes 2-4 on an already-read dict; provenance marks given keys "file"."""
    notes: list[tuple[str, str]] = []
    normalized = normalize_keys(expand_dotted_keys(raw, notes), ZeroTuneConfig, "", notes)
    try:
        cfg = ZeroTuneConfig.model_validate(normalized)
    except ValidationError as exc:
        raise translate(exc, normalized) from None
    except RecursionError:
        raise ConfigError("", "config is nested too deeply") from None
    check_cross_section(cfg)
    check_hyperparameters(cfg)
    cfg._provenance.update(_given_provenance(cfg, normalized))
    cfg._notes.extend(notes)
    return cfg


def expand_dotted_keys(raw: dict[str, Any], notes: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """Move DeepSpeed's dotted top-level keys into their sections: ``{"zero_optimization.stage": 3}`` is
    ``{"zero_optimization": {"stage": 3}}``.

    DeepSpeed clients write them (TRL's reference-model setup adds ``zero_optimization.reduce_bucket_size``
    and friends beside the block); the leaf is then checked like any other key, so an unknown one is
    refused under its full path. A dotted key that disagrees with the same key in its block gives way to
    the block, with a note in ``notes``: DeepSpeed reads only the block, and TRL writes its tuning values
    (``0.9 * hidden_size**2``) beside blocks that accelerate already filled (``int(0.9 * hidden_size**2)``).
    """
    dotted = [k for k in raw if isinstance(k, str) and "." in k and not k.startswith("_")]
    if not dotted:
        return raw
    expanded = {k: v for k, v in raw.items() if k not in dotted}
    for key in dotted:
        parts = key.split(".")
        if any(not part for part in parts):
            raise ConfigError(printable_key(key), "a dotted key needs a name between every pair of dots "
                                               "(as in 'zero_optimization.stage')")
        node = expanded
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, Mapping):
                raise ConfigError(printable_key(key), f"'{'.'.join(parts[:depth + 1])}' is {show_value(child)}, "
                                                   "not a section, so it cannot hold a dotted key's value")
            node[part] = child = dict(child)
            node = child
        leaf = parts[-1]
        if leaf in node and node[leaf] != raw[key]:
            if notes is not None:
                notes.append((printable_key(key), f"given twice: {show_value(node[leaf])} in the '{parts[0]}' block is "
                                               f"used, not {show_value(raw[key])} beside it (as DeepSpeed does)"))
            continue
        node[leaf] = raw[key]
    return expanded


def _plain_copy(source: Mapping[str, Any]) -> dict[str, Any]:
    try:
        return copy.deepcopy(dict(source))
    except Exception as exc:  # noqa: BLE001 - any uncopyable value is a user input problem
        raise ConfigError("", f"config dict cannot be copied: {exc}") from None


def check_cross_section(cfg: ZeroTuneConfig) -> None:
    """Constraints spanning several keys that a single field cannot express."""
    if cfg.fp16.enabled is True and cfg.bf16.enabled is True:
        raise ConfigError("bf16.enabled", "fp16.enabled and bf16.enabled are both true; enable at most one")
    zero = cfg.zero_optimization
    for name in ("offload_optimizer", "offload_param"):
        offload = getattr(zero, name)
        if offload.device == "nvme" and not offload.nvme_path:
            raise ConfigError(f"zero_optimization.{name}.nvme_path", "required when device is 'nvme'")
    if zero.offload_param.device != "none" and isinstance(zero.stage, int) and zero.stage != 3:
        # DeepSpeed reads offload_param only at stage 3 (zero.Init configs and TRL's shared dicts carry it to
        # every stage): accepted, and said to change nothing here.
        cfg._notes.append(("zero_optimization.offload_param.device",
                           f"no effect here: parameter offload ('{zero.offload_param.device}') needs "
                           f"zero_optimization.stage 3 and the stage is {zero.stage}; parameters stay with the model"))
    if zero.ignore_unused_parameters is False and isinstance(zero.stage, int) and zero.stage != 2:
        cfg._notes.append(("zero_optimization.ignore_unused_parameters",
                           f"no effect here at stage {zero.stage}: a parameter without a gradient takes a zero one "
                           "(only stage 2 checks that every trainable parameter got a gradient, as DeepSpeed's "
                           "ZeRO 1/2 optimizer does)"))
    check_grad_accum_dtype(cfg)
    if cfg.checkpoint.auto_resume is True and not cfg.checkpoint.save_dir:
        raise ConfigError("checkpoint.auto_resume", "needs checkpoint.save_dir: the directory to resume from (and "
                                                    "the default of save_checkpoint)")


def _given_provenance(cfg: ZeroTuneConfig, normalized: Mapping[str, Any]) -> dict[str, str]:
    provenance: dict[str, str] = {}
    for path, value in iter_leaves(cfg):
        if isinstance(value, str) and value == AUTO:
            provenance[path] = "auto"
        elif path_in(normalized, path):
            provenance[path] = "file"
        else:
            provenance[path] = "default"
    return provenance
