"""The engine members DeepSpeed scripts (and HF accelerate) call, with DeepSpeed's behaviour, on 2 ranks."""

from __future__ import annotations

import logging

import pytest
import torch

import zerotune
from tests.harness import run_distributed
from tests.logs import recorded_messages
from tests.models import (Trace, assert_close_traces, loss_of, make_mlp, mlp_batch, mlp_param_groups, rank_slice,
                          reference_run)

STEPS, GAS, ROWS = 6, 2, 4
ADAMW = {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}


def _config(stage: int, gas: int = GAS, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": ROWS // 2, "gradient_accumulation_steps": gas, "gradient_clipping": 0.5,
            "optimizer": {"type": "AdamW", "params": ADAMW}, "steps_per_print": 1000,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 0},
            **extra}


def _reference(gas: int = GAS) -> Trace:
    model = make_mlp()
    optimizer = torch.optim.AdamW(mlp_param_groups(model), **{**ADAMW, "betas": tuple(ADAMW["betas"])})
    return reference_run(model, optimizer, mlp_batch, steps=STEPS, gas=gas, global_rows=ROWS, clip=0.5)


def _accelerate_style_loop(stage: int) -> Trace:
    """HF Trainer + accelerate: the caller divides by GAS, passes scale_wrt_gas=False, sets the boundary
    on every micro-step and calls step() only at the boundary."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = make_mlp()
    engine, *_ = zerotune.initialize(model=model, model_parameters=mlp_param_groups(model), config=_config(stage))
    losses, norms = [], []
    for step in range(STEPS):
        total = torch.zeros(())
        for micro in range(GAS):
            boundary = micro == GAS - 1
            engine.set_gradient_accumulation_boundary(is_boundary=boundary)
            loss = loss_of(engine, rank_slice(mlp_batch(step, micro, ROWS), rank, world))
            returned = engine.backward(loss / GAS, scale_wrt_gas=False)
            assert torch.equal(returned, loss / GAS)  # scale_wrt_gas=False: returned unscaled
            if boundary:
                engine.step()
            total += loss.detach()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / GAS / world)
        norms.append(engine.get_global_grad_norm())
    engine.destroy()
    return Trace(losses, norms)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_boundary_set_by_the_caller_matches_single_process(stage: int) -> None:
    traces = run_distributed(_accelerate_style_loop, 2, stage)
    for trace in traces:
        assert_close_traces(trace, _reference(), rel=1e-5)


def _no_sync_loop(stage: int) -> dict:
    """GAS 1 in the config, two micro-batches accumulated by hand: the first inside no_sync()."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = make_mlp()
    engine, *_ = zerotune.initialize(model=model, model_parameters=mlp_param_groups(model), config=_config(stage, gas=1))
    losses, norms, bytes_inside = [], [], 0
    for step in range(STEPS):
        first = loss_of(engine, rank_slice(mlp_batch(step, 0, ROWS), rank, world))
        zerotune.comm.reset_comm_stats()
        with engine.no_sync():
            engine.backward(first / 2)
            with pytest.raises(RuntimeError, match="inside no_sync context manager"):
                engine.step()
        bytes_inside += zerotune.comm.total_comm_bytes()
        second = loss_of(engine, rank_slice(mlp_batch(step, 1, ROWS), rank, world))
        engine.backward(second / 2)
        engine.step()
        total = (first + second).detach() / 2
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
        norms.append(engine.get_global_grad_norm())
    engine.destroy()
    return {"trace": Trace(losses, norms), "bytes_inside": bytes_inside}


@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_accumulates_locally_and_matches_single_process(stage: int) -> None:
    for out in run_distributed(_no_sync_loop, 2, stage):
        assert out["bytes_inside"] == 0
        assert_close_traces(out["trace"], _reference(), rel=1e-5)


def _no_sync_refused(stage: int) -> str:
    engine, *_ = zerotune.initialize(model=make_mlp(), config=_config(stage))
    try:
        with engine.no_sync():
            pass
    except RuntimeError as error:
        return str(error)
    finally:
        engine.destroy()
    return "no error"


@pytest.mark.parametrize("stage", [2, 3])
def test_no_sync_is_refused_where_gradients_are_partitioned(stage: int) -> None:
    message = run_distributed(_no_sync_refused, 2, stage)[0]
    assert f"incompatible with ZeRO stage {stage}" in message


def _members() -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out: dict = {}
    model = make_mlp()
    client = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorded_messages() as messages:
        engine, optimizer, _, _ = zerotune.initialize(model=model, optimizer=client, config=_config(1))
    out["client_used"] = optimizer is client and engine.optimizer_name() == "SGD"
    out["client_warning"] = [m for m in messages if "no effect" in m]
    engine.destroy()

    model = make_mlp()
    dataset = [(mlp_batch(0, i, 1)["x"][0], mlp_batch(0, i, 1)["y"][0]) for i in range(32)]
    engine, _, loader, _ = zerotune.initialize(model=model, model_parameters=mlp_param_groups(model),
                                               training_data=dataset, config=_config(2))
    out["optimizer_name"] = engine.optimizer_name()
    out["partition_gradients"] = engine.zero_optimization_partition_gradients()
    out["gather_on_save"] = engine.zero_gather_16bit_weights_on_model_save()
    out["dp_group_size"] = torch.distributed.get_world_size(engine.get_data_parallel_group())
    out["wall_clock_breakdown"] = engine.wall_clock_breakdown()
    out["loss_scale"] = engine.get_loss_scale()
    calls = []
    remove = engine.register_post_step_hook(lambda e: calls.append(e.global_steps))
    seen = []
    engine.set_data_post_process_func(lambda batch, state: seen.append(len(batch)) or batch)
    batches = iter(loader)
    returned = []
    for _ in range(3 * GAS):
        x, y = next(batches)
        loss = engine(x, y)
        returned.append(torch.equal(engine.backward(loss), loss / GAS))
        engine.step()
    out["backward_returns_loss_over_gas"] = all(returned)
    out["post_step_calls"] = list(calls)
    remove()
    out["post_processed"] = len(seen)
    out["samples_per_sec_positive"] = engine.tput_timer.avg_samples_per_sec() > 0
    engine.set_train_batch_size(2 * engine.train_batch_size())
    out["after_resize"] = (engine.train_batch_size(), engine.gradient_accumulation_steps())
    with pytest.raises(ValueError, match="multiple of train_micro_batch_size_per_gpu x data-parallel size = 4"):
        engine.set_train_batch_size(6)
    eval_batches = iter([rank_slice(mlp_batch(9, m, ROWS), rank, world) for m in range(2 * GAS)])
    out["eval"] = engine.eval_batch(eval_batches, num_micro_batches=2).item()
    expected = torch.stack([loss_of(engine, rank_slice(mlp_batch(9, m, ROWS), rank, world)).detach()
                            for m in range(2)]).mean()
    torch.distributed.all_reduce(expected)
    out["eval_expected"] = expected.item() / world
    engine.destroy()
    return out


def test_engine_members_behave_as_deepspeed() -> None:
    results = run_distributed(_members, 2)
    # a client optimizer given with a config block is used, and the block reported (rank 0 logs)
    assert results[0]["client_used"] and len(results[0]["client_warning"]) == 1
    assert "using the client optimizer" in results[0]["client_warning"][0] and results[1]["client_warning"] == []
    for out in results:
        assert out["optimizer_name"] == "adamw" and out["partition_gradients"] and not out["gather_on_save"]
        assert out["dp_group_size"] == 2 and out["wall_clock_breakdown"] is False and out["loss_scale"] == 1.0
        assert out["backward_returns_loss_over_gas"] and out["post_step_calls"] == [1, 2, 3]
        assert out["post_processed"] == 3 * GAS and out["samples_per_sec_positive"]
        assert out["after_resize"] == (16, 4)
        assert out["eval"] == pytest.approx(out["eval_expected"], rel=1e-6)


def _tags(policy: str, directory: str) -> str:
    import os

    engine, *_ = zerotune.initialize(model=make_mlp(), config=_config(0, checkpoint={"tag_validation": policy}))
    rank = torch.distributed.get_rank()
    try:
        with recorded_messages(level=logging.WARNING) as messages:
            engine.save_checkpoint(directory, tag=f"t{rank}")
    except Exception as error:  # noqa: BLE001 - the message is the result
        return f"error: {error}"
    finally:
        engine.destroy()
    return f"saved {sorted(os.listdir(directory))} {messages}"


@pytest.mark.parametrize("policy", ["Ignore", "Warn", "Fail"])
def test_checkpoint_tag_validation_is_honoured(policy: str, tmp_path) -> None:
    results = run_distributed(_tags, 2, policy, str(tmp_path))
    if policy == "Fail":
        assert all("ranks passed different checkpoint tags: ['t0', 't1'] (checkpoint.tag_validation is Fail)" in r
                   for r in results)
        return
    assert all(r.startswith("saved ['latest', 't0']") for r in results)  # one whole checkpoint, rank 0's tag
    warned = "saving every rank under rank 0's tag 't0'" in results[0]
    assert warned == (policy == "Warn")
