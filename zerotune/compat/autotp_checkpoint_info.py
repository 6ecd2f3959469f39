"""DeepSpeed's universal-checkpoint schema of a tensor-parallel model, read off zerotune's ``TPLayout`` records.

DeepSpeed's AutoTP leaves ``model.universal_checkpoint_info`` on a model it split: for each parameter, how its
tensor-parallel shards merge back (row-parallel: joined along the input features; replicated: any rank's copy;
vocabulary: joined along dim 0, of ``original_vocab_size`` rows; fused sub-parameters: each part joined on its
own). DeepSpeed's ``ds_to_universal`` reads it. zerotune joins its own shards by the ``TPLayout`` each sharded
parameter carries (``parallel/tensor/layout.py``) and does not need the schema; ``deepspeed.initialize`` still
attaches it after a tensor-parallel split, derived from those layouts, so DeepSpeed code inspecting it sees
the split zerotune made. Names follow DeepSpeed's: an embedding or LM head (``embed`` / ``lm_head`` in the
name) split along its rows is a vocabulary parameter.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from zerotune.compat.checkpoint_constants import (
    ORIGINAL_VOCAB_SIZE,
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    PARAMETER_WITH_SUB_PARAMS,
    TP_REPLICATED_PARAMETER_PATTERNS,
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    VOCABULARY_PARAMETER_PATTERNS,
)
from zerotune.parallel.tensor.layers import RowParallelLinear, VocabParallelEmbedding
from zerotune.parallel.tensor.layout import tp_layout_of


def universal_checkpoint_info(model: nn.Module) -> dict[str, Any]:
    """The schema of ``model``'s tensor-parallel split (every parameter classified by its layout)."""
    row, replicated, vocabulary, sub_params = [], [], [], []
    vocab_size = None
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            full_name = f"{module_name}.{param_name}" if module_name else param_name
            pattern = rf"^{re.escape(full_name)}$"
            layout = tp_layout_of(param)
            if layout is None:
                replicated.append(pattern)
                continue
            if isinstance(module, RowParallelLinear) and param_name == "weight":
                row.append(pattern)
            by_rows = layout.dim % param.dim() == 0
            if param.dim() == 2 and by_rows and (isinstance(module, VocabParallelEmbedding)
                                                 or "embed" in full_name or "lm_head" in full_name):
                vocabulary.append(pattern)
                vocab_size = layout.full_size if vocab_size is None else vocab_size
            if layout.parts > 1 and param_name == "weight":
                shape = [layout.parts, -1] if by_rows else [-1, layout.parts]
                sub_params.append({"patterns": [pattern], "shape": shape, "partition_dim": layout.dim % param.dim()})
    info: dict[str, Any] = {
        UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: sorted(set(row)),
        TP_REPLICATED_PARAMETER_PATTERNS: sorted(set(replicated)),
        VOCABULARY_PARAMETER_PATTERNS: sorted(set(vocabulary)),
        PARAMETER_WITH_SUB_PARAMS: sub_params,
    }
    if vocab_size is not None:
        info[ORIGINAL_VOCAB_SIZE] = vocab_size
    return info


def attach_universal_checkpoint_info(model: nn.Module) -> None:
    """Leave the schema on ``model`` under DeepSpeed's attribute name (after a tensor-parallel split)."""
    setattr(model, UNIVERSAL_CHECKPOINT_INFO, universal_checkpoint_info(model))


__all__ = ["attach_universal_checkpoint_info", "universal_checkpoint_info"]
