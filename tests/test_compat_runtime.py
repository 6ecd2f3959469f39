"""The DeepSpeed names beyond the engine: accelerator, optimizers, topologies, groups, RNG tracker,
``DeepSpeedConfig``, ZeRO-3 leaf modules and external parameters."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import zerotune
from tests.harness import run_distributed
from tests.logs import recorded_messages
from tests.models import Trace, assert_close_traces, loss_of, rank_slice, reference_run
from zerotune.compat import checkpoint, checkpointing, groups, ops, pipe, runtime, utils
from zerotune.compat import zero as compat_zero
from zerotune.compat.accelerator import Accelerator, get_accelerator
from zerotune.zero.stage3.wrap import unit_module_names


def test_cpu_accelerator_answers_as_deepspeeds() -> None:
    accelerator = Accelerator("cpu")
    assert accelerator.device_name() == "cpu" and accelerator.device_name(0) == "cpu"
    assert accelerator.current_device_name() == "cpu" and accelerator.communication_backend_name() == "gloo"
    assert accelerator.is_available() and accelerator.is_bf16_supported() and accelerator.is_synchronized_device()
    accelerator.synchronize()
    accelerator.empty_cache()
    accelerator.manual_seed(3)
    first = torch.rand(2)
    accelerator.manual_seed(3)
    assert torch.equal(first, torch.rand(2))
    assert accelerator.total_memory() > accelerator.available_memory() > 0
    assert accelerator.max_memory_allocated() >= accelerator.memory_allocated() > 0
    tensor = torch.ones(2)
    assert accelerator.pin_memory(tensor) is tensor and not accelerator.is_pinned(tensor)
    assert accelerator.on_accelerator(tensor)
    with accelerator.stream(accelerator.Stream()):
        event = accelerator.Event(enable_timing=True)
        event.record()
    assert event.elapsed_time(event) == 0.0
    assert accelerator.FloatTensor(2, 3).shape == (2, 3) and accelerator.LongTensor([1]).dtype == torch.int64
    assert get_accelerator().device_name() == ("cuda" if torch.cuda.is_available() else "cpu")


def test_ds_accelerator_variable_is_checked(monkeypatch) -> None:
    from zerotune.compat import accelerator as module

    monkeypatch.setattr(module, "_current", None)
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='xpu' is not supported by zerotune; valid: cpu, cuda"):
        get_accelerator()
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert module.get_accelerator().device_name() == "cpu"


def _two_step_trace(make_optimizer) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = make_optimizer(model.parameters())
    for _ in range(3):
        model(torch.ones(2, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("cls", [ops.FusedAdam, ops.DeepSpeedCPUAdam])
def test_deepspeed_adams_are_torch_adam_with_deepspeeds_defaults(cls) -> None:
    mode = "adam_w_mode" if cls is ops.FusedAdam else "adamw_mode"
    decoupled = _two_step_trace(lambda p: cls(p, lr=0.1, weight_decay=0.1))
    expected = _two_step_trace(lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1))
    assert all(torch.equal(a, b) for a, b in zip(decoupled, expected))
    coupled = _two_step_trace(lambda p: cls(p, lr=0.1, weight_decay=0.1, **{mode: False}))
    expected = _two_step_trace(lambda p: torch.optim.Adam(p, lr=0.1, weight_decay=0.1))
    assert all(torch.equal(a, b) for a, b in zip(coupled, expected))
    with pytest.raises(ValueError, match=r"bias_correction=False\) is not supported"):
        cls([nn.Parameter(torch.ones(1))], bias_correction=False)


def test_config_adam_builds_deepspeeds_fused_adam_class() -> None:
    # DeepSpeed builds its FusedAdam for "Adam" / "AdamW" (its own test_ds_initialize checks the class)
    run_distributed(_fused_adam_built, 1)  # (initialize makes a process group: never in the pytest process)


def _fused_adam_built() -> None:
    model = nn.Linear(4, 2)
    _, optimizer, _, _ = zerotune.initialize(model=model, model_parameters=list(model.parameters()),
                                             config={"train_batch_size": 1, "optimizer": {"type": "Adam"}})
    assert isinstance(optimizer, ops.FusedAdam)
    _, optimizer, _, _ = zerotune.initialize(model=nn.Linear(4, 2), config={
        "train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"torch_adam": True}}})
    assert not isinstance(optimizer, ops.FusedAdam)  # torch_adam: DeepSpeed builds torch's own class


def test_the_returned_optimizer_carries_the_engines_loss_scaler_as_deepspeeds() -> None:
    run_distributed(_loss_scaler_on_the_optimizer, 1)


def _loss_scaler_on_the_optimizer() -> None:
    model = nn.Linear(4, 2)
    engine, optimizer, _, _ = zerotune.initialize(model=model, config={
        "train_batch_size": 1, "optimizer": {"type": "Adam"}, "zero_optimization": {"stage": 1},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 2}})
    assert optimizer.dynamic_loss_scale is True and optimizer.loss_scaler is engine.loss_scaler
    assert optimizer.loss_scaler.cur_scale == 2**8 and optimizer.loss_scaler.scale_window == 2
    for _ in range(3):
        engine.backward(engine(torch.ones(1, 4, dtype=torch.float16)).float().sum())
        engine.step()
    assert optimizer.loss_scaler.cur_iter == 3 and optimizer.loss_scaler.cur_scale == 2**9  # the window doubled it
    view = optimizer.loss_scale_config  # DeepSpeed 0.19's name for the same numbers
    assert (view.dynamic_loss_scale, view.cur_scale, view.cur_iter, view.scale_window) == (True, 2**9, 3, 2)
    _, static, _, _ = zerotune.initialize(model=nn.Linear(4, 2), config={"train_batch_size": 1,
                                                                         "optimizer": {"type": "SGD"}})
    assert static.dynamic_loss_scale is False and static.loss_scaler.cur_scale == 1.0


def test_deepspeed_zero_config_answers_deepspeeds_attribute_names() -> None:
    from zerotune.compat.zero_config import DeepSpeedZeroConfig, DeepSpeedZeroOffloadParamConfig

    config = DeepSpeedZeroConfig(stage3_prefetch_bucket_size=12345, stage3_param_persistence_threshold=7,
                                 stage3_gather_fp16_weights_on_model_save=True)
    assert config.prefetch_bucket_size == 12345 and config.param_persistence_threshold == 7
    assert config.gather_16bit_weights_on_model_save is True and config.pipeline_loading_checkpoint is False
    assert config.offload_param is None and config.offload_optimizer is None  # DeepSpeed's "no offload block"
    assert DeepSpeedZeroConfig(offload_param=None).offload_param is None
    assert isinstance(DeepSpeedZeroConfig(cpu_offload_param=True).offload_param, DeepSpeedZeroOffloadParamConfig)
    assert DeepSpeedZeroConfig(offload_param={}).offload_param.device == "none"


def test_cpu_adagrad_is_torch_adagrad_on_the_host() -> None:
    trace = _two_step_trace(lambda p: ops.DeepSpeedCPUAdagrad(p, lr=0.1, weight_decay=0.1))
    assert all(torch.equal(a, b) for a, b in zip(trace, _two_step_trace(
        lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-10, weight_decay=0.1))))
    embedding = nn.Embedding(8, 2, sparse=True)  # sparse gradients, as torch's Adagrad takes them
    optimizer = ops.DeepSpeedCPUAdagrad(embedding.parameters())
    embedding(torch.tensor([1, 3])).sum().backward()
    before = embedding.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(before[[1, 3]], embedding.weight[[1, 3]]) and torch.equal(before[0], embedding.weight[0])
    with pytest.raises(ValueError, match="amsgrad"):
        ops.DeepSpeedCPUAdagrad(embedding.parameters(), amsgrad=True)
    meta = nn.Parameter(torch.ones(2, device="meta"))
    meta.grad = torch.ones(2, device="meta")
    with pytest.raises(AssertionError, match="steps host parameters; one is on meta"):
        ops.DeepSpeedCPUAdagrad([meta]).step()


def test_fused_lamb_is_zerotunes_lamb() -> None:
    trace = _two_step_trace(lambda p: ops.FusedLamb(p, lr=0.01))
    from zerotune.optim import Lamb

    assert all(torch.equal(a, b) for a, b in zip(trace, _two_step_trace(lambda p: Lamb(p, lr=0.01))))


def _grid_answers() -> dict:
    import torch.distributed as dist

    from zerotune.compat.pipe_topology import PipelineParallelGrid

    grid = PipelineParallelGrid(topology=pipe.PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2))
    rank = torch.tensor([dist.get_rank()])
    sums = {}
    for name, group in (("pipe", grid.get_pipe_parallel_group()), ("data", grid.get_data_parallel_group()),
                        ("model", grid.get_model_parallel_group())):
        total = rank.clone()
        dist.all_reduce(total, group=group)
        sums[name] = total.item()
    default = PipelineParallelGrid()  # 4 = 2 x 2: pipe takes the first prime, data the second
    return {"stage": grid.get_stage_id(), "data": grid.get_data_parallel_rank(), "pp": grid.pp_group,
            "dp": grid.dp_group, "sums": sums, "first": grid.is_first_stage, "last": grid.is_last_stage,
            "to_global": [grid.stage_to_global(stage_id=s) for s in (0, 1)],
            "default": (default.get_pipe_parallel_world_size(), default.get_data_parallel_world_size()),
            "p2p": grid.p2p_groups}


def test_pipeline_parallel_grid_builds_deepspeeds_groups() -> None:
    from zerotune.compat.pipe_topology import _prime_factors

    assert _prime_factors(12) == [2, 2, 3] and _prime_factors(7) == [7] and _prime_factors(1) == []
    for rank, out in enumerate(run_distributed(_grid_answers, 4)):
        stage, data = divmod(rank, 2)  # axes pipe, data, model: pipe outermost
        assert (out["stage"], out["data"], out["first"], out["last"]) == (stage, data, stage == 0, stage == 1)
        assert out["pp"] == [data, 2 + data] and out["dp"] == [2 * stage, 2 * stage + 1]
        assert out["sums"] == {"pipe": 2 * data + 2, "data": 4 * stage + 1, "model": 2 * data + 2}
        assert out["to_global"] == [data, 2 + data] and out["default"] == (2, 2)
        assert out["p2p"] == [[0, 2], [1, 3], [2, 0], [3, 1]]


def test_process_topology_matches_deepspeeds_layout() -> None:
    topology = pipe.PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topology.world_size() == 8 and topology.get_axis_names() == ["pipe", "data", "model"]
    assert topology.get_rank(pipe=1, data=0, model=1) == 5
    assert topology.get_coord(5) == topology.ProcessCoord(pipe=1, data=0, model=1)
    assert topology.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topology.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topology.filter_match(pipe=0, model=1) == [1, 3] and topology.get_axis_list("data", 1) == [2, 3, 6, 7]
    assert topology.get_rank_repr(5) == "model_01" and topology.get_dim("tensor") == 0
    with pytest.raises(ValueError, match="outside the topology"):
        topology.get_rank(pipe=2, data=0, model=0)


def test_pipeline_module_takes_its_stages_from_a_topology() -> None:
    from zerotune.pipe.module import _stages_of_topology

    assert _stages_of_topology(pipe.PipeDataParallelTopology(num_pp=4, num_dp=2), None) == 4
    with pytest.raises(ValueError, match="contradicts the topology's pipe size 4"):
        _stages_of_topology(pipe.PipeDataParallelTopology(num_pp=4, num_dp=2), 2)
    with pytest.raises(ValueError, match="set tensor_parallel.autotp_size"):
        _stages_of_topology(pipe.PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1), None)


def test_rng_tracker_forks_a_separate_stream() -> None:
    tracker = checkpointing.get_cuda_rng_tracker()
    checkpointing.model_parallel_cuda_manual_seed(7)
    torch.manual_seed(7)
    plain = torch.rand(3)
    torch.manual_seed(7)
    with tracker.fork():
        forked = torch.rand(3)
    assert not torch.equal(plain, forked)
    assert torch.equal(torch.rand(3), plain)  # the default stream did not move
    with tracker.fork():
        assert not torch.equal(torch.rand(3), forked)  # the tracked stream advanced
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("model-parallel-rng", 99)


def test_clone_tensors_for_torch_save_copies_views() -> None:
    base = torch.arange(10.0)
    cloned = checkpoint.clone_tensors_for_torch_save({"a": [base[:2]], "b": (base[5:], 3)})
    assert cloned["a"][0].untyped_storage().nbytes() == 8 and cloned["b"][1] == 3
    assert torch.equal(cloned["b"][0], base[5:])


def test_deepspeed_config_exposes_deepspeeds_attributes() -> None:
    config = runtime.DeepSpeedConfig({"train_batch_size": 8, "gradient_accumulation_steps": 2,
                                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                      "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}})
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (8, 4, 2)
    assert config.zero_optimization_stage == 2 and config.zero_enabled and config.bfloat16_enabled
    assert not config.fp16_enabled and config.optimizer_name == "adamw" and config.optimizer_params == {"lr": 1e-3}


def _log_dist_on_two_ranks() -> list[str]:
    with recorded_messages() as messages:
        utils.log_dist("only rank 1", ranks=[1])
        utils.log_dist("everyone", ranks=[-1], level=logging.WARNING)
        utils.log_dist("nobody once initialized")
    return messages


def test_log_dist_logs_on_the_listed_ranks_only() -> None:
    assert run_distributed(_log_dist_on_two_ranks, 2) == [["[Rank 0] everyone"],
                                                          ["[Rank 1] only rank 1", "[Rank 1] everyone"]]
    if not torch.distributed.is_initialized():  # before initialization the one process logs everything
        with recorded_messages() as messages:
            utils.log_dist("hello")
        assert messages == ["[Rank -1] hello"]


def test_repeating_loader_restarts() -> None:
    loader = utils.RepeatingLoader([1, 2])
    assert [next(loader) for _ in range(5)] == [1, 2, 1, 2, 1]


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 2)
        self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = int(self.gate(x).sum() > 0)  # data-dependent: one expert runs
        return self.experts[choice](x)


class _MoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.moe = _Experts()
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.out(self.moe(torch.tanh(self.inp(x)))), y)


def test_z3_leaf_modules_become_one_unit() -> None:
    model = _MoEModel()
    assert "moe.experts.0" in unit_module_names(model)
    leaves = utils.set_z3_leaf_modules(model, [_Experts])
    assert leaves == [model.moe] and utils.z3_leaf_module(model.moe) and utils.get_z3_leaf_modules(model) == leaves
    assert unit_module_names(model) == ["inp", "moe", "out"]
    utils.unset_z3_leaf_modules(model, ["_Experts"])
    assert "moe.experts.0" in unit_module_names(model)
    with pytest.raises(ValueError, match="no module of class Conv2d"):
        utils.set_z3_leaf_modules(model, [nn.Conv2d])


def _moe_batch(step: int, micro: int, rows: int) -> dict:
    generator = torch.Generator().manual_seed(77 + 13 * step + micro)
    return {"x": torch.randn(rows, 4, generator=generator), "y": torch.randn(rows, 1, generator=generator)}


def _stage3_sgd_trace(model: nn.Module) -> Trace:
    """Four SGD steps of ``model`` at ZeRO-3 (every unit released after use), one row per rank."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zerotune.initialize(model=model, config=config)
    losses, norms = [], []
    for step in range(4):
        loss = loss_of(engine, rank_slice(_moe_batch(step, 0, world), rank, world))
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
        norms.append(engine.get_global_grad_norm())
    engine.destroy()
    return Trace(losses, norms)


def _leaf_moe_stage3() -> Trace:
    torch.manual_seed(0)
    model = _MoEModel()
    utils.set_z3_leaf_modules(model, [_Experts])
    return _stage3_sgd_trace(model)


def test_leaf_moe_block_with_data_dependent_experts_matches_single_process_at_stage3() -> None:
    torch.manual_seed(0)
    reference_model = _MoEModel()
    reference = reference_run(reference_model, torch.optim.SGD(reference_model.parameters(), lr=0.1), _moe_batch,
                              steps=4, gas=1, global_rows=2, clip=0.0)
    for trace in run_distributed(_leaf_moe_stage3, 2):
        assert_close_traces(trace, reference, rel=1e-5)


class _ReachesAcross(nn.Module):
    """``head`` reads ``body.weight`` directly: the DeepSpeed case for register_external_parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.body(x))
        return nn.functional.mse_loss(self.head(hidden @ self.body.weight), y)


def test_register_external_parameter_moves_the_weight_to_the_always_gathered_root() -> None:
    from zerotune.zero.stage3.wrap import ROOT, assign_params

    model = _ReachesAcross()
    assert model.body.weight in assign_params(model, ["body", "head"])["body"]
    compat_zero.register_external_parameter(model.head, model.body.weight)
    compat_zero.register_external_parameter(model.head, model.body.weight)  # once only
    assigned = assign_params(model, ["body", "head"])
    assert any(p is model.body.weight for p in assigned[ROOT])
    compat_zero.unregister_external_parameter(model.head, model.body.weight)
    with pytest.raises(ValueError, match="was not registered"):
        compat_zero.unregister_external_parameter(model.head, model.body.weight)


def _external_stage3() -> Trace:
    torch.manual_seed(0)
    model = _ReachesAcross()
    compat_zero.register_external_parameter(model.head, model.body.weight)
    trace = _stage3_sgd_trace(model)
    ids = [getattr(p, "ds_id", None) for p in model.parameters()]
    assert None not in ids and len(set(ids)) == len(ids)
    assert all(tuple(p.ds_shape) == tuple(p.shape) and p.ds_numel == p.numel() for p in model.parameters())
    return trace


def test_external_parameter_at_stage3_matches_single_process_and_params_carry_ds_attributes() -> None:
    torch.manual_seed(0)
    reference_model = _ReachesAcross()
    reference = reference_run(reference_model, torch.optim.SGD(reference_model.parameters(), lr=0.1), _moe_batch,
                              steps=4, gas=1, global_rows=2, clip=0.0)
    for trace in run_distributed(_external_stage3, 2):
        assert_close_traces(trace, reference, rel=1e-5)


def _groups_after_initialize() -> dict:
    before = (groups._get_data_parallel_world_size(), groups._get_model_parallel_world_size())
    engine, *_ = zerotune.initialize(model=nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1,
                                                                   "tensor_parallel": {"autotp_size": 1}})
    sizes = {"dp": torch.distributed.get_world_size(groups._get_data_parallel_group()),
             "mp": torch.distributed.get_world_size(groups._get_model_parallel_group()),
             "dp_rank": groups._get_data_parallel_rank(), "before": before}
    engine.destroy()
    return sizes


def test_groups_answer_from_the_engines_mesh() -> None:
    for rank, sizes in enumerate(run_distributed(_groups_after_initialize, 2)):
        assert sizes == {"dp": 2, "mp": 1, "dp_rank": rank, "before": (2, 1)}
