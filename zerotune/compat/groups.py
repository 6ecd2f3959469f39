"""``deepspeed.utils.groups``: DeepSpeed's global process-group queries, answered from the mesh of
the engine that ``initialize`` built last (before any engine: the world is data parallel).

DeepSpeed keeps its groups in module globals; zerotune passes its mesh explicitly, so these
functions exist only for scripts that ask DeepSpeed's way. As DeepSpeed's, the groups outlive the
engine: ``deepspeed.initialize`` hands its mesh here (``adopt_engine_mesh``), so a script may build
layers on ``get_tensor_model_parallel_group()`` after a throwaway engine. DeepSpeed's own tensor-parallel
globals (``_TENSOR_MODEL_PARALLEL_GROUP`` ...) exist too: ``_init_tp_mesh_device`` sets them as
DeepSpeed's does, and where set they answer before the mesh. An axis of size 1 answers with a
one-rank group of this rank (made once, collectively, on first use), never with ``None``,
because ``torch.distributed.get_world_size(None)`` would mean the whole world.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as torch_dist

from zerotune.compat import comm as dist
from zerotune.compat.ds_logging import log_dist
from zerotune.compat.paths import DeepSpeedFeatureNotSupported
from zerotune.distributed.mesh import ProcessMesh, latest_mesh

_singleton: torch_dist.ProcessGroup | None = None
_engine_mesh: ProcessMesh | None = None

# DeepSpeed's tensor-parallel globals: None until ``_init_tp_mesh_device`` (the mesh answers meanwhile)
_TENSOR_MODEL_PARALLEL_GROUP: Any = None
_MODEL_PARALLEL_GROUP: Any = None
_DATA_PARALLEL_GROUP: Any = None
_DEVICE_MESH_SPLIT_UNSUPPORTED = "No backend for the parent process group or its backend does not support splitting"


def adopt_engine_mesh(mesh: ProcessMesh) -> None:
    """Keep ``mesh`` (an engine's) for the queries after that engine is gone, as DeepSpeed's groups stay."""
    global _engine_mesh
    _engine_mesh = mesh


def _mesh() -> ProcessMesh | None:
    return latest_mesh() or _engine_mesh


def _group(axis: str) -> torch_dist.ProcessGroup:
    mesh = _mesh()
    if mesh is None:
        if axis == "dp":
            return _world()
        return _singleton_group()
    group = mesh.group(axis)
    if group is None:
        return _world() if torch_dist.get_world_size() == 1 else _singleton_group()
    return group


def _world() -> torch_dist.ProcessGroup:
    world = torch_dist.group.WORLD
    if world is None:
        raise RuntimeError("deepspeed.utils.groups: torch.distributed is not initialized; call "
                           "deepspeed.init_distributed() or deepspeed.initialize() first")
    return world


def _singleton_group() -> torch_dist.ProcessGroup:
    global _singleton
    if _singleton is None:
        _singleton, _ = torch_dist.new_subgroups(group_size=1)
    return _singleton


def _size(axis: str) -> int:
    explicit = _explicit(axis)
    if explicit is not None:
        return dist.get_world_size(group=explicit)
    mesh = _mesh()
    if mesh is None:
        return torch_dist.get_world_size() if axis == "dp" else 1
    return mesh.size(axis)


def _rank(axis: str) -> int:
    explicit = _explicit(axis)
    if explicit is not None:
        return dist.get_rank(group=explicit)
    mesh = _mesh()
    if mesh is None:
        return torch_dist.get_rank() if axis == "dp" else 0
    return mesh.rank(axis)


def _explicit(axis: str) -> Any:
    """The group ``_init_tp_mesh_device`` set for ``axis`` ("tp" or "dp"), else None."""
    return {"tp": _TENSOR_MODEL_PARALLEL_GROUP, "dp": _DATA_PARALLEL_GROUP}.get(axis)


def _get_data_parallel_group() -> torch_dist.ProcessGroup:
    explicit = _explicit("dp")
    return explicit if explicit is not None else _group("dp")


def _get_data_parallel_world_size() -> int:
    return _size("dp")


def _get_data_parallel_rank() -> int:
    return _rank("dp")


def _get_model_parallel_group() -> torch_dist.ProcessGroup:
    explicit = _explicit("tp")
    return explicit if explicit is not None else _group("tp")


def _get_model_parallel_world_size() -> int:
    return _size("tp")


def _get_model_parallel_rank() -> int:
    return _rank("tp")


get_tensor_model_parallel_group = get_model_parallel_group = _get_model_parallel_group
get_tensor_model_parallel_world_size = get_model_parallel_world_size = _get_model_parallel_world_size
get_tensor_model_parallel_rank = get_model_parallel_rank = _get_model_parallel_rank
get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of tensor-parallel rank 0 of this rank's group (what scripts broadcast a batch from)."""
    return dist.get_global_rank(_get_model_parallel_group(), 0)


def _init_tp_mesh_device(tensor_model_parallel_size: int = 1, data_parallel_size: int | None = None) -> Any:
    """DeepSpeed's (data x tensor) groups, tensor ranks consecutive, kept in this module's globals; returns
    ``(data-parallel group, model-parallel group)``. A DeviceMesh makes them, or -- with
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` or a backend that cannot split groups -- one ``new_group`` per group."""
    global _DATA_PARALLEL_GROUP, _MODEL_PARALLEL_GROUP, _TENSOR_MODEL_PARALLEL_GROUP
    if _TENSOR_MODEL_PARALLEL_GROUP is not None:
        return _DATA_PARALLEL_GROUP, _MODEL_PARALLEL_GROUP
    world = dist.get_world_size()
    tp = tensor_model_parallel_size
    dp = data_parallel_size if data_parallel_size is not None else world // max(tp, 1)
    if tp < 1 or dp * tp != world:
        raise ValueError(f"_init_tp_mesh_device: data_parallel_size {dp} x tensor_model_parallel_size {tp} does not "
                         f"equal the world size {world}")
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
        log_dist("TORCH_DISTRIBUTED_DEBUG=DETAIL: tensor-parallel groups made with new_group", ranks=[0])
        return _init_tp_groups_with_new_group(tp, dp)
    try:
        mesh = dist.initialize_mesh_device((dp, tp), ("data_parallel", "tensor_parallel"))
    except RuntimeError as error:
        if _DEVICE_MESH_SPLIT_UNSUPPORTED not in str(error):
            raise
        log_dist("the backend cannot split process groups: tensor-parallel groups made with new_group", ranks=[0])
        return _init_tp_groups_with_new_group(tp, dp)
    _TENSOR_MODEL_PARALLEL_GROUP = _MODEL_PARALLEL_GROUP = mesh.get_group(mesh_dim="tensor_parallel")
    _DATA_PARALLEL_GROUP = mesh.get_group(mesh_dim="data_parallel")
    return _DATA_PARALLEL_GROUP, _MODEL_PARALLEL_GROUP


def _init_tp_groups_with_new_group(tp: int, dp: int) -> Any:
    """The same groups one ``new_group`` each, in DeepSpeed's order (data groups first; every rank makes all)."""
    global _DATA_PARALLEL_GROUP, _MODEL_PARALLEL_GROUP, _TENSOR_MODEL_PARALLEL_GROUP
    rank, world = dist.get_rank(), dp * tp
    for tp_rank in range(tp):
        ranks = list(range(tp_rank, world, tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            _DATA_PARALLEL_GROUP = group
    for dp_rank in range(dp):
        ranks = list(range(dp_rank * tp, (dp_rank + 1) * tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            _TENSOR_MODEL_PARALLEL_GROUP = _MODEL_PARALLEL_GROUP = group
    return _DATA_PARALLEL_GROUP, _MODEL_PARALLEL_GROUP


def _get_sequence_parallel_group() -> torch_dist.ProcessGroup:
    return _group("sp")


def _get_sequence_parallel_world_size() -> int:
    return _size("sp")


def _get_sequence_parallel_rank() -> int:
    return _rank("sp")


def _get_pipe_parallel_group() -> torch_dist.ProcessGroup:
    return _group("pp")


# ---- expert groups ---------------------------------------------------------------------------
# zerotune has no mixture-of-experts layer (compat/moe.py refuses one), but DeepSpeed code builds DeepSpeed's
# expert groups itself and reduces over them (deepspeed.runtime.utils.CheckOverflow, for parameters marked
# ``allreduce = False``). They are kept as DeepSpeed keeps them: by name ("ep_size_N"), this rank's groups
# only, and forgotten when torch.distributed's world is created anew.
_expert_world: object = None
_expert_groups: dict[str, torch_dist.ProcessGroup] = {}
_expert_data_groups: dict[str, torch_dist.ProcessGroup] = {}


def expert_rank_lists(world: int, expert_size: int, pipe_size: int = 1, data_before_expert: bool = False
                      ) -> tuple[list[list[int]], list[list[int]]]:
    """DeepSpeed's layout of (expert-parallel, expert-data-parallel) rank lists within each pipeline stage.

    Experts consecutive (default): world 8, 2 experts -> experts [0, 1], [2, 3], ...; their data parallel
    [0, 2, 4, 6], [1, 3, 5, 7]. ``data_before_expert``: data parallel consecutive, [0, 1, 2, 3], [4, 5, 6, 7];
    experts strided across them, [0, 4], [1, 5], [2, 6], [3, 7].
    """
    if pipe_size < 1 or world % pipe_size:
        raise ValueError(f"expert groups: pipeline size {pipe_size} does not divide the world size {world}")
    stage = world // pipe_size
    if expert_size < 1 or stage % expert_size:
        raise ValueError(f"expert groups: expert parallel size {expert_size} does not divide the {stage} ranks of "
                         "a pipeline stage")
    experts, data = [], []
    for start in range(0, world, stage):
        stage_experts, stage_data = _split_experts(list(range(start, start + stage)), expert_size, data_before_expert)
        experts += stage_experts
        data += stage_data
    return experts, data


def _split_experts(ranks: list[int], expert_size: int, data_before_expert: bool
                   ) -> tuple[list[list[int]], list[list[int]]]:
    """One data-parallel group's ranks cut into expert-parallel groups and their expert-data-parallel groups."""
    if data_before_expert:
        stride = len(ranks) // expert_size
        return [ranks[i::stride] for i in range(stride)], [ranks[i:i + stride] for i in range(0, len(ranks), stride)]
    return ([ranks[i:i + expert_size] for i in range(0, len(ranks), expert_size)],
            [ranks[i::expert_size] for i in range(expert_size)])


def _get_expert_parallel_ranks(world_size: int, tensor_parallel_size_: int, expert_parallel_size_: int,
                               pipeline_parallel_size_: int = 1, use_data_before_expert_parallel_: bool = False
                               ) -> tuple[list[list[int]], list[list[int]]]:
    """DeepSpeed's rank lists of the expert-parallel and expert-data-parallel groups with tensor parallelism:
    each pipeline stage's data-parallel groups (ranks strided by the tensor-parallel size, one per tensor-parallel
    rank) cut into experts as ``expert_rank_lists`` cuts a stage. A pure function: no group is created."""
    sizes = (tensor_parallel_size_, expert_parallel_size_, pipeline_parallel_size_)
    if any(size < 1 for size in sizes) or world_size % (tensor_parallel_size_ * pipeline_parallel_size_):
        raise ValueError(f"expert groups: tensor x pipeline parallel sizes {sizes[0]} x {sizes[2]} do not divide the "
                         f"world size {world_size}")
    stage = world_size // pipeline_parallel_size_
    if (stage // tensor_parallel_size_) % expert_parallel_size_:
        raise ValueError(f"expert groups: expert parallel size {expert_parallel_size_} does not divide the "
                         f"{stage // tensor_parallel_size_} data-parallel ranks of a stage")
    experts, data = [], []
    for start in range(0, world_size, stage):
        for tp_rank in range(tensor_parallel_size_):
            dp_ranks = list(range(start + tp_rank, start + stage, tensor_parallel_size_))
            group_experts, group_data = _split_experts(dp_ranks, expert_parallel_size_,
                                                       use_data_before_expert_parallel_)
            experts += group_experts
            data += group_data
    return experts, data


def _current_expert_groups() -> tuple[dict[str, torch_dist.ProcessGroup], dict[str, torch_dist.ProcessGroup]]:
    global _expert_world
    if _expert_world is not _world():  # a new world: the old groups are gone with it
        _expert_world = _world()
        _expert_groups.clear()
        _expert_data_groups.clear()
    return _expert_groups, _expert_data_groups


def _create_expert_and_data_parallel(expert_parallel_size_: int, mp_size: int | None = None,
                                     pp_size: int | None = None, mp_mode: str = "tp",
                                     use_data_before_expert_parallel_: bool = False,
                                     folding_spec: object = None) -> None:
    """DeepSpeed's expert and expert-data-parallel groups of size ``expert_parallel_size_`` (collective: every
    rank creates every group, once per size). Without model parallelism only, as zerotune has no expert layers
    that would combine with it."""
    if (mp_size or 1) > 1 or folding_spec is not None:
        raise DeepSpeedFeatureNotSupported("deepspeed.utils.groups._create_expert_and_data_parallel",
                                           "expert groups combined with model parallelism (mp_size > 1, AutoEP "
                                           "folding)")
    experts, data = _current_expert_groups()
    name = f"ep_size_{expert_parallel_size_}"
    if name in experts:
        return
    pipe = pp_size if pp_size is not None else _size("pp")
    expert_lists, data_lists = expert_rank_lists(torch_dist.get_world_size(), expert_parallel_size_, pipe,
                                                 use_data_before_expert_parallel_)
    rank = torch_dist.get_rank()
    for ranks in data_lists:  # DeepSpeed's creation order (data groups first), which every rank must share
        group = torch_dist.new_group(ranks)
        if rank in ranks:
            data[name] = group
    for ranks in expert_lists:
        group = torch_dist.new_group(ranks)
        if rank in ranks:
            experts[name] = group


def _get_expert_parallel_group(group_name: str) -> torch_dist.ProcessGroup:
    return _expert_group(group_name, _current_expert_groups()[0])


def _get_expert_data_parallel_group(group_name: str) -> torch_dist.ProcessGroup:
    return _expert_group(group_name, _current_expert_groups()[1])


def _get_expert_parallel_world_size(group_name: str) -> int:
    return torch_dist.get_world_size(_get_expert_parallel_group(group_name))


def _get_expert_parallel_rank(group_name: str) -> int:
    return torch_dist.get_rank(_get_expert_parallel_group(group_name))


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return torch_dist.get_world_size(_get_expert_data_parallel_group(group_name))


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return torch_dist.get_rank(_get_expert_data_parallel_group(group_name))


def _get_max_expert_size() -> int | None:
    """The largest expert-parallel size created (None before any)."""
    sizes = [int(name[len("ep_size_"):]) for name in _current_expert_groups()[0]]
    return max(sizes) if sizes else None


def _get_max_expert_parallel_group() -> torch_dist.ProcessGroup:
    size = _get_max_expert_size()
    if size is None:
        raise RuntimeError("deepspeed.utils.groups: no expert groups exist; call "
                           "groups._create_expert_and_data_parallel(expert_parallel_size) first")
    return _get_expert_parallel_group(f"ep_size_{size}")


def _expert_group(name: str, groups: dict[str, torch_dist.ProcessGroup]) -> torch_dist.ProcessGroup:
    if name not in groups:
        raise KeyError(f"deepspeed.utils.groups: no expert group {name!r}; created: {sorted(groups) or 'none'} "
                       "(groups._create_expert_and_data_parallel makes them)")
    return groups[name]
