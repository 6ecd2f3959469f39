"""Pipeline parallelism reproduces single-process PyTorch (fp32, 6 steps, GAS 4, clipping 0.5).

A PipelineModule MLP (LayerSpecs, a TiedLayerSpec shared by the first and last layer) on 2 and
4 stages under GPipe and 1F1B, 2 stages x 2 data-parallel ranks with ZeRO-1; the reference is the
same PipelineModule built with one stage in this process (seed_layers gives every layer the same
initial weights however the layers are split). Also: stage balance, 1F1B's in-flight bound, and
the errors for bad setups.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import zerotune
from tests.harness import run_distributed
from tests.models import Trace, assert_close_traces, mse, pipeline_layers
from zerotune.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from zerotune.pipe.partition import PartitionError, balanced_boundaries
from zerotune.pipe.schedule import ScheduleError, build_schedule, max_in_flight

STEPS, GAS, CLIP, ROWS, WIDTH = 6, 4, 0.5, 8, 16


def _pipe(stages: int, checkpoint_interval: int = 0) -> PipelineModule:
    return PipelineModule(pipeline_layers(WIDTH), num_stages=stages, loss_fn=mse, seed_layers=True, base_seed=7,
                          activation_checkpoint_interval=checkpoint_interval)


def _micro_batch(step: int, micro: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(rows, WIDTH, generator=generator), torch.randn(rows, WIDTH, generator=generator)


def _reference() -> Trace:
    model = _pipe(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for micro in range(GAS):
            x, y = _micro_batch(step, micro, ROWS)
            loss = mse(model(x), y)
            (loss / GAS).backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / GAS)
    return Trace(losses, norms)


def _config(schedule: str, stage: int, dp: int) -> dict:
    return {"train_micro_batch_size_per_gpu": ROWS // dp, "gradient_accumulation_steps": GAS,
            "gradient_clipping": CLIP, "zero_optimization": {"stage": stage}, "pipeline": {"schedule": schedule},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}


def _batches(engine, step: int):
    dp = engine.mpu.get_data_parallel_world_size()
    rank, rows = engine.mpu.get_data_parallel_rank(), ROWS // dp
    return iter([tuple(t[rank * rows:(rank + 1) * rows] for t in _micro_batch(step, m, ROWS)) for m in range(GAS)])


def _train(engine, steps: range) -> Trace:
    import torch.distributed as dist

    losses, norms = [], []
    for step in steps:
        total = engine.train_batch(_batches(engine, step)).detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
        norms.append(engine.get_global_grad_norm())
    return Trace(losses, norms)


def _engine(stages: int, schedule: str, zero_stage: int, checkpoint_interval: int = 0):
    import torch.distributed as dist

    dp = dist.get_world_size() // stages
    engine, *_ = zerotune.initialize(model=_pipe(stages, checkpoint_interval), config=_config(schedule, zero_stage, dp))
    return engine


def _pipeline_run(stages: int, schedule: str, zero_stage: int, checkpoint_interval: int = 0) -> Trace:
    return _train(_engine(stages, schedule, zero_stage, checkpoint_interval), range(STEPS))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_pipeline_module_matches_single_process(stages, schedule):
    expected = _reference()
    for trace in run_distributed(_pipeline_run, stages, stages, schedule, 0, timeout=180):
        assert_close_traces(trace, expected, rel=1e-5)


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_two_stages_by_two_data_parallel_ranks_with_zero_matches_single_process(zero_stage):
    expected = _reference()
    for trace in run_distributed(_pipeline_run, 4, 2, "1f1b", zero_stage, timeout=180):
        assert_close_traces(trace, expected, rel=1e-5)


def _zero2_state(zero_stage: int) -> dict:
    engine = _engine(2, "1f1b", zero_stage)
    _train(engine, range(1))
    breakdown = engine.memory_breakdown()
    engine.destroy()
    return breakdown


def test_pipeline_zero2_keeps_only_a_gradient_slice_per_rank():
    zero1, zero2 = run_distributed(_zero2_state, 4, 1)[0], run_distributed(_zero2_state, 4, 2)[0]
    assert zero2["grads"] < zero1["grads"] and zero2["optimizer_state"] == zero1["optimizer_state"]


def test_activation_checkpoint_interval_recomputes_and_still_matches():
    expected = _reference()
    for trace in run_distributed(_pipeline_run, 2, 2, "1f1b", 0, 2, timeout=180):
        assert_close_traces(trace, expected, rel=1e-5)


def _save_resume_and_eval(zero_stage: int, directory: str) -> tuple[list[float], list[float], float]:
    engine = _engine(2, "1f1b", zero_stage)
    _train(engine, range(3))
    engine.save_checkpoint(directory, tag="t")
    first = _train(engine, range(3, 6))
    resumed = _engine(2, "1f1b", zero_stage)
    resumed.load_checkpoint(directory, tag="t")
    second = _train(resumed, range(3, 6))
    evaluated = resumed.eval_batch(_batches(resumed, 99)).item()
    return first.losses + first.grad_norms, second.losses + second.grad_norms, evaluated


@pytest.mark.parametrize("zero_stage, world", [(0, 2), pytest.param(1, 4, marks=pytest.mark.slow)])
def test_checkpoint_resume_is_bit_identical_and_eval_batch_returns_the_loss_on_every_rank(zero_stage, world, tmp_path):
    results = run_distributed(_save_resume_and_eval, world, zero_stage, str(tmp_path), timeout=240)
    assert {f"model_states_stage{s}.pt" for s in (0, 1)} <= {p.name for p in (tmp_path / "t").iterdir()}
    reference = _pipe(1)  # the eval loss equals the single-process model's after the same 6 steps
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(STEPS):
        for micro in range(GAS):
            x, y = _micro_batch(step, micro, ROWS)
            (mse(reference(x), y) / GAS).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        expected_eval = sum(mse(reference(x), y).item() for x, y in (_micro_batch(99, m, ROWS) for m in range(GAS))) / GAS
    for first, second, evaluated in results:
        assert first == second
        assert abs(evaluated - expected_eval) <= 1e-5 * expected_eval


# ----------------------------------------------------------------------------- pure parts


def test_parameters_partition_balances_within_one_layer():
    rng = random.Random(0)
    for _ in range(300):
        counts = [rng.randint(0, 1000) for _ in range(rng.randint(2, 30))]
        stages = rng.randint(1, len(counts))
        bounds = balanced_boundaries(counts, stages)
        loads = [sum(counts[bounds[s]:bounds[s + 1]]) for s in range(stages)]
        assert all(bounds[s] < bounds[s + 1] for s in range(stages))  # every stage owns a layer
        assert max(loads) <= sum(counts) / stages + max(counts)


def test_one_f_one_b_holds_at_most_p_micro_batches_and_gpipe_holds_all():
    for stage in range(4):
        assert max_in_flight(build_schedule("1f1b", 8, 4, stage)) == 4 - stage
        assert max_in_flight(build_schedule("gpipe", 8, 4, stage)) == 8


def test_more_stages_than_layers_is_refused():
    with pytest.raises(PartitionError, match="5 pipeline stages but only 4 layer"):
        balanced_boundaries([1, 1, 1, 1], 5)


def test_1f1b_with_fewer_micro_batches_than_stages_holds_them_all_on_the_early_stages():
    """As DeepSpeed's TrainSchedule: a stage whose warm-up covers every micro-batch runs GPipe's order."""
    assert build_schedule("1f1b", 2, 4, 0) == build_schedule("gpipe", 2, 4, 0)
    assert [max_in_flight(build_schedule("1f1b", 2, 4, stage)) for stage in range(4)] == [2, 2, 2, 1]
    with pytest.raises(ScheduleError, match="0 micro-batches, 4 stages"):
        build_schedule("1f1b", 0, 4, 0)


def test_tied_layer_specs_of_different_shapes_are_refused():
    layers = [TiedLayerSpec("proj", nn.Linear, 4, 8), LayerSpec(nn.Tanh), TiedLayerSpec("proj", nn.Linear, 8, 8)]
    with pytest.raises(ValueError, match="TiedLayerSpec key 'proj': layer 2 .* shapes"):
        PipelineModule(layers, num_stages=1)


def _initialize_error(config_change: dict, stages: int) -> str:
    try:
        zerotune.initialize(model=_pipe(stages), config={**_config("1f1b", 0, 1), **config_change})
    except Exception as error:  # noqa: BLE001 - the message is what is tested
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize("change, expected", [
    ({"zero_optimization": {"stage": 3}}, "3 with pipeline parallelism is not supported yet"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     "optimizer offload with pipeline parallelism at ZeRO stage 2 is not supported yet"),
])
def test_bad_pipeline_setups_are_refused_at_initialize(change, expected):
    for message in run_distributed(_initialize_error, 2, change, 2, timeout=120):
        assert expected in message, message


def _micro_step_api_and_hooks() -> dict:
    from zerotune.engine import Engine

    engine = _engine(2, "1f1b", 1)
    steps = []
    engine.register_post_step_hook(lambda e: steps.append(e.global_steps))
    engine.train_batch(_batches(engine, 0))
    errors = {}
    try:
        engine(torch.zeros(1, WIDTH))
    except RuntimeError as error:
        errors["call"] = str(error)
    for name in ("backward", "step"):
        try:
            getattr(engine, name)
        except AttributeError as error:
            errors[name] = str(error)
    result = {"is_engine": isinstance(engine, Engine), "hooked": steps, "errors": errors}
    engine.destroy()
    return result


def test_the_pipeline_engine_is_the_step_core_with_a_schedule_not_a_disabled_engine():
    """PipelineEngine shares the step core (post-step hooks run after train_batch) and has no micro-step API:
    calling it, or asking for backward / step, says to use train_batch."""
    result = run_distributed(_micro_step_api_and_hooks, 2)[0]
    assert not result["is_engine"] and result["hooked"] == [1]
    assert set(result["errors"]) == {"call", "backward", "step"}
    assert all("train_batch" in message for message in result["errors"].values())
