"""Cross-entropy over vocab-sharded logits, without ever gathering the full ``[tokens, V]`` logits.

With a column-parallel LM head each rank holds logits for its slice of the vocabulary
(rank r owns ids ``[r*V/tp, (r+1)*V/tp)``). Gathering them would cost tokens x V floats per rank;
Megatron's algorithm needs only three small all-reduces of one number per token:

1. the row max (MAX), subtracted for numerical stability;
2. the target's logit: only the owning rank has it, the others contribute 0 (SUM);
3. the sum of exp over the vocabulary (SUM).

Steps 2 and 3 are fused into one all-reduce of a ``[2, tokens]`` tensor. Then
``loss = log(sum_exp) - target_logit`` and the gradient w.r.t. the local logits is
``softmax - onehot(target)`` restricted to the local slice, which each rank computes without
further communication. Everything runs in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from zerotune.distributed import comm
from zerotune.parallel.tensor.mappings import group_rank, group_world_size

REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss ``[N]`` (0 at ignored tokens) from local logits ``[N, V/tp]`` (fp32)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup | None,
                ignore_index: int) -> torch.Tensor:
        local_vocab = logits.shape[-1]
        vocab_start = group_rank(group) * local_vocab

        row_max = logits.max(dim=-1).values  # (N,)
        comm.all_reduce(row_max, group, op=comm.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)  # (N, V/tp)

        counted = target != ignore_index  # (N,)
        local_target = target - vocab_start
        owned = counted & (local_target >= 0) & (local_target < local_vocab)
        local_target = local_target.masked_fill(~owned, 0)  # any valid index; masked out below

        exp = shifted.exp()  # (N, V/tp)
        sums = torch.stack([
            shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0),
            exp.sum(dim=-1),
        ])  # (2, N): [target logit (owner only), sum of exp]
        comm.all_reduce(sums, group, op=comm.ReduceOp.SUM)
        target_logit, sum_exp = sums[0], sums[1]

        loss = (sum_exp.log() - target_logit).masked_fill(~counted, 0.0)  # (N,)
        softmax = exp.div_(sum_exp.unsqueeze(-1))  # (N, V/tp), reuses exp's storage
        ctx.save_for_backward(softmax, local_target, owned, counted)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, owned, counted = ctx.saved_tensors
        grad = softmax.clone()  # d loss / d logits = softmax - onehot(target)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -owned.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * counted).unsqueeze(-1))  # ignored tokens contribute nothing
        return grad, None, None, None


def _check_target_ids(target: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """F.cross_entropy rejects out-of-range targets; here no rank would own such an id and the loss
    would silently use a target logit of 0. Costs one host sync, which the loss's logging pays anyway.
    Tensors without values (a ``zerotune plan`` trace on fake tensors) are not checked."""
    if is_fake(target) or target.device.type == "meta":
        return
    outside = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    if bool(outside.any()):
        bad = int(target[outside][0])
        raise IndexError(f"target id {bad} is outside the vocabulary [0, {vocab_size}) and is not "
                         f"ignore_index={ignore_index}")


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup | None, *,
                                 ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(full_logits.view(-1, V), target.view(-1), ignore_index=..., reduction=...)``
    computed from this rank's vocab shard ``logits[..., V/tp]`` -- same value and gradient.

    ``target`` holds full-vocabulary ids with shape ``logits.shape[:-1]``. The result is fp32;
    ``reduction="none"`` gives the flat per-token loss ``[N]`` (0 at ignored tokens), ``"mean"``
    divides by the number of non-ignored tokens (NaN if there are none, as in PyTorch). A target
    id outside ``[0, V)`` that is not ``ignore_index`` raises IndexError, as F.cross_entropy does.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if tuple(logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(f"target shape {tuple(target.shape)} must equal logits shape without its vocab dim "
                         f"{tuple(logits.shape[:-1])} (logits {tuple(logits.shape)})")
    flat_logits = logits.float().reshape(-1, logits.shape[-1])  # (N, V/tp)
    flat_target = target.reshape(-1).to(flat_logits.device)  # (N,)
    _check_target_ids(flat_target, flat_logits.shape[-1] * group_world_size(group), ignore_index)
    loss = _VocabParallelCrossEntropy.apply(flat_logits, flat_target, group, ignore_index)  # (N,)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (flat_target != ignore_index).sum()


def vocab_parallel_causal_lm_loss(group: dist.ProcessGroup | None) -> Callable[..., torch.Tensor]:
    """A drop-in for transformers' ``ForCausalLMLoss`` on vocab-sharded logits.

    Use as ``hf_model.loss_function = vocab_parallel_causal_lm_loss(tp_group)`` once the LM head is
    column-parallel without ``gather_output``. Shifting, ``num_items_in_batch`` (sum, then divide:
    the gradient-accumulation-correct normalization) and ``ignore_index`` behave exactly as in
    ``transformers.loss.loss_utils.ForCausalLMLoss``.
    """
    world = group_world_size(group)

    def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                       num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                       shift_labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        if logits.shape[-1] * world != vocab_size:
            raise ValueError(
                f"vocab-parallel loss got logits with {logits.shape[-1]} vocab entries per rank x tp size {world} = "
                f"{logits.shape[-1] * world}, but vocab_size={vocab_size}; the LM head must be column-parallel "
                "over the full vocabulary with gather_output=False"
            )
        if shift_labels is None:
            # Shift so that tokens < n predict n; the last position predicts nothing.
            labels = F.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:].contiguous()
        flat_logits = logits.reshape(-1, logits.shape[-1])  # (N, V/tp)
        flat_labels = shift_labels.reshape(-1).to(logits.device)  # (N,)
        if num_items_in_batch is None:
            return vocab_parallel_cross_entropy(flat_logits, flat_labels, group, ignore_index=ignore_index)
        loss = vocab_parallel_cross_entropy(flat_logits, flat_labels, group, ignore_index=ignore_index,
                                            reduction="sum")
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        return loss / num_items_in_batch

    causal_lm_loss.__qualname__ = causal_lm_loss.__name__ = "vocab_parallel_causal_lm_loss"
    return causal_lm_loss
