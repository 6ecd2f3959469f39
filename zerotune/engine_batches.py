"""What the engines read from a micro-batch and a model's output, shared by ``Engine`` and ``PipelineEngine``:
tensors moved or cast through nested containers, the loss found in an output, an empty micro-batch refused."""

from __future__ import annotations

from typing import Any, Callable

import torch


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in nested lists / tuples / dicts; leave other values alone."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value


def loss_from_output(output: Any) -> torch.Tensor:
    """The scalar loss in a model's output: a tensor, ``output.loss`` or ``output["loss"]``."""
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return output
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    raise TypeError(
        f"train_batch needs the model to return a scalar loss (a 1-element tensor, .loss or ['loss']); "
        f"it returned {type(output).__name__}"
    )


def check_batch_not_empty(inputs: Any, step: int, micro_step: int, rank: int) -> None:
    """A micro-batch whose first tensor has no rows would give a NaN loss (a mean over nothing) and a step."""
    found: list[torch.Tensor] = []

    def collect(tensor: torch.Tensor) -> torch.Tensor:
        found.append(tensor)
        return tensor

    map_tensors(inputs, collect)
    first = next((t for t in found if t.dim() > 0), None)
    if first is not None and first.shape[0] == 0:
        raise ValueError(f"empty batch: the micro-batch of optimizer step {step}, micro-step {micro_step}, on rank "
                         f"{rank} has 0 rows (its first input has shape {tuple(first.shape)}); check the data loader "
                         "(a shard with fewer samples than ranks, or a filter that dropped every row)")
