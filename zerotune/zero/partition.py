"""Partition math for ZeRO: pure functions, no tensors, no processes.

The trainable parameters of one param group are laid end to end in a flat buffer, padded so
it splits evenly over the N data-parallel ranks. Rank r owns the contiguous slice
``[r * shard, (r + 1) * shard)``. A parameter may straddle two (or more) ranks' slices; the
``Piece`` records say which part of which parameter lies in which slice.

    flat:   | p0 ........ | p1 .... | p2 ............... | pad |
    ranks:  |<---- rank 0 ---->|<---- rank 1 ---->|<---- rank 2 ---->|
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """``length`` elements of parameter ``param`` starting at ``param_offset``, at ``flat_offset`` in the flat buffer.
    """

    param: int
    param_offset: int
    flat_offset: int
    length: int


@dataclass(frozen=True)
class FlatLayout:
    """Where every parameter of one group lives in its padded flat buffer, and who owns what."""

    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    world: int
    shard: int

    @property
    def total(self) -> int:
        """Elements holding parameters (without padding)."""
        return sum(self.numels)

    @property
    def padded(self) -> int:
        return self.shard * self.world

    def owned_range(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside the {self.world} data-parallel ranks")
        return rank * self.shard, (rank + 1) * self.shard

    def pieces_in(self, start: int, end: int) -> list[Piece]:
        """The parts of parameters that fall in the flat range ``[start, end)``, in flat order."""
        pieces = []
        for index, (offset, numel) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(start, offset), min(end, offset + numel)
            if lo < hi:
                pieces.append(Piece(index, lo - offset, lo, hi - lo))
        return pieces

    def owned_pieces(self, rank: int) -> list[Piece]:
        """The parameter parts rank ``rank`` owns (its optimizer state covers exactly these)."""
        return self.pieces_in(*self.owned_range(rank))

    def owner_of(self, flat_index: int) -> int:
        return flat_index // self.shard


def flat_layout(numels: list[int] | tuple[int, ...], world: int, align: int = 1) -> FlatLayout:
    """Lay ``numels`` end to end and pad to a multiple of ``world * align`` (align keeps shards aligned)."""
    if world < 1 or align < 1:
        raise ValueError(f"world ({world}) and align ({align}) must be positive")
    if any(n < 0 for n in numels):
        raise ValueError(f"parameter sizes must be non-negative, got {list(numels)}")
    offsets, running = [], 0
    for numel in numels:
        offsets.append(running)
        running += numel
    shard = max(1, math.ceil(running / (world * align))) * align
    return FlatLayout(tuple(numels), tuple(offsets), world, shard)


def split_at_owner_boundaries(layout: FlatLayout, start: int, end: int) -> list[tuple[int, int, int]]:
    """Split ``[start, end)`` where ownership changes: ``[(owner, lo, hi), ...]`` in flat order."""
    spans = []
    lo = start
    while lo < end:
        owner = layout.owner_of(lo)
        hi = min(end, (owner + 1) * layout.shard)
        spans.append((owner, lo, hi))
        lo = hi
    return spans
