"""Pipeline-parallel plans: which layers each stage holds, and how many micro-batches it keeps alive.

The stages are cut as ``zerotune.pipe`` cuts a Hugging Face model (``hf_pipeline_layers``: the embedding
layer, one layer per transformer block, the head layer; ``balanced_boundaries`` over their parameter
counts, the "parameters" method "best" stands for). A stage's activations are its blocks' share of the
one-example trace (the head stage also takes what is saved outside the blocks: final norm, logits, loss)
times the micro-batches in flight under 1F1B: stage ``s`` of ``p`` holds ``min(p - s, accumulation)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerotune.plan.activations import ActivationProfile


@dataclass(frozen=True)
class StageShare:
    index: int
    trainable: int
    frozen: int
    blocks: tuple[int, ...]  # transformer block indices (model order)
    has_head: bool


def stage_shares(model: torch.nn.Module, stages: int, method: str = "parameters") -> list[StageShare]:
    """Each stage's parameters and blocks, as the pipeline engine would partition ``model``."""
    from zerotune.pipe.hf_layers import hf_pipeline_layers
    from zerotune.pipe.partition import balanced_boundaries, layer_weights

    layers, _, _ = hf_pipeline_layers(model)
    counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    bounds = balanced_boundaries(layer_weights(method, counts, [type(layer).__name__ for layer in layers]), stages)
    shares = []
    for index in range(stages):
        held = range(bounds[index], bounds[index + 1])
        params = {id(p): p for i in held for p in layers[i].parameters()}  # a weight tied within a stage: once
        trainable = sum(p.numel() for p in params.values() if p.requires_grad)
        frozen = sum(p.numel() for p in params.values()) - trainable
        blocks = tuple(i - 1 for i in held if 0 < i < len(layers) - 1)
        shares.append(StageShare(index, trainable, frozen, blocks, len(layers) - 1 in held))
    return shares


def in_flight(stage: int, stages: int, accumulation: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once under 1F1B."""
    return max(1, min(stages - stage, accumulation))


def stage_activations(whole: ActivationProfile, share: StageShare, micro_batches: int) -> ActivationProfile:
    """One example's activations of the whole model, narrowed to ``share`` and multiplied by the micro-batches
    in flight (as if one example of that many times the size)."""
    outside = whole.saved_bytes - sum(whole.block_saved)
    saved = [whole.block_saved[b] * micro_batches for b in share.blocks]
    inputs = [whole.block_inputs[b] * micro_batches for b in share.blocks]
    extra = outside * micro_batches if share.has_head else 0
    # under checkpointing one block of one micro-batch is recomputed at a time, whatever is in flight
    recompute = max((whole.block_saved[b] for b in share.blocks), default=0)
    return ActivationProfile(sum(saved) + extra, saved, inputs,
                             whole.logits_bytes * micro_batches if share.has_head else 0, recompute)
