"""What a ZeRO state holds of each parameter, in terms that do not depend on the layout.

Every state keeps its fp32 masters (and stage 3 its weights) in flat holders: a whole parameter
(stage 0), a rank's slice of a param group's flat buffer (stages 1-2), a rank's slice of a unit's
shard (stage 3). A ``HeldPiece`` says which elements of which parameter sit where in a holder:
``length`` elements of the flattened parameter from ``param_offset``, at ``offset`` in the holder.
The parameter is the tensor-parallel shard the rank trains (``tp_layout_of`` tells which piece of
the full tensor it is), so a piece plus the parameter's name and tp layout locate its values in the
full logical tensor. That is all a checkpoint needs to save a rank's state and to load it at any
other (dp, tp, pp, ZeRO stage, offload): ``checkpoint/logical.py`` works on these pieces only.
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
