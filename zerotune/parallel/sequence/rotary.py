"""Rotary position embedding applied to already-computed cos/sin tables (the "rotate half" form).

Ulysses attention modules written for Megatron-style models (``DistributedAttention``) receive the
rotary tables with the query and key and must apply them *after* the all-to-all, once each rank holds
the whole sequence for its heads, so that every token meets the table row of its global position.
Kept apart from the all-to-all because it is pure per-token arithmetic with no communication.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the two halves of the last dimension: multiplying by sin and adding
    ``x * cos`` then rotates each (x1_i, x2_i) pair by its position's angle."""
    if x.shape[-1] % 2:
        raise ValueError(f"rotate_half: the last dimension must be even (two halves), got shape {tuple(x.shape)}")
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rot_dim = freqs_cos.shape[-1]`` features of ``t`` by the tables; the rest pass through.

    ``t`` is ``[seq, ..., dim]`` and the tables broadcast against ``t[..., :rot_dim]`` (e.g. ``[seq, 1, rot_dim]``);
    a table narrower than the head dimension is partial rotary (GPT-NeoX's ``rotary_pct``)."""
    rot_dim = freqs_cos.shape[-1]
    if freqs_sin.shape != freqs_cos.shape:
        raise ValueError(f"apply_rotary_pos_emb: freqs_cos {tuple(freqs_cos.shape)} and freqs_sin "
                         f"{tuple(freqs_sin.shape)} must have the same shape")
    if rot_dim > t.shape[-1]:
        raise ValueError(f"apply_rotary_pos_emb: the tables rotate {rot_dim} features but the tensor has only "
                         f"{t.shape[-1]} (shape {tuple(t.shape)})")
    rotated, passed = t[..., :rot_dim], t[..., rot_dim:]
    rotated = rotated * freqs_cos + rotate_half(rotated) * freqs_sin
    return rotated if passed.shape[-1] == 0 else torch.cat((rotated, passed), dim=-1)
