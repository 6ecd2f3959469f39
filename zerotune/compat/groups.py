"""``deepspeed.utils.groups``: DeepSpeed's global process-group queries, answered from the mesh of
the engine that ``initialize`` built last (before any engine: the world is data parallel).

DeepSpeed keeps its groups in module globals; zerotune passes its mesh explicitly, so these
functions exist only for scripts that ask DeepSpeed's way. An axis of size 1 answers with a
one-rank group of this rank (made once, collectively, on first use), never with ``None``,
because ``dist.get_world_size(None)`` would mean the whole world.
"""

from __future__ import annotations

import torch.distributed as dist

from zerotune.compat.paths import DeepSpeedFeatureNotSupported
from zerotune.distributed.mesh import latest_mesh

_singleton: dist.ProcessGroup | None = None


def _group(axis: str) -> dist.ProcessGroup:
    mesh = latest_mesh()
    if mesh is None:
        if axis == "dp":
            return _world()
        return _singleton_group()
    group = mesh.group(axis)
    if group is None:
        return _world() if dist.get_world_size() == 1 else _singleton_group()
    return group


def _world() -> dist.ProcessGroup:
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("deepspeed.utils.groups: torch.distributed is not initialized; call "
                           "deepspeed.init_distributed() or deepspeed.initialize() first")
    return world


def _singleton_group() -> dist.ProcessGroup:
    global _singleton
    if _singleton is None:
        _singleton, _ = dist.new_subgroups(group_size=1)
    return _singleton


def _size(axis: str) -> int:
    mesh = latest_mesh()
    if mesh is None:
        return dist.get_world_size() if axis == "dp" else 1
    return mesh.size(axis)


def _rank(axis: str) -> int:
    mesh = latest_mesh()
    if mesh is None:
        return dist.get_rank() if axis == "dp" else 0
    return mesh.rank(axis)


def _get_data_parallel_group() -> dist.ProcessGroup:
    return _group("dp")


def _get_data_parallel_world_size() -> int:
    return _size("dp")


def _get_data_parallel_rank() -> int:
    return _rank("dp")


def _get_model_parallel_group() -> dist.ProcessGroup:
    return _group("tp")


def _get_model_parallel_world_size() -> int:
    return _size("tp")


def _get_model_parallel_rank() -> int:
    return _rank("tp")


get_tensor_model_parallel_group = _get_model_parallel_group
get_tensor_model_parallel_world_size = _get_model_parallel_world_size
get_tensor_model_parallel_rank = _get_model_parallel_rank


def _get_sequence_parallel_group() -> dist.ProcessGroup:
    return _group("sp")


def _get_sequence_parallel_world_size() -> int:
    return _size("sp")


def _get_sequence_parallel_rank() -> int:
    return _rank("sp")


def _get_pipe_parallel_group() -> dist.ProcessGroup:
    return _group("pp")


# ---- expert groups ---------------------------------------------------------------------------
# zerotune has no mixture-of-experts layer (compat/moe.py refuses one), but DeepSpeed code builds DeepSpeed's
# expert groups itself and reduces over them (deepspeed.runtime.utils.CheckOverflow, for parameters marked
# ``allreduce = False``). They are kept as DeepSpeed keeps them: by name ("ep_size_N"), this rank's groups
# only, and forgotten when torch.distributed's world is created anew.
_expert_world: object = None
_expert_groups: dict[str, dist.ProcessGroup] = {}
_expert_data_groups: dict[str, dist.ProcessGroup] = {}


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


def _current_expert_groups() -> tuple[dict[str, dist.ProcessGroup], dict[str, dist.ProcessGroup]]:
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
    expert_lists, data_lists = expert_rank_lists(dist.get_world_size(), expert_parallel_size_, pipe,
                                                 use_data_before_expert_parallel_)
    rank = dist.get_rank()
    for ranks in data_lists:  # DeepSpeed's creation order (data groups first), which every rank must share
        group = dist.new_group(ranks)
        if rank in ranks:
            data[name] = group
    for ranks in expert_lists:
        group = dist.new_group(ranks)
        if rank in ranks:
            experts[name] = group


def _get_expert_parallel_group(group_name: str) -> dist.ProcessGroup:
    return _expert_group(group_name, _current_expert_groups()[0])


def _get_expert_data_parallel_group(group_name: str) -> dist.ProcessGroup:
    return _expert_group(group_name, _current_expert_groups()[1])


def _get_expert_parallel_world_size(group_name: str) -> int:
    return dist.get_world_size(_get_expert_parallel_group(group_name))


def _get_expert_parallel_rank(group_name: str) -> int:
    return dist.get_rank(_get_expert_parallel_group(group_name))


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return dist.get_world_size(_get_expert_data_parallel_group(group_name))


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return dist.get_rank(_get_expert_data_parallel_group(group_name))


def _get_max_expert_size() -> int | None:
    """The largest expert-parallel size created (None before any)."""
    sizes = [int(name[len("ep_size_"):]) for name in _current_expert_groups()[0]]
    return max(sizes) if sizes else None


def _get_max_expert_parallel_group() -> dist.ProcessGroup:
    size = _get_max_expert_size()
    if size is None:
        raise RuntimeError("deepspeed.utils.groups: no expert groups exist; call "
                           "groups._create_expert_and_data_parallel(expert_parallel_size) first")
    return _get_expert_parallel_group(f"ep_size_{size}")


def _expert_group(name: str, groups: dict[str, dist.ProcessGroup]) -> dist.ProcessGroup:
    if name not in groups:
        raise KeyError(f"deepspeed.utils.groups: no expert group {name!r}; created: {sorted(groups) or 'none'} "
                       "(groups._create_expert_and_data_parallel makes them)")
    return groups[name]
