"""Model-state bytes per rank: the ZeRO paper's formulas, and the layout zerotune actually allocates.

The paper (Rajbhandari et al. 2020, section 5) counts, for Psi parameters on N data-parallel ranks with
mixed-precision Adam: 2 Psi bytes of 16-bit parameters, 2 Psi of 16-bit gradients, and K Psi of optimizer
state (K = 12: fp32 masters, momentum and variance), partitioned by stage:

    stage 0: (2 + 2 + K) Psi     stage 1: (2 + 2) Psi + K Psi / N
    stage 2: 2 Psi + (2 + K) Psi / N     stage 3: (2 + 2 + K) Psi / N

``zerotune_model_states`` is the same accounting for what zerotune's engine holds (``memory_breakdown``):
trainable and frozen parameters apart, fp32 training without masters, stage 0's fp32 gradient buckets,
and the optimizer state and masters on the host when ``offload_optimizer`` is set.
"""

from __future__ import annotations

from dataclasses import dataclass

ADAM_STATE_BYTES = 8  # fp32 momentum + variance per trainable parameter
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "lamb": 8, "onebitadam": 8, "sgd": 4, "adagrad": 4, "rmsprop": 4}


def zero_paper_model_states(psi: float, n: int, stage: int, k: float = 12.0) -> float:
    """Bytes of model state per device in the ZeRO paper's Figure 1 / Table 1 accounting."""
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return 4 * psi + k * psi / n
    if stage == 2:
        return 2 * psi + (2 + k) * psi / n
    if stage == 3:
        return (2 + 2 + k) * psi / n
    raise ValueError(f"ZeRO stage must be 0-3, got {stage!r}")


@dataclass(frozen=True)
class StateBytes:
    """One rank's model state, by kind; ``host``: what ``offload_optimizer`` / ``offload_param`` keep in host
    memory (or, for NVMe, on disk: ``nvme``) instead of on the device."""

    params: int
    grads: int
    master_weights: int
    optimizer_state: int
    host: int = 0
    nvme: int = 0

    @property
    def device_total(self) -> int:
        return self.params + self.grads + self.master_weights + self.optimizer_state


def zerotune_model_states(trainable: int, frozen: int, *, stage: int, dp: int, precision: str = "fp32",
                          optimizer: str = "adamw", offload_optimizer: str = "none",
                          offload_param: str = "none") -> StateBytes:
    """What zerotune's engine allocates per rank for ``trainable`` + ``frozen`` parameters at ``stage`` over
    ``dp`` data-parallel ranks (the accounting ``engine.memory_breakdown()`` reports and
    ``tests/test_zero_accounting.py`` measures)."""
    width = 2 if precision in ("bf16", "fp16") else 4
    mixed = width == 2
    state_per_param = OPTIMIZER_STATE_BYTES.get(optimizer.lower().replace("_", ""), ADAM_STATE_BYTES)
    shard = 1 if stage == 0 else dp
    params = width * (trainable + frozen) // (dp if stage == 3 else 1)
    if stage == 0:
        grads = 4 * trainable  # fp32 all-reduce buckets are the gradient storage
    elif stage == 1:
        grads = width * trainable  # whole flat buffers, reduced then sliced
    else:
        grads = width * trainable // dp
    masters = 4 * trainable // shard if mixed else 0
    optimizer_state = state_per_param * trainable // shard
    host = nvme = 0
    if offload_optimizer in ("cpu", "nvme"):
        moved = masters + optimizer_state + (4 * trainable // shard if mixed else 0)  # + fp32 gradient staging
        if offload_optimizer == "cpu":
            host = moved
        else:
            nvme, host = masters + optimizer_state, 4 * trainable // shard
        masters = optimizer_state = 0
    if offload_param in ("cpu", "nvme") and stage == 3:
        if offload_param == "cpu":
            host += params
        else:
            nvme += params
        params = 0
    return StateBytes(params, grads, masters, optimizer_state, host, nvme)
