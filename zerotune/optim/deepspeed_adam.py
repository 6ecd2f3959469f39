"""DeepSpeed's Adam classes, ``FusedAdam`` and ``DeepSpeedCPUAdam``, over ``torch.optim.Adam``.

They are what a config's ``"Adam"`` / ``"AdamW"`` builds (as DeepSpeed builds its FusedAdam), so code
that checks ``isinstance(optimizer, FusedAdam)`` holds, and what ``deepspeed.ops.adam`` exports. zerotune
ships no compiled kernels: both run torch's fused / foreach kernels on any device, with DeepSpeed's
constructor arguments and defaults (``adam_w_mode`` / ``adamw_mode`` true: decoupled weight decay,
weight decay 0). Arguments torch cannot honour are refused by name.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

__all__ = ["FusedAdam", "DeepSpeedCPUAdam", "beta_pair", "check_bias_correction"]


def check_bias_correction(cls: str, bias_correction: bool) -> None:
    if not bias_correction:
        raise ValueError(f"{cls}(bias_correction=False) is not supported: torch's Adam always corrects the "
                         "moment bias; remove the argument or pass True")


def beta_pair(betas: Sequence[float]) -> tuple[float, float]:
    """``betas`` as the pair torch's optimizers take (DeepSpeed's callers pass lists too)."""
    beta1, beta2 = betas
    return beta1, beta2


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's FusedAdam signature over ``torch.optim.Adam``; ``torch_options`` are torch's
    implementation switches (``fused``, ``foreach``, ``maximize``, ...), which the engine sets."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True,
                 **torch_options: Any) -> None:
        del set_grad_none  # torch's zero_grad already sets gradients to None
        check_bias_correction(type(self).__name__, bias_correction)
        super().__init__(params, lr=lr, betas=beta_pair(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         decoupled_weight_decay=adam_w_mode, **torch_options)


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's CPU Adam signature over ``torch.optim.Adam`` (torch's CPU kernels)."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        check_bias_correction(type(self).__name__, bias_correction)
        super().__init__(model_params, lr=lr, betas=beta_pair(betas), eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, decoupled_weight_decay=adamw_mode)
