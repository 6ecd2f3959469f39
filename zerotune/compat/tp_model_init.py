"""``deepspeed.tp_model_init``: what it records and how ``deepspeed.initialize`` merges that into the config.

DeepSpeed's ``tp_model_init(model, tp_size, dtype, tp_group=None)`` no longer splits anything: AutoTP runs in
``initialize``. It records its arguments (``deepspeed._TP_MODEL_INIT_ARGS``), and ``initialize`` folds them
into the config's ``tensor_parallel`` block: a missing ``autotp_size`` is filled in, a different one, a
conflicting precision or a ``tp_group`` together with an ``mpu`` is an error naming the key. zerotune then
builds its mesh from the merged ``autotp_size`` as always; a recorded ``tp_group`` must have the ranks of the
mesh's tensor-parallel group (checked after the engine is built). These are pure functions over the record;
the record itself lives on the ``deepspeed`` module (``compat/deepspeed.py``), where scripts reset it.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TPModelInitArgs", "check_tp_group", "config_dict", "merge_tp_model_init", "record_tp_model_init"]

_CONFLICT = "Conflicting tp_model_init arguments across calls: "


@dataclass(frozen=True)
class TPModelInitArgs:
    """What ``tp_model_init`` was called with."""

    tp_size: int
    dtype: torch.dtype
    tp_group: Any = None


def record_tp_model_init(existing: TPModelInitArgs | None, tp_size: int, dtype: torch.dtype,
                         tp_group: Any = None) -> TPModelInitArgs:
    """The record after one more ``tp_model_init`` call; repeated calls must agree (DeepSpeed's rule)."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size must be a positive int, got {tp_size!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"tp_model_init: dtype must be a torch.dtype, got {dtype!r}")
    new = TPModelInitArgs(tp_size, dtype, tp_group)
    if existing is None:
        return new
    if (existing.tp_size, existing.dtype) != (tp_size, dtype):
        raise ValueError(f"{_CONFLICT}tp_size/dtype {existing.tp_size}/{existing.dtype} then {tp_size}/{dtype}")
    if (existing.tp_group is None) != (tp_group is None) or (
            tp_group is not None and dist.get_world_size(existing.tp_group) != dist.get_world_size(tp_group)):
        raise ValueError(f"{_CONFLICT}tp_group given in one call and not in the other, or of another size")
    return existing


def config_dict(source: Any) -> dict:
    """A copy of the config as a dict (``initialize``'s ``config``: a dict or a JSON file path)."""
    if isinstance(source, dict):
        return copy.deepcopy(source)
    if isinstance(source, (str, Path)) and Path(source).is_file():
        with open(source, encoding="utf-8") as handle:
            return json.load(handle)
    raise ValueError(f"tp_model_init + initialize: the config must be a dict or a JSON file path to merge the "
                     f"recorded tensor-parallel arguments into, got {type(source).__name__} {source!r:.80}")


def _config_dtype(config: dict) -> torch.dtype | None:
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled", False) is True:
            return dtype
    return None


def merge_tp_model_init(recorded: TPModelInitArgs, config: dict, mpu: Any) -> dict:
    """``config`` with ``tensor_parallel.autotp_size`` from the record; an error naming the key on a conflict."""
    if recorded.tp_group is not None and mpu is not None:
        raise ValueError("tp_model_init provided tp_group; deepspeed.initialize must not receive mpu (one source "
                         "of tensor-parallel groups)")
    section = config.setdefault("tensor_parallel", {})
    if not isinstance(section, dict):
        raise ValueError(f"tensor_parallel must be a dict, got {type(section).__name__}")
    configured = section.get("autotp_size")
    if configured is not None and configured != recorded.tp_size:
        raise ValueError(f"Conflicting tensor_parallel.autotp_size in config ({configured}) and tp_model_init "
                         f"({recorded.tp_size})")
    section["autotp_size"] = recorded.tp_size
    tp = section.get("tp") or {}
    if not isinstance(tp, dict) or tp.get("tp_size", recorded.tp_size) != recorded.tp_size:
        raise ValueError(f"Conflicting tensor_parallel.tp.tp_size in config ({tp!r}) and tp_model_init "
                         f"({recorded.tp_size})")
    if recorded.tp_group is not None and dist.get_world_size(recorded.tp_group) != recorded.tp_size:
        raise ValueError(f"tp_model_init tp_size ({recorded.tp_size}) does not match its tp_group's size "
                         f"({dist.get_world_size(recorded.tp_group)})")
    config_dtype = _config_dtype(config)
    if config_dtype is not None and config_dtype != recorded.dtype:
        raise ValueError(f"Conflicting dtype: config uses {config_dtype} (bf16/fp16.enabled) but tp_model_init "
                         f"requested {recorded.dtype}")
    return config


def check_tp_group(recorded: TPModelInitArgs | None, mesh_tp_group: Any) -> None:
    """A recorded ``tp_group`` must hold the same ranks as the tensor-parallel group the engine built."""
    if recorded is None or recorded.tp_group is None:
        return
    given = dist.get_process_group_ranks(recorded.tp_group)
    built = [dist.get_rank()] if mesh_tp_group is None else dist.get_process_group_ranks(mesh_tp_group)
    if sorted(given) != sorted(built):
        raise ValueError(f"tp_model_init tp_group has ranks {given}, but the engine's tensor-parallel group (tensor "
                         f"ranks consecutive) is {built}: pass a group of consecutive ranks or no tp_group")
