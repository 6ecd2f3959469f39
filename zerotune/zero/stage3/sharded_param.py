"""One partitioned parameter and its explicit state.

A partitioned parameter stays the same ``nn.Parameter`` object (optimizers, tied weights, peft
and user code keep their references) with its full shape, dtype and device. Only ``.data``
changes with the state:

* ``SHARDED``: ``.data`` is a placeholder of the full shape backed by one element of storage
  (stride 0). The values live in this rank's slice of the segment's local shard. Writing into
  the placeholder raises (every element aliases one location); reading it gives no real values:
  use ``zerotune.zero.GatheredParameters`` to read or modify full parameters outside forward.
* ``UNSHARDED``: ``.data`` is a view of the segment's gathered full buffer (real values).
"""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from zerotune.zero.stage3.segment import FlatSegment

_ATTRIBUTE = "_zerotune_sharded"
_ids = itertools.count()


class ParamState(enum.Enum):
    SHARDED = "sharded"
    """Holds only this rank's slice (in the segment's local shard); ``.data`` is a 1-element placeholder."""
    UNSHARDED = "unsharded"
    """``.data`` is a view of the gathered full buffer: the whole parameter is in memory."""


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` that owns one element of storage (all strides 0)."""
    return torch.empty(1, dtype=dtype, device=device).as_strided(tuple(shape), (0,) * len(shape))


class ShardedParam:
    """The partitioned state of one parameter: where its slice lives, and which ``.data`` it shows."""

    def __init__(self, param: torch.nn.Parameter, segment: FlatSegment, index: int, full_view: torch.Tensor) -> None:
        self.param = param
        self.segment = segment
        self.index = index
        self.shape = param.shape
        self.numel = param.numel()
        self.offset = segment.layout.offsets[index]
        self._full_view = full_view
        self._placeholder = placeholder(param.shape, full_view.dtype, full_view.device)
        self.state = ParamState.UNSHARDED
        setattr(param, _ATTRIBUTE, self)
        # DeepSpeed's markers of a partitioned parameter, which Hugging Face and user code read
        # (``hasattr(p, "ds_id")``, ``p.ds_numel`` for parameter counts, ``p.ds_shape``).
        if not hasattr(param, "ds_id"):
            param.ds_id = next(_ids)
        param.ds_shape, param.ds_numel = param.shape, self.numel

    @property
    def placeholder_ptr(self) -> int:
        """Address of the placeholder's one element: a tensor with it shows no real values."""
        return self._placeholder.data_ptr()

    def to_unsharded(self) -> None:
        """Show the gathered values (the segment's full buffer must hold them)."""
        self.param.data = self._full_view
        self.state = ParamState.UNSHARDED

    def to_sharded(self) -> None:
        self.param.data = self._placeholder
        self.state = ParamState.SHARDED

    def local_piece(self) -> tuple[int, int, torch.Tensor]:
        """``(lo, hi, view)``: the flattened-parameter range ``[lo, hi)`` this rank holds (maybe empty)
        and the 1-D view of the local shard holding it (write into it to set those values, then call
        ``segment.notify_local_changed()``)."""
        start, end = self.segment.layout.owned_range(self.segment.rank)
        lo, hi = max(start, self.offset), min(end, self.offset + self.numel)
        local = self.segment.make_resident()  # swapped shards stay in memory until notify_local_changed
        if lo >= hi:
            return 0, 0, local[:0]
        return lo - self.offset, hi - self.offset, local[lo - start:hi - start]

    def detach(self) -> None:
        """Forget the partitioning (the segment is being replaced); ``.data`` is left as it is."""
        if getattr(self.param, _ATTRIBUTE, None) is self:
            delattr(self.param, _ATTRIBUTE)


def sharded_param_of(param: torch.Tensor) -> ShardedParam | None:
    """The partitioned state of ``param``, or None if it is an ordinary parameter."""
    return getattr(param, _ATTRIBUTE, None)
