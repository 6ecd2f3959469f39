"""Turning what the script passed to ``initialize`` into this rank's pipeline stage.

* a ``PipelineModule``: each stage built its own layers, so weights are made equal *within* a
  stage (broadcast over its tensor- then data-parallel ranks) and tied weights *across* stages
  (broadcast from the first stage holding them); tensor parallelism then splits the stage's
  layers by the user's ``partition_config`` rules;
* a Hugging Face model with ``"pipeline": {"stages": N}``: every rank holds the whole model on the host
  with rank 0's weights (``initialize`` broadcast them), AutoTP splits it if asked, and ``hf_layers.py``
  cuts it into embedding / block / head layers, of which this rank keeps its stage's: the other stages'
  weights go to the meta device and only the stage moves to the device (``initialize``), so a rank holds
  its stage only and a model bigger than one device can be cut.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from zerotune.config import ConfigError
from zerotune.distributed import comm
from zerotune.distributed.mesh import ProcessMesh
from zerotune.monitor.logging import log_rank0
from zerotune.parallel.activation_checkpointing import non_reentrant_checkpoint
from zerotune.pipe.module import PipelineModule
from zerotune.pipe.schedule import ScheduleError, build_schedule


def check_pipeline_composes(cfg: Any, mesh: ProcessMesh) -> None:
    """The schedule runs with the config's micro-batches (what composes with a pipeline: parallel/composition.py)."""
    if mesh.size("pp") == 1:
        return
    try:  # micro-batches = gradient_accumulation_steps: a schedule that cannot run fails now, not at step 1
        build_schedule(cfg.pipeline.schedule, cfg.gradient_accumulation_steps, mesh.size("pp"), 0)
    except ScheduleError as error:
        raise ConfigError("gradient_accumulation_steps", str(error)) from None


def _broadcast_within_stage(module: torch.nn.Module, mesh: ProcessMesh) -> None:
    with torch.no_grad():
        for tensor in module.state_dict(keep_vars=True).values():
            data = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
            comm.broadcast(data, 0, mesh.group("tp"))
            comm.broadcast(data, 0, mesh.group("dp_sp"))


def tie_groups(pipe: PipelineModule, mesh: ProcessMesh) -> dict[str, dist.ProcessGroup]:
    """One group per tie spanning several stages: the ranks at the same (dp, sp, tp) coordinate of those
    stages. Every rank creates every group, in the same order (a torch.distributed requirement)."""
    stage_size = dist.get_world_size() // mesh.size("pp")
    groups = {}
    for key in pipe.ties:
        stages = pipe.tie_stages(key)
        if len(stages) < 2:
            continue
        rank_lists = [[stage * stage_size + coordinate for stage in stages] for coordinate in range(stage_size)]
        mine, _ = dist.new_subgroups_by_enumeration(rank_lists)
        if mine is not None:
            groups[key] = mine
    return groups


def _broadcast_tied(pipe: PipelineModule, groups: dict[str, dist.ProcessGroup]) -> None:
    with torch.no_grad():
        for key, param in pipe.local_tied_parameters().items():
            comm.broadcast(param.data, 0, groups[key])


def build_pipeline(model: torch.nn.Module, cfg: Any, mesh: ProcessMesh, *, split_tensor_parallel: Callable
                   ) -> tuple[PipelineModule, dict[str, dist.ProcessGroup], Callable | None]:
    """(this rank's stage, tie groups, batch_fn or None for DeepSpeed's (inputs, labels) format)."""
    stages = mesh.size("pp")
    batch_fn = None
    if isinstance(model, PipelineModule):
        if model.num_stages != stages:
            raise ConfigError("pipeline.stages", f"{cfg.pipeline.stages} but the PipelineModule was built with "
                                                 f"num_stages={model.num_stages}; make them agree")
        pipe = model
        _broadcast_within_stage(pipe, mesh)
    else:
        from zerotune.pipe.hf_layers import hf_pipeline_layers

        split_tensor_parallel(model)
        layers, loss_fn, batch_fn = hf_pipeline_layers(model)
        method = "parameters" if cfg.pipeline.partition == "best" else cfg.pipeline.partition
        pipe = PipelineModule(layers, num_stages=stages, loss_fn=loss_fn, partition_method=method,
                              activation_checkpoint_interval=int(cfg.pipeline.activation_checkpoint_interval))
        pipe.export_names = {}  # the HF names of each tensor, so save_16bit_model writes a from_pretrained file
        for name, tensor in model.state_dict(keep_vars=True).items():
            pipe.export_names.setdefault(id(tensor), []).append(name)
        released = pipe.release_other_stages()
        log_rank0("pipeline: the %s's weights of other stages are released on each rank (%.1f MiB on rank 0; they "
                  "are on the meta device now): save through the engine (save_checkpoint, save_16bit_model)",
                  type(model).__name__, released / 2**20, rank=dist.get_rank())
    _apply_checkpointing_config(pipe, cfg.pipeline)
    groups = tie_groups(pipe, mesh)
    if isinstance(model, PipelineModule):
        _broadcast_tied(pipe, groups)
        split_tensor_parallel(pipe)
    return pipe, groups, batch_fn


def _apply_checkpointing_config(pipe: PipelineModule, section: Any) -> None:
    """The ``pipeline`` section's checkpointing, as DeepSpeed's engine applies it: ``use_reentrant: false`` swaps in
    ``non_reentrant_checkpoint`` whatever the interval (``set_checkpoint_interval`` may turn checkpointing on
    later), and a positive ``activation_checkpoint_interval`` overrides the module's."""
    if section.use_reentrant is False:
        pipe.activation_checkpoint_func = non_reentrant_checkpoint
    if int(section.activation_checkpoint_interval) > 0:
        pipe.set_checkpoint_interval(int(section.activation_checkpoint_interval))


def norm_counted_here(pipe: PipelineModule, mesh: ProcessMesh) -> Callable[[torch.nn.Parameter], bool]:
    """A tied weight's gradient norm is counted on the first stage holding it only."""
    stage = mesh.rank("pp")
    elsewhere = {id(param) for key, param in pipe.local_tied_parameters().items() if pipe.tie_stages(key)[0] != stage}
    return lambda param: id(param) not in elsewhere
