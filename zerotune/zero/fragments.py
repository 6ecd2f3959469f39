"""One parameter's fp32 master, optimizer state and gradient, read and written wherever its ZeRO stage keeps them.

Tools address training state by model parameter (DeepSpeed's ``safe_get_full_fp32_param`` and friends,
``compat/tensor_fragment.py``), while a ZeRO state keeps it in flat holders cut at rank boundaries. Every
state already says what it holds -- ``master_pieces()``: which elements of which parameter sit where in each
master -- and where masters and optimizer state live (``placement.read_master`` / ``write_master``: with the
parameters, on the host, in swap files). So one implementation here serves every stage; a stage adds only
where its gradients are (``master_grads``; ``grad_sync.whole_grad`` where a rank holds a whole gradient) and
how a weight is written (``write_weight``).

*Full* values: each rank writes its pieces into a zeroed fp32 buffer of the parameter's size and one
all-reduce over the data-parallel group assembles them (at stages 1-3 each element has one holder, so the sum
is exact); stage 0 holds every master whole and needs none. The full getters are therefore collectives:
every rank calls them for the same parameters in the same order. *Local* values: this rank's piece, 1-D fp32,
maybe 0 elements; concatenated in rank order they are the flattened parameter (stage 0: each rank's is whole).
A parameter the state does not train (frozen) has none: getters return None, setters do nothing.

Gradients are what the step will use, loss scale included (fp16): after a boundary backward the reduced
mean -- the all-reduce or reduce-scatter that ``engine.step()`` would wait for is finished first
(``grad_sync.settle``) -- and before a boundary (gradient accumulation, ``no_sync``) at stages 0 and 1 this
rank's own accumulation, which is all there is yet; stages 2 and 3 reduce every micro-step.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace
from typing import Any, Iterable, cast

import torch
from torch.utils.weak import WeakIdKeyDictionary

from zerotune.distributed import comm
from zerotune.zero.contracts import ZeroStage
from zerotune.zero.pieces import HeldPiece

# a stand-in with no state (the placements read only ``state`` / ``param_groups``), typed as what they take
_NO_OPTIMIZER = cast(torch.optim.Optimizer, SimpleNamespace(state={}, param_groups=[]))
"""Stands in for an engine built without an optimizer: masters are still there to read and write."""


class ParamFragments(ZeroStage):
    """Per-parameter access to a ZeRO state's masters, optimizer state and gradients (see the module docstring).

    Mixed into each state, which provides ``params``, ``masters``, ``master_pieces()``, ``placement``,
    ``grad_sync``, ``master_grads()`` and, when its masters are sharded, ``group``."""

    group: Any  # the data-parallel process group, where ``shards_masters``

    """Whether each master element has one holder over the data-parallel group (stages 1-3), so full values
    are assembled by an all-reduce; False where every rank holds every master (stage 0)."""

    # ---- where a parameter's elements are --------------------------------------------------
    def _locate(self, param: torch.Tensor) -> tuple[int, HeldPiece | None] | None:
        """``(master index, this rank's piece)`` of a trained parameter (piece None: this rank holds none of
        it; index -1 then); None if the state does not train it."""
        index = getattr(self, "_fragment_index", None)
        if index is None or index[0] != len(self.masters):  # (built once the state is complete)
            pieces = {id(piece.param): (i, piece) for i, held in enumerate(self.master_pieces()) for piece in held}
            index = self._fragment_index = (len(self.masters), pieces, {id(p) for p in self.params})
        _, pieces, trained = index
        if id(param) not in trained:
            return None
        return pieces.get(id(param), (-1, None))

    def _assemble(self, param: torch.Tensor, piece: HeldPiece | None, local: torch.Tensor,
                  failure: ValueError | None = None) -> torch.Tensor:
        """The whole parameter-shaped fp32 tensor from every rank's ``local`` piece (a collective at stages 1-3).
        A rank's ``failure`` travels in one extra element, so every rank raises, none is left in a collective."""
        full = torch.zeros(param.numel() + 1, dtype=torch.float32, device=param.device)
        if piece is not None and failure is None:
            full[piece.param_offset:piece.param_offset + piece.length] = local
        full[-1] = failure is not None
        if self.shards_masters:
            comm.all_reduce(full, self.group)
        if failure is not None:
            raise failure
        if full[-1].item():
            raise ValueError(f"a parameter of shape {tuple(param.shape)}: another rank failed to read its piece")
        return full[:-1].view(param.shape)

    @staticmethod
    def _piece_of(param: torch.Tensor, piece: HeldPiece | None, value: torch.Tensor, *, full: bool,
                  what: str) -> torch.Tensor:
        """This rank's part of ``value`` (a whole parameter if ``full``, else this rank's piece), flattened: 0
        elements where this rank holds no piece."""
        expected = param.numel() if full else (piece.length if piece is not None else 0)
        if not isinstance(value, torch.Tensor) or value.numel() != expected:
            got = value.numel() if isinstance(value, torch.Tensor) else type(value).__name__
            scope = f"the whole parameter, shape {tuple(param.shape)}" if full else "this rank's piece"
            raise ValueError(f"{what}: the value has {got} elements; expected {expected} ({scope})")
        flat = value.detach().reshape(-1)
        if piece is None:
            return flat[:0]
        return flat[piece.param_offset:piece.param_offset + piece.length] if full else flat

    # ---- masters and optimizer state -------------------------------------------------------
    def _holder(self, index: int, optimizer: Any, key: str | None, param: torch.Tensor
                ) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """``(values, state, target)``: master ``index`` and its optimizer state as the placement gives them, and
        the tensor ``key`` names among them (the master itself for None)."""
        if key is not None and optimizer is None:
            raise ValueError(f"optimizer state '{key}': the engine has no optimizer")
        values, state = self._placement.read_master(index, self.masters[index], optimizer or _NO_OPTIMIZER)
        if key is None:
            return values, state, values
        target = state.get(key)
        if not isinstance(target, torch.Tensor) or target.numel() != values.numel():
            per_element = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor)
                                 and v.numel() == values.numel())
            reason = ("it is not per-element state" if key in state else
                      "the optimizer has no state for it yet (torch optimizers create theirs at the first step)"
                      if not state else "the optimizer keeps no such state")
            raise ValueError(f"optimizer state '{key}' of a parameter of shape {tuple(param.shape)}: {reason}; "
                             f"per-element keys: {per_element}")
        return values, state, target

    def fragment_values(self, param: torch.Tensor, optimizer: Any, key: str | None = None, *,
                        full: bool) -> torch.Tensor | None:
        """``param``'s fp32 master (``key`` None) or optimizer state ``key``: whole (``full``, a collective) or
        this rank's piece; a copy on the parameter's device. None if the state does not train ``param``."""
        located = self._locate(param)
        if located is None:
            return None
        index, piece = located
        local, failure = torch.zeros(0, dtype=torch.float32, device=param.device), None
        if piece is not None:
            try:
                _, _, target = self._holder(index, optimizer, key, param)
            except ValueError as error:
                if not full:
                    raise
                failure = error
            else:
                part = target.detach().reshape(-1)[piece.offset:piece.offset + piece.length]
                local = part.to(param.device, torch.float32, copy=True)
        return self._assemble(param, piece, local, failure) if full else local

    @torch.no_grad()
    def set_fragment_values(self, param: torch.Tensor, optimizer: Any, value: torch.Tensor, key: str | None = None,
                            *, full: bool) -> None:
        """Overwrite ``param``'s fp32 master (``key`` None) or optimizer state ``key`` with ``value`` (the whole
        parameter if ``full``, every rank passing the same; else this rank's piece). A new master is also rounded
        into the model's weights where this rank holds them, so the next forward and step use it; no
        communication. Nothing happens for a parameter the state does not train."""
        located = self._locate(param)
        if located is None:
            return
        index, piece = located
        what = "fp32 parameter" if key is None else f"optimizer state '{key}'"
        part = self._piece_of(param, piece, value, full=full, what=f"set {'full' if full else 'local'} {what}")
        if piece is not None:
            values, state, target = self._holder(index, optimizer, key, param)
            target.reshape(-1)[piece.offset:piece.offset + piece.length].copy_(part)
            self._placement.write_master(index, self.masters[index], optimizer or _NO_OPTIMIZER, values, state)
        if key is None and full:
            self.write_weight(param, 0, value.detach().reshape(-1))
        elif key is None and piece is not None:
            self.write_weight(param, piece.param_offset, part)

    def write_weight(self, param: torch.Tensor, lo: int, values: torch.Tensor) -> None:
        """Round ``values`` into elements ``[lo, lo + n)`` of the flattened weight, where this rank holds them:
        all of them below stage 3, whose weights are whole in the module (stage 3 overrides this)."""
        with torch.no_grad():
            param.data.view(-1)[lo:lo + values.numel()].copy_(values)

    # ---- gradients ----------------------------------------------------------------------------
    def _grad_target(self, param: torch.Tensor, index: int,
                     piece: HeldPiece | None) -> tuple[torch.Tensor, bool] | None:
        """``(tensor, whole)``: ``param``'s whole gradient on this rank (stage 0; stage 1 before the boundary), or
        the view of this rank's piece in its master's gradient; None if it holds neither."""
        self._grad_sync.settle()
        # (a located parameter is one of ``self.params``, the parameters the stage trains)
        whole = self._grad_sync.whole_grad(cast(torch.nn.Parameter, param))
        if whole is not None:
            return whole.reshape(-1), True
        if piece is None:
            return None
        return self.master_grads()[index].reshape(-1)[piece.offset:piece.offset + piece.length], False

    def fragment_grad(self, param: torch.Tensor, *, full: bool) -> torch.Tensor | None:
        """``param``'s gradient in fp32 (see the module docstring for which): whole (``full``; a collective where
        it is sharded) or this rank's piece. None if the state does not train ``param``."""
        located = self._locate(param)
        if located is None:
            return None
        index, piece = located
        target = self._grad_target(param, index, piece)
        grad = None
        if target is not None:
            grad, whole = target
            if whole:
                if full:
                    return grad.to(param.device, torch.float32, copy=True).view(param.shape)
                grad = grad[piece.param_offset:piece.param_offset + piece.length] if piece is not None else grad[:0]
        local = (grad.to(param.device, torch.float32, copy=True) if grad is not None
                 else torch.zeros(0, dtype=torch.float32, device=param.device))
        return self._assemble(param, piece, local) if full else local

    @torch.no_grad()
    def set_fragment_grad(self, param: torch.Tensor, value: torch.Tensor, *, full: bool) -> None:
        """Overwrite ``param``'s gradient (the whole parameter if ``full``, every rank passing the same; else this
        rank's piece): the next step uses it. Gradients staged to the host during backward are dropped, so the
        step copies the new ones. Nothing happens for a parameter the state does not train."""
        located = self._locate(param)
        if located is None:
            return
        index, piece = located
        part = self._piece_of(param, piece, value, full=full, what=f"set {'full' if full else 'local'} gradient")
        target = self._grad_target(param, index, piece)
        if target is not None:
            grad, whole = target
            if whole and full:
                grad.copy_(value.detach().reshape(-1))
            elif whole and piece is not None:
                grad[piece.param_offset:piece.param_offset + piece.length].copy_(part)
            elif not whole:  # (this rank's piece of its master's gradient)
                grad.copy_(part)
        self._placement.clear_staging()


# ---- which engine a parameter belongs to ------------------------------------------------------
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""parameter -> the engine that trains it. Weak both ways, so neither keeps the other alive; keyed by identity
(a tensor's ``==`` is elementwise), and nothing is set on the parameter itself (it pickles as before)."""


def register_owner(params: Iterable[torch.Tensor], owner: Any) -> None:
    """Record ``owner`` (an engine: ``.state``, ``.optimizer``) as the one training ``params`` (the latest wins)."""
    ref = weakref.ref(owner)
    for param in params:
        _OWNERS[param] = ref


def owner_of(param: torch.Tensor) -> Any:
    """The live engine registered for ``param``, or None."""
    ref = _OWNERS.get(param)
    return None if ref is None else ref()
