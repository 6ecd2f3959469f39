"""``deepspeed.utils.groups``: DeepSpeed's global process-group queries, answered from the mesh of
the engine that ``initialize`` built last (before any engine: the world is data parallel).

DeepSpeed keeps its groups in module globals; zerotune passes its mesh explicitly, so these
functions exist only for scripts that ask DeepSpeed's way. An axis of size 1 answers with a
one-rank group of this rank (made once, collectively, on first use), never with ``None``,
because ``dist.get_world_size(None)`` would mean the whole world.
"""

from __future__ import annotations

import torch.distributed as dist

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
