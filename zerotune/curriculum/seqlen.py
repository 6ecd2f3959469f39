"""Applying a seqlen difficulty to a model call or a batch.

DeepSpeed hands the difficulty to the model as ``curriculum_seqlen=`` and leaves the cut to the model
(Megatron's GPT truncates its tokens, labels and masks). A Hugging Face model has no such parameter -- its
``**kwargs`` would pass the value on to places that choke on it -- so for a model without it zerotune cuts the
batch itself, the same way: every tensor whose dim 1 is the sequence (as long as ``input_ids``) keeps its
first ``length`` positions, and a 4-D ``(batch, heads, seq, seq)`` attention mask keeps its top-left
``length x length`` block. Causal-LM labels are shifted inside the model, so cutting them with the inputs
keeps them aligned.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

CURRICULUM_KWARG = "curriculum_seqlen"
# Where the sequence length is read from, in order: these keyword arguments, else the first positional
# tensor with a sequence dim.
_REFERENCE_KWARGS = ("input_ids", "inputs_embeds")


def takes_curriculum_seqlen(module: torch.nn.Module) -> bool:
    """Whether ``module.forward`` names a ``curriculum_seqlen`` parameter (``**kwargs`` does not count)."""
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # a builtin or C-implemented forward: no named parameters to see
        return False
    parameter = parameters.get(CURRICULUM_KWARG)
    return parameter is not None and parameter.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                            inspect.Parameter.VAR_KEYWORD)


def sequence_length(args: tuple, kwargs: dict) -> int | None:
    """The length of the call's sequences: ``input_ids`` (or ``inputs_embeds``) dim 1, else the first
    positional tensor's with at least 2 dims; None when the call has no such tensor."""
    for key in _REFERENCE_KWARGS:
        value = kwargs.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value.shape[1]
    first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2), None)
    return None if first is None else first.shape[1]


def _cut(value: Any, full: int, length: int) -> Any:
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return value
    if value.dim() == 4 and value.shape[-1] == full and value.shape[-2] == full:  # (B, heads, T, T) mask
        return value[..., :length, :length]
    if value.shape[1] == full:
        return value[:, :length]
    return value


def cut_sequences(args: tuple, kwargs: dict, length: int) -> tuple[tuple, dict]:
    """The call's sequence tensors cut to their first ``length`` positions (unchanged when no longer).

    Raises ValueError when the call has no tensor to read the sequence length from: a seqlen curriculum
    that silently did nothing would train on full sequences from step one."""
    full = sequence_length(args, kwargs)
    if full is None:
        raise ValueError("curriculum_learning (seqlen): the forward's inputs have no sequence tensor to cut (pass "
                         "input_ids, or a (batch, seq, ...) tensor first), and the model's forward takes no "
                         f"'{CURRICULUM_KWARG}' parameter to cut them itself")
    if length >= full:
        return args, kwargs
    return tuple(_cut(a, full, length) for a in args), {k: _cut(v, full, length) for k, v in kwargs.items()}


def cut_batch(batch: Any, length: int) -> Any:
    """A data loader batch (a dict of tensors, a tuple / list of tensors, or one tensor) cut like a call."""
    if isinstance(batch, Mapping):  # (a Hugging Face BatchEncoding is a Mapping, not a dict: it becomes one)
        return cut_sequences((), dict(batch), length)[1]
    if isinstance(batch, (list, tuple)):
        return type(batch)(cut_sequences(tuple(batch), {}, length)[0])
    return cut_sequences((batch,), {}, length)[0][0]


__all__ = ["CURRICULUM_KWARG", "cut_batch", "cut_sequences", "sequence_length", "takes_curriculum_seqlen"]
