"""DeepSpeed's ``engine.offload_states()`` / ``engine.reload_states()``: ZeRO states off the device between phases.

RLHF loops train one engine while another phase needs the device memory: the policy's optimizer state goes to the
host while it generates, a reference or critic model's parameters while the policy trains. The kinds of state are
DeepSpeed's ``OffloadStateTypeEnum`` (``zero/offloadable.py`` says what each one is at each stage); a move frees
the device storage and keeps the bytes in host memory, page-locked with ``pin_memory`` on CUDA
(``offload/storage_mover.py``), and ``reload_states`` puts them back into the same storage objects, so training
continues bit-identically to a run that never offloaded.

DeepSpeed's semantics, as its ``runtime/engine.py`` (``offload_states``, ``_refine_include_states``) and
``runtime/zero/stage3.py`` / ``stage_1_and_2.py`` define them (release 0.18):

* ``include=None`` moves every kind; a kind already moved is not moved again; ``reload_states()`` brings all back;
* ``device`` must be ``cpu``; ``none`` logs a warning and moves nothing; ``nvme`` is a ValueError;
* what ``offload_optimizer`` already keeps off the device (masters and optimizer state) is left out, silently in
  DeepSpeed, with a log line here; an engine with ``offload_param`` is refused, as DeepSpeed asserts;
* the call is local to the rank (no collective) and DeepSpeed never reloads by itself.

DeepSpeed does not check for use while states are away (a step then fails on mixed devices, or reads freed
memory). Here the phases that need a moved state refuse with one line naming it and ``reload_states()``:
``forward`` needs ``lp_params``; ``backward`` also ``lp_grads``; ``step``, checkpoints and pipeline batches every
kind but the scratch buffers. Nothing reloads implicitly: a hidden multi-GiB copy inside ``forward`` would move
the memory peak the caller offloaded to avoid. Tensors a script can reach (parameters, their ``.grad``, masters,
optimizer state) read their values from the host copy meanwhile, so logging or syncing weights still works.

Beyond DeepSpeed: every ZeRO stage 0-3 (DeepSpeed: 1-3), any torch optimizer (DeepSpeed's stage 3: FusedAdam
only), and an engine without an optimizer (its parameters can still move). The CUDA path (memory freed, pinned
buffers, the same losses after a reload) is checked by ``benchmarks/gpu_check.py``; the CPU tests run the same
code (``tests/test_offload_states.py``).
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING, Any, Iterable

import torch

from zerotune.monitor.logging import log_rank0
from zerotune.offload.storage_mover import MovedStorages, move_to_host, restore
from zerotune.zero.offloadable import SCRATCH_KINDS, STATE_KINDS, drop_scratch, kinds_off_device, prepare, tensors_of

if TYPE_CHECKING:
    from zerotune.config.schema import ZeroTuneConfig
    from zerotune.zero.contracts import ZeroStage

FORWARD_NEEDS = ("lp_params",)
BACKWARD_NEEDS = ("lp_params", "lp_grads")
STEP_NEEDS = ("lp_params", "lp_grads", "hp_params", "optim_states")
"""What a phase reads or writes: it refuses while any of these kinds is offloaded."""


def _name(value: Any) -> str:
    """A kind or device given as DeepSpeed's str enum, a string or a torch.device, as its plain name."""
    if isinstance(value, enum.Enum):
        value = value.value
    return str(value)


def state_kinds(include: Any) -> list[str]:
    """``include`` (None, one kind, or an iterable of kinds as strings or ``OffloadStateTypeEnum``) as names."""
    if include is None:
        return list(STATE_KINDS)
    items = [include] if isinstance(include, (str, enum.Enum)) else list(include)
    names = [_name(item) for item in items]
    unknown = [name for name in names if name not in STATE_KINDS]
    if unknown:
        raise ValueError(f"offload_states(include=...): unknown state {unknown[0]!r}; valid: {', '.join(STATE_KINDS)}")
    return names


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


class StateOffloading:
    """Mixed into ``EngineCore``; relies on the engine's attributes declared below."""

    if TYPE_CHECKING:  # set by EngineCore.__init__, or EngineQueries' properties
        state: ZeroStage
        optimizer: torch.optim.Optimizer | None
        module: torch.nn.Module
        _config: ZeroTuneConfig
        _offloaded: dict[str, MovedStorages | None]
        """kind -> its move (None for freed scratch)"""
        _pinned_host: dict[str, list[torch.Tensor]]
        """kind -> the page-locked buffers kept for the next move"""

        @property
        def device(self) -> torch.device: ...

        @property
        def global_rank(self) -> int: ...

    @property
    def offloaded_states(self) -> frozenset[str]:
        """The kinds ``offload_states`` moved off the device and ``reload_states`` has not brought back."""
        return frozenset(self._offloaded)

    def offload_states(self, include: Iterable[Any] | None = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move ``include`` (default: every kind) to host memory; see the module docstring for the rules."""
        target = _name(device)
        if target == "none":
            log_rank0("offload_states(device='none'): no device given; nothing moved", rank=self.global_rank,
                      level=logging.WARNING)
            return
        if target == "nvme":
            raise ValueError("offload_states(device='nvme'): moving states to NVMe is not supported (neither is it in "
                             "DeepSpeed); use device='cpu'")
        if target != "cpu":
            raise ValueError(f"offload_states(device={target!r}): states move to host memory; valid: 'cpu' "
                             "(OffloadDeviceEnum.cpu), or 'none' to move nothing")
        offload_param = self._config.zero_optimization.offload_param.device
        if offload_param != "none":
            raise RuntimeError(f"offload_states(): zero_optimization.offload_param.device is {offload_param!r}: the "
                               "parameters already live off the device and their states cannot move (DeepSpeed "
                               "refuses this too); set offload_param.device to 'none' to use offload_states")
        kinds = state_kinds(include)
        kept = kinds_off_device(self.state)
        named_kept = sorted(set(kinds) & set(kept)) if include is not None else []
        if named_kept:
            log_rank0("offload_states: %s left where they are: %s", ", ".join(named_kept), kept[named_kept[0]],
                      rank=self.global_rank)
        wanted = [kind for kind in STATE_KINDS if kind in kinds and kind not in kept and kind not in self._offloaded]
        if not wanted:
            return
        cuda = self.device.type == "cuda"
        prepare(self.state)
        if cuda:  # side streams (reductions, gathers) may still use what is about to be freed
            torch.cuda.synchronize(self.device)
        report = []
        for kind in wanted:
            if kind in SCRATCH_KINDS:
                self._offloaded[kind] = None
                report.append(f"{kind} ({_size(drop_scratch(self.state))} freed)")
                continue
            held = [buffer for moved in self._offloaded.values() if moved is not None for buffer in moved.host_buffers]
            moved = move_to_host(tensors_of(kind, self.state, self.optimizer, self.module), self.device,
                                 pin_memory=pin_memory, non_blocking=non_blocking,
                                 reuse=self._pinned_host.pop(kind, None), keep=held)
            self._offloaded[kind] = moved
            report.append(f"{kind} ({_size(moved.nbytes)})")
        if cuda:
            if not non_blocking:
                torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # (the freed blocks back to the driver, for another process or library)
        log_rank0("offload_states: moved to the host: %s", ", ".join(report), rank=self.global_rank,
                  level=logging.DEBUG)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Put every offloaded state back on the engine's device, into the storage it left (no-op if none is away)."""
        for kind, moved in reversed(list(self._offloaded.items())):
            if moved is None:  # freed scratch is allocated again when a reduction needs it
                continue
            restore(moved, non_blocking=non_blocking)
            pinned = [buffer for buffer in moved.host_buffers if buffer.is_pinned()]
            if pinned:  # kept for the next offload_states (DeepSpeed keeps its pinned buffers too)
                self._pinned_host[kind] = pinned
        self._offloaded.clear()

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: free every gathered ZeRO-3 parameter now (persistent ones too; each unit is gathered again
        at its next use), e.g. before handing the device to another phase. Stages 0-2 hold no gathered copies."""
        self.state.release_gathered()

    def state_devices(self, kind: Any) -> set[torch.device]:
        """Where ``kind`` lives now (DeepSpeed's ``get_state_devices``): the host while offloaded, nothing for freed
        scratch, else the devices of its tensors."""
        name = state_kinds(kind)[0]
        if name in self._offloaded:
            return set() if name in SCRATCH_KINDS else {torch.device("cpu")}
        if name in SCRATCH_KINDS:
            return {self.device}
        return {t.device for t in tensors_of(name, self.state, self.optimizer, self.module) if t.numel()}

    def _require_on_device(self, what: str, kinds: tuple[str, ...] = STEP_NEEDS) -> None:
        """Refuse ``what`` while a state it uses is offloaded (see the module docstring)."""
        away = [kind for kind in kinds if kind in self._offloaded]
        if away:
            raise RuntimeError(f"engine.{what}: {', '.join(away)} {'is' if len(away) == 1 else 'are'} offloaded to the "
                               "host by engine.offload_states(); call engine.reload_states() first")

