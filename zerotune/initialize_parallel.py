"""The model-parallel part of ``initialize``: the mesh's sizes, what composes with what, and the
in-place model changes (AutoTP, Ulysses attention) made before any optimizer state exists; and
which ranks count which parameters in the gradient norm."""

from __future__ import annotations

from typing import Any

import torch

from zerotune.config import ConfigError
from zerotune.distributed.mesh import ParallelDims, ProcessMesh
from zerotune.monitor.logging import log_rank0
from zerotune.parallel.composition import check_composes
from zerotune.parallel.sequence.ulysses_attention import install_ulysses_attention
from zerotune.parallel.tensor.autotp import apply_autotp
from zerotune.parallel.tensor.layout import tp_layout_of
from zerotune.parallel.tensor.plans import rules_from_config
from zerotune.pipe.module import PipelineModule
from zerotune.pipe.setup import norm_counted_here
from zerotune.zero.grad_norm import ModelParallelNorm


def parallel_dims(raw: Any, world_size: int, model: torch.nn.Module) -> ParallelDims:
    """The mesh's sizes from ``pipeline.stages`` (or the PipelineModule's ``num_stages``),
    ``tensor_parallel.autotp_size`` and ``sequence_parallel_size``; dp takes the rest."""
    stages = model.num_stages if isinstance(model, PipelineModule) else raw.pipeline.stages
    sizes = {}
    for key, value in (("tensor_parallel.autotp_size", raw.tensor_parallel.autotp_size),
                       ("sequence_parallel_size", raw.sequence_parallel_size), ("pipeline.stages", stages)):
        if value == "auto":
            raise ConfigError(key, '"auto" cannot be resolved: give the parallel size as a number')
        sizes[key] = max(int(value), 1)
    tp, sp, pp = sizes["tensor_parallel.autotp_size"], sizes["sequence_parallel_size"], sizes["pipeline.stages"]
    try:
        return ParallelDims.from_world(world_size, tp=tp, sp=sp, pp=pp)
    except ValueError as error:
        key = next(k for k, v in (("pipeline.stages", pp), ("tensor_parallel.autotp_size", tp)) if v > 1) \
            if pp > 1 or tp > 1 else "sequence_parallel_size"
        raise ConfigError(key, f"{error}; launch a multiple of pp x tp x sp = {pp * tp * sp} ranks") from None


def check_model_parallel_composes(cfg: Any, mesh: ProcessMesh) -> None:
    """What zerotune cannot run together yet fails now, naming the key (the rule: parallel/composition.py)."""
    check_composes(cfg.zero_optimization.stage, cfg.zero_optimization.offload_optimizer.device, mesh.size("tp"),
                   mesh.size("pp"), mesh.size("sp"))


def check_mpu_agrees(mpu: Any, mesh: ProcessMesh) -> None:
    """A Megatron ``mpu`` is accepted where it describes the layout zerotune built (same model- and data-parallel
    sizes and ranks; zerotune's groups are used); any other is refused naming ``mpu``."""
    if mpu is None:
        return
    queries = ("get_model_parallel_world_size", "get_model_parallel_rank", "get_data_parallel_world_size",
               "get_data_parallel_rank")
    if not all(callable(getattr(mpu, name, None)) for name in queries):
        raise ConfigError("mpu", f"needs {', '.join(queries)}; got {type(mpu).__name__}")
    theirs = tuple(int(getattr(mpu, name)()) for name in queries)
    ours = (mesh.size("tp"), mesh.rank("tp"), mesh.size("dp"), mesh.rank("dp"))
    if mesh.size("pp") > 1 or mesh.size("sp") > 1 or theirs != ours:
        raise ConfigError("mpu", f"describes model x data parallel sizes/ranks {theirs}, but zerotune's mesh from "
                                 f"tensor_parallel.autotp_size / sequence_parallel_size / pipeline.stages is {ours} "
                                 "(tensor ranks consecutive); zerotune builds its own groups: drop mpu or make "
                                 "the config agree")


def split_tensor_parallel(model: torch.nn.Module, cfg: Any, mesh: ProcessMesh, *, rank: int) -> None:
    """Tensor parallelism (AutoTP), applied in place before any state is built. A model the script already split
    (zerotune's or DeepSpeed's tensor-parallel layers) is trained as it is; its split must match the mesh."""
    tp_group = mesh.group("tp")
    if tp_group is None:  # (a tensor-parallel size of 1)
        return
    if _check_presplit(model, mesh.size("tp")):
        log_rank0("tensor parallelism: the model's layers are split already (over %d ranks); AutoTP left them as "
                  "they are", mesh.size("tp"), rank=rank)
        return
    partition = cfg.tensor_parallel.partition_config
    split = apply_autotp(model, tp_group, layer_specs=rules_from_config(partition.layer_specs),
                         use_default_specs=bool(partition.use_default_specs))
    log_rank0("tensor parallelism: %d layer(s) split over %d ranks (%s, ...)", len(split), mesh.size("tp"),
              ", ".join(f"{layer.name}: {layer.kind}" for layer in split[:3]), rank=rank)


def _check_presplit(model: torch.nn.Module, tp: int) -> bool:
    """Whether ``model`` holds tensor-parallel shards already; they must be split over ``tp`` ranks."""
    worlds = {layout.world for layout in (tp_layout_of(p) for p in model.parameters()) if layout is not None}
    if worlds and worlds != {tp}:
        raise ConfigError("tensor_parallel.autotp_size", f"is {tp}, but the model's layers are already split over "
                                                         f"{sorted(worlds)} ranks; make them agree")
    return bool(worlds)


def install_sequence_parallel(model: torch.nn.Module, mesh: ProcessMesh, *, rank: int) -> None:
    if mesh.size("sp") > 1:
        install_ulysses_attention(model, mesh.group("sp"))
        log_rank0("sequence parallelism: Ulysses attention over %d ranks", mesh.size("sp"), rank=rank)


def model_parallel_norm(mesh: ProcessMesh, pipe: PipelineModule | None) -> ModelParallelNorm | None:
    """The gradient norm spans the tp and pp ranks; what several of them hold (tp-replicated LayerNorms and
    row biases, weights tied across stages) is counted by one holder (see zero/grad_norm.py)."""
    groups, rules = [], []
    if mesh.size("tp") > 1:
        tp_rank0 = mesh.rank("tp") == 0
        groups.append(mesh.group("tp"))
        rules.append(lambda param: tp_layout_of(param) is not None or tp_rank0)
    if pipe is not None and mesh.size("pp") > 1:
        groups.append(mesh.group("pp"))
        rules.append(norm_counted_here(pipe, mesh))
    if not groups:
        return None
    return ModelParallelNorm(tuple(groups), lambda param: all(rule(param) for rule in rules))
