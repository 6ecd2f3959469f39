"""One partitioned parameter and its explicit state.

A partitioned parameter stays the same ``nn.Parameter`` object (optimizers, tied weights, peft
and user code keep their references) with its full shape, dtype and device. Only ``.data``
changes with the state:

* ``SHARDED``: ``.data`` is a placeholder of the full shape backed by one element of storage
  (stride 0). The values live in this rank's slice of the segment's local shard. Writing into
  the placeholder raises (every element aliases one location); reading it gives no real values:
  use ``zerotune.zero.GatheredParameters`` to read or modify full parameters outside forward.
* ``GATHERING``: the segment's all-gather is in flight; ``.data`` is still the placeholder.
* ``UNSHARDED``: ``.data`` is a view of the segment's gathered full buffer (real values).

``piece`` is this rank's range of the parameter as a 1-D view of the local shard. The parameter
also carries DeepSpeed's ``ds_*`` markers, which tools built on DeepSpeed read (``ds_markers.py``);
every state change updates them.
"""

from __future__ import annotations

import enum
from typing import Protocol

import torch

from zerotune.zero.partition import FlatLayout
from zerotune.zero.stage3.ds_markers import ZeroParamStatus, mark_partitioned, show_status


class SegmentShard(Protocol):
    """What a sharded parameter reads of its segment (``segment.FlatSegment``, which holds the parameters: the
    segment imports this module, so the parameter knows it only by this shape)."""

    @property
    def layout(self) -> FlatLayout: ...
    @property
    def rank(self) -> int: ...
    @property
    def persistent(self) -> bool: ...
    @property
    def local(self) -> torch.Tensor: ...
    @property
    def resident(self) -> bool: ...
    def make_resident(self) -> torch.Tensor: ...

_ATTRIBUTE = "_zerotune_sharded"


class ParamState(enum.Enum):
    SHARDED = "sharded"
    """Holds only this rank's slice (in the segment's local shard); ``.data`` is a 1-element placeholder."""
    GATHERING = "gathering"
    """The all-gather into the full buffer is in flight: memory as UNSHARDED, values as SHARDED."""
    UNSHARDED = "unsharded"
    """``.data`` is a view of the gathered full buffer: the whole parameter is in memory."""


_DS_STATUS = {ParamState.SHARDED: ZeroParamStatus.NOT_AVAILABLE, ParamState.GATHERING: ZeroParamStatus.INFLIGHT,
              ParamState.UNSHARDED: ZeroParamStatus.AVAILABLE}


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` that owns one element of storage (all strides 0)."""
    return torch.empty(1, dtype=dtype, device=device).as_strided(tuple(shape), (0,) * len(shape))


class ShardedParam:
    """The partitioned state of one parameter: where its slice lives, and which ``.data`` it shows."""

    def __init__(self, param: torch.nn.Parameter, segment: SegmentShard, index: int, full_view: torch.Tensor) -> None:
        self.param = param
        self.segment = segment
        self.index = index
        self.shape = param.shape
        self.numel = param.numel()
        self.offset = segment.layout.offsets[index]
        self._full_view = full_view
        self._placeholder = placeholder(param.shape, full_view.dtype, full_view.device)
        start, end = segment.layout.owned_range(segment.rank)
        lo, hi = max(start, self.offset), min(end, self.offset + self.numel)
        self._range = (lo - self.offset, hi - self.offset) if lo < hi else (0, 0)  # of the flattened parameter
        self._at = lo - start if lo < hi else 0  # where that range starts in the local shard
        self.piece = segment.local.new_empty(0)
        """This rank's range of the parameter: a 1-D view of the local shard (0 elements while it is swapped out)."""
        self.users: set[int] = set()
        """``id(module)`` of the unit modules whose forward is running with this parameter."""
        self.point_piece()
        setattr(param, _ATTRIBUTE, self)
        mark_partitioned(param, numel=self.numel, persistent=segment.persistent, piece=self.piece,
                         piece_numel=self._range[1] - self._range[0], users=self.users)
        self._set_state(ParamState.UNSHARDED)

    @property
    def placeholder_ptr(self) -> int:
        """Address of the placeholder's one element: a tensor with it shows no real values."""
        return self._placeholder.data_ptr()

    def _set_state(self, state: ParamState) -> None:
        self.state = state
        show_status(self.param, _DS_STATUS[state])

    def to_gathering(self) -> None:
        """The segment's all-gather was launched; ``.data`` stays the placeholder until ``to_unsharded``."""
        self._set_state(ParamState.GATHERING)

    def to_unsharded(self) -> None:
        """Show the gathered values (the segment's full buffer must hold them)."""
        self.param.data = self._full_view
        self._set_state(ParamState.UNSHARDED)

    def to_sharded(self) -> None:
        self.param.data = self._placeholder
        self._set_state(ParamState.SHARDED)

    @torch.no_grad()
    def point_piece(self) -> None:
        """Point ``piece`` at this rank's range in the segment's shard, or at nothing while the shard is in its
        swap file; the segment calls it whenever the shard's storage changes (``piece`` stays one object)."""
        if not self.segment.resident:
            self.piece.set_()  # type: ignore[call-overload]  # (torch's stubs lack set_(): empty storage)
            return
        local = self.segment.local
        self.piece.set_(local.untyped_storage(), local.storage_offset() + self._at, (self._range[1] - self._range[0],),
                        (1,))

    def local_piece(self) -> tuple[int, int, torch.Tensor]:
        """``(lo, hi, view)``: the flattened-parameter range ``[lo, hi)`` this rank holds (maybe empty)
        and the 1-D view of the local shard holding it (write into it to set those values, then call
        ``segment.notify_local_changed()``)."""
        local = self.segment.make_resident()  # swapped shards stay in memory until notify_local_changed
        lo, hi = self._range
        return lo, hi, local[self._at:self._at + hi - lo]

    def detach(self) -> None:
        """Forget the partitioning (the segment is being replaced); ``.data`` is left as it is."""
        if getattr(self.param, _ATTRIBUTE, None) is self:
            delattr(self.param, _ATTRIBUTE)


def sharded_param_of(param: torch.Tensor) -> ShardedParam | None:
    """The partitioned state of ``param``, or None if it is an ordinary parameter."""
    return getattr(param, _ATTRIBUTE, None)
