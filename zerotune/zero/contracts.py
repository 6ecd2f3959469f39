"""The one way into a ZeRO stage: ``ZeroStage``, the object the engines, the pipeline and checkpoints use.

A stage is built from three parts: a *gradient sync* (how the gradients of a micro-step are reduced), the
*state* (masters, optimizer groups, the step's phases) and a *master placement* (where the fp32 masters and
the optimizer state live). The stage object is the state; it owns its sync and placement privately
(``_grad_sync``, ``_placement``) and offers every operation the rest of the package needs, so no code outside
``zerotune/zero/`` names a concrete stage class or a stage number to choose behaviour: what differs between
stages is answered by the stage itself (``partitions_weights``, ``reduces_every_backward``, ...), and each
parameter's master, optimizer state and gradient is reached through the fragment methods
(``zero/fragments.py``).

Why an abstract base class and not a Protocol: the stages share concrete behaviour (the micro-step calls go to
the sync, one step is attach -> placement step -> round into the model), which an ABC holds once, and a stage
that lacks an operation fails when it is constructed rather than at the first call that needs it.
``GradSync`` and ``MasterPlacement`` stay Protocols: they are the stage's private parts, with several unrelated
implementations each (``tests/test_zero_contracts.py`` checks them, and that a fake stage drives an engine).
"""

from __future__ import annotations

import abc
from collections.abc import Set as AbstractSet
from typing import Any, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

from zerotune.zero.pieces import HeldPiece

TiedWeight = tuple[torch.nn.Parameter, dist.ProcessGroup | None]
"""A weight tied across pipeline stages and the group of the stages holding it: its gradient is summed there."""


@runtime_checkable
class GradSync(Protocol):
    """Reduces the gradients of each micro-step; one per stage (all-reduce, reduce at the boundary,
    bucketed reduce-scatter, per-unit reduce-scatter)."""

    reduces_every_backward: bool

    def begin_micro_step(self, is_boundary: bool) -> None: ...
    def finish(self, ties: Sequence[TiedWeight] = ()) -> None:
        """Complete the boundary's reduction; sum each tied weight's gradient over its group where this sync
        holds it (before its reduction or after, whichever leaves every holder the whole sum)."""
    def settle(self) -> None:
        """Between a boundary backward and the step, finish its reduction now (the step's ``finish`` then has
        nothing left), so gradients read or written there are the ones the step uses."""
    def whole_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """``param``'s whole gradient if this rank holds one (stage 0; stage 1 before the boundary), else None."""
    def zero_grad(self) -> None: ...
    def grad_bytes(self) -> int: ...
    def buffer_bytes(self) -> int: ...
    def remove_hooks(self) -> None: ...


@runtime_checkable
class MasterPlacement(Protocol):
    """Where the fp32 masters and the optimizer state live (with the parameters, host memory, NVMe files)."""

    resident: bool
    streams_grads: bool

    def optimizer_params(self, master_index: int, master: torch.nn.Parameter) -> list[torch.nn.Parameter]: ...
    def attach(self, masters: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor],
               coefficient: float) -> None: ...
    def step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def read_master(self, index: int, master: torch.nn.Parameter, optimizer: torch.optim.Optimizer
                    ) -> tuple[torch.Tensor, dict]: ...
    def write_master(self, index: int, master: torch.nn.Parameter, optimizer: torch.optim.Optimizer,
                     values: torch.Tensor, state: dict) -> None: ...
    def clear_staging(self) -> None: ...
    def grad_bytes(self) -> int: ...


class ZeroStage(abc.ABC):
    """One ZeRO stage: its gradient sync, masters, optimizer groups and step phases (module docstring)."""

    _grad_sync: GradSync
    _placement: MasterPlacement
    masters: list[torch.nn.Parameter]

    partitions_weights: bool = False
    """Whether the weights themselves are partitioned (stage 3): a forward gathers them, and ``units`` lists the
    partitioned units that savers and markers walk."""
    shards_masters: bool = False
    """Whether masters and optimizer state are partitioned over the data-parallel ranks (stages 1-3)."""
    units: Sequence[Any] = ()
    """Stage 3's partitioned units (``zero/stage3/unit.py``); empty below stage 3."""

    @property
    def reduces_every_backward(self) -> bool:
        """Whether every backward reduces gradients to their owners (stages 2 and 3), not only a boundary's: such
        a stage cannot accumulate locally (``no_sync``) and each of its backwards communicates."""
        return self._grad_sync.reduces_every_backward

    # ---- a micro-step and the step -------------------------------------------------------
    def begin_micro_step(self, is_boundary: bool) -> None:
        """Before a backward: whether it ends the optimizer step (only then do stages 0/1 communicate)."""
        self._grad_sync.begin_micro_step(is_boundary)

    def finish(self, ties: Sequence[TiedWeight] = ()) -> None:
        """At the boundary, before the step: the reduction complete, tied weights' gradients summed."""
        self._grad_sync.finish(ties)

    def settle(self) -> None:
        self._grad_sync.settle()

    def step(self, optimizer: torch.optim.Optimizer, grads: Sequence[torch.Tensor], coefficient: float) -> None:
        """One optimizer step on the masters with ``grads`` (``step_grads()``) times ``coefficient`` (unscale and
        clip in one factor), then the new masters rounded into the model."""
        self.attach(grads, coefficient)
        self._placement.step(optimizer)
        self.update_model()

    def use_local_gradients(self, enabled: bool) -> None:
        """Skip the gradient reduction (each rank steps on its own gradient: OneBitAdam after its warm-up)."""
        if enabled:
            raise NotImplementedError(f"{type(self).__name__} reduces every gradient; per-rank (local) gradients "
                                      "need ZeRO stage 0")

    def grad_bytes(self) -> int:
        """Bytes of the gradients this rank keeps for the step."""
        return self._grad_sync.grad_bytes()

    def buffer_bytes(self) -> int:
        """Bytes of communication scratch (buckets, reduce buffers)."""
        return self._grad_sync.buffer_bytes()

    def remove_hooks(self) -> None:
        """Detach everything the stage hooked into the model (the engine's ``destroy()``)."""
        self._grad_sync.remove_hooks()

    # ---- stage 3's module hooks and gathered copies (nothing to do below it) ----------------
    def release_gathered(self) -> None:  # noqa: B027 (a no-op below stage 3, not abstract)
        """Free every gathered copy of a partitioned weight now (each is gathered again when next used)."""

    def detach_forward_hooks(self) -> None:  # noqa: B027 (a no-op below stage 3, not abstract)
        """Stop gathering in forward (the caller gathers itself: generation under ``GatheredParameters``)."""

    def attach_forward_hooks(self) -> None:  # noqa: B027 (a no-op below stage 3, not abstract)
        """Gather in forward again after ``detach_forward_hooks``."""

    def forward_hook_handles(self) -> list[Any]:
        """The handles of the hooks that gather weights in forward (empty below stage 3)."""
        return []

    # ---- what each stage provides ----------------------------------------------------------
    @property
    @abc.abstractmethod
    def params(self) -> list[torch.nn.Parameter]:
        """The trainable parameters, in model order."""

    @abc.abstractmethod
    def optimizer_groups(self, groups: Sequence[dict]) -> list[dict]:
        """The user's param groups with each parameter replaced by what the optimizer steps (its master)."""

    @abc.abstractmethod
    def step_grads(self) -> list[torch.Tensor]:
        """The gradients the step uses, one per master (for the norm and ``step``)."""

    @abc.abstractmethod
    def master_grads(self) -> list[torch.Tensor]:
        """Per master, the gradient of the elements it holds, in its layout: views of the gradient sync's buffers
        (writing one changes what the step uses), in the accumulation dtype."""

    @abc.abstractmethod
    def write_weight(self, param: torch.nn.Parameter, lo: int, values: torch.Tensor) -> None:
        """Round ``values`` into elements ``[lo, lo + n)`` of the flattened weight where this rank holds them."""

    @abc.abstractmethod
    def fragment_values(self, param: torch.nn.Parameter, optimizer: Any, key: str | None = None, *,
                        full: bool) -> torch.Tensor | None:
        """``param``'s fp32 master or optimizer state ``key``, whole (a collective) or this rank's piece."""

    @abc.abstractmethod
    def set_fragment_values(self, param: torch.nn.Parameter, optimizer: Any, value: torch.Tensor,
                            key: str | None = None, *, full: bool) -> None: ...

    @abc.abstractmethod
    def fragment_grad(self, param: torch.nn.Parameter, *, full: bool) -> torch.Tensor | None: ...

    @abc.abstractmethod
    def set_fragment_grad(self, param: torch.nn.Parameter, value: torch.Tensor, *, full: bool) -> None: ...

    @abc.abstractmethod
    def grad_norm(self, grads: Sequence[torch.Tensor]) -> float:
        """The global L2 norm of ``grads`` over every rank holding a part of them (the same on every rank)."""

    @abc.abstractmethod
    def attach(self, grads: Sequence[torch.Tensor], coefficient: float = 1.0) -> None:
        """Hand ``grads`` (scaled by ``coefficient``) to the masters for the optimizer."""

    @abc.abstractmethod
    def update_model(self) -> None:
        """Round the masters into the model's weights (and gather them where the weights are whole)."""

    @abc.abstractmethod
    def reload_from_model(self) -> None:
        """Take the masters from the model's weights again (after a script wrote the weights)."""

    @abc.abstractmethod
    def first_nonfinite_param(self, names: dict[int, str]) -> str:
        """The name of the first parameter with a non-finite gradient (a collective)."""

    @abc.abstractmethod
    def master_bytes(self) -> int: ...

    @abc.abstractmethod
    def partitioned_param_bytes(self) -> int: ...

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    @abc.abstractmethod
    def master_pieces(self) -> list[list[HeldPiece]]:
        """Per master (in ``masters`` order), the parameter parts it holds: what a checkpoint saves by name."""

    @abc.abstractmethod
    def weight_pieces(self) -> list[tuple[Any, list[HeldPiece]]]:
        """Per partitioned weight shard (stage 3), the shard's holder and the parameter parts in it."""

    @abc.abstractmethod
    def state_dict(self, optimizer: torch.optim.Optimizer | None, names: dict[int, str], *, weights: bool,
                   masters: bool) -> dict:
        """What this rank holds, by parameter name and range (``zero/held.py``): loadable at any layout."""

    @abc.abstractmethod
    def load_state_dict(self, source: Any, optimizer: torch.optim.Optimizer | None, names: dict[int, str], *,
                        weights: bool = True, skip: AbstractSet[str] = frozenset()) -> None:
        """Take what this rank holds now from a source of pieces saved at any layout."""
