"""Where the fp32 master weights and the optimizer state live: with the parameters, or on the host.

``offload_optimizer: {device: cpu}`` (ZeRO-Offload) keeps them in host memory -- page-locked when
CUDA is present, so the copies can overlap -- and the optimizer steps there: gradients are
copied to the host before the step and the updated masters back into the model's shards after
it. On a CPU-only machine the host *is* the device, and the same path runs (separate masters,
the same copies), so it is tested here. Offload changes where state lives, never the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from zerotune.offload.cpu_step import step_threads


ShardWriter = Callable[[int, torch.Tensor], None]
"""``writer(lo, values)``: write ``values`` at offset ``lo`` of the model shard a master rounds into."""


@dataclass
class MasterPlacement:
    """``device`` None: masters with the parameters (views of them in fp32); else that (host) device."""

    device: torch.device | None = None
    pin_memory: bool = False
    step_threads: int | None = None
    """Torch threads for an offloaded (host) optimizer step; the ranks' training threads are restored after."""
    _grads: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

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
        return mixed_precision or self.offloaded

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """An fp32 copy of ``tensor`` where the masters live."""
        device = self.device or tensor.device
        master = torch.empty(tensor.shape, dtype=torch.float32, device=device,
                             pin_memory=self.pin_memory and device.type == "cpu" and torch.cuda.is_available())
        return master.copy_(tensor)

    streams_grads = False
    """True: ``step_grads`` may hand over gradients in the model dtype, converted chunk by chunk in the step."""

    def attach(self, masters: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor], coefficient: float) -> None:
        """Unscale/clip (``grads * coefficient``) and give each master its gradient, where the master lives."""
        if coefficient != 1.0:
            torch._foreach_mul_(list(grads), coefficient)
        for master, grad in zip(masters, self.grads_for(masters, grads)):
            master.grad = grad

    def grads_for(self, masters: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients where the masters are (host copies into reused buffers when offloading)."""
        if not self.offloaded:
            return list(grads)
        placed = []
        for master, grad in zip(masters, grads):
            buffer = self._grads.get(id(master))
            if buffer is None or buffer.shape != master.shape:
                buffer = self._grads[id(master)] = torch.empty_like(master)
            placed.append(buffer.copy_(grad, non_blocking=buffer.is_pinned()))
        if torch.cuda.is_available() and any(g.is_cuda for g in grads):
            torch.cuda.current_stream().synchronize()  # the step reads the host copies next
        return placed

    def grad_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._grads.values())
