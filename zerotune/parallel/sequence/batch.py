"""The data side of Ulysses sequence parallelism: cut each forward's full-sequence batch into this
rank's tokens, and turn the per-rank losses into the full-sequence loss.

Each of the P ranks of a sequence-parallel group gets the same full-sequence batch and keeps the
contiguous s/P tokens at its index (rank r: tokens [r*s/P, (r+1)*s/P)). Three things must be
decided on the FULL sequence before cutting, or the numbers would differ from a single process:

* positions -- a rank's tokens keep their global positions (rotary / learned embeddings);
* labels -- a causal LM predicts token t+1 at position t, so labels are shifted on the full
  sequence (the last token of rank r's slice predicts the first token of rank r+1's); the model
  then gets ``shift_labels`` and skips its own shift, and ``num_items_in_batch`` = the number of
  predicted tokens of the full batch, so each rank's HF loss is (sum of its tokens' losses) /
  (global token count) and the sum over ranks is the full-sequence mean;
* padding -- the full 2D attention mask is recorded in the model's Ulysses context, where
  attention (which sees all tokens) builds its mask from it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerotune.distributed import comm
from zerotune.parallel.sequence.ulysses_attention import record_sequence_batch, ulysses_context

IGNORE_INDEX = -100  # transformers' causal-LM loss ignores this label


def _group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


def shard_sequence_batch(kwargs: dict[str, Any], group: dist.ProcessGroup | None, model: nn.Module) -> dict[str, Any]:
    """This rank's share of the full-sequence HF keyword inputs ``kwargs`` (input_ids or inputs_embeds,
    optional attention_mask, position_ids, labels / shift_labels, token_type_ids, ...).

    Returns new keyword inputs for ``model(**...)``; records the full attention mask and positions in
    ``model``'s Ulysses context (``install_ulysses_attention`` must have run). The model's logits
    then cover only this rank's tokens, and its loss is this rank's share of the full-sequence loss
    (combine with ``combine_sequence_parallel_loss``).
    """
    if not isinstance(kwargs, dict):
        raise TypeError(
            f"sequence parallelism needs keyword Hugging Face inputs (a dict with input_ids or inputs_embeds), "
            f"got {type(kwargs).__name__}"
        )
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
        raise ValueError(
            "sequence parallelism needs keyword Hugging Face inputs with input_ids [batch, seq] or inputs_embeds "
            f"[batch, seq, hidden]; got keys {sorted(kwargs)}"
        )
    size, rank = _group_size_and_rank(group)
    batch, length = tokens.shape[0], tokens.shape[1]
    if length % size:
        raise ValueError(
            f"sequence length {length} is not divisible by the sequence-parallel size {size}; pad the batch to a "
            f"multiple of {size} tokens (with attention_mask 0 and labels {IGNORE_INDEX} on the padding)"
        )
    local = slice(rank * (length // size), (rank + 1) * (length // size))
    out = dict(kwargs)

    given_positions = kwargs.get("position_ids")
    if given_positions is None:
        positions = torch.arange(length, device=tokens.device).unsqueeze(0).expand(batch, -1)
    else:
        _check_sequence_shaped("position_ids", given_positions, length)
        positions = given_positions
    out["position_ids"] = positions[:, local].contiguous()

    full_mask = kwargs.get("attention_mask")
    padding_mask = None
    if full_mask is not None:
        if full_mask.dim() != 2 or tuple(full_mask.shape) != (batch, length):
            raise ValueError(
                f"sequence parallelism needs a 2D attention_mask of shape [batch, seq] = {[batch, length]}, got "
                f"shape {list(full_mask.shape)} (custom 4D masks are not supported)"
            )
        padding_mask = full_mask if bool((full_mask == 0).any()) else None

    shift_labels = _full_shift_labels(kwargs, length)
    if shift_labels is not None:
        out["shift_labels"] = shift_labels[:, local].contiguous()  # the HF loss views it flat
        out["labels"] = out["shift_labels"]  # the HF model computes a loss only when labels are given
        if kwargs.get("num_items_in_batch") is None:  # a caller's own count (e.g. over accumulation) wins
            out["num_items_in_batch"] = (shift_labels != IGNORE_INDEX).sum()

    handled = {"position_ids", "labels", "shift_labels", "num_items_in_batch"}
    for name, value in kwargs.items():
        if name not in handled and isinstance(value, torch.Tensor) and value.dim() >= 2 \
                and value.shape[0] == batch and value.shape[1] == length:
            out[name] = value[:, local].contiguous()  # input_ids, inputs_embeds, attention_mask, token_type_ids, ...
    out.setdefault("use_cache", False)  # a cache of sequence shards cannot serve generation

    packed_ids = None
    # Like transformers: restarting positions mean packed sequences only without a mask and a cache.
    if given_positions is not None and full_mask is None and not out["use_cache"]:
        from transformers.masking_utils import find_packed_sequence_indices

        packed_ids = find_packed_sequence_indices(given_positions.expand(batch, -1))
    record_sequence_batch(ulysses_context(model), sequence_length=length, padding_mask=padding_mask,
                          position_ids=positions, packed_sequence_ids=packed_ids)
    return out


def _check_sequence_shaped(name: str, value: torch.Tensor, length: int) -> None:
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[1] != length:
        shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"sequence parallelism needs {name} of shape [batch, {length}], got {shape}")


def _full_shift_labels(kwargs: dict[str, Any], length: int) -> torch.Tensor | None:
    """Labels already shifted on the full sequence (position t holds the target of token t)."""
    if kwargs.get("shift_labels") is not None:
        _check_sequence_shaped("shift_labels", kwargs["shift_labels"], length)
        return kwargs["shift_labels"]
    labels = kwargs.get("labels")
    if labels is None:
        return None
    _check_sequence_shaped("labels", labels, length)
    return nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]


class _CombineLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_loss: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.size = 1 if group is None else dist.get_world_size(group)
        total = local_loss.detach().clone()
        comm.all_reduce(total, group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.size, None


def combine_sequence_parallel_loss(local_loss: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The full-sequence loss on every sp rank: the SUM over the group of the ranks' losses (each is
    its tokens' loss sum over the global token count, so the sum is the full-sequence mean).

    Backward multiplies the gradient by the sp size P, and here is why. The ranks' parameter
    gradients are partial (each covers its own tokens) and must be SUMMED over sp; but ZeRO / data
    parallel gradient sync AVERAGES over all dp x sp ranks holding the same parameters. Scaling by
    P makes that average (1 / (dp P)) sum_dp sum_sp P g = (1 / dp) sum_dp sum_sp g: the sum over sp,
    averaged over dp -- exactly the gradient of the full-sequence batch, with no sp-specific sync.
    """
    return _CombineLoss.apply(local_loss, group)


def sequence_parallel_forward(model: nn.Module, group: dist.ProcessGroup | None, args: tuple,
                              kwargs: dict[str, Any]) -> Any:
    """The engine's forward under sequence parallelism: cut the full-sequence batch to this rank's tokens,
    run, and return the full-sequence loss -- scripts feed whole sequences and see whole-sequence losses."""
    if args:
        raise TypeError("with sequence_parallel_size > 1 the engine needs the Hugging Face keyword inputs "
                        "(engine(input_ids=..., labels=..., attention_mask=...)), not positional ones")
    output = model(**shard_sequence_batch(kwargs, group, model))
    if isinstance(output, torch.Tensor):
        return combine_sequence_parallel_loss(output, group)
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        output["loss"] = combine_sequence_parallel_loss(loss, group)
    return output
