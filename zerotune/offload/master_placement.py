"""Where the fp32 master weights and the optimizer state live: with the parameters, or on the host.

``offload_optimizer: {device: cpu}`` (ZeRO-Offload) keeps them in host memory -- page-locked when
CUDA is present, so the copies can overlap -- and the optimizer steps there: gradients are
copied to the host before the step and the updated masters back into the model's shards after
it. On a CPU-only machine the host *is* the device, and the same path runs (separate masters,
the same copies), so it is tested here. Offload changes where state lives, never the numbers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from zerotune.distributed.streams import host_wait, phase, streams_for
from zerotune.offload.cpu_step import step_threads
from zerotune.offload.pinned import track_pinned

ShardWriter = Callable[[int, torch.Tensor], None]
"""``writer(lo, values)``: write ``values`` at offset ``lo`` of the model shard a master rounds into."""


@dataclass
class MasterPlacement:
    """``device`` None: masters with the parameters (views of them in fp32); else that (host) device."""

    device: torch.device | None = None
    pin_memory: bool = False
    always_separate: bool = False
    """Separate masters even in fp32 without offload (the shards they would view live in files)."""
    step_threads: int | None = None
    """Torch threads for an offloaded (host) optimizer step; the ranks' training threads are restored after."""
    _grads: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _staging: list[torch.Tensor] = field(default_factory=list, repr=False)
    _expected: list[int] = field(default_factory=list, repr=False)
    _staged: list[int] = field(default_factory=list, repr=False)
    _staged_event: object = field(default=None, repr=False)  # the copy stream's event after the last staged copy
    staged_steps: int = 0
    """Optimizer steps whose gradients were all copied to the host during backward."""

    resident = True
    """Whether the masters hold their values in memory (NVMe offload keeps them in files)."""

    @property
    def offloaded(self) -> bool:
        return self.device is not None

    def adopt(self, masters: Sequence[torch.Tensor], shard_writers: Sequence[ShardWriter]) -> None:
        """Take charge of the masters once built; ``shard_writers[i](lo, values)`` rounds part of master i
        into the model's shard (used when the masters are stepped where the model cannot see them)."""

    def optimizer_params(self, master_index: int, master: torch.nn.Parameter) -> list[torch.nn.Parameter]:
        """What the optimizer steps for master ``master_index`` (NVMe offload: one proxy per chunk)."""
        return [master]

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.step_threads is None:
            optimizer.step()
            return
        with step_threads(self.step_threads):  # the host's cores, shared by this machine's ranks
            optimizer.step()

    def separate_masters(self, mixed_precision: bool) -> bool:
        """Whether masters are a copy (mixed precision, or living elsewhere) rather than views of the shards."""
        return mixed_precision or self.offloaded or self.always_separate

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """An fp32 copy of ``tensor`` where the masters live."""
        device = self.device or tensor.device
        master = torch.empty(tensor.shape, dtype=torch.float32, device=device,
                             pin_memory=self.pin_memory and device.type == "cpu" and torch.cuda.is_available())
        return track_pinned(master).copy_(tensor)

    # ---- checkpoints: one master's values and optimizer state, wherever they live -----------
    def read_master(self, index: int, master: torch.nn.Parameter, optimizer: torch.optim.Optimizer
                    ) -> tuple[torch.Tensor, dict]:
        """Master ``index``'s fp32 values and its optimizer state (tensors of its shape, and scalars)."""
        return master.detach(), dict(optimizer.state.get(master, {}))

    @torch.no_grad()
    def write_master(self, index: int, master: torch.nn.Parameter, optimizer: torch.optim.Optimizer,
                     values: torch.Tensor, state: dict) -> None:
        """Overwrite master ``index`` and replace its optimizer state (``state`` as ``read_master`` gives it)."""
        master.copy_(values.view(master.shape))
        if state:
            optimizer.state[master] = {key: _placed(value, master, optimizer) for key, value in state.items()}
        else:
            optimizer.state.pop(master, None)

    streams_grads = False
    """True: ``step_grads`` may hand over gradients in the model dtype, converted chunk by chunk in the step."""

    def attach(self, masters: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor], coefficient: float) -> None:
        """Unscale/clip (``grads * coefficient``) and give each master its gradient, where the master lives."""
        if coefficient != 1.0:
            torch._foreach_mul_(list(grads), coefficient)
        for master, grad in zip(masters, self.grads_for(masters, grads)):
            master.grad = grad
        self.clear_staging()

    def grads_for(self, masters: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients where the masters are (host copies into reused buffers when offloading)."""
        if not self.offloaded:
            return list(grads)
        placed = []
        on_device = next((g.device for g in grads if g.device.type != "cpu"), None)
        streams = streams_for(on_device) if on_device is not None else None
        with phase("offload_copy"), (streams.on("copy") if streams is not None else contextlib.nullcontext()):
            for master, grad in zip(masters, grads):
                if grad.device == master.device and grad.dtype == master.dtype:  # staged, or already on the host
                    placed.append(grad)
                    continue
                buffer = self._grads.get(id(master))
                if buffer is None or buffer.shape != master.shape:
                    buffer = self._grads[id(master)] = torch.empty_like(master)
                placed.append(buffer.copy_(grad, non_blocking=buffer.is_pinned()))
        if streams is not None:
            host_wait(streams.mark("copy"))  # the host step reads the copies next: wait for them, not the device
        return placed

    # ---- gradients copied to the host during backward (ZeRO-Offload's overlap) -------------
    def enable_staging(self, masters: Sequence[torch.Tensor], expected: Sequence[int]) -> None:
        """Host fp32 gradient buffers, one per master, filled by ``stage`` as backward finishes each part
        (``expected[i]``: how many of master i's elements get a gradient). Only when offloading to the host."""
        if not (self.offloaded and self.resident):
            return
        pin = self.pin_memory and torch.cuda.is_available()
        self._staging = [track_pinned(torch.zeros(m.shape, dtype=torch.float32, device=self.device, pin_memory=pin))
                         for m in masters]
        self._expected = list(expected)
        self._staged = [0] * len(masters)

    def stage(self, master_index: int, lo: int, grad: torch.Tensor) -> None:
        """The final gradient of ``[lo, lo + n)`` of master ``master_index`` (last micro-step): copy it to the
        host now, asynchronously into pinned memory with CUDA, while backward goes on."""
        if not self._staging:
            return
        buffer = self._staging[master_index]
        streams = streams_for(grad.device)
        # on the copy stream, behind the reduction that produced ``grad`` (the backward goes on meanwhile)
        with phase("offload_copy"), streams.on("copy", after=streams.mark("reduce")):
            buffer[lo:lo + grad.numel()].copy_(grad, non_blocking=buffer.is_pinned())
        self._staged_event = streams.mark("copy")
        self._staged[master_index] += grad.numel()

    def staged_grads(self) -> list[torch.Tensor] | None:
        """The host gradients if backward staged all of them, else None (the step copies them instead)."""
        if not self._staging or self._staged != self._expected:
            return None
        host_wait(self._staged_event)  # the copy stream is in order: its last event covers every staged copy
        self._staged_event = None
        self.staged_steps += 1
        return list(self._staging)

    def refresh(self, master_index: int, values: torch.Tensor) -> None:
        """Overwrite master ``master_index`` where it is not resident (NVMe offload): a resident master is copied
        into by its state."""
        raise NotImplementedError(f"{type(self).__name__} keeps its masters in memory: copy into them directly")

    def clear_staging(self) -> None:
        self._staged = [0] * len(self._staging)

    def grad_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self._grads.values(), *self._staging])


def _placed(value: object, param: torch.nn.Parameter, optimizer: torch.optim.Optimizer) -> object:
    """An optimizer state value where the optimizer expects it: per-element state with the parameter; a
    scalar ``step`` on the host unless the group is fused or capturable (torch's own convention)."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() > 0 and value.numel() == param.numel():
        return value.reshape(param.shape).to(param.device)
    if value.dim() > 0:  # a per-group counter kept as a one-element tensor (held.py saves it with the scalars)
        return value.to(param.device, copy=True)
    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), {})
    on_device = group.get("fused") or group.get("capturable")
    return value.to(param.device if on_device else "cpu", copy=True)  # its own: optimizers count steps in place
