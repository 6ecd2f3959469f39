"""What a ZeRO state holds of each parameter, in terms that do not depend on the layout.

Every state keeps its fp32 masters (and stage 3 its weights) in flat holders: a whole parameter
(stage 0), a rank's slice of a param group's flat buffer (stages 1-2), a rank's slice of a unit's
shard (stage 3). A ``HeldPiece`` says which elements of which parameter sit where in a holder:
``length`` elements of the flattened parameter from ``param_offset``, at ``offset`` in the holder.
The parameter is the tensor-parallel shard the rank trains (``tp_layout_of`` tells which piece of
the full tensor it is), so a piece plus the parameter's name and tp layout locate its values in the
full logical tensor. That is all a checkpoint needs to save a rank's state and to load it at any
other (dp, tp, pp, ZeRO stage, offload): ``HeldStateDict`` gives every state its ``state_dict()`` /
``load_state_dict()`` in those terms, and ``checkpoint/logical.py`` stores and reads them.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import Protocol

import torch

from zerotune.parallel.tensor.layout import tp_layout_of
from zerotune.parallel.tensor.state_dict import full_shape
from zerotune.zero.contracts import ZeroStage
from zerotune.zero.pieces import HeldPiece

WEIGHT, MASTER, OPTIM = "weight", "master", "optim."
"""Kinds of held values: the weights (model dtype), the fp32 masters, one optimizer state tensor (``optim.<key>``)."""


class PieceSource(Protocol):
    """Where ``load_state_dict`` takes values from (``checkpoint.logical.PieceReader``)."""

    scalars: dict[str, dict]

    def has(self, name: str, kind: str) -> bool: ...
    def shape(self, name: str) -> tuple[int, ...] | None: ...
    def optimizer_keys(self, name: str) -> list[str]: ...
    def local(self, name: str, kind: str, param: torch.Tensor) -> torch.Tensor: ...


def tp_of(param: torch.Tensor) -> list[int] | None:
    """The tensor-parallel piece ``param`` is, as ``[dim, world, rank, full_size, parts]`` (None: replicated)."""
    layout = tp_layout_of(param)
    return None if layout is None else [layout.dim, layout.world, layout.rank, layout.full_size, layout.parts]


def weight_kind(source: PieceSource, name: str, param: torch.Tensor) -> str:
    """fp32 weights come from the fp32 masters when the source has them (a bf16 run resumed in fp32)."""
    return MASTER if param.dtype == torch.float32 and source.has(name, MASTER) else WEIGHT


class HeldStateDict(ZeroStage):
    """``state_dict()`` / ``load_state_dict()`` by parameter name for a state that says what it holds
    (``master_pieces``, ``weight_pieces``, ``masters``, ``placement``): the layout-independent form a checkpoint
    stores, so a state built at any layout loads what a state at any other saved."""

    @torch.no_grad()
    def state_dict(self, optimizer: torch.optim.Optimizer | None, names: dict[int, str], *, weights: bool,
                   masters: bool) -> dict:
        """This rank's pieces, each with its parameter's name, full logical shape, tp piece and flat range:
        ``weights`` the partitioned weights (stage 3); ``masters`` the fp32 masters; with an optimizer, its
        per-element state and (per name) its scalars. Tensors, numbers and strings only (``weights_only``)."""
        entries: list[dict] = []
        tensors: dict[str, torch.Tensor] = {}
        scalars: dict[str, dict] = {}

        def add(piece: HeldPiece, kind: str, holder: torch.Tensor) -> None:
            key = f"t{len(entries)}"
            tensors[key] = holder.detach().reshape(-1)[piece.offset:piece.offset + piece.length].to("cpu", copy=True)
            entries.append({"key": key, "name": names[id(piece.param)], "kind": kind,
                            "shape": list(full_shape(piece.param)), "tp": tp_of(piece.param),
                            "start": piece.param_offset, "stop": piece.param_offset + piece.length})

        if weights:
            for segment, pieces in self.weight_pieces():
                local = segment.read_local()
                for piece in pieces:
                    add(piece, WEIGHT, local)
        if optimizer is None:
            return {"entries": entries, "scalars": scalars, "tensors": tensors}
        for index, (master, pieces) in enumerate(zip(self.masters, self.master_pieces())):
            if not pieces:
                continue
            values, optimizer_state = self._placement.read_master(index, master, optimizer)
            per_element = {}
            for key, value in optimizer_state.items():
                # a one-element tensor beside a larger shard is a per-group counter (a step kept as a tensor), saved
                # with the scalars: it is not cut into pieces
                if isinstance(value, torch.Tensor) and value.dim() > 0 and (value.numel() != 1 or values.numel() == 1):
                    if value.numel() != values.numel():
                        raise ValueError(f"optimizer state '{key}' has {value.numel()} elements for a parameter shard "
                                         f"of {values.numel()}: only per-element optimizer state (Adam, SGD, Adagrad, "
                                         "Lamb) can be saved by parameter name")
                    per_element[key] = value
            others = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer_state.items()
                      if k not in per_element}
            for piece in pieces:
                if masters:
                    add(piece, MASTER, values)
                for key, value in per_element.items():
                    add(piece, OPTIM + key, value)
                if others:
                    scalars[names[id(piece.param)]] = others
        return {"entries": entries, "scalars": scalars, "tensors": tensors}

    @torch.no_grad()
    def load_state_dict(self, source: PieceSource, optimizer: torch.optim.Optimizer | None, names: dict[int, str],
                        *, weights: bool = True, skip: AbstractSet[str] = frozenset()) -> None:
        """Take what this rank holds from ``source``: with ``weights``, the partitioned weights (stage 3, except
        ``skip``) and the masters refreshed from the model's weights; with an optimizer, the masters (saved
        masters, or the weights: exact for an fp32 source) and the optimizer state. Checked beforehand
        (``checkpoint.logical.check_fits``)."""
        for segment, pieces in self.weight_pieces() if weights else []:
            local = segment.read_local()
            for piece in pieces:
                name = names[id(piece.param)]
                if name in skip or source.shape(name) is None:
                    continue
                values = source.local(name, weight_kind(source, name, piece.param), piece.param)
                local[piece.offset:piece.offset + piece.length] = \
                    values[piece.param_offset:piece.param_offset + piece.length]
            segment.overwrite_local(local, notify=False)
        if weights:
            self.reload_from_model()  # masters follow the weights (then overwritten from the source, if any)
        if optimizer is None:
            return
        for index, (master, pieces) in enumerate(zip(self.masters, self.master_pieces())):
            if not pieces:
                continue
            current, _ = self._placement.read_master(index, master, optimizer)
            values = current.detach().reshape(-1).clone()  # (keeps the padding of the last rank's slice)
            for piece in pieces:
                name = names[id(piece.param)]
                taken = source.local(name, weight_kind(source, name, values), piece.param)
                values[piece.offset:piece.offset + piece.length] = \
                    taken[piece.param_offset:piece.param_offset + piece.length]
            first = names[id(pieces[0].param)]
            keys = source.optimizer_keys(first)
            optimizer_state = dict(source.scalars.get(first, {}))  # (even without per-element state: counters)
            for key in keys:
                tensor = torch.zeros_like(values)
                for piece in pieces:
                    taken = source.local(names[id(piece.param)], OPTIM + key, piece.param)
                    tensor[piece.offset:piece.offset + piece.length] = \
                        taken[piece.param_offset:piece.param_offset + piece.length]
                optimizer_state[key] = tensor
            self._placement.write_master(index, master, optimizer, values, optimizer_state)
