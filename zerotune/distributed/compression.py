"""Top-K gradient compression with error feedback, for every data-parallel reduction.

Per bucket and rank: add the residual (what earlier steps did not send), keep the k = ceil(ratio x n)
largest-magnitude entries, exchange (indices, values) with the other ranks (one all-gather of
each), and sum them densely; the entries not sent become the new residual. Over any sequence of
steps, what a rank sent plus its final residual equals the sum of its gradients (error feedback),
so nothing is lost, only delayed -- why Top-K at 1% still converges.

The three ZeRO reductions use the one exchange (``_gather_sparse``): all-reduce (stage 0), the
reduce-scatter of a chunk (stage 1: every rank keeps the entries of its slice) and the reduce of a
bucket to its owner (stage 2). Each bucket keeps its residual under a stable key, saved in
checkpoints. When the sparse form would not be smaller than the dense one (k >= n / 2: an index
costs as much as a value), or during ``warmup_steps``, or for buckets under ``min_bucket_numel``,
the dense collective runs instead -- so ratio 1.0 is exactly the uncompressed run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerotune.distributed import comm

SPARSE_COUNTER = "sparse_all_gather"  # the comm-statistics entry of compressed gradient exchanges
GRADIENT_OPS = ("all_reduce", "reduce_scatter", "reduce", SPARSE_COUNTER)  # every gradient reduction's counter


@dataclass
class CompressionStats:
    """Gradient bytes handed to the reductions (dense size) and bytes actually sent, since the last reset."""

    dense_bytes: int = 0
    sent_bytes: int = 0

    @property
    def ratio(self) -> float:
        return self.sent_bytes / self.dense_bytes if self.dense_bytes else 1.0


class TopKCompressor:
    """Top-K selection with per-bucket residuals (see the module docstring)."""

    def __init__(self, ratio: float, *, error_feedback: bool = True, warmup_steps: int = 0,
                 min_bucket_numel: int = 0, dense_when_cheaper: bool = True) -> None:
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"gradient_compression.ratio must be in (0, 1], got {ratio}")
        self.ratio, self.error_feedback = float(ratio), bool(error_feedback)
        self.warmup_steps, self.min_bucket_numel = int(warmup_steps), int(min_bucket_numel)
        self.dense_when_cheaper = dense_when_cheaper
        self.residuals: dict[str, torch.Tensor] = {}
        self.step = 0  # optimizer steps taken; the engine advances it
        self.stats = CompressionStats()

    def k_of(self, numel: int) -> int:
        return max(1, math.ceil(self.ratio * numel))

    def compresses(self, numel: int) -> bool:
        """Whether a bucket of ``numel`` elements goes sparse this step."""
        if self.step < self.warmup_steps or numel < max(self.min_bucket_numel, 1):
            return False
        return not (self.dense_when_cheaper and 2 * self.k_of(numel) >= numel)

    def compress(self, key: str, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices int32, values) of the k largest |flat + residual|; the rest becomes the residual."""
        corrected = flat.float()
        residual = self.residuals.get(key) if self.error_feedback else None
        if residual is not None:
            corrected = corrected + residual
        k = self.k_of(flat.numel())
        indices = torch.topk(corrected.abs(), k, sorted=False).indices
        values = corrected[indices]
        if self.error_feedback:
            corrected = corrected.clone() if corrected is flat else corrected
            corrected[indices] = 0
            self.residuals[key] = corrected
        return indices.to(torch.int32), values.to(flat.dtype)

    @staticmethod
    def decompress(indices: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
        """The dense sum of the (indices, values) pairs (duplicates add up)."""
        dense = torch.zeros(numel, dtype=values.dtype, device=values.device)
        return dense.index_add_(0, indices.long(), values)

    # ---- residual bookkeeping -------------------------------------------------------------
    def rescale_residuals(self, factor: float) -> None:
        """The loss scale changed by ``factor``: residuals are in scaled-gradient units."""
        for residual in self.residuals.values():
            residual.mul_(factor)

    def drop_residuals(self) -> None:
        """After an fp16 overflow the residuals may hold inf/nan: start over."""
        self.residuals.clear()

    def state_dict(self) -> dict:
        return {"residuals": {k: v.detach().cpu().clone() for k, v in self.residuals.items()}, "step": self.step}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        self.residuals = {k: v.to(device) for k, v in state["residuals"].items()}
        self.step = int(state["step"])


def _gather_sparse(compressor: TopKCompressor, key: str, flat: torch.Tensor,
                   group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's top-k of ``flat`` (+ residual), summed densely: the compressed all-reduce's result."""
    indices, values = compressor.compress(key, flat)
    world = 1 if group is None else dist.get_world_size(group)
    all_indices = torch.empty(world * indices.numel(), dtype=indices.dtype, device=indices.device)
    all_values = torch.empty(world * values.numel(), dtype=values.dtype, device=values.device)
    comm.all_gather_into_tensor(all_indices, indices, group, counter=SPARSE_COUNTER)
    comm.all_gather_into_tensor(all_values, values, group, counter=SPARSE_COUNTER)
    compressor.stats.sent_bytes += indices.numel() * indices.element_size() + values.numel() * values.element_size()
    return compressor.decompress(all_indices, all_values, flat.numel())


def _count_dense(compressor: TopKCompressor, flat: torch.Tensor, sent: bool) -> None:
    nbytes = flat.numel() * flat.element_size()
    compressor.stats.dense_bytes += nbytes
    if sent:
        compressor.stats.sent_bytes += nbytes


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, compressor: TopKCompressor, key: str,
               async_op: bool = False) -> comm.Handle:
    """Sum ``tensor`` over ``group`` in place, sparse when ``compressor`` says so."""
    sparse = compressor.compresses(tensor.numel())
    _count_dense(compressor, tensor, sent=not sparse)
    if not sparse:
        return comm.all_reduce(tensor, group, async_op=async_op)
    tensor.copy_(_gather_sparse(compressor, key, tensor, group))
    return comm.Handle("all_reduce", group, None)


def reduce(tensor: torch.Tensor, owner: int, group: dist.ProcessGroup | None, compressor: TopKCompressor, key: str,
           async_op: bool = False) -> comm.Handle:
    """Sum ``tensor`` over ``group`` into rank ``owner``'s copy (the others' copies are undefined)."""
    sparse = compressor.compresses(tensor.numel())
    _count_dense(compressor, tensor, sent=not sparse)
    if not sparse:
        return comm.reduce(tensor, owner, group, async_op=async_op)
    summed = _gather_sparse(compressor, key, tensor, group)
    if group is None or dist.get_rank(group) == owner:
        tensor.copy_(summed)
    return comm.Handle("reduce", group, None)


def reduce_scatter(output: torch.Tensor, inputs: list[torch.Tensor], group: dist.ProcessGroup | None,
                   compressor: TopKCompressor, key: str, async_op: bool = False) -> comm.Handle:
    """Rank r's ``output`` = the sum over ranks of their ``inputs[r]``; top-k over all of a rank's inputs."""
    numel = sum(i.numel() for i in inputs)
    sparse = compressor.compresses(numel)
    compressor.stats.dense_bytes += numel * inputs[0].element_size()
    if not sparse:
        compressor.stats.sent_bytes += numel * inputs[0].element_size()
        return comm.reduce_scatter(output, inputs, group, async_op=async_op)
    summed = _gather_sparse(compressor, key, torch.cat([i.reshape(-1) for i in inputs]), group)
    rank = 0 if group is None else dist.get_rank(group)
    start = sum(i.numel() for i in inputs[:rank])
    output.copy_(summed[start:start + output.numel()].view_as(output))
    return comm.Handle("reduce_scatter", group, None)
