"""``deepspeed.ops.adam`` / ``deepspeed.ops.lamb``: DeepSpeed's optimizer classes by name.

zerotune ships no compiled kernels: ``FusedAdam`` and ``DeepSpeedCPUAdam`` are torch's Adam
(torch's fused / foreach kernels on any device) with DeepSpeed's constructor arguments and
defaults (``adam_w_mode`` / ``adamw_mode`` true: decoupled weight decay, weight decay 0);
``FusedLamb`` is zerotune's Lamb. Arguments torch cannot honour are refused by name.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable, Sequence

import torch

from zerotune.compat.op_capabilities import compatible_ops, installed_ops
from zerotune.optim.lamb import Lamb

__all__ = ["FusedAdam", "DeepSpeedCPUAdam", "FusedLamb", "adam", "lamb"]


def _check_bias_correction(cls: str, bias_correction: bool) -> None:
    if not bias_correction:
        raise ValueError(f"{cls}(bias_correction=False) is not supported: torch's Adam always corrects the "
                         "moment bias; remove the argument or pass True")


def _beta_pair(betas: Sequence[float]) -> tuple[float, float]:
    """``betas`` as the pair torch's optimizers take (DeepSpeed's callers pass lists too)."""
    beta1, beta2 = betas
    return beta1, beta2


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's FusedAdam signature over ``torch.optim.Adam``."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        _check_bias_correction(type(self).__name__, bias_correction)
        super().__init__(params, lr=lr, betas=_beta_pair(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         decoupled_weight_decay=adam_w_mode)


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's CPU Adam signature over ``torch.optim.Adam`` (torch's CPU kernels)."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        _check_bias_correction(type(self).__name__, bias_correction)
        super().__init__(model_params, lr=lr, betas=_beta_pair(betas), eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, decoupled_weight_decay=adamw_mode)


class FusedLamb(Lamb):
    """DeepSpeed's FusedLamb signature over zerotune's Lamb."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False) -> None:
        if amsgrad:
            raise ValueError("FusedLamb(amsgrad=True) is not supported (nor by DeepSpeed's kernel)")
        del max_grad_norm  # DeepSpeed's kernel ignores it too: clipping is the engine's gradient_clipping
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=_beta_pair(betas), eps=eps,
                         eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, max_coeff=max_coeff,
                         min_coeff=min_coeff)


# ``deepspeed.ops.adam`` and ``deepspeed.ops.lamb`` are this module too.
adam = lamb = sys.modules[__name__]

# what DeepSpeed code reads before using an op (op_capabilities.py says what "compatible" means here)
__compatible_ops__ = compatible_ops
__installed_ops__ = installed_ops
