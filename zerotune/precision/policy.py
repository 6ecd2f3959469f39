"""Which dtypes a run uses, and the fp32 master copy of the trainable parameters.

Policy (as in DeepSpeed's fp16/bf16 engines):
* the model's parameters and activations are in ``param_dtype`` (fp32, bf16 or fp16);
* gradients are accumulated in fp32 buffers (see ``zerotune.zero.allreduce_sync``);
* the optimizer updates fp32 **master** weights and keeps its state in fp32; after each step
  the masters are copied (rounded) into the model's parameters.
In fp32 the master *is* the parameter: no second copy exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class PrecisionPolicy:
    param_dtype: torch.dtype = torch.float32

    @property
    def mixed(self) -> bool:
        return self.param_dtype != torch.float32

    @property
    def name(self) -> str:
        return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.param_dtype]


def policy_from_flags(*, fp16: bool, bf16: bool) -> PrecisionPolicy:
    if fp16 and bf16:
        raise ValueError("fp16 and bf16 cannot both be enabled")
    return PrecisionPolicy(torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32)


class MasterWeights:
    """fp32 copies of the trainable parameters (or the parameters themselves in fp32)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], policy: PrecisionPolicy) -> None:
        self.params = list(params)
        self.policy = policy
        if policy.mixed:
            self.masters = [torch.nn.Parameter(p.detach().float().clone(), requires_grad=True) for p in self.params]
        else:
            self.masters = self.params
        self._master_of = {id(p): m for p, m in zip(self.params, self.masters)}

    def master_of(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        return self._master_of[id(param)]

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round the updated fp32 masters into the model's low-precision parameters."""
        if self.policy.mixed:
            params: list[torch.Tensor] = [*self.params]
            masters: list[torch.Tensor] = [*self.masters]
            torch._foreach_copy_(params, masters)

    @torch.no_grad()
    def copy_from_model(self) -> None:
        """Refresh the masters from the model (after loading weights into the module only)."""
        if self.policy.mixed:
            params: list[torch.Tensor] = [*self.params]
            masters: list[torch.Tensor] = [*self.masters]
            torch._foreach_copy_(masters, params)

    def master_bytes(self) -> int:
        if not self.policy.mixed:
            return 0
        return sum(m.numel() * m.element_size() for m in self.masters)
