"""``engine.offload_states()`` / ``reload_states()`` (DeepSpeed's API, issue 28): every included state leaves its
storage, excluded ones stay, reloading restores the values, and training continues bit-identically, at ZeRO 0-3
on 2 ranks. On this CPU-only machine the engine's device is the host, and the same code runs: each state's bytes go
to a separate host buffer and its storage is freed (0 bytes), which is what these tests check."""

from __future__ import annotations

import pytest
import torch

import zerotune
from tests.harness import run_distributed
from tests.models import loss_of, make_mlp, mlp_batch, mlp_param_groups, rank_slice
from zerotune.compat.offload_states import OffloadDeviceEnum, OffloadStateTypeEnum, get_state_devices
from zerotune.offload.storage_mover import move_to_host, restore
from zerotune.zero.offloadable import STATE_KINDS

STEPS, GAS, ROWS = 3, 2, 4
ADAMW = {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}
MOVED = ("optim_states", "hp_params", "lp_params", "lp_grads")


def _config(stage: int, precision: str, offload: str = "none") -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 300, "overlap_comm": True}  # stage 2: reductions in flight
    if offload != "none":
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload == "params":
        zero["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": ROWS // 2, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.5,
            "optimizer": {"type": "AdamW", "params": ADAMW}, "steps_per_print": 1000, "zero_optimization": zero,
            "bf16": {"enabled": precision == "bf16"}}


def _engine(stage: int, precision: str, offload: str = "none"):
    model = make_mlp()
    engine, *_ = zerotune.initialize(model=model, model_parameters=mlp_param_groups(model),
                                     config=_config(stage, precision, offload))
    return engine


def _holders(engine) -> dict[str, list[torch.Tensor]]:
    """Each kind's tensors, listed here independently of zero/offloadable.py."""
    state, sync, stage = engine.state, engine.state._grad_sync, engine.zero_optimization_stage()
    grads = {0: lambda: [b.buffer for b in sync.buckets.buckets], 1: lambda: list(sync.grad_buffers),
             2: lambda: list(sync.grad_shards), 3: lambda: [u.grad_shard for u in state.units if u.trainable]}
    params = ([s.local for u in state.units for s in u.segments] if stage == 3 else list(engine.module.parameters()))
    return {"lp_params": params, "lp_grads": grads[stage](),
            "hp_params": list(state.masters) if engine.bf16_enabled() and not engine.zero_cpu_offload() else [],
            "optim_states": [v for s in engine.optimizer.state.values() for v in s.values() if v.dim() > 0]}


def _check_one_kind_at_a_time(engine) -> None:
    """Offload each kind alone: its storages are freed and its tensors read their values from the host copy; the
    other kinds' storages are untouched; after reload every tensor is back on its own storage, values equal."""
    for kind in MOVED:
        holders = _holders(engine)
        before = {k: [(t, t.untyped_storage(), t.untyped_storage().data_ptr(), t.detach().clone()) for t in ts]
                  for k, ts in holders.items()}
        assert all(ts for k, ts in holders.items() if k != "hp_params"), holders
        engine.offload_states(include=[OffloadStateTypeEnum(kind)])
        assert engine.offloaded_states == {kind} and get_state_devices(engine, kind) == {torch.device("cpu")}
        for other, entries in before.items():
            for tensor, storage, pointer, values in entries:
                if other == kind:
                    assert storage.nbytes() == 0, (kind, tuple(tensor.shape))
                    assert tensor.untyped_storage().data_ptr() != pointer and torch.equal(tensor, values)
                else:
                    assert tensor.untyped_storage().data_ptr() == pointer and storage.nbytes() > 0, (kind, other)
        engine.reload_states()
        assert engine.offloaded_states == frozenset()
        for entries in before.values():
            for tensor, storage, _, values in entries:
                assert tensor.untyped_storage().data_ptr() == storage.data_ptr() and torch.equal(tensor, values)


def _check_refusals(engine, batch: dict) -> None:
    with pytest.raises(ValueError, match=r"unknown state 'optimizer'; valid: optim_states, hp_params, lp_params, "
                                         r"lp_grads, contiguous_grad_buffer"):
        engine.offload_states(include=["optimizer"])
    with pytest.raises(ValueError, match="device='nvme'.*not supported"):
        engine.offload_states(device=OffloadDeviceEnum.nvme)
    with pytest.raises(ValueError, match=r"device='cuda:0'.*valid: 'cpu'"):
        engine.offload_states(device=torch.device("cuda:0"))
    engine.offload_states(device="none")  # DeepSpeed's rule: a warning, nothing moved
    assert engine.offloaded_states == frozenset()
    engine.offload_states(include="optim_states")
    with pytest.raises(RuntimeError, match=r"engine.step\(\): optim_states is offloaded .*reload_states\(\) first"):
        engine.step()
    with pytest.raises(RuntimeError, match=r"save_checkpoint\(\): optim_states is offloaded"):
        engine.save_checkpoint("/nonexistent")
    engine.offload_states(include=["lp_grads", "lp_params"])
    with pytest.raises(RuntimeError, match=r"engine.forward\(\): lp_params is offloaded"):
        engine(**batch)
    with pytest.raises(RuntimeError, match=r"engine.backward\(\): lp_params, lp_grads are offloaded"):
        engine.backward(torch.zeros((), requires_grad=True))
    engine.reload_states()


def _run(stage: int, precision: str, offload: bool, checks: bool) -> dict:
    """``STEPS`` optimizer steps of GAS micro-steps; with ``offload``, states leave and come back at each phase
    boundary an RLHF loop would use (after a backward, after a step around a no-grad 'generation' forward)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    engine = _engine(stage, precision)
    losses, norms, scratch = [], [], []
    for step in range(STEPS):
        for micro in range(GAS):
            batch = rank_slice(mlp_batch(step, micro, ROWS), rank, world)
            loss = loss_of(engine, batch)
            engine.backward(loss)
            if offload:  # the gradients (the boundary's reductions still in flight at stages 0 and 2)
                held = engine.memory_breakdown()["comm_buffers"]
                engine.offload_states(include=[OffloadStateTypeEnum.lp_grads, "contiguous_grad_buffer"])
                scratch.append((held, engine.memory_breakdown()["comm_buffers"]))
                engine.reload_states()
            engine.step()
            losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
        if offload and checks and step == 1:
            _check_one_kind_at_a_time(engine)
            _check_refusals(engine, batch)
        if offload:  # "generation": the optimizer side is away, the model still runs
            engine.offload_states(include=[OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params],
                                  pin_memory=True, non_blocking=True)
        with torch.no_grad():
            losses.append(loss_of(engine, batch).item())
        if offload:
            engine.offload_states()  # the rest too
            assert engine.offloaded_states == set(STATE_KINDS)
            engine.reload_states(non_blocking=True)
    with zerotune.zero.GatheredParameters(list(engine.module.parameters())):
        weights = [p.detach().clone() for p in engine.module.parameters()]
    engine.destroy()
    return {"losses": losses, "norms": norms, "weights": weights, "scratch": scratch}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_training_after_offload_and_reload_is_bit_identical(stage: int, precision: str) -> None:
    plain = run_distributed(_run, 2, stage, precision, False, False)
    moved = run_distributed(_run, 2, stage, precision, True, True)
    for ours, reference in zip(moved, plain):
        assert ours["losses"] == reference["losses"] and ours["norms"] == reference["norms"]
        assert all(torch.equal(a, b) for a, b in zip(ours["weights"], reference["weights"]))
        if stage >= 2:  # the reduction scratch was freed (stage 3: gathered units released too)
            assert all(after == 0 for _, after in ours["scratch"]) and any(held for held, _ in ours["scratch"])


def _with_offloaded_optimizer(stage: int) -> dict:
    """``offload_optimizer: cpu`` keeps masters and optimizer state on the host already: left out, as in DeepSpeed."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    engine = _engine(stage, "bf16", offload="optimizer")
    batch = rank_slice(mlp_batch(0, 0, ROWS), rank, world)
    for _ in range(GAS):
        engine.backward(loss_of(engine, batch))
        engine.step()
    masters = [(m.untyped_storage().data_ptr(), m.detach().clone()) for m in engine.state.masters]
    engine.offload_states()
    out = {"offloaded": sorted(engine.offloaded_states),
           "masters_kept": all(m.untyped_storage().data_ptr() == p and torch.equal(m, v)
                               for m, (p, v) in zip(engine.state.masters, masters))}
    engine.reload_states()
    engine.backward(loss_of(engine, batch))
    engine.destroy()
    engine = _engine(3, "bf16", offload="params")
    try:
        engine.offload_states()
    except RuntimeError as error:
        out["offload_param"] = str(error)
    finally:
        engine.destroy()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_states_offload_optimizer_keeps_on_the_host_are_left_out(stage: int) -> None:
    out = run_distributed(_with_offloaded_optimizer, 2, stage)[0]
    assert out["offloaded"] == ["contiguous_grad_buffer", "lp_grads", "lp_params"] and out["masters_kept"]
    assert "offload_param.device is 'cpu'" in out["offload_param"]


def test_the_mover_restores_every_view_and_carries_host_writes_back() -> None:
    flat = torch.arange(12, dtype=torch.float32)
    named, unnamed = flat[2:6].view(2, 2), flat[4:10]
    other = torch.ones(3)
    moved = move_to_host([flat, named], torch.device("cpu"), pin_memory=True, non_blocking=False)
    assert moved.nbytes == 48 and flat.untyped_storage().nbytes() == 48  # (flat now reads the host copy)
    assert unnamed.untyped_storage().nbytes() == 0 and torch.equal(named, torch.tensor([[2.0, 3.0], [4.0, 5.0]]))
    named[0, 0] = 100.0  # a write while offloaded is what comes back
    again = move_to_host([named, other], torch.device("cpu"), pin_memory=False, non_blocking=False,
                         keep=moved.host_buffers)
    assert again.nbytes == 12  # (named already points into a host copy: not moved twice)
    restore(again, non_blocking=False)
    restore(moved, non_blocking=False)
    assert unnamed.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert torch.equal(unnamed, torch.arange(4.0, 10.0))
    assert flat[2].item() == 100.0 and torch.equal(other, torch.ones(3))


def test_deepspeed_spellings_resolve_through_the_alias_and_name_the_same_kinds() -> None:
    from zerotune.compat.alias import install_deepspeed_alias, uninstall_deepspeed_alias

    install_deepspeed_alias()
    try:
        from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum as Device
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as Kind
        from deepspeed.runtime.zero.offload_states import get_state_devices as devices
    finally:
        uninstall_deepspeed_alias()
    assert Kind is OffloadStateTypeEnum and devices is get_state_devices and Device.cpu == "cpu"
    assert tuple(kind.value for kind in Kind) == STATE_KINDS  # the engine's plain names, in DeepSpeed's order
    assert DeepSpeedZeroOffloadOptimizerConfig(device="cpu", pin_memory=True).device == "cpu"



def _empty_partition_cache(empty: bool) -> dict:
    """Stage 3 with every unit persistent (threshold above the model): after a forward all stay gathered until
    ``empty_partition_cache`` frees them; the next step gathers again and trains as if nothing happened."""
    from zerotune.zero.stage3.ds_markers import ZeroParamStatus

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    config = _config(3, "fp32")
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 10 ** 9
    model = make_mlp()
    engine, *_ = zerotune.initialize(model=model, model_parameters=mlp_param_groups(model), config=config)
    statuses, losses = [], []
    for step in range(STEPS):
        for micro in range(GAS):
            loss = loss_of(engine, rank_slice(mlp_batch(step, micro, ROWS), rank, world))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        with torch.no_grad():
            losses.append(loss_of(engine, rank_slice(mlp_batch(step, 0, ROWS), rank, world)).item())
        if empty:
            before = {p.ds_status for p in engine.module.parameters()}
            engine.empty_partition_cache()
            statuses.append((before, {p.ds_status for p in engine.module.parameters()}))
    engine.destroy()
    return {"statuses": statuses, "losses": losses, "gathered": {ZeroParamStatus.AVAILABLE},
            "freed": {ZeroParamStatus.NOT_AVAILABLE}}


def test_empty_partition_cache_frees_every_gathered_parameter_and_training_goes_on() -> None:
    emptied = run_distributed(_empty_partition_cache, 2, True)[0]
    assert emptied["statuses"] and all(before == emptied["gathered"] and after == emptied["freed"]
                                       for before, after in emptied["statuses"])
    assert emptied["losses"] == run_distributed(_empty_partition_cache, 2, False)[0]["losses"]
