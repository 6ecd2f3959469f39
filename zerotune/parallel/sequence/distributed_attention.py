"""Ulysses around any attention callable: the module form of sequence parallelism, for models that do
not dispatch through transformers' attention interface (Megatron-style blocks, hand-written models).

``ulysses_attention.py`` wraps a Hugging Face model's attention by name; this wraps one attention
*function or module* the caller owns. Each of the P ranks of the group holds s/P tokens of q, k, v
laid out ``[b, s/P, h, d]`` (``batch_dim_idx=0``) or ``[s/P, b, h, d]`` (``batch_dim_idx=1``). One
all-to-all per tensor trades the sequence split for a head split (``[.., s, h/P, d]``), the local
attention runs on the whole sequence for its heads, and one all-to-all trades the output back. The
local attention therefore computes exactly what it computes single-process for those heads, which is
why the result equals unsplit attention. The exchanges are ``seq_all_to_all`` (the one Ulysses
collective, differentiable), so the backward needs nothing here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerotune.parallel.sequence.all_to_all import seq_all_to_all
from zerotune.parallel.sequence.rotary import apply_rotary_pos_emb

HEAD_DIM = 2  # [b, s, h, d] and [s, b, h, d] both keep heads at dimension 2


def sequence_dim(batch_dim_idx: int) -> int:
    """Where the sequence is in a 4D ``[b, s, h, d]`` (batch first, 0) or ``[s, b, h, d]`` (sequence first, 1)."""
    if batch_dim_idx not in (0, 1):
        raise ValueError(f"batch_dim_idx must be 0 ([batch, seq, heads, dim]) or 1 ([seq, batch, heads, dim]), "
                         f"got {batch_dim_idx!r}")
    return 1 - batch_dim_idx


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None, batch_dim_idx: int) -> torch.Tensor:
    """``[.., s/P, h, d]`` sequence-split -> ``[.., s, h/P, d]`` head-split (rank r keeps heads chunk r)."""
    _check_4d(x, "sequence_to_heads")
    return seq_all_to_all(x, group, scatter_dim=HEAD_DIM, gather_dim=sequence_dim(batch_dim_idx))


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup | None, batch_dim_idx: int) -> torch.Tensor:
    """The inverse of ``sequence_to_heads``: ``[.., s, h/P, d]`` -> ``[.., s/P, h, d]``."""
    _check_4d(x, "heads_to_sequence")
    return seq_all_to_all(x, group, scatter_dim=sequence_dim(batch_dim_idx), gather_dim=HEAD_DIM)


def _check_4d(x: torch.Tensor, what: str) -> None:
    if x.dim() != 4:
        raise ValueError(f"{what}: Ulysses exchanges 4D tensors [batch, seq, heads, dim] or [seq, batch, heads, dim], "
                         f"got shape {tuple(x.shape)}")


class DistributedAttention(nn.Module):
    """``local_attention(q, k, v, *args, **kwargs)`` on the full sequence for this rank's heads, fed and
    returning sequence-split tensors. ``scatter_idx`` >= 2 (the heads; DeepSpeed's default 2) selects the
    usual sequence-in / sequence-out direction; ``gather_idx`` is kept for DeepSpeed's signature: where the
    sequence is comes from ``forward``'s ``batch_dim_idx``."""

    def __init__(self, local_attention: Any, sequence_process_group: dist.ProcessGroup | None,
                 scatter_idx: int = 2, gather_idx: int = 0, sp_stream: Any = None) -> None:
        super().__init__()
        if sp_stream is not None:
            raise ValueError("DistributedAttention: sp_stream (overlapping the all-to-alls on a side CUDA stream) is "
                             "not supported by zerotune; pass sp_stream=None")
        if scatter_idx < 2:
            raise ValueError(f"DistributedAttention: scatter_idx={scatter_idx} would split the sequence of inputs that "
                             "are already sequence-split; the heads (dimension 2) are scattered, so use scatter_idx=2")
        if not callable(local_attention):
            raise TypeError(f"DistributedAttention: local_attention must be callable, got "
                            f"{type(local_attention).__name__}")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int,
                rotary_pos_emb: tuple[torch.Tensor, torch.Tensor] | None = None, *args: Any,
                **kwargs: Any) -> torch.Tensor:
        """Sequence-split q, k, v in, sequence-split attention output out (same layout).

        ``rotary_pos_emb`` = (cos, sin) tables of the FULL sequence with the first two dimensions swapped
        relative to q (Megatron passes ``[b, s, 1, d]`` tables with sequence-first ``[s, b, h, d]`` q, as
        DeepSpeed does): they are applied after the exchange, where each rank holds every position."""
        group = self.spg
        query, key, value = (sequence_to_heads(t, group, batch_dim_idx) for t in (query, key, value))
        if rotary_pos_emb is not None:
            cos, sin = (table.permute(1, 0, 2, 3) for table in rotary_pos_emb)
            query = apply_rotary_pos_emb(query, cos, sin)
            key = apply_rotary_pos_emb(key, cos, sin)
        context = self.local_attn(query, key, value, *args, **kwargs)
        return heads_to_sequence(context, group, batch_dim_idx)
