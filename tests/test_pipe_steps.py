"""The pipeline schedules as instructions (``zerotune/pipe/steps.py``, ``deepspeed.runtime.pipe.schedule`` under
the alias) and the engine that executes them.

Pure checks over every small size: the instructions' computations are ``build_schedule``'s order (1F1B is
DeepSpeed's TrainSchedule order), no buffer is reused while busy, and the stages' instructions run together
-- sends asynchronous, receives blocking, a barrier between steps -- without deadlock, each receive getting
the micro-batch it expects. Multi-rank: the engine's computations are the schedule's, and 1F1B with fewer
micro-batches than stages (DeepSpeed runs it) reproduces single-process training.
"""

from __future__ import annotations

from collections import deque

import pytest
import torch

import zerotune
from tests.harness import run_distributed
from tests.models import mse, pipeline_layers
from zerotune.pipe import PipelineModule
from zerotune.pipe import steps as S
from zerotune.pipe.schedule import ScheduleError, build_schedule, total_ticks

SIZES = [(m, p) for m in range(1, 9) for p in range(1, 6)]
_SENDS = {S.SendActivation: ("activation", +1), S.SendGrad: ("grad", -1)}
_RECVS = {S.RecvActivation: ("activation", -1), S.RecvGrad: ("grad", +1)}


def _schedules(micro_batches: int, stages: int, kind: str) -> list[S.PipeSchedule]:
    if kind == "inference":
        return [S.InferenceSchedule(micro_batches, stages, s) for s in range(stages)]
    return [S.train_schedule(kind, micro_batches, stages, s) for s in range(stages)]


def _annotated(schedule: S.PipeSchedule) -> list[list[tuple[S.PipeInstruction, int]]]:
    """Each step's instructions with the micro-batch each concerns (a buffer holds one from its load or
    receive to its last use; forwards and backwards each run in micro-batch order)."""
    in_buffer: dict[int, int] = {}
    forwards = backwards = 0
    annotated = []
    for step in schedule:
        row = []
        for instruction in step:
            micro_batch = -1
            if isinstance(instruction, S.BufferOpInstruction):
                buffer = instruction.buffer_id
                if isinstance(instruction, (S.RecvActivation, S.LoadMicroBatch)) and buffer not in in_buffer:
                    in_buffer[buffer], forwards = forwards, forwards + 1
                micro_batch = in_buffer[buffer]
                if isinstance(instruction, S.BackwardPass):
                    assert micro_batch == backwards
                    backwards += 1
                if isinstance(instruction, S.SendGrad) or (
                        isinstance(instruction, S.SendActivation) and isinstance(schedule, S.InferenceSchedule)) or (
                        isinstance(instruction, S.BackwardPass) and schedule.is_first_stage):
                    del in_buffer[buffer]  # the buffer's last use
                elif isinstance(instruction, S.ForwardPass) and isinstance(schedule, S.InferenceSchedule) and (
                        schedule.is_last_stage):
                    del in_buffer[buffer]
            row.append((instruction, micro_batch))
        annotated.append(row)
    return annotated


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_the_instructions_compute_in_build_schedules_order(name):
    for micro_batches, stages in SIZES:
        for stage, schedule in enumerate(_schedules(micro_batches, stages, name)):
            computed = [("forward" if isinstance(i, S.ForwardPass) else "backward", m)
                        for step in _annotated(schedule) for i, m in step
                        if isinstance(i, (S.ForwardPass, S.BackwardPass))]
            assert computed == [(a.kind, a.micro_batch) for a in build_schedule(name, micro_batches, stages, stage)]
            assert len(list(schedule)) == total_ticks(micro_batches, stages)


def test_1f1b_is_deepspeeds_order_warm_up_alternate_drain():
    """Stage 1 of 4 with 6 micro-batches: two warm-up forwards, one forward one backward, then the drain."""
    order = [f"{a.kind[0]}{a.micro_batch}" for a in build_schedule("1f1b", 6, 4, 1)]
    assert order == ["f0", "f1", "f2", "b0", "f3", "b1", "f4", "b2", "f5", "b3", "b4", "b5"]


@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "inference"])
def test_no_buffer_is_reused_while_it_holds_a_micro_batch(kind):
    """``_annotated`` fails on a buffer handed to a new micro-batch before its last use; ids stay in range."""
    for micro_batches, stages in SIZES:
        for schedule in _schedules(micro_batches, stages, kind):
            for step in _annotated(schedule):
                for instruction, _ in step:
                    if isinstance(instruction, S.BufferOpInstruction):
                        assert 0 <= instruction.buffer_id < schedule.num_pipe_buffers()


@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "inference"])
def test_stages_run_together_without_deadlock_even_with_a_barrier_between_steps(kind):
    """Every stage executes its steps; a send never waits, a receive waits for its neighbour's send. All
    stages finish step t before any starts step t + 1, and each receive gets the micro-batch it is for."""
    for micro_batches, stages in SIZES:
        annotated = [_annotated(s) for s in _schedules(micro_batches, stages, kind)]
        channels: dict[tuple[int, int, str], deque[int]] = {}
        for tick in range(len(annotated[0])):
            pending = [deque(stage_steps[tick]) for stage_steps in annotated]
            while any(pending):
                progressed = False
                for stage, queue in enumerate(pending):
                    while queue:
                        instruction, micro_batch = queue[0]
                        if type(instruction) in _SENDS:
                            what, direction = _SENDS[type(instruction)]
                            channels.setdefault((stage, stage + direction, what), deque()).append(micro_batch)
                        elif type(instruction) in _RECVS:
                            what, direction = _RECVS[type(instruction)]
                            channel = channels.get((stage + direction, stage, what))
                            if not channel:
                                break  # blocked
                            assert channel.popleft() == micro_batch
                        queue.popleft()
                        progressed = True
                assert progressed, f"deadlock at step {tick}: {micro_batches} micro-batches, {stages} stages, {kind}"
        assert not any(channels.values())  # every send received


def test_the_last_training_step_reduces_and_steps_and_inference_starts_without_a_send():
    steps = list(S.TrainSchedule(micro_batches=4, stages=3, stage_id=0))
    assert [type(i) for i in steps[-1][-3:]] == [S.ReduceTiedGrads, S.ReduceGrads, S.OptimizerStep]
    assert sum(isinstance(i, S.OptimizerStep) for step in steps for i in step) == 1
    first = list(S.InferenceSchedule(micro_batches=3, stages=3, stage_id=0))
    assert [type(i) for i in first[0]] == [S.LoadMicroBatch, S.ForwardPass]
    assert [type(i) for i in first[3]] == [S.SendActivation]
    single = list(S.DataParallelSchedule(micro_batches=2, stages=1, stage_id=0))
    assert [type(i) for i in single[-1]] == [S.LoadMicroBatch, S.ForwardPass, S.BackwardPass, S.ReduceGrads,
                                              S.OptimizerStep]


def test_schedule_queries_and_instruction_fields():
    schedule = S.TrainSchedule(micro_batches=8, stages=4, stage_id=3)
    assert (schedule.stage, schedule.num_stages, schedule.num_micro_batches) == (3, 4, 8)
    assert (schedule.prev_stage, schedule.next_stage) == (2, 4)
    assert schedule.is_last_stage and not schedule.is_first_stage
    assert [S.TrainSchedule(8, 4, s).num_pipe_buffers() for s in range(4)] == [4, 3, 2, 2]
    assert S.GPipeSchedule(8, 4, 0).num_pipe_buffers() == 8
    first, again = list(schedule), list(schedule)  # iterable again, from the start
    assert first and [list(map(repr, step)) for step in first] == [list(map(repr, step)) for step in again]
    instruction = S.SendGrad(buffer_id=2, note="x")
    assert (instruction.name, instruction.buffer_id, instruction.kwargs) == ("SendGrad", 2, {"buffer_id": 2,
                                                                                            "note": "x"})
    assert repr(instruction) == "SendGrad(buffer_id=2, note='x')" and repr(S.OptimizerStep()) == "OptimizerStep()"


def test_bad_sizes_and_names_are_refused_naming_them():
    with pytest.raises(ScheduleError, match="4 micro-batches, 2 stages, stage 2"):
        S.TrainSchedule(micro_batches=4, stages=2, stage_id=2)
    with pytest.raises(ScheduleError, match="unknown pipeline schedule 'zb'"):
        S.train_schedule("zb", 4, 2, 0)
    with pytest.raises(ScheduleError, match="micro-batch 5 is not one"):
        S.TrainSchedule(4, 2, 0)._buffer_idx(5)


def test_the_deepspeed_module_path_is_this_schedule():
    from zerotune.compat.alias import install_deepspeed_alias

    install_deepspeed_alias()
    import deepspeed.runtime.pipe.schedule as schedule

    assert schedule.TrainSchedule is S.TrainSchedule and schedule.LoadMicroBatch is S.LoadMicroBatch


# ----------------------------------------------------------------------------- the engine executes them

WIDTH, ROWS = 8, 4


def _micro_batch(step: int, micro: int, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(rows, WIDTH, generator=generator), torch.randn(rows, WIDTH, generator=generator)


def _pipe(stages: int) -> PipelineModule:
    return PipelineModule(pipeline_layers(WIDTH), num_stages=stages, loss_fn=mse, seed_layers=True, base_seed=3)


def _engine(schedule: str, gas: int):
    engine, *_ = zerotune.initialize(model=_pipe(2), config={
        "train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": gas, "pipeline": {"schedule": schedule},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    return engine


def _run_engine(schedule: str, gas: int, steps: int) -> tuple[list[float], list[list[tuple[str, int]]]]:
    engine = _engine(schedule, gas)
    losses, orders = [], []
    for step in range(steps):
        losses.append(engine.train_batch(iter([_micro_batch(step, m) for m in range(gas)])).item())
        orders.append([(kind, micro_batch) for kind, micro_batch, _, _ in engine.timeline])
    engine.destroy()
    return losses, orders


def _rows(micro: int) -> int:
    return 2 + micro  # a different batch shape for every micro-batch


def _run_with_set_dataiterator(gas: int, steps: int, via: str) -> list[float]:
    engine = _engine("1f1b", gas)
    batches = [_micro_batch(step, m, _rows(m)) for step in range(steps) for m in range(gas)]
    if via == "loader":
        engine.set_dataloader(batches)
    else:
        engine.set_dataiterator(iter(batches))
    losses = [engine.train_batch().item() for _ in range(steps)]
    engine.destroy()
    return losses


def _reference(gas: int, steps: int, rows=lambda micro: ROWS) -> list[float]:
    model = _pipe(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(gas):
            x, y = _micro_batch(step, micro, rows(micro))
            loss = mse(model(x), y)
            (loss / gas).backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / gas)
    return losses


@pytest.mark.parametrize("schedule, gas", [("1f1b", 1), ("1f1b", 3), ("gpipe", 2)])
def test_the_engine_computes_in_the_schedules_order_and_matches_single_process(schedule, gas):
    """Also 1F1B with one micro-batch on two stages, which DeepSpeed's TrainSchedule runs."""
    expected = _reference(gas, 3)
    for stage, (losses, orders) in enumerate(run_distributed(_run_engine, 2, schedule, gas, 3, timeout=180)):
        assert losses == pytest.approx(expected, rel=1e-5)
        planned = [(a.kind, a.micro_batch) for a in build_schedule(schedule, gas, 2, stage)]
        assert all(order == planned for order in orders)


@pytest.mark.parametrize("via", ["iterator", "loader"])
def test_train_batch_reads_set_dataiterators_iterator_and_shapes_may_change_between_micro_batches(via):
    """DeepSpeed's ``set_dataiterator`` / ``set_dataloader``; ``PipelineModule(dynamic_shape=...)`` is accepted,
    and zerotune's stages send each message's shapes whatever it says (each micro-batch here has its own rows)."""
    assert PipelineModule(pipeline_layers(WIDTH), num_stages=1, dynamic_shape=True).dynamic_shape
    expected = _reference(3, 2, _rows)
    for losses in run_distributed(_run_with_set_dataiterator, 2, 3, 2, via, timeout=180):
        assert losses == pytest.approx(expected, rel=1e-5)
