"""Built-in tensor-parallel plans for Hugging Face architectures (AutoTP's knowledge).

A plan is a list of ``LayerRule``s -- regular expressions over parameter names, each saying
how the layer owning that weight is split -- in the same shape as DeepSpeed's
``tensor_parallel.partition_config.layer_specs``, so user rules and built-in ones are one
mechanism. The Megatron pattern throughout: the first projection of a block (q/k/v, the MLP's
up projections) splits its output features (column), the second (attention output, MLP down)
its input features (row), so each block costs one all-reduce in forward and one in backward.

Per architecture also: which config attributes hold head counts (they must divide by the tp
size) and how attention modules learn their local head count, where the model's code reads it
from an attribute instead of the tensor shapes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn


@dataclass(frozen=True)
class LayerRule:
    """Layers whose weight name matches one of ``patterns`` are split as ``partition_type``."""

    patterns: tuple[str, ...]
    partition_type: str  # "column" | "row" | "skip"
    parts: int = 1  # fused sub-blocks along the output features (GPT-2's c_attn: q|k|v)
    vocab: bool = False  # an embedding / LM head over the vocabulary (needs the vocab-parallel loss)
    gather_output: bool = False  # column: all-gather the output, so what follows sees all of it (a gathered LM head)

    def matches(self, weight_name: str) -> bool:
        return any(re.fullmatch(pattern, weight_name) for pattern in self.patterns)


@dataclass(frozen=True)
class ArchitecturePlan:
    rules: tuple[LayerRule, ...]
    head_attributes: tuple[str, ...]  # config attributes that must be divisible by the tp size
    localize: Callable[[nn.Module, int], None] | None = None  # fix attention modules' head bookkeeping


def _localize_gpt2_attention(module: nn.Module, tp: int) -> None:
    """GPT-2 splits its fused q|k|v output with ``split_size`` (the full width): make it the local width."""
    if type(module).__name__ == "GPT2Attention":
        attention: Any = module  # (transformers' GPT2Attention: nn.Module does not declare its attributes)
        attention.split_size //= tp
        attention.num_heads //= tp


_VOCAB_GPT2 = (LayerRule((r"(.*\.)?wte\.weight",), "column", vocab=True),
               LayerRule((r"lm_head\.weight",), "column", vocab=True))
_VOCAB_LLAMA = (LayerRule((r"(.*\.)?embed_tokens\.weight",), "column", vocab=True),
                LayerRule((r"lm_head\.weight",), "column", vocab=True))

_LLAMA_FAMILY = ArchitecturePlan(
    rules=(
        LayerRule((r".*\.self_attn\.[qkv]_proj\.weight",), "column"),
        LayerRule((r".*\.self_attn\.o_proj\.weight",), "row"),
        LayerRule((r".*\.mlp\.(gate|up)_proj\.weight",), "column"),
        LayerRule((r".*\.mlp\.down_proj\.weight",), "row"),
    ) + _VOCAB_LLAMA,
    head_attributes=("num_attention_heads", "num_key_value_heads"),
)

PLANS: dict[str, ArchitecturePlan] = {
    "gpt2": ArchitecturePlan(
        rules=(
            LayerRule((r".*\.attn\.c_attn\.weight",), "column", parts=3),
            LayerRule((r".*\.attn\.c_proj\.weight",), "row"),
            LayerRule((r".*\.mlp\.c_fc\.weight",), "column"),
            LayerRule((r".*\.mlp\.c_proj\.weight",), "row"),
        ) + _VOCAB_GPT2,
        head_attributes=("n_head",),
        localize=_localize_gpt2_attention,
    ),
    "llama": _LLAMA_FAMILY,
    "mistral": _LLAMA_FAMILY,
    "qwen2": _LLAMA_FAMILY,
    "bert": ArchitecturePlan(  # embeddings and the MLM head stay replicated: BERT computes its loss inline
        rules=(
            LayerRule((r".*\.attention\.self\.(query|key|value)\.weight",), "column"),
            LayerRule((r".*\.attention\.output\.dense\.weight",), "row"),
            LayerRule((r".*\.intermediate\.dense\.weight",), "column"),
            LayerRule((r".*\.layer\.\d+\.output\.dense\.weight",), "row"),
        ),
        head_attributes=("num_attention_heads",),
    ),
}


def parts_from_shape(shape: Any, partition_dim: int | None, partition_type: str) -> int:
    """DeepSpeed's fused sub-parameter ``shape`` (with ``partition_dim``) as zerotune's ``parts``.

    ``(n, -1)`` or ``((s, s, ..., s), -1)`` split at dim 0 of a column layer: n equal parts of the output
    features, each split over the ranks separately. Unequal sizes (a GQA q|k|v), a view with more than two dims
    or a split along another dim are layouts a ``TPLayout`` cannot record: a ValueError names them."""
    shape = tuple(tuple(s) if isinstance(s, (list, tuple)) else s for s in shape)
    dim = partition_dim if partition_dim is not None else (0 if partition_type == "column" else 1)
    if partition_type != "column" or len(shape) != 2 or dim != 0:
        raise ValueError(f"shape={list(shape)}, partition_dim={dim} ({partition_type}): zerotune splits fused "
                         "sub-parameters only along a column layer's output features (a 2-D shape split at "
                         "partition_dim 0), not after a reshape or along another dim")
    parts, rest = shape
    if not (rest == -1 or (isinstance(rest, int) and rest > 0)):
        raise ValueError(f"shape={list(shape)}: the second entry must be -1 or a positive size")
    if isinstance(parts, tuple):
        if not parts or any(not isinstance(p, int) or p <= 0 for p in parts):
            raise ValueError(f"shape={list(shape)}: sub-parameter sizes must be positive integers")
        if len(set(parts)) > 1:
            raise ValueError(f"shape={list(shape)}: unequal sub-parameter sizes {parts} (e.g. a GQA q|k|v) are not "
                             "supported: zerotune's tensor-parallel layout splits equal fused parts; split q, k and v "
                             "as separate layers")
        return len(parts)
    if isinstance(parts, int) and parts > 0:
        return parts
    if parts == -1:
        return 1
    raise ValueError(f"shape={list(shape)}: the first entry must be a part count, -1 or a tuple of sizes")


def from_start(pattern: str) -> str:
    """A ``layer_specs`` pattern as a rule pattern: DeepSpeed matches it from the start of the name (``re.match``:
    ``.*\\.q_proj`` matches ``model.layers.0.q_proj.weight``), rules match in full, so the rest is let through."""
    return f"(?:{pattern}).*"


def rules_from_config(layer_specs: list) -> tuple[LayerRule, ...]:
    """The config's ``partition_config.layer_specs`` (sections or dicts) as rules, matching as DeepSpeed's do."""
    rules = []
    for spec in layer_specs:
        get: Callable[..., Any] = (spec.get if isinstance(spec, dict)
                                   else lambda key, default=None, s=spec: getattr(s, key, default))
        rules.append(LayerRule(tuple(from_start(p) for p in get("patterns")), get("partition_type"),
                               int(get("parts", 1) or 1), gather_output=bool(get("gather_output", False))))
    return tuple(rules)
