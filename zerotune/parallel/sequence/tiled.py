"""Tiled computation along the sequence: bound the activation memory of per-token work (an MLP, the logits
and loss) on very long sequences by running it one tile of tokens at a time (ALST's tiled MLP and tiled
logits loss).

Each function is an autograd Function whose forward runs the tiles without building a graph and whose
backward recomputes one tile at a time with a graph, so at most one tile's activations are alive. The
gradients are exact: every tile's contribution to the input and to each parameter is computed with
``torch.autograd.grad`` and summed.

Why the parameters are inputs of the Function: ZeRO's gradient sync acts when autograd *accumulates* a
parameter's gradient (a post-accumulate-grad hook). Calling ``backward`` once per tile would accumulate,
and so report, each parameter once per tile, and a sync that moves the first report into its buckets
would reduce a partial gradient. Here the tiles' parameter gradients are summed inside the Function and
returned as the gradients of its parameter inputs, so autograd accumulates each parameter once, as for
an untiled layer, and any gradient sync sees one complete gradient. The parameters are found from the
modules given (``self`` of the computation) plus ``compute_params``; a tile that uses a trainable tensor
outside those is refused with an error naming it, rather than dropping its gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

REDUCTIONS = (None, "mean", "sum")


def trainable_params(modules: Sequence[Any], extra: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
    """The distinct trainable parameters of the nn.Modules among ``modules``, then of ``extra``."""
    found: dict[int, torch.Tensor] = {}
    for module in modules:
        if isinstance(module, nn.Module):
            for weight in module.parameters():
                if weight.requires_grad:
                    found.setdefault(id(weight), weight)
    for param in extra or ():
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"compute_params must hold tensors, got a {type(param).__name__}")
        if param.requires_grad:
            found.setdefault(id(param), param)
    return list(found.values())


def sequence_pieces(length: int, shards: int) -> list[int]:
    """Tile lengths covering ``length`` tokens in ``shards`` near-equal tiles (the last may be shorter)."""
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise ValueError(f"shards must be a positive int, got {shards!r}")
    step = max(1, math.ceil(length / shards))
    return [min(step, length - start) for start in range(0, length, step)] or [0]


def _check_leaves(output: torch.Tensor, known: list[torch.Tensor], what: str) -> None:
    """Refuse a tile whose graph reaches a trainable leaf that is neither the input nor a known parameter."""
    known_ids = {id(t) for t in known}
    seen: set[int] = set()
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) not in known_ids:
            raise ValueError(
                f"{what}: the tiled computation uses a trainable tensor of shape {tuple(variable.shape)} that is "
                "neither a parameter of the module passed in nor in compute_params; add it to compute_params so its "
                "gradient is computed (tiles accumulate parameter gradients themselves)")
        stack.extend(next_node for next_node, _ in node.next_functions)


def _tile_grads(output: torch.Tensor, grad_output: torch.Tensor | None, tile_input: torch.Tensor | None,
                params: list[torch.Tensor], what: str) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """Gradients of <output, grad_output> with respect to the tile's input and the parameters."""
    inputs = ([tile_input] if tile_input is not None else []) + params
    if not output.requires_grad or not inputs:
        return None, [None] * len(params)
    _check_leaves(output, inputs, what)
    grads = torch.autograd.grad(output, inputs, grad_output, allow_unused=True)
    if tile_input is None:
        return None, list(grads)
    return grads[0], list(grads[1:])


def _add(total: list[torch.Tensor | None], grads: list[torch.Tensor | None]) -> None:
    for i, grad in enumerate(grads):
        previous = total[i]
        if grad is not None:
            total[i] = grad if previous is None else previous + grad


class _TiledMLP(torch.autograd.Function):
    """fn(module, x) applied tile by tile along dimension -2 of ``x``; recomputed per tile in backward."""

    @staticmethod
    def forward(ctx, fn: Callable, module: Any, x: torch.Tensor, shards: int, *params: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.module, ctx.pieces = fn, module, sequence_pieces(x.shape[-2], shards)
        ctx.params = params  # the Parameter objects (ZeRO-3 swaps their .data: read them as they are in backward)
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(module, tile) for tile in x.split(ctx.pieces, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        params = list(ctx.params)
        x_grad = torch.zeros_like(x) if ctx.needs_input_grad[2] else None
        param_grads: list[torch.Tensor | None] = [None] * len(params)
        start = 0
        for length, grad_tile in zip(ctx.pieces, grad.split(ctx.pieces, dim=-2), strict=True):
            tile = x.narrow(-2, start, length).detach().requires_grad_(x_grad is not None)
            with torch.enable_grad():
                output = ctx.fn(ctx.module, tile)
            tile_grad, grads = _tile_grads(output, grad_tile, tile if x_grad is not None else None, params,
                                           "TiledMLP")
            if x_grad is not None and tile_grad is not None:
                x_grad.narrow(-2, start, length).copy_(tile_grad)
            _add(param_grads, grads)
            start += length
        return (None, None, x_grad, None, *param_grads)


def tiled_mlp(fn: Callable[[Any, torch.Tensor], torch.Tensor], module: Any, x: torch.Tensor, shards: int,
              compute_params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """``fn(module, x)`` for a per-token ``fn`` (an MLP's forward), ``shards`` tiles along the sequence
    (dimension -2 of ``[batch, seq, hidden]`` or ``[seq, hidden]``); only one tile's activations live at once.
    Parameters: those of ``module`` and ``compute_params``."""
    params = trainable_params([module], compute_params)
    return _TiledMLP.apply(fn, module, x, shards, *params)


class _SequenceTiledCompute(torch.autograd.Function):
    """fn(**tiles of the sharded kwargs along dim 1, **passed kwargs), outputs joined along ``out_dim``."""

    @staticmethod
    def forward(ctx, fn: Callable, pieces: list[int], names: list[str], passed: dict, grad_name: str, out_dim: int,
                reduction: str | None, *tensors: torch.Tensor) -> torch.Tensor:
        sharded, params = dict(zip(names, tensors[:len(names)], strict=True)), list(tensors[len(names):])
        ctx.fn, ctx.pieces, ctx.passed, ctx.grad_name, ctx.out_dim = fn, pieces, passed, grad_name, out_dim
        ctx.reduction, ctx.params, ctx.names = reduction, params, names
        ctx.save_for_backward(*sharded.values())
        with torch.no_grad():
            outputs = [fn(**tile, **passed) for tile in _tiles(sharded, pieces)]
        ctx.out_lengths = [1 if out_dim == 0 and o.dim() == 0 else o.shape[out_dim] for o in outputs]
        joined = torch.stack(outputs) if out_dim == 0 and outputs[0].dim() == 0 else torch.cat(outputs, dim=out_dim)
        ctx.joined_shape = joined.shape
        if reduction is None:
            return joined
        return joined.mean() if reduction == "mean" else joined.sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        sharded = dict(zip(ctx.names, ctx.saved_tensors, strict=True))
        if ctx.reduction is not None:  # d(mean)/d(element) = 1/numel, d(sum)/d(element) = 1
            scale = 1.0 / math.prod(ctx.joined_shape) if ctx.reduction == "mean" else 1.0
            grad = (grad * scale).expand(ctx.joined_shape)
        target = sharded[ctx.grad_name]
        wants_input = ctx.needs_input_grad[7 + ctx.names.index(ctx.grad_name)]
        input_grad = torch.zeros_like(target) if wants_input else None
        param_grads: list[torch.Tensor | None] = [None] * len(ctx.params)
        start, out_start = 0, 0
        for tile, length, out_length in zip(_tiles(sharded, ctx.pieces), ctx.pieces, ctx.out_lengths, strict=True):
            tile[ctx.grad_name] = tile[ctx.grad_name].detach().requires_grad_(wants_input)
            with torch.enable_grad():
                output = ctx.fn(**tile, **ctx.passed)
            grad_tile = grad.narrow(ctx.out_dim, out_start, out_length).reshape(output.shape)
            tile_grad, grads = _tile_grads(output, grad_tile, tile[ctx.grad_name] if wants_input else None,
                                           list(ctx.params), "sequence_tiled_compute")
            if input_grad is not None and tile_grad is not None:
                input_grad.narrow(1, start, length).copy_(tile_grad)
            _add(param_grads, grads)
            start, out_start = start + length, out_start + out_length
        tensor_grads = [input_grad if name == ctx.grad_name else None for name in ctx.names]
        return (None,) * 7 + (*tensor_grads, *param_grads)


def _tiles(sharded: dict[str, torch.Tensor], pieces: list[int]) -> list[dict[str, torch.Tensor]]:
    split = {name: value.split(pieces, dim=1) for name, value in sharded.items()}
    return [{name: parts[i] for name, parts in split.items()} for i in range(len(pieces))]


def sequence_tiled_compute(fn: Callable[..., torch.Tensor], seqlen: int, shards: int,
                           kwargs_to_shard: dict[str, torch.Tensor], kwargs_to_pass: dict[str, Any],
                           grad_requiring_tensor_key: str, compute_params: Sequence[torch.Tensor] | None = None,
                           output_unshard_dimension: int = 1, output_reduction: str | None = "mean") -> torch.Tensor:
    """``fn(**kwargs_to_shard, **kwargs_to_pass)`` computed in ``shards`` tiles of the sequence (dimension 1 of
    every ``kwargs_to_shard`` tensor, ``seqlen`` long); the tiles' outputs are joined along
    ``output_unshard_dimension`` (0: one scalar per tile, stacked) and reduced by ``output_reduction`` (None,
    "mean" or "sum"). Only ``kwargs_to_shard[grad_requiring_tensor_key]`` gets an input gradient; parameters:
    those of the nn.Modules in ``kwargs_to_pass`` and ``compute_params``."""
    if output_reduction not in REDUCTIONS:
        raise ValueError(f"output_reduction must be None, 'mean' or 'sum', got {output_reduction!r}")
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(f"grad_requiring_tensor_key {grad_requiring_tensor_key!r} is not a key of kwargs_to_shard "
                         f"({sorted(kwargs_to_shard)})")
    for name, value in kwargs_to_shard.items():
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != seqlen:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"kwargs_to_shard[{name!r}] must be a tensor [batch, seqlen={seqlen}, ...], got {shape}")
    names = list(kwargs_to_shard)
    params = trainable_params(list(kwargs_to_pass.values()), compute_params)
    return _SequenceTiledCompute.apply(fn, sequence_pieces(seqlen, shards), names, dict(kwargs_to_pass),
                                       grad_requiring_tensor_key, output_unshard_dimension, output_reduction,
                                       *kwargs_to_shard.values(), *params)


class _TiledFusedLogitsLoss(torch.autograd.Function):
    """The loss of ``fn(module, x_tile, y_tile[, mask_tile])`` over tiles of the flattened batch x sequence.

    Each tile's logits are recomputed in backward, like the tiled MLP's activations. DeepSpeed instead runs the
    tiles' backward inside forward to save that recompute; a backward during forward would run ZeRO-3's
    backward hooks (gradient reduce, parameter release) in the middle of its forward, so zerotune does not."""

    @staticmethod
    def forward(ctx, fn: Callable, module: Any, mask: torch.Tensor | None, shards: int, reduction: str,
                y: torch.Tensor, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] * x.shape[1]
        ctx.fn, ctx.module, ctx.reduction, ctx.params = fn, module, reduction, params
        ctx.pieces = sequence_pieces(rows, shards)
        ctx.save_for_backward(x, y, mask)
        with torch.no_grad():
            total = torch.stack([fn(*args) for args in _loss_tiles(module, x, y, mask, ctx.pieces, False)])
        return total.mean() if reduction == "mean" else total.sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, y, mask = ctx.saved_tensors
        wants_x = ctx.needs_input_grad[6]
        weight = grad / len(ctx.pieces) if ctx.reduction == "mean" else grad  # d(loss)/d(tile loss)
        x_grads: list[torch.Tensor] = []
        param_grads: list[torch.Tensor | None] = [None] * len(ctx.params)
        for args in _loss_tiles(ctx.module, x, y, mask, ctx.pieces, wants_x):
            with torch.enable_grad():
                loss = ctx.fn(*args)
            tile = args[1]
            tile_grad, grads = _tile_grads(loss, weight.to(loss.dtype).expand(loss.shape), tile if wants_x else None,
                                           list(ctx.params), "TiledFusedLogitsLoss")
            if wants_x:
                x_grads.append(torch.zeros_like(tile) if tile_grad is None else tile_grad)
            _add(param_grads, grads)
        x_grad = torch.cat(x_grads).reshape(x.shape) if wants_x else None
        return (None,) * 6 + (x_grad, *param_grads)


def _loss_tiles(module: Any, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, pieces: list[int],
                differentiable: bool) -> list[tuple]:
    """``(module, x_tile, y_tile[, mask_tile])`` per tile of the flattened [batch * seq] tokens."""
    rows = x.shape[0] * x.shape[1]
    flat_x, flat_y = x.reshape(rows, *x.shape[2:]), y.reshape(rows, *y.shape[2:])
    flat_mask = None if mask is None else mask.reshape(rows)
    tiles, start = [], 0
    for length in pieces:
        args: tuple = (module, flat_x.narrow(0, start, length).detach().requires_grad_(differentiable),
                       flat_y.narrow(0, start, length))
        if flat_mask is not None:
            args += (flat_mask.narrow(0, start, length),)
        tiles.append(args)
        start += length
    return tiles


def tiled_fused_logits_loss(fn: Callable[..., torch.Tensor], module: Any, x: torch.Tensor, y: torch.Tensor,
                            mask: torch.Tensor | None, shards: int, compute_params: Sequence[torch.Tensor] | None,
                            output_reduction: str = "mean") -> torch.Tensor:
    """A loss ``fn(module, x, y[, mask])`` (e.g. lm_head + cross entropy) in ``shards`` tiles of the flattened
    ``[batch, seq]`` tokens, never holding more than one tile's logits. The result is the "mean" or "sum" of the
    tiles' losses: with a per-tile mean loss, "mean" equals the untiled mean only when the tiles hold equal
    numbers of counted tokens (use "sum" of token sums and divide by the count otherwise)."""
    if output_reduction not in ("mean", "sum"):
        raise ValueError(f"output_reduction must be 'mean' or 'sum', got {output_reduction!r}")
    if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
        raise ValueError(f"x and y must both be [batch, seq, ...] with the same batch and seq, got x "
                         f"{tuple(x.shape)} and y {tuple(y.shape)}")
    if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"mask must be [batch, seq] = {list(x.shape[:2])}, got {list(mask.shape)}")
    params = trainable_params([module], compute_params)
    return _TiledFusedLogitsLoss.apply(fn, module, mask, shards, output_reduction, y, x, *params)
