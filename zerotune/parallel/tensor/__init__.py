"""Megatron-style tensor parallelism: sharded layers, their collectives and the sharded-vocab loss.

``layout`` says where a parameter's shard sits in the full tensor (used by checkpointing and ZeRO),
``mappings`` holds the conjugate collectives, ``layers`` the column/row/vocab-parallel modules and
``cross_entropy`` the loss over vocab-sharded logits.
"""

from __future__ import annotations

from zerotune.parallel.tensor.cross_entropy import (
    vocab_parallel_causal_lm_loss,
    vocab_parallel_cross_entropy,
)
from zerotune.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from zerotune.parallel.tensor.layout import (
    TPLayout,
    mark_tensor_parallel,
    shard_tensor,
    tp_layout_of,
    unshard_tensor,
)
from zerotune.parallel.tensor.mappings import (
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    scatter_to_tensor_parallel,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPLayout",
    "VocabParallelEmbedding",
    "copy_to_tensor_parallel",
    "gather_from_tensor_parallel",
    "mark_tensor_parallel",
    "reduce_from_tensor_parallel",
    "scatter_to_tensor_parallel",
    "shard_tensor",
    "tp_layout_of",
    "unshard_tensor",
    "vocab_parallel_causal_lm_loss",
    "vocab_parallel_cross_entropy",
]
