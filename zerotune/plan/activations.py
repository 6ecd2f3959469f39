"""Activation memory from a trace of one micro-batch forward on fake tensors, not a formula per model.

Every tensor autograd saves for the backward pass goes through ``saved_tensors_hooks``. The forward runs
on fake CPU tensors (``FakeTensorMode``: shapes and dtypes, no storage), so it allocates nothing and takes
seconds even for a 70B model, and it takes the kernels a real device would: attention through the fused
(flash) kernel, which saves its output and log-sum-exp, not the sequence x sequence probabilities the
meta device's decomposition would save. Saved tensors are
counted once per storage (the input of q/k/v projections is one tensor saved three times) and the
model's own parameters are left out (they are model state). Hooks on the blocks activation
checkpointing would wrap (``checkpoint_block_names``) attribute each saved tensor to its block, which
gives the checkpointed figure: what is saved outside the blocks, each block's input, and one block's
activations alive again while it is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ActivationProfile:
    saved_bytes: int
    """Saved for backward by one micro-batch forward, without activation checkpointing."""
    block_saved: list[int] = field(default_factory=list)
    """The part of it saved inside each checkpointable block."""
    block_inputs: list[int] = field(default_factory=list)
    """Each block's input (what a checkpointed block keeps)."""
    logits_bytes: int = 0
    """The output logits (batch x sequence x vocabulary)."""
    recompute_bytes: int | None = None
    """A block's activations alive again while it is recomputed (None: the largest of ``block_saved``)."""

    @property
    def checkpointed_bytes(self) -> int:
        """With every block checkpointed: everything saved outside the blocks, the blocks' inputs, and the
        largest block's activations while it is recomputed."""
        if not self.block_saved:
            return self.saved_bytes
        recompute = max(self.block_saved) if self.recompute_bytes is None else self.recompute_bytes
        return self.saved_bytes - sum(self.block_saved) + sum(self.block_inputs) + recompute

    def scaled(self, factor: int) -> ActivationProfile:
        """The same for ``factor`` times the examples (a transformer's examples do not mix)."""
        return ActivationProfile(self.saved_bytes * factor, [b * factor for b in self.block_saved],
                                 [b * factor for b in self.block_inputs], self.logits_bytes * factor,
                                 None if self.recompute_bytes is None else self.recompute_bytes * factor)


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage._cdata, storage.nbytes()


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((t for t in map(_first_tensor, value) if t is not None), None)
    if isinstance(value, dict):
        return next((t for t in map(_first_tensor, value.values()) if t is not None), None)
    return None


def trace_activations(model: torch.nn.Module, batch: int, seq_len: int, *, dtype: torch.dtype,
                      task: str = "causal-lm", tp: int = 1) -> ActivationProfile:
    """Run one training forward (with labels) of ``model`` (built on the meta device) at ``dtype``, as rank 0
    of a ``tp``-way tensor-parallel group when ``tp`` > 1 (zerotune's ``apply_autotp`` splits it first, over
    a fake process group). The model is consumed: its parameters become fake tensors (this rank's shards)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = model.to(dtype=dtype)
    model.train()
    ties = _tied_names(model)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        for name, first in ties:  # to_empty gives each module its own tensor: share the tied weight again
            parent, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(parent), attribute, model.get_parameter(first))
        if tp == 1:
            return _trace(model, batch, seq_len, task)
        from zerotune.parallel.tensor.autotp import apply_autotp
        from zerotune.plan.fake_group import fake_world

        with fake_world(tp) as group:
            apply_autotp(model, group)
            return _trace(model, batch, seq_len, task)


def _tied_names(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(name, the first name of the same parameter) for every parameter reachable under two names."""
    first: dict[int, str] = {}
    ties = []
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            ties.append((name, first[id(parameter)]))
        else:
            first[id(parameter)] = name
    return ties


def _trace(model: torch.nn.Module, batch: int, seq_len: int, task: str) -> ActivationProfile:
    from zerotune.parallel.block_checkpointing import checkpoint_block_names

    params = {_storage(p)[0] for p in model.parameters()}
    try:
        blocks = [model.get_submodule(name) for name in checkpoint_block_names(model, None)]
    except ValueError:
        blocks = []
    counted: dict[int, int] = {}
    current: list[int | None] = [None]
    block_saved = [0] * len(blocks)
    block_inputs = [0] * len(blocks)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key, size = _storage(tensor)
        if key not in params and key not in counted:
            counted[key] = size
            if current[0] is not None:
                block_saved[current[0]] += size
        return tensor

    hooks = []
    for index, block in enumerate(blocks):
        def enter(module: Any, args: Any, kwargs: Any, index: int = index) -> None:
            current[0] = index
            first = _first_tensor(args) if args else _first_tensor(kwargs)
            block_inputs[index] = first.numel() * first.element_size() if first is not None else 0

        def leave(module: Any, args: Any, output: Any) -> None:
            current[0] = None
        hooks.append(block.register_forward_pre_hook(enter, with_kwargs=True))
        hooks.append(block.register_forward_hook(leave))
    ids = torch.zeros(batch, seq_len, dtype=torch.long)
    inputs = {"input_ids": ids, "labels": ids if task == "causal-lm" else torch.zeros(batch, dtype=torch.long)}
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    logits = getattr(output, "logits", None)
    logits_bytes = logits.numel() * logits.element_size() if isinstance(logits, torch.Tensor) else 0
    return ActivationProfile(sum(counted.values()), block_saved, block_inputs, logits_bytes)
