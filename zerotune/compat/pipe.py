"""``deepspeed.pipe`` / ``deepspeed.runtime.pipe``: the pipeline classes and DeepSpeed's topologies."""

from __future__ import annotations

import itertools
from collections import namedtuple
from typing import Any, Callable, Sequence

from zerotune.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from zerotune.pipe.engine import PipelineEngine

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "PipelineEngine", "ProcessTopology",
           "PipeDataParallelTopology", "PipeModelDataParallelTopology"]


def _coordinate_class(axes: Sequence[str]) -> Callable[..., tuple[int, ...]]:
    """DeepSpeed's ``topology.ProcessCoord``: a namedtuple whose fields are the axes, known at run time only."""
    return namedtuple("ProcessCoord", axes)


class ProcessTopology:
    """Ranks laid out on a grid of named axes, the first axis outermost (DeepSpeed's class).

    ``PipelineModule(topology=...)`` takes its pipe size from it; rank queries answer as DeepSpeed's.
    """

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        if len(axes) != len(dims) or any(not isinstance(d, int) or d < 1 for d in dims):
            raise ValueError(f"ProcessTopology needs one positive size per axis; got axes={axes}, dims={dims}")
        self.axes, self.dims = list(axes), list(dims)
        self.ProcessCoord = _coordinate_class(self.axes)
        self.mapping = {self.ProcessCoord(*coord): rank
                        for rank, coord in enumerate(itertools.product(*(range(d) for d in dims)))}

    def get_rank(self, **coord_kwargs: int) -> int:
        if len(coord_kwargs) != len(self.axes):
            raise ValueError(f"get_rank needs a coordinate for every axis {self.axes}, got {sorted(coord_kwargs)}")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"coordinate {coord_kwargs} is outside the topology {dict(zip(self.axes, self.dims))}")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_rank_repr(self, rank: int, omit_axes: Sequence[str] = ("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        coord = self.get_coord(rank)
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}"
                              for axis in self.axes if axis not in omit_axes)

    def get_dim(self, axis: str) -> int:
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        for coord, index in self.mapping.items():
            if index == rank:
                return coord
        raise ValueError(f"rank {rank} is not in the topology of {self.world_size()} ranks")

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The rank lists that differ only along ``axis`` (one communicator each)."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for fixed in itertools.product(*(range(self.get_dim(a)) for a in others)):
            where = dict(zip(others, fixed))
            lists.append([self.get_rank(**where, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        return [rank for coord, rank in self.mapping.items()
                if all(getattr(coord, key) == value for key, value in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        if axis not in self.axes:
            return []
        position = self.axes.index(axis)
        return [rank for coord, rank in self.mapping.items() if coord[position] == idx]

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])
