"""The batch-size triple, solved exactly as DeepSpeed does (pure arithmetic).

train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp_world_size.
Any two members give the third; only the micro batch gives gas = 1; only the global
batch gives gas = 1 and micro = tbs / dp. Errors show the arithmetic so the user sees
which number to change.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from .errors import BatchSizeError, ConfigError

TBS = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"
BATCH_KEYS = (TBS, MICRO, GAS)


class BatchSizes(NamedTuple):
    """The solved triple."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int


def solve_batch(
    train_batch_size: Optional[int],
    micro_batch: Optional[int],
    grad_accum: Optional[int],
    dp_world_size: int,
) -> BatchSizes:
    """Fill in the missing members (None) of the triple or raise ConfigError."""
    tbs, micro, gas, dp = train_batch_size, micro_batch, grad_accum, dp_world_size
    if tbs is None and micro is None:
        raise ConfigError(
            TBS, f"neither {TBS} nor {MICRO} is set; set at least one of them (DeepSpeed requires the same)"
        )
    if tbs is not None and micro is not None and gas is not None:
        if tbs != micro * gas * dp:
            raise BatchSizeError(
                TBS, f"{TBS} {tbs} != {MICRO} {micro} * {GAS} {gas} * data-parallel size {dp} = {micro * gas * dp}"
            )
        return BatchSizes(tbs, micro, gas)
    if tbs is not None and micro is not None:
        gas = _divide(tbs, micro * dp, f"{MICRO} {micro} * data-parallel size {dp}")
        return BatchSizes(tbs, micro, gas)
    if tbs is not None and gas is not None:
        micro = _divide(tbs, gas * dp, f"{GAS} {gas} * data-parallel size {dp}")
        return BatchSizes(tbs, micro, gas)
    if micro is not None:
        gas = 1 if gas is None else gas
        return BatchSizes(micro * gas * dp, micro, gas)
    assert tbs is not None
    micro = _divide(tbs, dp, f"data-parallel size {dp}")
    return BatchSizes(tbs, micro, 1)


def _divide(tbs: int, divisor: int, divisor_text: str) -> int:
    if tbs % divisor != 0:
        product = f" = {divisor}" if "*" in divisor_text else ""
        raise BatchSizeError(TBS, f"{TBS} {tbs} is not divisible by {divisor_text}{product}")
    return tbs // divisor
