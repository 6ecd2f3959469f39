"""LAMB with DeepSpeed's ``FusedLamb`` semantics, as a plain torch optimizer.

torch has no LAMB, and DeepSpeed's is a CUDA kernel, so this reimplements that kernel's
arithmetic with ``torch._foreach_*`` ops (one launch per op for all tensors of a device
and dtype) so it runs anywhere torch does. Per parameter ``p`` with gradient ``g`` at
step ``t`` (DeepSpeed ``csrc/lamb/fused_lamb_cuda_kernel.cu``):

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    update = m / (sqrt(v) + eps) + weight_decay * p       # eps_inside_sqrt: m / sqrt(v + eps)
    coeff = clamp(||p|| / ||update||, min_coeff, max_coeff), or 1 if either norm is 0
    step_size = lr * sqrt(1 - beta2**t) / (1 - beta1**t)  # just lr without bias_correction
    p -= step_size * coeff * update

Note the two places this differs from the LAMB paper, kept for DeepSpeed parity: bias
correction is folded into the step size instead of into ``m`` and ``v``, so the trust
ratio is measured on the *uncorrected* update, and the ratio is clamped to
``[min_coeff, max_coeff]``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, overload

import torch


class Lamb(torch.optim.Optimizer):
    """LAMB (layer-wise adaptive moments) matching DeepSpeed's ``Lamb`` optimizer type.

    Args mirror DeepSpeed's ``FusedLamb``: ``lr``, ``bias_correction``, ``betas``,
    ``eps``, ``eps_inside_sqrt``, ``weight_decay``, ``max_coeff``, ``min_coeff``.
    ``lamb_coeffs`` holds the trust ratios of the last step (one per parameter that had
    a gradient), like ``FusedLamb.get_lamb_coeffs()``, for logging.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr} (must be >= 0)")
        if eps < 0.0:
            raise ValueError(f"Invalid eps: {eps} (must be >= 0)")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid betas: {tuple(betas)} (each must be in [0, 1))")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay: {weight_decay} (must be >= 0)")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(
                f"Invalid min_coeff/max_coeff: need 0 <= min_coeff ({min_coeff}) <= max_coeff ({max_coeff})"
            )
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.lamb_coeffs: list[float] = []

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        coeffs: list[torch.Tensor] = []
        for group in self.param_groups:
            # foreach ops need every tensor of one call on the same device and dtype.
            buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                buckets[(p.device, p.dtype)].append(p)
            for params in buckets.values():
                coeffs.append(self._update_bucket(group, params))
        self.lamb_coeffs = [c for bucket in coeffs for c in bucket.tolist()]
        return loss

    def _update_bucket(self, group: dict[str, Any], params: list[torch.Tensor]) -> torch.Tensor:
        """Apply one LAMB step to ``params`` (same device and dtype); return their trust ratios."""
        beta1, beta2 = group["betas"]
        grads = [p.grad for p in params if p.grad is not None]  # (``step`` buckets only parameters with one)
        exp_avgs, exp_avg_sqs, step_sizes = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            step_sizes.append(_step_size(float(group["lr"]), beta1, beta2, state["step"], group["bias_correction"]))

        # Phase 1: moments.
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

        # Phase 2: the Adam-style update direction, plus decoupled weight decay.
        if group["eps_inside_sqrt"]:
            denoms = torch._foreach_add(exp_avg_sqs, group["eps"])
            torch._foreach_sqrt_(denoms)
        else:
            denoms = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_add_(denoms, group["eps"])
        updates = torch._foreach_div(exp_avgs, denoms)
        if group["weight_decay"] != 0.0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])

        # Phase 3: layer-wise trust ratio ||p|| / ||update||, clamped; 1 where a norm is 0.
        weight_norms = torch.stack(torch._foreach_norm(params)).float()  # (n,)
        update_norms = torch.stack(torch._foreach_norm(updates)).float()  # (n,)
        both_nonzero = (weight_norms != 0) & (update_norms != 0)
        ratios = weight_norms / torch.where(both_nonzero, update_norms, 1.0)
        ratios = ratios.clamp(group["min_coeff"], group["max_coeff"])
        coeffs = torch.where(both_nonzero, ratios, torch.ones_like(ratios))

        # Phase 4: p -= step_size * coeff * update.
        scales = (coeffs * torch.tensor(step_sizes, dtype=coeffs.dtype, device=coeffs.device)).neg()
        torch._foreach_mul_(updates, list(scales.to(params[0].dtype).unbind()))
        torch._foreach_add_(params, updates)
        return coeffs


def _step_size(lr: float, beta1: float, beta2: float, step: int, bias_correction: bool) -> float:
    """Learning rate with Adam's bias correction folded in, as DeepSpeed's kernel does."""
    if not bias_correction:
        return lr
    return lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
