"""``deepspeed.checkpointing`` (and ``zerotune.checkpointing``): activation checkpointing plus Megatron's
model-parallel RNG tracker.

The checkpointing itself is ``zerotune.parallel.activation_checkpointing``, re-exported here under DeepSpeed's
names, with the zerotune extension that checkpoints a model's transformer blocks
(``apply_activation_checkpointing``, ``parallel/block_checkpointing.py``).

DeepSpeed's module globals (``PARTITION_ACTIVATIONS``, ``CONTIGUOUS_CHECKPOINTING``, ``num_layers``,
``CPU_CHECKPOINT``, ``SYNCHRONIZE``, ``PROFILE_TIME``, ``mpu``, ``deepspeed_checkpointing_enabled``) read the
policy in force, so they follow ``configure()`` and the running engine as DeepSpeed's follow its
``configure()``. Assigning one reconfigures that one setting (what the policy refuses is refused);
assigning the value already in force changes nothing, so code that saves and restores them is harmless.

The tracker keeps named RNG states (Megatron's "model-parallel-rng": a different dropout stream
per tensor-parallel rank) and swaps one in for a block with ``fork()``. It tracks the CUDA
generator with a GPU and the CPU generator without one, so the same script runs on both.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any, Iterator

import torch

from zerotune.config import NotSupportedYetError
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


# DeepSpeed's global -> (the policy's field, configure()'s keyword)
_POLICY_GLOBALS = {
    "PARTITION_ACTIVATIONS": ("partition_activations", "partition_activations"),
    "CONTIGUOUS_CHECKPOINTING": ("contiguous_memory_optimization", "contiguous_checkpointing"),
    "num_layers": ("number_checkpoints", "num_checkpoints"),
    "CPU_CHECKPOINT": ("cpu_checkpointing", "checkpoint_in_cpu"),
    "SYNCHRONIZE": ("synchronize_checkpoint_boundary", "synchronize"),
    "PROFILE_TIME": ("profile", "profile"),
}


def _policy_global(name: str) -> property:
    field, _ = _POLICY_GLOBALS[name]

    def read(module: types.ModuleType) -> Any:
        return getattr(configured_policy(), field)

    def write(module: types.ModuleType, value: Any) -> None:
        if value == read(module):
            return
        policy = configured_policy()
        keywords = {keyword: getattr(policy, f) for f, keyword in _POLICY_GLOBALS.values()}
        keywords[_POLICY_GLOBALS[name][1]] = value
        configure(None, **keywords)

    return property(read, write, doc=f"DeepSpeed's {name}: the policy in force's {field}")


def _read_mpu(module: types.ModuleType) -> None:
    return None  # configure() refuses an mpu


def _write_mpu(module: types.ModuleType, value: Any) -> None:
    if value is not None:
        raise NotSupportedYetError("mpu", "a Megatron mpu is not supported yet (tensor parallelism lands in a later "
                                          "release); leave deepspeed.checkpointing.mpu as None")


def _read_enabled(module: types.ModuleType) -> bool:
    return is_configured()


def _write_enabled(module: types.ModuleType, value: Any) -> None:
    if bool(value) != is_configured():
        raise AttributeError("deepspeed.checkpointing.deepspeed_checkpointing_enabled follows configure() and the "
                             "engine's activation_checkpointing section; call configure(None, ...) instead")


class _CheckpointingModule(types.ModuleType):
    """This module, with DeepSpeed's globals as views of the policy (see the module docstring)."""

    PARTITION_ACTIVATIONS = _policy_global("PARTITION_ACTIVATIONS")
    CONTIGUOUS_CHECKPOINTING = _policy_global("CONTIGUOUS_CHECKPOINTING")
    num_layers = _policy_global("num_layers")
    CPU_CHECKPOINT = _policy_global("CPU_CHECKPOINT")
    SYNCHRONIZE = _policy_global("SYNCHRONIZE")
    PROFILE_TIME = _policy_global("PROFILE_TIME")
    mpu = property(_read_mpu, _write_mpu, doc="DeepSpeed's mpu global: always None here")
    deepspeed_checkpointing_enabled = property(_read_enabled, _write_enabled, doc="DeepSpeed's: is_configured()")


sys.modules[__name__].__class__ = _CheckpointingModule
