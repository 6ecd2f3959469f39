"""How the world's ranks are arranged into parallel axes.

``ParallelDims`` is pure arithmetic (testable without processes); ``build_mesh`` turns it into a
``torch.distributed.DeviceMesh`` with named axes in DeepSpeed's/Megatron's rank layout:
pipeline outermost, then data, then sequence, tensor innermost (consecutive ranks share a
tensor-parallel group; Megatron orders its context-parallel axis the same way).

One derived axis, ``dp_sp``: the data and sequence ranks together. They hold the same
parameters (sequence parallelism splits tokens, not weights), so gradients are averaged and
ZeRO partitions over ``dp_sp`` -- as DeepSpeed's "sequence data parallel" group -- while batch
arithmetic and data loading use ``dp`` alone (the sp ranks of one group read the same samples).

Components receive the mesh (or one axis of it) explicitly; nothing keeps process groups in
module globals.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("pp", "dp", "sp", "tp")
DERIVED_AXES = ("dp_sp",)


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the pipeline, data, sequence and tensor axes; their product is the world size."""

    dp: int
    tp: int = 1
    pp: int = 1
    sp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"parallel size {axis}={size!r} must be a positive integer")

    @classmethod
    def from_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, sp: int = 1) -> ParallelDims:
        """Data-parallel size is whatever the model-parallel and sequence axes leave over."""
        for axis, size in (("tp", tp), ("pp", pp), ("sp", sp)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"parallel size {axis}={size!r} must be a positive integer")
        if world_size % (tp * pp * sp):
            raise ValueError(
                f"world size {world_size} is not divisible by tensor parallel {tp} x pipeline parallel {pp} "
                f"x sequence parallel {sp}"
            )
        return cls(dp=world_size // (tp * pp * sp), tp=tp, pp=pp, sp=sp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.sp * self.tp

    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in AXES)


class ProcessMesh:
    """A DeviceMesh over the axes that have more than one rank, answering for all axes.

    Axes of size 1 are left out of the DeviceMesh (creating a process group per rank for them
    would be pure overhead); asking for such an axis gives size 1, rank 0 and group ``None``,
    which the comm layer treats as "nothing to communicate". The data-parallel axis is always
    present so world size 1 still goes through a real process group.
    """

    def __init__(self, dims: ParallelDims, device_type: str) -> None:
        if dims.world_size != dist.get_world_size():
            sp = f" x sp={dims.sp}" if dims.sp > 1 else ""
            raise ValueError(
                f"parallel sizes pp={dims.pp} x dp={dims.dp}{sp} x tp={dims.tp} = {dims.world_size} "
                f"do not match the world size {dist.get_world_size()}"
            )
        self.dims = dims
        names = tuple(axis for axis in AXES if getattr(dims, axis) > 1 or axis == "dp")
        shape = tuple(getattr(dims, axis) for axis in names)
        self.device_mesh: DeviceMesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        self._names = names
        self._dp_sp_mesh = self.device_mesh["dp", "sp"]._flatten("dp_sp") if dims.sp > 1 and dims.dp > 1 else None

    @staticmethod
    def _check_axis(axis: str) -> None:
        if axis not in AXES + DERIVED_AXES:
            raise ValueError(f"unknown parallel axis {axis!r}; valid axes: {', '.join(AXES + DERIVED_AXES)}")

    def size(self, axis: str) -> int:
        self._check_axis(axis)
        if axis == "dp_sp":
            return self.dims.dp * self.dims.sp
        return getattr(self.dims, axis)

    def rank(self, axis: str) -> int:
        self._check_axis(axis)
        if axis == "dp_sp":
            return self.rank("dp") * self.dims.sp + self.rank("sp")
        if axis not in self._names:
            return 0
        return self.device_mesh.get_local_rank(axis)

    def group(self, axis: str) -> dist.ProcessGroup | None:
        self._check_axis(axis)
        if axis == "dp_sp":
            if self._dp_sp_mesh is not None:
                return self._dp_sp_mesh.get_group()
            return self.group("sp" if self.dims.sp > 1 else "dp")
        if axis not in self._names:
            return None
        return self.device_mesh.get_group(axis)


_latest: weakref.ref[ProcessMesh] | None = None


def build_mesh(dims: ParallelDims, device_type: str) -> ProcessMesh:
    """The mesh every component receives; ``device_type`` is "cuda" or "cpu"."""
    global _latest
    mesh = ProcessMesh(dims, device_type)
    _latest = weakref.ref(mesh)
    return mesh


def latest_mesh() -> ProcessMesh | None:
    """The most recently built mesh while an engine still holds it, else None.

    Only for DeepSpeed's global group queries (``deepspeed.utils.groups``), whose functions take
    no mesh argument; zerotune's own code always receives its mesh explicitly.
    """
    return _latest() if _latest is not None else None
