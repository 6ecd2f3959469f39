"""DeepSpeed's ``OneBitAdam``: Adam whose momentum is all-reduced as 1-bit signs after a warm-up.

For ``freeze_step`` steps it is Adam on the data-parallel mean gradient (the engine all-reduces
gradients as usual) and learns the variance. Then the variance is frozen, the engine stops
all-reducing gradients, and each rank updates its momentum with its *local* gradient and averages
the momentum with ``compressed_allreduce``: every rank sends sign bits plus one scale (1/32 of the
fp32 bytes), with error feedback on both sides -- what the signs did not say is added to the next
step's momentum (the worker error) and to the next average (the server error). All ranks end with
the same momentum and the same frozen variance, so the weights stay identical.

As DeepSpeed's implementation: no bias correction (``bias_correction`` is accepted and ignored),
ZeRO stage 0 only, ``cuda_aware`` / ``comm_backend_name`` accepted (communication goes through
zerotune's comm layer on whatever backend the process group has). The error buffers differ per
rank: ``error_state_dict`` / ``load_error_state_dict`` let checkpoints save them per rank.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, overload

import torch
import torch.distributed as dist

from zerotune.distributed import comm

_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_signs(signs_positive: torch.Tensor) -> torch.Tensor:
    """Booleans (numel a multiple of 8) -> uint8, 8 per byte."""
    bits = signs_positive.reshape(-1, 8).to(torch.uint8) * _BIT_WEIGHTS.to(signs_positive.device)
    return bits.sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """uint8 -> +1 / -1 floats (8 per byte)."""
    bits = packed.reshape(-1, 1).bitwise_and(_BIT_WEIGHTS.to(packed.device)).ne(0)
    return bits.reshape(-1).float() * 2 - 1


def _scaled_signs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, positive) with scale = ||x|| / sqrt(n): the 1-bit approximation scale * sign(x)."""
    return x.norm() / math.sqrt(x.numel()), x >= 0


def compressed_allreduce(buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                         group: dist.ProcessGroup | None) -> torch.Tensor:
    """The (approximate) mean of ``buffer`` over ``group``, sent as signs; errors updated in place.

    ``worker_error`` has the padded size (a multiple of 8 x world), ``server_error`` 1/world of it.
    """
    world = 1 if group is None else dist.get_world_size(group)
    padded = worker_error.numel()
    corrected = torch.zeros(padded, dtype=torch.float32, device=buffer.device)
    corrected[:buffer.numel()] = buffer.reshape(-1)
    corrected += worker_error
    scale, positive = _scaled_signs(corrected)
    worker_error.copy_(corrected - scale * (positive.float() * 2 - 1))
    packed = pack_signs(positive)  # chunk r (for server r) is bytes [r * padded/8/world, ...)
    received = torch.empty_like(packed)
    comm.all_to_all_single(received, packed, group)
    scales = torch.empty(world, dtype=torch.float32, device=buffer.device)
    comm.all_gather_into_tensor(scales, scale.reshape(1).float(), group)
    chunk = padded // world
    mine = (unpack_signs(received).reshape(world, chunk) * scales.reshape(world, 1)).mean(dim=0) + server_error
    server_scale, server_positive = _scaled_signs(mine)
    server_error.copy_(mine - server_scale * (server_positive.float() * 2 - 1))
    all_packed = torch.empty(world * chunk // 8, dtype=torch.uint8, device=buffer.device)
    comm.all_gather_into_tensor(all_packed, pack_signs(server_positive), group)
    server_scales = torch.empty(world, dtype=torch.float32, device=buffer.device)
    comm.all_gather_into_tensor(server_scales, server_scale.reshape(1).float(), group)
    averaged = (unpack_signs(all_packed).reshape(world, chunk) * server_scales.reshape(world, 1)).reshape(-1)
    return averaged[:buffer.numel()].view_as(buffer).to(buffer.dtype)


class OneBitAdam(torch.optim.Optimizer):
    """See the module docstring. ``comm_group`` (the data-parallel ranks) is set by ``initialize``."""

    def __init__(self, params: Iterable, lr: float = 1e-3, freeze_step: int = 100000, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl") -> None:
        if amsgrad:
            raise ValueError("OneBitAdam does not support amsgrad (as DeepSpeed's)")
        if not isinstance(freeze_step, int) or freeze_step < 0:
            raise ValueError(f"freeze_step must be a non-negative integer, got {freeze_step!r}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "eps_inside_sqrt": eps_inside_sqrt}
        super().__init__(params, defaults)
        self.freeze_step = freeze_step
        self.comm_group: dist.ProcessGroup | None = None
        self.steps_taken = 0
        self.errors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # param index -> (worker, server) error
        del bias_correction, cuda_aware, comm_backend_name  # accepted for DeepSpeed configs (see the docstring)

    @property
    def takes_local_gradients(self) -> bool:
        """After the warm-up the engine hands over each rank's own gradient; momentum is averaged here."""
        return self.steps_taken >= self.freeze_step

    def _errors_for(self, index: int, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if index not in self.errors:
            world = 1 if self.comm_group is None else dist.get_world_size(self.comm_group)
            padded = math.ceil(param.numel() / (8 * world)) * 8 * world
            self.errors[index] = (torch.zeros(padded, device=param.device),
                                  torch.zeros(padded // world, device=param.device))
        return self.errors[index]

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step; ``closure`` (torch's optimizer contract) re-evaluates the model, and its loss is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressing = self.takes_local_gradients
        index = -1
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                index += 1
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(param.grad, alpha=1 - beta1)
                if compressing:
                    exp_avg.copy_(compressed_allreduce(exp_avg, *self._errors_for(index, param), self.comm_group))
                else:
                    exp_avg_sq.mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
                if group["eps_inside_sqrt"]:
                    update = exp_avg / (exp_avg_sq + group["eps"]).sqrt()
                else:
                    update = exp_avg / (exp_avg_sq.sqrt() + group["eps"])
                if group["weight_decay"] > 0:
                    update.add_(param, alpha=group["weight_decay"])
                param.add_(update, alpha=-group["lr"])
        self.steps_taken += 1
        return loss

    def error_state_dict(self) -> dict:
        """This rank's error-feedback buffers (they differ per rank: the engine saves them per rank) and the
        step count that decides whether compression runs."""
        return {"steps_taken": self.steps_taken,
                "errors": {i: (w.detach().cpu().clone(), s.detach().cpu().clone())
                           for i, (w, s) in self.errors.items()}}

    def load_error_state_dict(self, state: dict, device: torch.device) -> None:
        self.steps_taken = int(state["steps_taken"])
        self.errors = {int(i): (w.to(device), s.to(device)) for i, (w, s) in state["errors"].items()}
