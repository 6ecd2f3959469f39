"""``deepspeed.sequence.layer``: DeepSpeed's Ulysses layer names on zerotune's Ulysses pieces.

``DistributedAttention`` is zerotune's (``zerotune/parallel/sequence/distributed_attention.py``); the
all-to-all names take DeepSpeed's argument order (``group`` first for ``_SeqAllToAll.apply``) and run
``seq_all_to_all``, the one Ulysses collective. DeepSpeed reads ``scatter_idx < 2`` as "heads back to
sequence" and places the sequence by ``batch_dim_idx``; so does this. What zerotune does not do is
refused with a clear error where it is asked for: heads that do not divide over the group (DeepSpeed's
uneven-heads exchange), and the asynchronous overlap path (``async_op`` / ``handle``, CUDA side streams).
``_torchembed_available`` is False: zerotune has no fused rotary kernel, ``apply_rotary_pos_emb`` always
runs the reference arithmetic.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zerotune.parallel.sequence.distributed_attention import (
    DistributedAttention,
    heads_to_sequence,
    sequence_to_heads,
)
from zerotune.parallel.sequence.rotary import apply_rotary_pos_emb
from zerotune.parallel.sequence.rotary import rotate_half as _rotate_half

_torchembed_available = False


def single_all_to_all(input: torch.Tensor, scatter_idx: int, gather_idx: int, batch_dim_idx: int,
                      group: dist.ProcessGroup | None, async_op: bool = False, handle: Any = None,
                      type: Any = None) -> torch.Tensor:
    """One Ulysses exchange of a 4D tensor: ``scatter_idx >= 2`` sequence-split -> head-split, else back."""
    if async_op or handle is not None:
        raise ValueError("single_all_to_all: the asynchronous overlap path (async_op / handle) is not supported by "
                         "zerotune; call it with async_op=False and handle=None")
    if scatter_idx >= 2:
        return sequence_to_heads(input, group, batch_dim_idx)
    return heads_to_sequence(input, group, batch_dim_idx)


class _SeqAllToAll:
    """DeepSpeed's differentiable Ulysses exchange, called as ``_SeqAllToAll.apply(group, input, scatter_idx,
    gather_idx, batch_dim_idx)``; the gradient is the inverse exchange (``seq_all_to_all``'s own backward)."""

    @staticmethod
    def apply(group: dist.ProcessGroup | None, input: torch.Tensor, scatter_idx: int, gather_idx: int,
              batch_dim_idx: int, stream: Any = None, handle: Any = None, type: Any = None,
              is_fwd: bool = True) -> torch.Tensor:
        if stream is not None:
            raise ValueError("_SeqAllToAll: overlapping the exchange on a side CUDA stream is not supported by "
                             "zerotune; pass stream=None")
        return single_all_to_all(input, scatter_idx, gather_idx, batch_dim_idx, group, handle=handle)


__all__ = ["DistributedAttention", "_SeqAllToAll", "_rotate_half", "_torchembed_available", "apply_rotary_pos_emb",
           "single_all_to_all"]
