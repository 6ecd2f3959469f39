"""``deepspeed.ops.adam`` / ``deepspeed.ops.lamb``: DeepSpeed's optimizer classes by name.

``FusedAdam`` and ``DeepSpeedCPUAdam`` are zerotune's own (``zerotune.optim.deepspeed_adam``: torch's
Adam with DeepSpeed's arguments, what a config's "Adam" builds); ``FusedLamb`` is zerotune's Lamb with
FusedLamb's signature. Arguments torch cannot honour are refused by name.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable

import torch

from zerotune.compat.op_capabilities import compatible_ops, installed_ops
from zerotune.optim.deepspeed_adam import DeepSpeedCPUAdam, FusedAdam, beta_pair
from zerotune.optim.lamb import Lamb

__all__ = ["FusedAdam", "DeepSpeedCPUAdam", "FusedLamb", "DeepSpeedCPUAdagrad", "adam", "lamb", "adagrad"]


class FusedLamb(Lamb):
    """DeepSpeed's FusedLamb signature over zerotune's Lamb."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False) -> None:
        if amsgrad:
            raise ValueError("FusedLamb(amsgrad=True) is not supported (nor by DeepSpeed's kernel)")
        del max_grad_norm  # DeepSpeed's kernel ignores it too: clipping is the engine's gradient_clipping
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=beta_pair(betas), eps=eps,
                         eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, max_coeff=max_coeff,
                         min_coeff=min_coeff)


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's CPU Adagrad signature over ``torch.optim.Adagrad`` (torch's host kernels, sparse gradients
    included). Like DeepSpeed's, it steps host parameters only: ZeRO-Offload puts the masters there."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad(amsgrad=True) is not supported (nor by DeepSpeed's kernel)")
        del fp32_optimizer_states  # the state takes the parameters' dtype, fp32 for ZeRO-Offload's masters
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for param in group["params"]:
                if param.device.type != "cpu":
                    raise AssertionError(f"DeepSpeedCPUAdagrad steps host parameters; one is on {param.device} "
                                         "(enable zero_optimization.offload_optimizer.device 'cpu', or use "
                                         "torch.optim.Adagrad)")
        return super().step(closure)


# ``deepspeed.ops.adam``, ``deepspeed.ops.lamb`` and ``deepspeed.ops.adagrad`` are this module too.
adam = lamb = adagrad = sys.modules[__name__]

# what DeepSpeed code reads before using an op (op_capabilities.py says what "compatible" means here)
__compatible_ops__ = compatible_ops
__installed_ops__ = installed_ops
