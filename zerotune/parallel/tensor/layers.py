"""Column-, row- and vocab-parallel layers (Megatron-style tensor parallelism).

A transformer MLP ``y = W2 act(W1 x)`` splits with one all-reduce per direction: W1 by output
columns (each rank computes a slice of the hidden activation, no communication), W2 by input rows
(each rank multiplies its slice and the partial sums are added). Attention splits the same way
with whole heads per rank. See ``mappings.py`` for why each collective sits where it does.

Every layer's parameters are ordinary ``nn.Parameter``s holding the LOCAL shard, named ``weight``
and ``bias`` like the module they replace, so an HF model's state-dict keys do not change. Each
sharded parameter carries a ``TPLayout`` saying where it sits in the full tensor; replicated ones
(the row-parallel bias) carry none. ``tp_group`` holds the process group (None = tp size 1).

Two weight layouts are supported because HF uses both: ``"out_in"`` is ``nn.Linear``'s
``[out, in]`` (``y = x W^T + b``) and ``"in_out"`` is GPT-2 ``Conv1D``'s ``[in, out]``
(``y = x W + b``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zerotune.parallel.tensor.layout import TPLayout, mark_tensor_parallel, shard_tensor
from zerotune.parallel.tensor.mappings import (
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    group_rank,
    group_world_size,
    reduce_from_tensor_parallel,
    scatter_to_tensor_parallel,
)

WEIGHT_LAYOUTS = ("out_in", "in_out")


def _check_weight_layout(weight_layout: str) -> None:
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(
            f"weight_layout must be one of {WEIGHT_LAYOUTS} ('out_in' = nn.Linear's [out, in], "
            f"'in_out' = GPT-2 Conv1D's [in, out]), got {weight_layout!r}"
        )


def _check_divisible(what: str, size: int, world: int, parts: int = 1) -> None:
    if size % (parts * world) != 0:
        fused = f" x {parts} fused parts" if parts > 1 else ""
        raise ValueError(
            f"{what}={size} is not divisible by tp size {world}{fused} "
            f"({size} % {parts * world} = {size % (parts * world)})"
        )


def _full_features(weight: torch.Tensor, bias: torch.Tensor | None, weight_layout: str) -> tuple[int, int]:
    """(out_features, in_features) of a full linear weight stored as ``weight_layout``, with its bias checked."""
    _check_weight_layout(weight_layout)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D, got shape {tuple(weight.shape)}")
    out_features, in_features = weight.shape if weight_layout == "out_in" else weight.shape[::-1]
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"bias must have shape ({out_features},) to match weight {tuple(weight.shape)} "
                         f"({weight_layout}), got {tuple(bias.shape)}")
    return out_features, in_features


def _full_linear_tensors(in_features: int, out_features: int, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A full ``[out, in]`` weight (and bias) initialized exactly as ``nn.Linear`` would, from the current
    RNG: with the same seed every tp rank builds the same full model, then keeps its own shard."""
    weight = torch.empty(out_features, in_features)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    full_bias = None
    if bias:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        full_bias = torch.empty(out_features).uniform_(-bound, bound)
    return weight, full_bias


def _as_parameter(shard: torch.Tensor, source: torch.Tensor) -> nn.Parameter:
    """Wrap a shard; a frozen source parameter (e.g. a LoRA base weight) stays frozen."""
    requires_grad = source.requires_grad if isinstance(source, nn.Parameter) else True
    return nn.Parameter(shard.detach(), requires_grad=requires_grad)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_layout: str) -> torch.Tensor:
    if weight_layout == "out_in":
        return F.linear(x, weight, bias)
    # Conv1D's own computation: addmm on the flattened rows.
    rows = x.reshape(-1, x.shape[-1])  # (N, in)
    out = rows @ weight if bias is None else torch.addmm(bias, rows, weight)  # (N, out)
    return out.view(*x.shape[:-1], weight.shape[-1])


def _linear_repr(layer: ColumnParallelLinear | RowParallelLinear) -> str:
    """The part of a parallel linear's repr both kinds share: features and local-of-full weight shape."""
    full = (layer.out_features, layer.in_features) if layer.weight_layout == "out_in" else (
        layer.in_features, layer.out_features)
    return (f"in_features={layer.in_features}, out_features={layer.out_features}, "
            f"weight={tuple(layer.weight.shape)} of {full} ({layer.weight_layout})")


class ColumnParallelLinear(nn.Module):
    """``y = x W + b`` with W split by OUTPUT features: rank r computes output columns
    ``[r*out/tp, (r+1)*out/tp)`` (per fused part). The input is replicated; the output stays split
    unless ``gather_output``."""

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup | None, *,
                 bias: bool = True, gather_output: bool = False, weight_layout: str = "out_in",
                 parts: int = 1) -> None:
        super().__init__()
        self._configure(in_features, out_features, group, gather_output, weight_layout, parts)
        weight, full_bias = _full_linear_tensors(in_features, out_features, bias)
        if weight_layout == "in_out":
            weight = weight.t()
        self._adopt_full(weight, full_bias)

    @classmethod
    def from_full(cls, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup | None, *,
                  weight_layout: str = "out_in", parts: int = 1, gather_output: bool = False) -> ColumnParallelLinear:
        """Shard existing full tensors (e.g. a loaded HF layer's) instead of initializing new ones."""
        out_features, in_features = _full_features(weight, bias, weight_layout)
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module._configure(in_features, out_features, group, gather_output, weight_layout, parts)
        module._adopt_full(weight, bias)
        return module

    def _configure(self, in_features: int, out_features: int, group: dist.ProcessGroup | None,
                   gather_output: bool, weight_layout: str, parts: int) -> None:
        _check_weight_layout(weight_layout)
        if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
            raise ValueError(f"parts must be an int >= 1, got {parts!r}")
        if gather_output and parts > 1:
            raise ValueError(
                f"gather_output=True with parts={parts} is not supported: the gathered output would interleave "
                "the fused sub-blocks rank by rank instead of restoring the full layout; keep the output split"
            )
        self.tp_group = group
        self.tp_world, self.tp_rank = group_world_size(group), group_rank(group)
        _check_divisible("out_features", out_features, self.tp_world, parts)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.weight_layout, self.parts = gather_output, weight_layout, parts

    def _adopt_full(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        out_dim = 0 if self.weight_layout == "out_in" else 1
        weight_layout = TPLayout(out_dim, self.tp_world, self.tp_rank, self.out_features, self.parts)
        self.weight = _as_parameter(shard_tensor(weight.detach(), weight_layout), weight)
        mark_tensor_parallel(self.weight, weight_layout)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            bias_layout = TPLayout(0, self.tp_world, self.tp_rank, self.out_features, self.parts)
            self.bias = _as_parameter(shard_tensor(bias.detach(), bias_layout), bias)
            mark_tensor_parallel(self.bias, bias_layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tensor_parallel(x, self.tp_group)  # (..., in), replicated
        y = _linear(x, self.weight, self.bias, self.weight_layout)  # (..., out / tp)
        return gather_from_tensor_parallel(y, self.tp_group, dim=-1) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"{_linear_repr(self)}, bias={self.bias is not None}, parts={self.parts}, "
                f"gather_output={self.gather_output}, tp={self.tp_world}")


class RowParallelLinear(nn.Module):
    """``y = x W + b`` with W split by INPUT features: rank r multiplies input columns
    ``[r*in/tp, (r+1)*in/tp)`` and the partial products are summed over the group. The bias is
    replicated and added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup | None, *,
                 bias: bool = True, input_is_parallel: bool = True, weight_layout: str = "out_in") -> None:
        super().__init__()
        self._configure(in_features, out_features, group, input_is_parallel, weight_layout)
        weight, full_bias = _full_linear_tensors(in_features, out_features, bias)
        if weight_layout == "in_out":
            weight = weight.t()
        self._adopt_full(weight, full_bias)

    @classmethod
    def from_full(cls, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup | None, *,
                  weight_layout: str = "out_in", input_is_parallel: bool = True) -> RowParallelLinear:
        """Shard existing full tensors (e.g. a loaded HF layer's) instead of initializing new ones."""
        out_features, in_features = _full_features(weight, bias, weight_layout)
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module._configure(in_features, out_features, group, input_is_parallel, weight_layout)
        module._adopt_full(weight, bias)
        return module

    def _configure(self, in_features: int, out_features: int, group: dist.ProcessGroup | None,
                   input_is_parallel: bool, weight_layout: str) -> None:
        _check_weight_layout(weight_layout)
        self.tp_group = group
        self.tp_world, self.tp_rank = group_world_size(group), group_rank(group)
        _check_divisible("in_features", in_features, self.tp_world)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.weight_layout = input_is_parallel, weight_layout

    def _adopt_full(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        in_dim = 1 if self.weight_layout == "out_in" else 0
        weight_layout = TPLayout(in_dim, self.tp_world, self.tp_rank, self.in_features)
        self.weight = _as_parameter(shard_tensor(weight.detach(), weight_layout), weight)
        mark_tensor_parallel(self.weight, weight_layout)
        if bias is None:
            self.register_parameter("bias", None)
        else:  # replicated: every rank holds (and gets the same gradient for) the full bias
            self.bias = _as_parameter(bias.detach().clone(memory_format=torch.contiguous_format), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x, self.tp_group, dim=-1)  # (..., in) -> (..., in / tp)
        partial = _linear(x, self.weight, None, self.weight_layout)  # (..., out), this rank's addend
        y = reduce_from_tensor_parallel(partial, self.tp_group)  # (..., out), summed over ranks
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"{_linear_repr(self)}, bias={self.bias is not None} (replicated), "
                f"input_is_parallel={self.input_is_parallel}, tp={self.tp_world}")


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split: rank r holds ids ``[r*V/tp, (r+1)*V/tp)``.

    Each rank looks up the ids it owns and gives zero rows for the rest; summing over the group
    then yields every id's row exactly once. Ids outside ``[0, V)`` therefore come out as zero rows
    rather than an IndexError. ``num_embeddings`` / ``embedding_dim`` / ``padding_idx`` are the
    FULL values, for HF code that reads them.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: dist.ProcessGroup | None, *,
                 padding_idx: int | None = None) -> None:
        super().__init__()
        self._configure(num_embeddings, embedding_dim, group, padding_idx)
        weight = torch.empty(num_embeddings, embedding_dim)
        nn.init.normal_(weight)  # as nn.Embedding.reset_parameters
        if self.padding_idx is not None:
            weight[self.padding_idx].zero_()
        self._adopt_full(weight)

    @classmethod
    def from_full(cls, weight: torch.Tensor, group: dist.ProcessGroup | None,
                  padding_idx: int | None = None) -> VocabParallelEmbedding:
        """Shard an existing full ``[V, H]`` embedding table."""
        if weight.dim() != 2:
            raise ValueError(f"embedding weight must be 2-D [num_embeddings, embedding_dim], got {tuple(weight.shape)}")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module._configure(weight.shape[0], weight.shape[1], group, padding_idx)
        module._adopt_full(weight)
        return module

    def _configure(self, num_embeddings: int, embedding_dim: int, group: dist.ProcessGroup | None,
                   padding_idx: int | None) -> None:
        self.tp_group = group
        self.tp_world, self.tp_rank = group_world_size(group), group_rank(group)
        _check_divisible("num_embeddings", num_embeddings, self.tp_world)
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx must be within [-{num_embeddings}, {num_embeddings}) for "
                                 f"num_embeddings={num_embeddings}, got {padding_idx}")
            padding_idx %= num_embeddings  # nn.Embedding's normalization of negative indices
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        rows = num_embeddings // self.tp_world
        self.vocab_start, self.vocab_end = self.tp_rank * rows, (self.tp_rank + 1) * rows
        owns_padding = padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end
        self._local_padding_idx = padding_idx - self.vocab_start if padding_idx is not None and owns_padding else None

    def _adopt_full(self, weight: torch.Tensor) -> None:
        layout = TPLayout(0, self.tp_world, self.tp_rank, self.num_embeddings)
        self.weight = _as_parameter(shard_tensor(weight.detach(), layout), weight)
        mark_tensor_parallel(self.weight, layout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        not_mine = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(not_mine, 0)
        rows = F.embedding(local_ids, self.weight, self._local_padding_idx)  # (..., H)
        rows = rows.masked_fill(not_mine.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel(rows, self.tp_group)

    def extra_repr(self) -> str:
        full = (self.num_embeddings, self.embedding_dim)
        return (f"{self.num_embeddings}, {self.embedding_dim}, weight={tuple(self.weight.shape)} of {full}, "
                f"rows=[{self.vocab_start}, {self.vocab_end}), padding_idx={self.padding_idx}, tp={self.tp_world}")
