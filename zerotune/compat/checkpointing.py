"""``deepspeed.checkpointing`` (and ``zerotune.checkpointing``): activation checkpointing plus Megatron's
model-parallel RNG tracker.

The checkpointing itself is ``zerotune.parallel.activation_checkpointing``, re-exported here under DeepSpeed's
names, with the zerotune extension that checkpoints a model's transformer blocks
(``apply_activation_checkpointing``, ``parallel/block_checkpointing.py``).

The tracker keeps named RNG states (Megatron's "model-parallel-rng": a different dropout stream
per tensor-parallel rank) and swaps one in for a block with ``fork()``. It tracks the CUDA
generator with a GPU and the CPU generator without one, so the same script runs on both.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from zerotune.distributed.mesh import latest_mesh
from zerotune.parallel.activation_checkpointing import (
    CheckpointPolicy,
    checkpoint,
    configure,
    configured_policy,
    is_configured,
    non_reentrant_checkpoint,
    policy_from_section,
    reset,
)
from zerotune.parallel.block_checkpointing import (
    apply_activation_checkpointing,
    checkpointed_module_names,
    remove_activation_checkpointing,
)

_MODEL_PARALLEL_RNG = "model-parallel-rng"

__all__ = ["checkpoint", "configure", "is_configured", "reset", "non_reentrant_checkpoint", "get_cuda_rng_tracker",
           "model_parallel_cuda_manual_seed", "CudaRNGStatesTracker", "CheckpointPolicy",
           "apply_activation_checkpointing", "checkpointed_module_names", "configured_policy", "policy_from_section",
           "remove_activation_checkpointing"]


def _get_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class CudaRNGStatesTracker:
    """Named RNG states; ``fork(name)`` runs a block on that state and saves where it got to."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists in the tracker")
        self.seeds_.add(seed)
        original = _get_state()
        torch.manual_seed(seed) if not torch.cuda.is_available() else torch.cuda.manual_seed(seed)
        self.states_[name] = _get_state()
        _set_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not in the tracker; add it first (model_parallel_cuda_manual_seed)")
        original = _get_state()
        _set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_state()
            _set_state(original)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Megatron's seeding: the default generator gets ``seed`` on every tensor-parallel rank; the
    tracker's model-parallel state gets ``seed + 2718 + tp_rank`` (different dropout per rank)."""
    mesh = latest_mesh()
    tp_rank = mesh.rank("tp") if mesh is not None else 0
    _TRACKER.reset()
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    _TRACKER.add(_MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)
