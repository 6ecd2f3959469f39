"""``deepspeed.checkpoint`` / ``deepspeed.checkpoint.utils``: ``clone_tensors_for_torch_save``,
``get_model_ckpt_name_for_rank`` and the client-state key ``UNIVERSAL_CHECKPOINT_INFO``."""

from __future__ import annotations

import os
from typing import Any

import torch

from zerotune.checkpoint.engine_parts import model_file_name
from zerotune.compat.checkpoint_constants import UNIVERSAL_CHECKPOINT_INFO

__all__ = ["UNIVERSAL_CHECKPOINT_INFO", "clone_tensors_for_torch_save", "get_model_ckpt_name_for_rank"]


def clone_tensors_for_torch_save(item: Any, device: torch.device = torch.device("cpu")) -> Any:
    """A copy of ``item`` (tensors in nested lists / tuples / dicts) with every tensor cloned onto
    ``device``, so ``torch.save`` writes each tensor's own values, not the whole storage a view shares."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


def get_model_ckpt_name_for_rank(base_folder: str | os.PathLike, mp_rank_str: str) -> str:
    """The file in the checkpoint tag directory ``base_folder`` that holds model-parallel rank ``mp_rank_str``'s
    module state dict (under its ``module`` key), as DeepSpeed's function of this name answers for its layout.

    Why not DeepSpeed's name alone: zerotune saves the module once, tensor-parallel shards joined into full tensors
    (``checkpoint/engine_parts.py``), so every model-parallel rank's module state is in ``model_states.pt``. A
    DeepSpeed-layout checkpoint (which zerotune also loads) keeps one ``mp_rank_XX_model_states.pt`` per rank: where
    ``base_folder`` holds that file, it is the answer. A pipeline checkpoint has one module file per stage and no
    single one to name (``model_states_stage{s}.pt``).
    """
    if not str(mp_rank_str).isdigit():
        raise ValueError(f"get_model_ckpt_name_for_rank: mp_rank_str must be a model-parallel rank's digits "
                         f"(e.g. '00'), got {mp_rank_str!r}")
    deepspeed_file = os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")
    if os.path.isfile(deepspeed_file):
        return deepspeed_file
    return os.path.join(base_folder, model_file_name())
