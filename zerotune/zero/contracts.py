"""The interfaces the engine and the checkpoint code rely on, declared once.

Three objects make up a ZeRO stage: a *gradient sync* (how gradients of a micro-step are reduced),
a *state* (masters, optimizer groups and the step phases) and a *master placement* (where the fp32
masters and optimizer state live). Every stage implements the same three contracts, so the engine
runs one step recipe and a checkpoint saves and loads any stage the same way; nothing outside a
stage reads its internals (flat groups, units, segments): a parameter's master, optimizer state and gradient
are reached through the state's fragment methods (``zero/fragments.py``). ``tests/test_zero_contracts.py`` checks
that each implementation provides them.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from zerotune.zero.held import HeldPiece


@runtime_checkable
class GradSync(Protocol):
    """Reduces the gradients of each micro-step; one per stage (all-reduce, reduce at the boundary,
    bucketed reduce-scatter, per-unit reduce-scatter)."""

    def begin_micro_step(self, is_boundary: bool) -> None: ...
    def finish(self) -> None: ...
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


@runtime_checkable
class ZeroState(Protocol):
    """Masters, optimizer groups and the step phases of one ZeRO stage, as the engine uses them."""

    grad_sync: Any
    placement: Any
    masters: list[torch.nn.Parameter]
    units: list
    """Stage 3's partitioned units (empty below stage 3)."""

    @property
    def params(self) -> list[torch.nn.Parameter]: ...
    def optimizer_groups(self, groups: Sequence[dict]) -> list[dict]: ...
    def step_grads(self) -> list[torch.Tensor]: ...
    def master_grads(self) -> list[torch.Tensor]:
        """Per master, the gradient of the elements it holds, in its layout: views of the gradient sync's buffers
        (writing one changes what the step uses), in the accumulation dtype."""
    def write_weight(self, param: torch.nn.Parameter, lo: int, values: torch.Tensor) -> None:
        """Round ``values`` into elements ``[lo, lo + n)`` of the flattened weight where this rank holds them."""
    def fragment_values(self, param: torch.nn.Parameter, optimizer: Any, key: str | None = None, *,
                        full: bool) -> torch.Tensor | None:
        """``param``'s fp32 master or optimizer state ``key``, whole (a collective) or this rank's piece
        (``zero/fragments.py``, as the three methods below)."""
    def set_fragment_values(self, param: torch.nn.Parameter, optimizer: Any, value: torch.Tensor,
                            key: str | None = None, *, full: bool) -> None: ...
    def fragment_grad(self, param: torch.nn.Parameter, *, full: bool) -> torch.Tensor | None: ...
    def set_fragment_grad(self, param: torch.nn.Parameter, value: torch.Tensor, *, full: bool) -> None: ...
    def grad_norm(self, grads: Sequence[torch.Tensor]) -> float: ...
    def attach(self, grads: Sequence[torch.Tensor], coefficient: float = 1.0) -> None: ...
    def update_model(self) -> None: ...
    def reload_from_model(self) -> None: ...
    def first_nonfinite_param(self, names: dict[int, str]) -> str: ...
    def master_bytes(self) -> int: ...
    def partitioned_param_bytes(self) -> int: ...
    def zero_grad(self) -> None: ...
    def master_pieces(self) -> list[list[HeldPiece]]:
        """Per master (in ``masters`` order), the parameter parts it holds: what a checkpoint saves by name."""
    def weight_pieces(self) -> list[tuple[Any, list[HeldPiece]]]:
        """Per partitioned weight shard (stage 3), the shard's holder and the parameter parts in it."""
    def state_dict(self, optimizer: torch.optim.Optimizer | None, names: dict[int, str], *, weights: bool,
                   masters: bool) -> dict:
        """What this rank holds, by parameter name and range (``zero/held.py``): loadable at any layout."""
    def load_state_dict(self, source: Any, optimizer: torch.optim.Optimizer | None, names: dict[int, str], *,
                        weights: bool = True, skip: set[str] = frozenset()) -> None:
        """Take what this rank holds now from a source of pieces saved at any layout."""
