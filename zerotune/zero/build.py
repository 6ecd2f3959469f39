"""Build a ZeRO stage complete: its master placement, state and gradient sync, from the config.

One builder per stage, each in the order the objects need: the fp32 masters are taken from the
parameters *before* the model is cast to its training dtype (so they carry no rounding error), and
every object receives what it needs at construction -- no attributes are set on them afterwards.
``initialize`` calls ``build_zero_state`` and knows nothing of the stages' parts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from zerotune.config import ConfigError, NotSupportedYetError
from zerotune.distributed.compression import TopKCompressor
from zerotune.distributed.mesh import ProcessMesh
from zerotune.offload.buffers import BufferPool as SwapBufferPool
from zerotune.offload.cpu_step import cpu_step_threads
from zerotune.offload.master_placement import MasterPlacement
from zerotune.offload.nvme_optimizer import NvmePlacement
from zerotune.offload.swap_files import AioSettings, SwapStore
from zerotune.parallel.composition import check_composes
from zerotune.precision.policy import MasterWeights, PrecisionPolicy
from zerotune.zero.allreduce_sync import AllReduceGradSync
from zerotune.zero.contracts import ZeroStage
from zerotune.zero.grad_norm import ModelParallelNorm
from zerotune.zero.replicated_state import ReplicatedState
from zerotune.zero.sharded_state import ShardedState
from zerotune.zero.stage1_sync import ReduceAtBoundaryGradSync
from zerotune.zero.stage2_sync import BucketedReduceGradSync
from zerotune.zero.stage3.leaves import apply_leaf_config
from zerotune.zero.stage3.schedule import UnitScheduler
from zerotune.zero.stage3.state import Stage3State
from zerotune.zero.stage3.unit import BufferPool
from zerotune.zero.stage3.wrap import partition_model


def gradient_compressor(cfg: Any) -> TopKCompressor | None:
    """Top-K compression for the stage's gradient reductions (``gradient_compression`` block)."""
    section = cfg.gradient_compression
    if section is None:
        return None
    if cfg.zero_optimization.stage == 3:
        raise NotSupportedYetError("gradient_compression", "with ZeRO stage 3 is not supported yet (stages 0, 1 "
                                   "and 2 compress their all-reduce / reduce-scatter / reduce)")
    return TopKCompressor(section.ratio, error_feedback=bool(section.error_feedback),
                          warmup_steps=int(section.warmup_steps), min_bucket_numel=int(section.min_bucket_numel))


def build_zero_state(cfg: Any, groups: list[dict], trainable: list[torch.nn.Parameter], policy: PrecisionPolicy,
                     mesh: ProcessMesh, model: torch.nn.Module, compressor: TopKCompressor | None, *,
                     rank: int, norm: ModelParallelNorm | None = None) -> ZeroStage:
    """The state of ``zero_optimization.stage`` over ``trainable`` (in ``groups``' optimizer groups); the model
    is cast to ``policy.param_dtype`` on the way. ``norm``: how the gradient norm spans tp / pp ranks."""
    zero = cfg.zero_optimization
    # what composes with tp / pp / sp is parallel/composition.py's rule
    check_composes(zero.stage, zero.offload_optimizer.device, mesh.size("tp"), mesh.size("pp"), mesh.size("sp"))
    group = mesh.group("dp_sp")  # the ranks holding the same parameters: gradients are averaged, ZeRO shards over them
    predivide = float(mesh.size("dp_sp")) if cfg.prescale_gradients else float(cfg.gradient_predivide_factor)
    wire = communication_dtype(cfg, compressor)
    apply_leaf_config(model, zero.leaf_module)  # marks only stage 3 reads; set at every stage, as DeepSpeed does
    if zero.stage == 0:
        return _build_stage0(zero, trainable, policy, group, model, predivide, compressor, norm, wire)
    chosen = {id(p) for p in trainable}
    group_params = [[p for p in g["params"] if id(p) in chosen] for g in groups]
    placement = _master_placement(cfg, rank)
    if zero.stage == 3:
        return _build_stage3(zero, group_params, policy, group, model, predivide, placement, rank=rank,
                             aio=AioSettings.from_config(cfg.aio), wire=wire, norm=norm)
    return _build_stage1_or_2(zero, group_params, trainable, policy, group, model, predivide, placement, compressor,
                              norm, wire)


WIRE_DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16, "bfp16": torch.bfloat16}


def communication_dtype(cfg: Any, compressor: TopKCompressor | None) -> torch.dtype | None:
    """``communication_data_type``: the dtype gradient reductions carry (None: the gradients' own)."""
    name = cfg.communication_data_type
    wire = WIRE_DTYPES.get(name) if name is not None else None
    if wire is not None and compressor is not None:
        raise NotSupportedYetError("communication_data_type", f"{name} together with gradient_compression is not "
                                   "supported yet (Top-K sends its own values and indices); unset one of them")
    return wire


def _build_stage0(zero: Any, trainable: list[torch.nn.Parameter], policy: PrecisionPolicy, group: Any,
                  model: torch.nn.Module, predivide: float, compressor: TopKCompressor | None,
                  norm: ModelParallelNorm | None, wire: torch.dtype | None) -> ReplicatedState:
    weights = MasterWeights(trainable, policy)  # fp32 masters before the cast
    model.to(policy.param_dtype)
    grad_sync = AllReduceGradSync(trainable, group, bucket_numel=int(zero.reduce_bucket_size),
                                  device=trainable[0].device if trainable else torch.device("cpu"),
                                  predivide_factor=predivide, compressor=compressor, comm_dtype=wire)
    return ReplicatedState(weights, grad_sync, norm)


def _build_stage1_or_2(zero: Any, group_params: list[list[torch.nn.Parameter]], trainable: list[torch.nn.Parameter],
                       policy: PrecisionPolicy, group: Any, model: torch.nn.Module, predivide: float,
                       placement: MasterPlacement, compressor: TopKCompressor | None,
                       norm: ModelParallelNorm | None, wire: torch.dtype | None) -> ShardedState:
    bucket = int(zero.reduce_bucket_size)
    if zero.stage == 1:
        def make_grad_sync(flat_groups: list, on_final_grad: Any
                           ) -> ReduceAtBoundaryGradSync | BucketedReduceGradSync:
            return ReduceAtBoundaryGradSync(flat_groups, group, bucket_numel=bucket, predivide_factor=predivide,
                                            compressor=compressor, comm_dtype=wire)
    else:
        position = {id(p): i for i, p in enumerate(trainable)}
        required = None if zero.ignore_unused_parameters is not False else {
            id(param): name for name, param in model.named_parameters() if id(param) in position}

        def make_grad_sync(flat_groups: list, on_final_grad: Any
                           ) -> ReduceAtBoundaryGradSync | BucketedReduceGradSync:
            return BucketedReduceGradSync(flat_groups, group, bucket_numel=bucket, position=position,
                                          predivide_factor=predivide, max_in_flight=2 if zero.overlap_comm else 0,
                                          compressor=compressor, on_final_grad=on_final_grad, comm_dtype=wire,
                                          require_all_grads=required)
    state = ShardedState(group_params, policy, group, allgather_bucket_numel=int(zero.allgather_bucket_size),
                         make_grad_sync=make_grad_sync, placement=placement, stage_grads=zero.stage == 2,
                         model_parallel_norm=norm)
    model.to(policy.param_dtype)  # the flat parameters are already in this dtype; frozen ones and buffers follow
    return state


def _local_world_size() -> int:
    """Ranks on this machine (torchrun's LOCAL_WORLD_SIZE; else assume all ranks are local)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit():
        return int(local)
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _master_placement(cfg: Any, rank: int) -> MasterPlacement:
    """``offload_optimizer``: fp32 masters and optimizer state in host memory (ZeRO-Offload) or in
    swap files under ``nvme_path`` (ZeRO-Infinity), one directory per rank."""
    zero = cfg.zero_optimization
    offload = zero.offload_optimizer
    if offload.device == "none":  # with parameters on NVMe, masters cannot be views of their shards
        return MasterPlacement(always_separate=zero.stage == 3 and zero.offload_param.device == "nvme")
    if zero.stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer.device",
                          f"{offload.device} needs ZeRO stage 1, 2 or 3 (the stage is 0)")
    threads = cpu_step_threads(_local_world_size())  # the host step may use this rank's share of the cores
    if offload.device == "cpu":
        return MasterPlacement(device=torch.device("cpu"), pin_memory=bool(offload.pin_memory), step_threads=threads)
    store = SwapStore(Path(offload.nvme_path) / f"zerotune_optimizer_rank{rank}", AioSettings.from_config(cfg.aio))
    return NvmePlacement(store, sub_group_size=int(zero.sub_group_size), buffer_count=int(offload.buffer_count),
                         step_threads=threads)


def _build_stage3(zero: Any, group_params: list[list[torch.nn.Parameter]], policy: PrecisionPolicy, group: Any,
                  model: torch.nn.Module, predivide: float, placement: MasterPlacement, *, rank: int,
                  aio: AioSettings, wire: torch.dtype | None = None, norm: ModelParallelNorm | None = None
                  ) -> Stage3State:
    """Partition the model into units (hooks attached), masters from the fp32 shards, then cast.

    ``model.to(dtype)`` is not used: it would materialize every partitioned parameter's placeholder.
    """
    offload = zero.offload_param
    state = Stage3State(group_params, policy, group, placement, model_parallel_norm=norm)
    store = (SwapStore(Path(offload.nvme_path) / f"zerotune_params_rank{rank}", aio)
             if offload.device == "nvme" else None)
    pool = (SwapBufferPool(int(offload.buffer_count), int(offload.buffer_size), dtype=policy.param_dtype)
            if store is not None else None)

    def unit_built(unit: Any) -> None:  # masters taken and the unit cast (and swapped out) before the next
        state.add_unit(unit)
        if store is not None:  # files hold the model dtype
            for kind, segment in (("trainable", unit.trainable), ("frozen", unit.frozen)):
                if segment is not None:
                    segment.swap_out_to(store, f"unit{len(state.units) - 1}_{kind}", pool)

    units = partition_model(model, group, group_params, buffers=BufferPool(capacity_numel=int(zero.reduce_bucket_size)),
                            persistence_threshold=int(zero.stage3_param_persistence_threshold),
                            shard_device=torch.device("cpu") if offload.device != "none" else None,
                            pin_memory=bool(offload.pin_memory), on_unit_built=unit_built)
    state.start_schedule(lambda on_final_grad: UnitScheduler(
        units, prefetch_numel=int(zero.stage3_prefetch_bucket_size),
        max_live_numel=int(zero.stage3_max_live_parameters),
        predivide_factor=predivide, max_in_flight=2 if zero.overlap_comm else 0, on_final_grad=on_final_grad,
        comm_dtype=wire))
    with torch.no_grad():
        for buffer in model.buffers():
            if buffer.is_floating_point():
                buffer.data = buffer.data.to(policy.param_dtype)
    return state
