"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: DeepSpeed's ALST (Arctic long-sequence training) names.

The tiled computations are zerotune's (``zerotune/parallel/sequence/tiled.py``), called with DeepSpeed's
argument order (``TiledMLP.apply(fn, self, x, shards, compute_params)``...). Where DeepSpeed marks parameters
``ds_grad_is_ready`` so its ZeRO buckets wait for the last tile, zerotune's tiles sum the parameter gradients
themselves and hand autograd one gradient per parameter, so no engine needs telling (see tiled.py).
``TiledFusedLogitsLoss`` recomputes each tile's logits in backward where DeepSpeed runs the tiles' backward inside
forward (that would run ZeRO-3's backward hooks mid-forward); its parameter gradients are therefore scaled by the
incoming gradient like any other (a loss scale or accumulation divisor applies to them; DeepSpeed's ignore it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from zerotune.compat.refusals import refused_class, refused_function
from zerotune.parallel.sequence.tiled import sequence_tiled_compute, tiled_fused_logits_loss, tiled_mlp

_MODULE = "deepspeed.runtime.sequence_parallel.ulysses_sp"


class TiledMLP:
    """``TiledMLP.apply(fn, self, x, shards, compute_params)``: ``fn(self, x)`` in ``shards`` sequence tiles."""

    @staticmethod
    def apply(fn: Callable[[Any, torch.Tensor], torch.Tensor], self: Any, x: torch.Tensor, shards: int,
              compute_params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        return tiled_mlp(fn, self, x, shards, compute_params)


class TiledFusedLogitsLoss:
    """``TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params, output_reduction)``."""

    @staticmethod
    def apply(fn: Callable[..., torch.Tensor], self: Any, x: torch.Tensor, y: torch.Tensor,
              mask: torch.Tensor | None, shards: int, compute_params: Sequence[torch.Tensor] | None,
              output_reduction: str = "mean") -> torch.Tensor:
        return tiled_fused_logits_loss(fn, self, x, y, mask, shards, compute_params, output_reduction)


UlyssesSPAttentionHF = refused_class(f"{_MODULE}.UlyssesSPAttentionHF")
# DeepSpeed's entry point is this classmethod, called before any instance exists: refused the same way.
UlyssesSPAttentionHF.register_with_transformers = staticmethod(  # type: ignore[attr-defined]
    refused_function(f"{_MODULE}.UlyssesSPAttentionHF"))
UlyssesSPDataLoaderAdapter = refused_class(f"{_MODULE}.UlyssesSPDataLoaderAdapter")

__all__ = ["TiledFusedLogitsLoss", "TiledMLP", "UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter",
           "sequence_tiled_compute"]
