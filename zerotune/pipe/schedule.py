"""Pipeline schedules: when one stage runs each micro-batch's forward and backward.

Pure functions of (micro-batches M, stages P, this stage s). Each schedule is a *timeline*: every
computation gets the tick of a lockstep clock at which it runs in the ideal pipeline, where a
forward or backward takes one tick and the neighbour's result of tick t is usable at tick t + 1.
A stage's order is its computations sorted by tick; the instructions ``steps.py`` yields (the ones
the engine executes, with the sends and receives) are laid out on the same ticks. One clock for
every stage is what keeps blocking receives from deadlocking: everything a receive at tick t
waits for was computed at an earlier tick, on any stage.

* GPipe: all M forwards, then all M backwards; forward m at tick m + s, backward m at tick
  (M + P - 1) + (P - 1 - s) + m. Simple; holds M micro-batches of activations.
* 1F1B (PipeDream-flush, Megatron's and DeepSpeed's ``TrainSchedule``): forward m at tick 2m + s,
  backward m at tick 2m + 2P - 1 - s. Forwards and backwards take ticks of opposite parity, so a
  stage runs min(P - s - 1, M) warm-up forwards, then alternates one forward and one backward,
  then drains the remaining backwards: the same bubble as GPipe, (P - 1) / (M + P - 1), but at
  most min(P - s, M) micro-batches in flight. With fewer micro-batches than stages it degrades to
  GPipe's order on the stages whose warm-up covers every micro-batch, as DeepSpeed's does.

Both take 2 (M + P - 1) ticks; the last is stage 0's last backward.
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


def total_ticks(micro_batches: int, stages: int) -> int:
    """The ticks of one batch, every stage alike: M + P - 1 for the forwards, as many for the backwards."""
    return 2 * (micro_batches + stages - 1)


def timeline(name: str, micro_batches: int, stages: int, stage: int) -> dict[int, Action]:
    """This stage's computations by the tick at which each runs (ticks without one are idle: the bubble)."""
    check_sizes(micro_batches, stages, stage)
    ticks: dict[int, Action] = {}
    for m in range(micro_batches):
        if name == "1f1b":
            forward, backward = 2 * m + stage, 2 * m + 2 * stages - 1 - stage
        elif name == "gpipe":
            forward, backward = m + stage, micro_batches + 2 * stages - 2 - stage + m
        else:
            raise ScheduleError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULES)}")
        ticks[forward], ticks[backward] = Action("forward", m), Action("backward", m)
    return ticks


def build_schedule(name: str, micro_batches: int, stages: int, stage: int) -> list[Action]:
    """This stage's computations in the order it runs them."""
    ticks = timeline(name, micro_batches, stages, stage)
    return [ticks[tick] for tick in sorted(ticks)]


def gpipe(micro_batches: int, stages: int, stage: int) -> list[Action]:
    return build_schedule("gpipe", micro_batches, stages, stage)


def one_forward_one_backward(micro_batches: int, stages: int, stage: int) -> list[Action]:
    return build_schedule("1f1b", micro_batches, stages, stage)


def max_in_flight(actions: list[Action]) -> int:
    """The most micro-batches whose forward ran and backward did not yet (activations held)."""
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == "forward" else -1
        peak = max(peak, live)
    return peak


def check_sizes(micro_batches: int, stages: int, stage: int) -> None:
    """A clear error for sizes no schedule has (``PipeSchedule``'s constructor and the config check use it)."""
    if not all(isinstance(n, int) for n in (micro_batches, stages, stage)) or (
            micro_batches < 1 or stages < 1 or not 0 <= stage < stages):
        raise ScheduleError(f"invalid schedule sizes: {micro_batches} micro-batches, {stages} stages, stage {stage}")
