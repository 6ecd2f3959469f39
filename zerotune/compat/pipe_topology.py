"""``deepspeed.runtime.pipe.topology``: DeepSpeed's topologies (``compat/pipe.py``) and ``PipelineParallelGrid``,
the process groups of a ``ProcessTopology``.

Megatron-style code (and DeepSpeed's pipeline tests) builds one from a topology and asks it for the data-,
pipe-, model- and slice-parallel groups and this rank's place in each. zerotune's own engines build their
groups from the config's mesh (``zerotune/distributed/mesh.py``); this grid is for client code that passes a
topology around as an ``mpu``. Every rank creates every group, in the same order, as ``new_group`` requires.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from zerotune.compat.pipe import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid",
           "_prime_factors"]


def _prime_factors(number: int) -> list[int]:
    """``number``'s prime factors, smallest first, with multiplicity (DeepSpeed's default grid splits them)."""
    if number < 1:
        raise ValueError(f"prime factors of a positive number only, got {number}")
    factors, candidate = [], 2
    while candidate * candidate <= number:
        while number % candidate == 0:
            factors.append(candidate)
            number //= candidate
        candidate += 1
    return factors + ([number] if number > 1 else [])


def _default_topology(world_size: int) -> ProcessTopology:
    """No topology given: the prime factors of the world alternate between pipe (first) and data."""
    pipe = data = 1
    for index, prime in enumerate(_prime_factors(world_size)):
        if index % 2 == 0:
            pipe *= prime
        else:
            data *= prime
    return PipeDataParallelTopology(num_pp=pipe, num_dp=data)


class PipelineParallelGrid:
    """The groups of ``topology`` (axes ``pipe``, ``data`` and optionally ``model``) for this rank."""

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None) -> None:
        del process_group  # (DeepSpeed's signature; the groups are built over the default world)
        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._topo = topology if topology is not None else _default_topology(self.world_size)
        if not self._is_grid_valid():
            raise ValueError(f"the topology {self._topo} has {self._topo.world_size()} ranks, the world "
                             f"{self.world_size}")
        self.data_parallel_size = max(self._topo.get_dim("data"), 1)
        self.pipe_parallel_size = max(self._topo.get_dim("pipe"), 1)
        self.model_parallel_size = max(self._topo.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        self.stage_id, self.data_parallel_id = self.get_stage_id(), self.get_data_parallel_id()
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1

        # one model replica: every rank of one data-parallel index (its pipe stages and model slices)
        replicas = [sorted(self._topo.get_axis_list("data", index)) for index in range(self.data_parallel_size)]
        self.ds_model_group, self.ds_model_proc_group = self._mine(replicas)
        self.ds_model_world_size = len(self.ds_model_group)
        self.ds_model_rank = self.ds_model_group.index(self.global_rank)
        self.dp_groups = self._topo.get_axis_comm_lists("data")
        self.dp_group, self.dp_proc_group = self._mine(self.dp_groups)
        self.pipe_groups = self._topo.get_axis_comm_lists("pipe")
        self.pp_group, self.pp_proc_group = self._mine(self.pipe_groups)
        self.p2p_groups = [[rank, self._next_stage_of(rank)] for rank in range(self.world_size)]
        self.model_groups = (self._topo.get_axis_comm_lists("model") if self.model_parallel_size > 1
                             else [[rank] for rank in range(self.world_size)])
        self.slice_group, self.slice_proc_group = self._mine(self.model_groups)

    def _mine(self, rank_lists: list[list[int]]) -> tuple[list[int], Any]:
        """Create a group per list (every rank, every list) and return this rank's list and group."""
        mine: tuple[list[int], Any] = ([], None)
        for ranks in rank_lists:
            group = dist.new_group(ranks=ranks)
            if self.global_rank in ranks:
                mine = (ranks, group)
        if mine[1] is None:
            raise ValueError(f"rank {self.global_rank} is in none of the groups {rank_lists}")
        return mine

    def _next_stage_of(self, rank: int) -> int:
        """The rank holding the next pipeline stage of ``rank``'s pipe (wrapping round to the first)."""
        ranks = next(r for r in self.pipe_groups if rank in r)
        return ranks[(ranks.index(rank) + 1) % len(ranks)]

    def _is_grid_valid(self) -> bool:
        return self._topo.world_size() == dist.get_world_size()

    def stage_to_global(self, stage_id: int, **coords: int) -> int:
        """The global rank of ``stage_id`` at this rank's other coordinates (or those given)."""
        return self._topo.get_rank(**self._topo.get_coord(self.global_rank)._replace(pipe=stage_id, **coords)._asdict())

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_stage_id(self) -> int:
        return self._topo.get_coord(self.global_rank).pipe

    def get_data_parallel_id(self) -> int:
        return self._topo.get_coord(self.global_rank).data

    def get_pipe_parallel_rank(self) -> int:
        return self.get_stage_id()

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        return self.pp_proc_group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group

    def get_model_parallel_rank(self) -> int:
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> Any:
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self) -> int:
        return self._topo.get_coord(self.global_rank).model if "model" in self._topo.get_axis_names() else 0

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> Any:
        return self.slice_proc_group
