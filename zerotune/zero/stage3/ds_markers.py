"""DeepSpeed's markers on ZeRO-3 parameters: the ``ds_*`` attributes tools read off the parameter itself.

Tools built on DeepSpeed ask the parameter, not the engine: transformers (``hasattr(p, "ds_id")``,
``p.ds_numel`` in its parameter count), peft (``ds_numel`` when a parameter shows 0 elements, ``ds_shape``
for adapter shapes), Lightning (``ds_numel`` and ``partition_numel()`` in its model summary) and TRL
(``ds_status`` before gathering a fused loss's head, ``ds_active_sub_modules`` cleared around generation).
So the markers sit on the parameters zerotune's stage 3 manages and ``ShardedParam`` keeps them true as
its state changes. This module is the one place below ``compat/`` with DeepSpeed's spellings for them;
``compat`` re-exports ``ZeroParamStatus`` under DeepSpeed's module paths.

What each marker holds, and where it differs from DeepSpeed:

* ``ds_status``: NOT_AVAILABLE while SHARDED, INFLIGHT while the segment's all-gather is in flight
  (``.data`` is still the placeholder then; DeepSpeed's already points at the buffer being filled),
  AVAILABLE while UNSHARDED.
* ``ds_tensor``: this rank's piece of the parameter, a 1-D *view* of the segment's local shard (writing
  into it changes the shard; the optimizer's and a load's writes show in it). DeepSpeed pads every
  parameter to a multiple of the world size and gives each rank an equal piece; zerotune shards a unit's
  parameters laid end to end, so a rank holds one contiguous range of each parameter -- all of it, part
  of it or none (0 elements) -- and the ranks' pieces concatenated in rank order are the flattened
  parameter, with no padding. ``ds_tensor.ds_numel`` is the piece's size, also while the shard is in
  its swap file (``offload_param: nvme``), when ``ds_tensor`` itself has 0 elements (DeepSpeed's shows a
  1-element invalid buffer then). Under ``offload_param: cpu`` it lives on the host, as DeepSpeed's;
  ``engine.offload_states`` moves it with the shard. The same tensor object throughout a partitioning,
  so a reference to it stays true.
* ``ds_numel``, ``ds_shape``: the whole parameter's size and shape; ``ds_id``: a process-wide unique int.
* ``ds_persist``: whether its unit stays gathered between uses (a unit smaller than
  ``stage3_param_persistence_threshold``); zerotune decides persistence per unit, DeepSpeed per parameter.
* ``ds_active_sub_modules``: ``id(module)`` of each unit module whose forward is running with it
  (DeepSpeed also counts backward; zerotune's backward schedule follows a cursor, not module calls).
* ``partition_numel()``: ``ds_tensor.ds_numel``.
"""

from __future__ import annotations

import enum
import itertools
from typing import Any

import torch

_ids = itertools.count()


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's ``ZeroParamStatus`` (names and values), held in a partitioned parameter's ``ds_status``."""

    AVAILABLE = 1
    """The whole values are in ``.data`` on every rank (zerotune: UNSHARDED)."""
    NOT_AVAILABLE = 2
    """Only this rank's piece is held (zerotune: SHARDED)."""
    INFLIGHT = 3
    """Being gathered (zerotune: GATHERING)."""


class _PartitionNumel:
    """``param.partition_numel()``: the size of this rank's piece (a class, not a lambda: parameters' attributes
    are copied and pickled with them)."""

    def __init__(self, numel: int) -> None:
        self.numel = numel

    def __call__(self) -> int:
        return self.numel


def mark_partitioned(param: torch.nn.Parameter, *, numel: int, persistent: bool, piece: torch.Tensor,
                     piece_numel: int, users: set[int]) -> None:
    """Set the markers of a newly partitioned parameter (again after re-partitioning: ``ds_id`` is kept)."""
    marked: Any = param  # (DeepSpeed's markers are attributes torch's types do not declare)
    marked_piece: Any = piece
    if not hasattr(param, "ds_id"):
        marked.ds_id = next(_ids)
    marked.ds_shape, marked.ds_numel, marked.ds_persist = param.shape, numel, persistent
    marked_piece.ds_numel = piece_numel
    marked.ds_tensor, marked.ds_active_sub_modules = piece, users
    marked.partition_numel = _PartitionNumel(piece_numel)


def show_status(param: torch.nn.Parameter, status: ZeroParamStatus) -> None:
    marked: Any = param  # (a DeepSpeed marker: see ``mark_partitioned``)
    marked.ds_status = status
