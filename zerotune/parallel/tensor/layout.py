"""Where a tensor-parallel shard sits inside its full tensor, and the pure math to cut and re-join it.

A tensor-parallel parameter is an ordinary ``nn.Parameter`` that holds only this rank's piece. The
rest of zerotune (ZeRO partitioning, gradient clipping, checkpoint save/load, HF export) needs to
know *which* piece it is without knowing which layer made it, so each such parameter carries a
``TPLayout`` (set by ``mark_tensor_parallel``, read by ``tp_layout_of``). Replicated parameters
carry none.

Fused weights are the one subtlety: GPT-2's ``c_attn`` stores q|k|v one after another along its
output dim. Cutting that dim into ``world`` contiguous chunks would give rank 0 all of q and half
of k; instead each of the ``parts`` sub-blocks is cut separately and rank r keeps
``[q_r, k_r, v_r]`` -- so every rank holds whole attention heads of all three projections.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_ATTRIBUTE = "_zerotune_tp"


@dataclass(frozen=True)
class TPLayout:
    """How this rank's shard maps into the full tensor.

    ``dim`` is a dim of the FULL tensor (the shard has the same number of dims); ``full_size`` is the
    full tensor's size along it; ``parts`` fused sub-blocks along ``dim`` are each split into
    ``world`` chunks separately (rank r keeps chunk r of every part, in part order).
    """

    dim: int
    world: int
    rank: int
    full_size: int
    parts: int = 1

    def __post_init__(self) -> None:
        for name in ("dim", "world", "rank", "full_size", "parts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"TPLayout.{name} must be an int, got {value!r}")
        if self.world < 1:
            raise ValueError(f"TPLayout.world (tensor-parallel size) must be >= 1, got {self.world}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"TPLayout.rank must be in [0, {self.world}) for tp size {self.world}, got {self.rank}")
        if self.parts < 1:
            raise ValueError(f"TPLayout.parts must be >= 1, got {self.parts}")
        if self.full_size < 0 or self.full_size % (self.parts * self.world) != 0:
            raise ValueError(
                f"cannot split size {self.full_size} along dim {self.dim} into {self.parts} part(s) x "
                f"tp size {self.world}: {self.full_size} is not divisible by {self.parts} * {self.world} = "
                f"{self.parts * self.world}"
            )

    @property
    def part_size(self) -> int:
        """Size of one fused sub-block in the full tensor."""
        return self.full_size // self.parts

    @property
    def chunk_size(self) -> int:
        """Size of this rank's piece of one sub-block."""
        return self.full_size // (self.parts * self.world)

    @property
    def local_size(self) -> int:
        """Size of this rank's shard along ``dim``."""
        return self.full_size // self.world


def mark_tensor_parallel(param: torch.Tensor, layout: TPLayout) -> None:
    """Record on ``param`` that it holds the shard described by ``layout``."""
    if not isinstance(layout, TPLayout):
        raise TypeError(f"layout must be a TPLayout, got {type(layout).__name__}")
    dim = _normalized_dim(layout, param.dim())
    if param.shape[dim] != layout.local_size:
        raise ValueError(
            f"a shard of size {param.shape[dim]} along dim {layout.dim} does not match its layout: full size "
            f"{layout.full_size} over tp size {layout.world} gives {layout.local_size}"
        )
    setattr(param, _ATTRIBUTE, layout)


def tp_layout_of(tensor: torch.Tensor) -> TPLayout | None:
    """The layout recorded by ``mark_tensor_parallel``, or None for a replicated (ordinary) tensor."""
    return getattr(tensor, _ATTRIBUTE, None)


def shard_tensor(full: torch.Tensor, layout: TPLayout) -> torch.Tensor:
    """This rank's piece of ``full`` (new contiguous storage, so the full tensor can be freed)."""
    dim = _normalized_dim(layout, full.dim())
    if full.shape[dim] != layout.full_size:
        raise ValueError(
            f"tensor of shape {tuple(full.shape)} has size {full.shape[dim]} along dim {layout.dim}, "
            f"but its layout says the full size is {layout.full_size}"
        )
    pieces = [
        full.narrow(dim, part * layout.part_size + layout.rank * layout.chunk_size, layout.chunk_size)
        for part in range(layout.parts)
    ]
    if len(pieces) == 1:
        return pieces[0].clone(memory_format=torch.contiguous_format)
    return torch.cat(pieces, dim=dim)


def unshard_tensor(shards: Sequence[torch.Tensor], layout: TPLayout) -> torch.Tensor:
    """Re-join every rank's shard (given in rank order) into the full tensor; ``layout.rank`` is ignored."""
    if len(shards) != layout.world:
        raise ValueError(f"unshard_tensor needs one shard per tp rank ({layout.world}), got {len(shards)}")
    dim = _normalized_dim(layout, shards[0].dim())
    for rank, shard in enumerate(shards):
        if shard.shape[dim] != layout.local_size or shard.shape != shards[0].shape:
            raise ValueError(
                f"shard of rank {rank} has shape {tuple(shard.shape)}; expected {layout.local_size} along dim "
                f"{layout.dim} and the same shape as rank 0's {tuple(shards[0].shape)}"
            )
    # Each shard is [part 0 chunk | part 1 chunk | ...]; the full tensor is part-major, rank-minor.
    split = [shard.split(layout.chunk_size, dim=dim) for shard in shards]
    return torch.cat([split[rank][part] for part in range(layout.parts) for rank in range(layout.world)], dim=dim)


def _normalized_dim(layout: TPLayout, ndim: int) -> int:
    if not -ndim <= layout.dim < ndim:
        raise ValueError(f"layout dim {layout.dim} is out of range for a tensor with {ndim} dim(s)")
    return layout.dim % ndim
