"""The tiny deterministic model and data the DeepSpeed fixture checkpoints were trained on.

Kept free of DeepSpeed and of zerotune so that both ``make_fixtures.py`` (run with DeepSpeed) and
zerotune's tests can rebuild exactly the same model and batches. Sizes are chosen so that ZeRO has
to pad: ``head.bias`` (3 elements), ``frozen`` (5) and the total trainable count (443) are odd, so
stage 1/2 pad the flat group and stage 3 pads single parameters when split over 2 ranks.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, WIDTH, OUT, SEQ = 32, 8, 3, 4


class TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, OUT)
        # A frozen parameter: DeepSpeed stores it apart from the optimizer's flat groups.
        self.frozen = nn.Parameter(torch.linspace(-1.0, 1.0, 5), requires_grad=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) * self.scale
        h = torch.tanh(self.fc1(h))
        h = self.norm(h)
        h = torch.tanh(self.fc2(h)) + self.frozen.sum() * 0.01
        return torch.nn.functional.mse_loss(self.head(h), target)


def make_model() -> TinyModel:
    """The model with its initial weights, the same on every call (seed 0)."""
    torch.manual_seed(0)
    return TinyModel()


def batch(step: int, rank: int, micro_batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """The (ids, target) micro-batch of data-parallel ``rank`` at optimizer step ``step`` (0-based)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (micro_batch, SEQ), generator=g)
    target = torch.randn(micro_batch, SEQ, OUT, generator=g)
    return ids, target
