"""Ulysses sequence parallelism for Hugging Face models: each sp rank holds seq/P tokens, attention
trades the sequence split for a head split with two all-to-alls (see ulysses_attention.py)."""

from __future__ import annotations

from zerotune.parallel.sequence.all_to_all import seq_all_to_all
from zerotune.parallel.sequence.batch import combine_sequence_parallel_loss, shard_sequence_batch
from zerotune.parallel.sequence.distributed_attention import DistributedAttention
from zerotune.parallel.sequence.ulysses_attention import (
    ULYSSES_ATTENTION,
    UlyssesContext,
    install_ulysses_attention,
    ulysses_attention_forward,
    ulysses_context,
)

__all__ = [
    "DistributedAttention",
    "ULYSSES_ATTENTION",
    "UlyssesContext",
    "combine_sequence_parallel_loss",
    "install_ulysses_attention",
    "seq_all_to_all",
    "shard_sequence_batch",
    "ulysses_attention_forward",
    "ulysses_context",
]
