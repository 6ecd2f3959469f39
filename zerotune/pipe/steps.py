"""Pipeline schedules as instructions: per tick of ``schedule.py``'s clock, the list of ``instructions.py``
a stage executes. ``PipelineEngine.train_batch`` runs ``train_schedule(...)``'s steps and ``eval_batch`` an
``InferenceSchedule``'s, instruction by instruction, so what these report is what the engine does.

Laid out on the timeline's ticks: a tick's receive, load and computation, and, first thing in the *next*
tick, the send of what the tick computed. Sends are asynchronous and every receive waits only for a send
issued at the same or an earlier tick, so a barrier between ticks could not deadlock (DeepSpeed's
"atomic steps"); issuing the send first in the next tick loses nothing to sending it right away.

Buffers are reused cyclically (micro-batch m in buffer m mod ``num_pipe_buffers()``): a buffer is busy from
its micro-batch's receive or load until the send of its input gradients, and the layout never hands a busy
buffer to another micro-batch (``tests/test_pipe_steps.py`` checks every small size).

DeepSpeed's classes and attributes (``PipeSchedule(micro_batches, stages, stage_id)``, ``steps()``,
``num_pipe_buffers()``, ``TrainSchedule``'s 1F1B order and tick count), so code written against
``deepspeed.runtime.pipe.schedule`` reads zerotune's schedules.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterator

from zerotune.pipe.instructions import (
    BackwardPass,
    BufferOpInstruction,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)
from zerotune.pipe.schedule import Action, ScheduleError, check_sizes, timeline, total_ticks

__all__ = ["PipeSchedule", "TrainSchedule", "GPipeSchedule", "InferenceSchedule", "DataParallelSchedule",
           "train_schedule", "PipeInstruction", "OptimizerStep", "ReduceGrads", "ReduceTiedGrads",
           "BufferOpInstruction", "LoadMicroBatch", "ForwardPass", "BackwardPass", "SendActivation", "RecvActivation",
           "SendGrad", "RecvGrad"]

Step = list[PipeInstruction]


class PipeSchedule(ABC):
    """The instructions of one batch on stage ``stage_id`` of ``stages``, one list per step (``steps()``);
    iterating the schedule yields the same lists, afresh each time ``iter()`` is called."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        check_sizes(micro_batches, stages, stage_id)
        self.micro_batches, self.stages, self.stage_id = micro_batches, stages, stage_id
        self.prev_stage, self.next_stage = stage_id - 1, stage_id + 1
        self.it: Iterator[Step] | None = None

    @abstractmethod
    def steps(self) -> Iterator[Step]:
        """Yield each step's instructions."""

    def num_pipe_buffers(self) -> int:
        """The buffers this stage needs: one per micro-batch unless the schedule bounds what is in flight."""
        return self.micro_batches

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    def _buffer_idx(self, micro_batch_id: int) -> int:
        if not self._valid_micro_batch(micro_batch_id):
            raise ScheduleError(f"micro-batch {micro_batch_id} is not one of this schedule's {self.micro_batches}")
        return micro_batch_id % self.num_pipe_buffers()

    def __iter__(self) -> PipeSchedule:
        self.it = None
        return self

    def __next__(self) -> Step:
        if self.it is None:
            self.it = self.steps()
        return next(self.it)


class _TimelineSchedule(PipeSchedule):
    """A training schedule on ``schedule.timeline``'s ticks; the subclass names the timeline."""

    timeline_name = ""

    def steps(self) -> Iterator[Step]:
        ticks = timeline(self.timeline_name, self.micro_batches, self.stages, self.stage_id)
        last_tick = total_ticks(self.micro_batches, self.stages) - 1
        previous: Action | None = None
        for tick in range(last_tick + 1):
            step: Step = []
            if previous is not None:  # the send of what the previous tick computed
                buffer = self._buffer_idx(previous.micro_batch)
                if previous.kind == "forward" and not self.is_last_stage:
                    step.append(SendActivation(buffer))
                elif previous.kind == "backward" and not self.is_first_stage:
                    step.append(SendGrad(buffer))
            action = ticks.get(tick)
            if action is not None:
                buffer = self._buffer_idx(action.micro_batch)
                if action.kind == "forward":
                    if not self.is_first_stage:
                        step.append(RecvActivation(buffer))
                    if self.is_first_stage or self.is_last_stage:
                        step.append(LoadMicroBatch(buffer))
                    step.append(ForwardPass(buffer))
                else:
                    if not self.is_last_stage:
                        step.append(RecvGrad(buffer))
                    step.append(BackwardPass(buffer))
            if tick == last_tick:
                step += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            previous = action
            yield step


class TrainSchedule(_TimelineSchedule):
    """1F1B: a batch's training on 2 (M + P - 1) steps, at most min(P - s, M) micro-batches in flight."""

    timeline_name = "1f1b"

    def num_pipe_buffers(self) -> int:
        return max(2, min(self.stages - self.stage_id, self.micro_batches))


class GPipeSchedule(_TimelineSchedule):
    """GPipe: every forward, then every backward; all M micro-batches in flight."""

    timeline_name = "gpipe"


TRAIN_SCHEDULES: dict[str, type[_TimelineSchedule]] = {"1f1b": TrainSchedule, "gpipe": GPipeSchedule}


def train_schedule(name: str, micro_batches: int, stages: int, stage_id: int) -> PipeSchedule:
    """The training schedule the config's ``pipeline.schedule`` names."""
    if name not in TRAIN_SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; valid: {', '.join(TRAIN_SCHEDULES)}")
    return TRAIN_SCHEDULES[name](micro_batches, stages, stage_id)


class InferenceSchedule(PipeSchedule):
    """Forwards only: micro-batch m at step m + s, its outputs sent first thing in the next step; two buffers
    (one receiving while the other's outputs are sent)."""

    def steps(self) -> Iterator[Step]:
        for tick in range(self.micro_batches + self.stages - 1):
            step: Step = []
            micro_batch = tick - self.stage_id
            if self._valid_micro_batch(micro_batch - 1) and not self.is_last_stage:
                step.append(SendActivation(self._buffer_idx(micro_batch - 1)))
            if self._valid_micro_batch(micro_batch):
                buffer = self._buffer_idx(micro_batch)
                if not self.is_first_stage:
                    step.append(RecvActivation(buffer))
                if self.is_first_stage or self.is_last_stage:
                    step.append(LoadMicroBatch(buffer))
                step.append(ForwardPass(buffer))
            yield step

    def num_pipe_buffers(self) -> int:
        return 2


class DataParallelSchedule(PipeSchedule):
    """One stage: each micro-batch's load, forward and backward in one buffer, then the reduction and the step
    (no tied-weight reduction: with one stage every tied weight is on it)."""

    def steps(self) -> Iterator[Step]:
        for micro_batch in range(self.micro_batches):
            step: Step = [LoadMicroBatch(0), ForwardPass(0), BackwardPass(0)]
            if micro_batch == self.micro_batches - 1:
                step += [ReduceGrads(), OptimizerStep()]
            yield step

    def num_pipe_buffers(self) -> int:
        return 1
