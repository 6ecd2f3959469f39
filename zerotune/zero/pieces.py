"""A part of one parameter held somewhere: the unit every stage describes its masters and shards in.

Kept apart from ``held.py`` (which saves and loads by these pieces) so the stage contract can name it without
importing the state-dict machinery that implements the contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from zerotune.zero.partition import FlatLayout


@dataclass(frozen=True)
class HeldPiece:
    """``length`` elements of ``param`` (flattened) from ``param_offset``, at ``offset`` of their holder."""

    param: torch.nn.Parameter
    param_offset: int
    offset: int
    length: int


def layout_pieces(params: Sequence[torch.nn.Parameter], layout: FlatLayout, start: int, end: int) -> list[HeldPiece]:
    """The parameters' parts in the flat range ``[start, end)``, with offsets relative to ``start``."""
    return [HeldPiece(params[p.param], p.param_offset, p.flat_offset - start, p.length)
            for p in layout.pieces_in(start, end)]
