"""DeepSpeed-style client snippets (the engine loop, the ZeRO optimizer driven like a torch optimizer, the
pipeline engine, imported as ``deepspeed.*`` paths) run with only the module name changed (deepspeed -> zerotune),
and match single-process PyTorch as the other parity tests do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed
from tests.models import (Trace, assert_close_traces, engine_run, gpt2_batch, loss_of, make_gpt2, make_mlp,
                          mlp_batch, rank_slice, reference_run)

STEPS, ROWS = 5, 4


def _mlp_reference() -> Trace:
    model = make_mlp()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    return reference_run(model, optimizer, mlp_batch, steps=STEPS, gas=1, global_rows=ROWS, clip=0.0)


def _zero_optimizer_snippet(nvme_dir: str, through: str) -> Trace:
    from zerotune.pt import DeepSpeedZeROOptimizer  # the seed: from deepspeed.pt import DeepSpeedZeROOptimizer

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = make_mlp()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    zero_config = {"stage": 3, "offload_optimizer": {"device": "cpu"},
                   "offload_param": {"device": "nvme", "nvme_path": f"{nvme_dir}/rank{rank}"},
                   "stage3_param_persistence_threshold": 0}
    optimizer = DeepSpeedZeROOptimizer(model, optimizer, zero_config)
    losses, norms = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = loss_of(optimizer.module, rank_slice(mlp_batch(step, 0, ROWS), rank, world))
        if through == "optimizer":
            optimizer.backward(loss)
        else:
            loss.backward()
        optimizer.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
        norms.append(optimizer.engine.get_global_grad_norm())
    placement = (optimizer.engine.zero_optimization_stage(), optimizer.engine.zero_cpu_offload())
    optimizer.engine.destroy()
    assert placement == (3, True)
    return Trace(losses, norms)


@pytest.mark.parametrize("through", ["optimizer", "loss"])
def test_zero_optimizer_snippet_stage3_cpu_optimizer_nvme_params(through: str, tmp_path: Path) -> None:
    for trace in run_distributed(_zero_optimizer_snippet, 2, str(tmp_path), through):
        assert_close_traces(trace, _mlp_reference(), rel=1e-5)


def _engine_initialize_snippet(precision: str) -> Trace:
    from zerotune import DeepSpeedEngine  # the seed: DeepSpeedEngine.initialize(..., config_params=ds_config)

    ds_config = {"train_batch_size": 4, "gradient_accumulation_steps": 2, "steps_per_print": 2,
                 "wall_clock_breakdown": True,
                 "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
                 "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8}}
    model = make_gpt2()
    engine, optimizer, _, _ = DeepSpeedEngine.initialize(model=model, model_parameters=model.parameters(),
                                                         config_params=ds_config)
    assert engine.wall_clock_breakdown() and engine.fp16_enabled() == (precision == "fp16")
    trace = engine_run(engine, gpt2_batch, steps=STEPS, gas=2, global_rows=2)
    engine.destroy()
    return trace


def test_engine_initialize_snippet_fp16_within_two_percent_of_fp32() -> None:
    model = make_gpt2()
    reference = reference_run(model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0), gpt2_batch,
                              steps=STEPS, gas=2, global_rows=2, clip=0.0)
    fp32 = run_distributed(_engine_initialize_snippet, 2, "fp32")
    fp16 = run_distributed(_engine_initialize_snippet, 2, "fp16")
    for trace in fp32:
        assert_close_traces(trace, reference, rel=1e-5)
    for trace in fp16:
        assert_close_traces(trace, reference, rel=0.02)


def test_zero_optimizer_refuses_accumulation_and_bad_configs() -> None:
    from zerotune.compat.pt import _config_of

    assert _config_of({"stage": 2})["zero_optimization"] == {"stage": 2}
    assert _config_of({"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 2})[
        "train_micro_batch_size_per_gpu"] == 2
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be 1"):
        _config_of({"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 2})
    with pytest.raises(TypeError, match="zero_config must be a dict"):
        _config_of([1])


def _pipeline_engine_snippet() -> Trace:
    from zerotune.runtime.pipe.engine import PipelineEngine  # the seed: from deepspeed.runtime.pipe.engine import ...

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8, "steps_per_print": 100,
              "pipeline": {"stages": 4}, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}
    engine = PipelineEngine(make_gpt2(), config=config)
    mpu = engine.mpu
    assert (mpu.get_pipe_parallel_world_size(), mpu.get_data_parallel_world_size()) == (4, 2)
    assert engine.zero_optimization_stage() == 2
    rank, losses, norms = mpu.get_data_parallel_rank(), [], []
    for step in range(3):
        batches = iter([rank_slice(gpt2_batch(step, m, 8), rank, 2) for m in range(8)])
        total = engine.train_batch(batches).detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / torch.distributed.get_world_size())
        norms.append(engine.get_global_grad_norm())
    engine.destroy()
    return Trace(losses, norms)


@pytest.mark.slow
def test_pipeline_engine_snippet_four_stages_zero2_on_eight_ranks() -> None:
    model = make_gpt2()
    reference = reference_run(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01), gpt2_batch,
                              steps=3, gas=8, global_rows=8, clip=0.0)
    for trace in run_distributed(_pipeline_engine_snippet, 8, timeout=400):
        assert_close_traces(trace, reference, rel=1e-5)


def _pipeline_engine_needs_a_pipelined_model() -> str:
    from zerotune.runtime.pipe.engine import PipelineEngine

    try:
        PipelineEngine(make_mlp(), config={"train_micro_batch_size_per_gpu": 1})
    except ValueError as error:
        return str(error)
    return "no error"


def test_pipeline_engine_refuses_a_model_without_stages() -> None:
    assert "needs a pipelined model" in run_distributed(_pipeline_engine_needs_a_pipelined_model, 1)[0]
