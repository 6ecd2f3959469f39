"""THE bucketing helper: pack parameters' gradients into a few flat buffers.

Communicating one large flat buffer is much cheaper than one collective per parameter, and
launching a bucket as soon as all its gradients exist overlaps communication with the rest
of backward. Gradients become ready roughly in reverse registration order, so buckets are
filled from the last parameter backwards (as DDP does).

A bucket holds *pieces* of parameters: whole parameters for data parallel, or the part of a
parameter that falls in one rank's ZeRO slice (a parameter straddling two slices lands in two
buckets). Buckets are launched strictly in index order on every rank: even when gradients
arrive in a slightly different order on different ranks, the collectives still match up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch


def assign_buckets(numels: Sequence[int], bucket_numel: int) -> list[list[int]]:
    """Group parameter indices (in reverse order) into buckets of at most ``bucket_numel`` elements.

    A parameter larger than the cap gets a bucket of its own. Pure function: easy to test.
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket size must be at least 1 element, got {bucket_numel}")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index in reversed(range(len(numels))):
        if current and filled + numels[index] > bucket_numel:
            buckets.append(current)
            current, filled = [], 0
        current.append(index)
        filled += numels[index]
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class BucketPiece:
    """``length`` elements of ``param`` (flattened) from ``param_offset``, at ``bucket_offset`` in the bucket."""

    param: torch.nn.Parameter
    param_offset: int
    length: int
    bucket_offset: int

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This piece of a parameter-shaped tensor (e.g. its gradient), flattened."""
        return tensor.reshape(-1)[self.param_offset:self.param_offset + self.length]


@dataclass
class Bucket:
    """One flat buffer and the parameter pieces whose gradients go in it.

    ``buffer`` is persistent for data parallel (it *is* the gradient storage) and allocated on
    demand for ZeRO-2 (freed once its reduction is done). ``target`` is strategy data, e.g. the
    owning rank and the slice of the flat parameter group the bucket covers.
    """

    index: int
    pieces: list[BucketPiece]
    numel: int
    dtype: torch.dtype
    device: torch.device
    buffer: torch.Tensor | None = None
    target: Any = None
    pending: int = 0
    launched: bool = False

    def ensure_buffer(self) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        return self.buffer

    def view(self, piece: BucketPiece) -> torch.Tensor:
        return self.ensure_buffer()[piece.bucket_offset:piece.bucket_offset + piece.length]

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [piece.param for piece in self.pieces]


@dataclass
class GradientBuckets:
    """Buckets plus the launch-in-order bookkeeping.

    ``launch`` is the strategy's collective (all-reduce for data parallel, reduce-to-owner for
    ZeRO-2); it is called with each bucket, in order, once that bucket and all before it are
    complete.
    """

    buckets: list[Bucket]
    launch: Callable[[Bucket], None]
    pieces_of: dict[int, list[tuple[Bucket, BucketPiece]]] = field(default_factory=dict)  # id(param) -> its pieces
    next_to_launch: int = 0

    @classmethod
    def from_pieces(cls, bucket_pieces: Sequence[Sequence[BucketPiece]], dtype: torch.dtype, device: torch.device,
                    launch: Callable[[Bucket], None], targets: Sequence[Any] | None = None,
                    persistent: bool = False) -> GradientBuckets:
        buckets = []
        for index, pieces in enumerate(bucket_pieces):
            numel = max((p.bucket_offset + p.length for p in pieces), default=0)
            bucket = Bucket(index, list(pieces), numel, dtype, device, target=targets[index] if targets else None)
            if persistent:
                bucket.ensure_buffer()
            buckets.append(bucket)
        pieces_of: dict[int, list[tuple[Bucket, BucketPiece]]] = {}
        for bucket in buckets:
            for piece in bucket.pieces:
                pieces_of.setdefault(id(piece.param), []).append((bucket, piece))
        return cls(buckets, launch, pieces_of)

    @classmethod
    def whole_params(cls, params: Sequence[torch.nn.Parameter], bucket_numel: int, dtype: torch.dtype,
                     device: torch.device, launch: Callable[[Bucket], None]) -> GradientBuckets:
        """Data parallel: persistent buckets of whole parameters, filled from the last parameter backwards."""
        bucket_pieces = []
        for indices in assign_buckets([p.numel() for p in params], bucket_numel):
            pieces, offset = [], 0
            for i in indices:
                pieces.append(BucketPiece(params[i], 0, params[i].numel(), offset))
                offset += params[i].numel()
            bucket_pieces.append(pieces)
        return cls.from_pieces(bucket_pieces, dtype, device, launch, persistent=True)

    def view_of(self, param: torch.nn.Parameter) -> torch.Tensor:
        """A whole parameter's slot, shaped like it (data-parallel buckets only)."""
        (bucket, piece), = self.pieces_of[id(param)]
        return bucket.view(piece).view(param.shape)

    def start_round(self) -> None:
        """Arm every bucket for a communicating micro-step."""
        for bucket in self.buckets:
            bucket.pending = len(bucket.pieces)
            bucket.launched = False
        self.next_to_launch = 0

    def mark_ready(self, param: torch.nn.Parameter) -> None:
        """Called when ``param``'s gradient for this round is in its bucket(s)."""
        for bucket, _ in self.pieces_of[id(param)]:
            bucket.pending -= 1
        self._launch_ready_prefix()

    def launch_remaining(self) -> None:
        """Launch every bucket not yet launched (parameters that got no gradient this step)."""
        while self.next_to_launch < len(self.buckets):
            self._launch(self.buckets[self.next_to_launch])

    def _launch_ready_prefix(self) -> None:
        while self.next_to_launch < len(self.buckets) and self.buckets[self.next_to_launch].pending <= 0:
            self._launch(self.buckets[self.next_to_launch])

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = True
        self.next_to_launch += 1
        self.launch(bucket)

    def zero_(self) -> None:
        for bucket in self.buckets:
            if bucket.buffer is not None:
                bucket.buffer.zero_()
