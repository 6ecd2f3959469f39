"""Pipeline schedules: the order in which one stage runs its micro-batches' forwards and backwards.

Pure functions of (micro-batches M, stages P, this stage s) -> a list of ``Action``s; the executor
(``engine.py``) adds the sends and receives around each action. Every stage's order is consistent
with its neighbours' (stage s+1 never waits for something stage s schedules after waiting on s+1),
which is what keeps blocking receives from deadlocking.

* GPipe: all M forwards, then all M backwards. Simple; holds M micro-batches of activations.
* 1F1B (PipeDream-flush, Megatron's and DeepSpeed's default): stage s runs P - s - 1 warm-up
  forwards, then alternates one forward and one backward, then drains the remaining backwards.
  Same bubble as GPipe, (P - 1) / (M + P - 1), but at most P - s micro-batches in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class Action:
    kind: str  # "forward" | "backward"
    micro_batch: int


class ScheduleError(ValueError):
    """A schedule that cannot run as configured; the message names the numbers."""


def gpipe(micro_batches: int, stages: int, stage: int) -> list[Action]:
    _check(micro_batches, stages, stage)
    return ([Action("forward", m) for m in range(micro_batches)]
            + [Action("backward", m) for m in range(micro_batches)])


def one_forward_one_backward(micro_batches: int, stages: int, stage: int) -> list[Action]:
    _check(micro_batches, stages, stage)
    if micro_batches < stages:
        raise ScheduleError(f"the 1F1B schedule needs at least as many micro-batches as pipeline stages: "
                            f"gradient_accumulation_steps={micro_batches} < {stages} stages; raise "
                            f"gradient_accumulation_steps to >= {stages} or use \"schedule\": \"gpipe\"")
    warmup = min(stages - stage - 1, micro_batches)
    actions = [Action("forward", m) for m in range(warmup)]
    next_forward, next_backward = warmup, 0
    while next_forward < micro_batches:
        actions.append(Action("forward", next_forward))
        actions.append(Action("backward", next_backward))
        next_forward, next_backward = next_forward + 1, next_backward + 1
    actions += [Action("backward", m) for m in range(next_backward, micro_batches)]
    return actions


def build_schedule(name: str, micro_batches: int, stages: int, stage: int) -> list[Action]:
    if name == "1f1b":
        return one_forward_one_backward(micro_batches, stages, stage)
    if name == "gpipe":
        return gpipe(micro_batches, stages, stage)
    raise ScheduleError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULES)}")


def max_in_flight(actions: list[Action]) -> int:
    """The most micro-batches whose forward ran and backward did not yet (activations held)."""
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == "forward" else -1
        peak = max(peak, live)
    return peak


def _check(micro_batches: int, stages: int, stage: int) -> None:
    if micro_batches < 1 or stages < 1 or not 0 <= stage < stages:
        raise ScheduleError(f"invalid schedule sizes: {micro_batches} micro-batches, {stages} stages, stage {stage}")
