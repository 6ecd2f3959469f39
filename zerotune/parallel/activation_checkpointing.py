"""Activation checkpointing: keep a region's inputs, recompute its activations during backward.

Two ways in, one mechanism (``torch.utils.checkpoint`` with ``use_reentrant=False`` and
``preserve_rng_state=True``, so dropout draws the same mask in the recompute and losses and gradients
equal an uncheckpointed run exactly):

- DeepSpeed's global API, ``checkpoint(function, *args)`` after ``configure(...)`` (reached as
  ``zerotune.checkpointing``); the policy in force is the running engine's (below).
- ``apply_activation_checkpointing(model)`` (``block_checkpointing.py``): replaces the ``forward`` of every
  transformer block (classes named in a Hugging Face model's ``_no_split_modules``, or an explicit list) by a
  checkpointed call, optionally only ``number_checkpoints`` evenly spaced blocks; reversible.

Why ``module.forward`` and not ``module.__call__``: forward pre/post hooks (ZeRO stage 3 gathers and
releases a block's parameters in them) run once, for the real forward, outside the checkpoint. The
recompute calls the original ``forward`` directly, so **the block's own hooks do not run during
recompute**. Stage 3 needs none there: its hook on the block's outputs re-gathers the block when backward
reaches it, which is before autograd asks for the block's saved tensors and so before the recompute.
Submodules *inside* a checkpointed block are called normally during the recompute, so their hooks do
run, inside backward (``torch._C._current_graph_task_id() != -1``).

``cpu_checkpointing``: the region's positional tensor inputs (for a transformer block, its hidden
states: the only activation checkpointing keeps) are saved through ``saved_tensors_hooks`` into host
memory (pinned for CUDA tensors, copied asynchronously) and moved back when the recompute needs them.
Parameters passed as inputs stay where they are. Keyword tensor inputs are held by torch's recompute
closure and stay on their device (HF blocks take hidden states positionally). On a CPU-only machine the
inputs are still copied, so the path is the same one an accelerator runs.

Whose policy: each engine owns one, from its ``activation_checkpointing`` section (``engine_guards.py``), so
two engines in one process keep theirs. A region checkpointed without an explicit policy follows, in order:
the engine whose blocks ``initialize`` wrapped (wherever the block is called from); else the engine whose
method is running, or that ran last (``guard_scope.engine_scope``); else ``configure()``'s. A direct
``configure()`` call after an engine was built overrides that engine's section, as it did when one global
policy held the latest of ``initialize`` and ``configure`` (Megatron-style scripts call it that way).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint

from zerotune.config import (
    ActivationCheckpointingConfig,
    ConfigError,
    NotSupportedYetError,
    ZeroTuneConfig,
    load_config,
)
from zerotune.distributed.guard_scope import GuardScope, engine_scope, next_serial
from zerotune.monitor.logging import log_rank0

SECTION = "activation_checkpointing"


class ContiguousCheckpointingError(ConfigError, AssertionError):
    """contiguous_memory_optimization without what it needs. Also an ``AssertionError``: DeepSpeed's
    ``configure()`` asserts both needs, so code written against DeepSpeed catches that."""


@dataclass(frozen=True)
class CheckpointPolicy:
    """How checkpointed regions store and time their activations (the ``activation_checkpointing`` section)."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "number_checkpoints":
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                    raise ConfigError(f"{SECTION}.number_checkpoints",
                                      f"{value!r} is not a positive integer (or null for every block)")
            elif not isinstance(value, bool):
                raise ConfigError(f"{SECTION}.{f.name}", f"{value!r} is not a boolean")
        # DeepSpeed's order: what contiguous_memory_optimization needs, then whether partitioning is available
        if self.contiguous_memory_optimization and not self.partition_activations:
            raise ContiguousCheckpointingError(f"{SECTION}.contiguous_memory_optimization",
                                               "true needs partition_activations: true (as in DeepSpeed), which is "
                                               "not supported yet; set it to false")
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise ContiguousCheckpointingError(f"{SECTION}.contiguous_memory_optimization",
                                               "true needs number_checkpoints: the number of layers checkpointed in "
                                               "a forward, which sizes the contiguous buffer")
        if self.partition_activations:
            raise NotSupportedYetError(f"{SECTION}.partition_activations",
                                       "true needs tensor parallelism, which is not supported yet; set it to false "
                                       "(cpu_checkpointing moves checkpointed activations off the device without it)")


def policy_from_section(section: ActivationCheckpointingConfig) -> CheckpointPolicy:
    """The policy a config section asks for; an unresolved "auto" takes the schema default (as resolve_config does)."""
    values = {}
    for f in fields(CheckpointPolicy):
        value = getattr(section, f.name)
        values[f.name] = type(section).model_fields[f.name].get_default() if value == "auto" else value
    return CheckpointPolicy(**values)


# ---- DeepSpeed's global API ---------------------------------------------------------------
_configured_policy: CheckpointPolicy | None = None
_configured_at = 0  # guard_scope.next_serial() at the last configure() call


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> CheckpointPolicy:
    """``deepspeed.checkpointing.configure``: defaults, then ``deepspeed_config``'s section, then the keywords.

    ``deepspeed_config``: a config file path, a config dict, a ``ZeroTuneConfig`` or its
    ``ActivationCheckpointingConfig`` section. Returns the policy now in force.
    """
    global _configured_policy, _configured_at
    if mpu_ is not None:
        raise NotSupportedYetError("mpu", "a Megatron mpu is not supported yet (tensor parallelism lands in a later "
                                          "release); call configure(None, ...)")
    base = CheckpointPolicy() if deepspeed_config is None else policy_from_section(_section_of(deepspeed_config))
    overrides = {"partition_activations": partition_activations,
                 "contiguous_memory_optimization": contiguous_checkpointing,
                 "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
                 "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    values = {f.name: getattr(base, f.name) for f in fields(CheckpointPolicy)}
    values.update({key: value for key, value in overrides.items() if value is not None})
    _configured_policy = CheckpointPolicy(**values)
    _configured_at = next_serial()
    return _configured_policy


def _section_of(deepspeed_config: Any) -> ActivationCheckpointingConfig:
    if isinstance(deepspeed_config, ActivationCheckpointingConfig):
        return deepspeed_config
    if isinstance(deepspeed_config, ZeroTuneConfig):
        return deepspeed_config.activation_checkpointing
    if isinstance(deepspeed_config, (str, Path, Mapping)):
        return load_config(deepspeed_config).activation_checkpointing
    raise TypeError(f"configure(deepspeed_config=...) got {type(deepspeed_config).__name__}; expected a config file "
                    "path, a config dict, a ZeroTuneConfig or an ActivationCheckpointingConfig")


def is_configured() -> bool:
    """``deepspeed.checkpointing.is_configured``: whether ``configure`` was called, or an engine built, in this
    process (DeepSpeed's initialize configures it)."""
    scope = engine_scope()
    return _configured_policy is not None or (scope is not None and scope.checkpoint_policy is not None)


def configured_policy() -> CheckpointPolicy:
    """The policy in force now: the running (else the newest) engine's, or ``configure``'s where that came later,
    or the defaults (plain checkpointing) before either (see the module docstring)."""
    return policy_in_force(engine_scope())


def policy_in_force(scope: GuardScope | None) -> CheckpointPolicy:
    """``scope``'s engine's policy, unless ``configure`` was called after that engine was built (or there is no
    engine, or it has none): then ``configure``'s, or the defaults."""
    if scope is not None and scope.checkpoint_policy is not None and scope.serial > _configured_at:
        return scope.checkpoint_policy
    return _configured_policy if _configured_policy is not None else CheckpointPolicy()


def reset() -> None:
    """``deepspeed.checkpointing.reset``: release buffers kept between a forward and its backward.

    DeepSpeed keeps such buffers only for contiguous_memory_optimization (which needs
    partition_activations, not supported yet); here every saved input lives with its autograd graph
    and is freed with it, so there is nothing to release. Kept because Megatron-style loops call it
    after evaluation forwards; it deliberately leaves the configured policy in place.
    """


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """``deepspeed.checkpointing.checkpoint``: ``function(*args, **kwargs)``, its activations recomputed in backward."""
    return run_checkpointed(function, args, kwargs, configured_policy(), _name_of(function))


def non_reentrant_checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """``deepspeed.checkpointing.non_reentrant_checkpoint``: the same mechanism as ``checkpoint``, which is
    non-reentrant too. A function of its own because DeepSpeed's pipeline tells the two apart by identity: with
    ``checkpoint`` (DeepSpeed's reentrant one) the engine makes the first stage's inputs require grad."""
    return run_checkpointed(function, args, kwargs, configured_policy(), _name_of(function))


def run_checkpointed(function: Callable, args: tuple, kwargs: dict, policy: CheckpointPolicy, name: str) -> Any:
    """One checkpointed call under ``policy``; without autograd recording it is a plain call."""
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    if policy.profile or policy.synchronize_checkpoint_boundary:
        function = _at_boundaries(function, policy, name)
    with _inputs_to_host() if policy.cpu_checkpointing else nullcontext():
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def _inputs_to_host() -> torch.autograd.graph.saved_tensors_hooks:
    """Hooks that see exactly the checkpoint's saved inputs (inside the region torch's own hooks take over)."""
    return torch.autograd.graph.saved_tensors_hooks(_pack_to_host, _unpack_from_host)


def _pack_to_host(tensor: torch.Tensor) -> tuple[torch.device | None, torch.Tensor]:
    if isinstance(tensor, torch.nn.Parameter):
        return None, tensor  # weights stay put: copying them would only duplicate them
    on_cuda = tensor.device.type == "cuda"
    host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=on_cuda)
    host.copy_(tensor, non_blocking=on_cuda)  # same stream as the recompute's copy back: ordered, no sync needed
    return tensor.device, host


def _unpack_from_host(packed: tuple[torch.device | None, torch.Tensor]) -> torch.Tensor:
    device, host = packed
    return host if device is None else host.to(device, non_blocking=True)


def _at_boundaries(function: Callable, policy: CheckpointPolicy, name: str) -> Callable:
    """``function`` with device synchronization and/or timing around its forward and each recompute."""
    calls = 0

    def bounded(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        phase = "forward" if calls == 0 else "recompute"
        calls += 1
        _synchronize()
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:  # the recompute ends in an exception once it produced what backward needs (early stop)
            _synchronize()
            if policy.profile:
                log_rank0("activation checkpoint %s: %s %.3f ms", name, phase, 1e3 * (time.perf_counter() - start),
                          rank=process_rank())
    return bounded


def _synchronize() -> None:
    # Timing asynchronous CUDA work needs it; on CPU there is nothing to wait for.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def process_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _name_of(function: Callable) -> str:
    return getattr(function, "__qualname__", None) or type(function).__name__
