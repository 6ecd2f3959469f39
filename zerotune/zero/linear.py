"""A linear layer whose autograd node computes with whatever its weight holds *at backward time*.

Why it exists: ZeRO-3 releases a unit's gathered weights after its forward and gathers them again
before its backward. ``torch.nn.functional.linear`` already works with that here (autograd saves a
leaf parameter itself, not a copy, and zerotune swaps the parameter's ``.data``), so zerotune never
replaces ``F.linear``. This function is for code that calls a linear *explicitly* outside the unit
that owns the weight -- a head applied to another module's weight, a loss computed after the
forward: if a partitioned weight or bias is still sharded when the forward or the backward needs
it, it is gathered for that computation and released again (a collective: every rank runs the same
forward and backward, so every rank takes part). It is also a ``torch.func``-ready
``autograd.Function`` (``setup_context``, generated vmap rule).

Autocast: the forward runs under whatever autocast state the caller set (``F.linear`` inside casts
as ``nn.Linear`` would). The backward runs under the *forward's* autocast state, recorded in
``setup_context`` (``ctx.forward_autocast``): an autocast region around
``backward()`` neither leaks into gradients of an fp32 forward nor is needed for a half one.
Gradients come back in the inputs' dtypes (autograd casts them), so fp32 master weights get fp32
gradients.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, NamedTuple

import torch

from zerotune.zero.stage3.gathered import GatheredParameters
from zerotune.zero.stage3.sharded_param import ParamState, sharded_param_of


@contextlib.contextmanager
def _whole(*params: torch.Tensor | None) -> Iterator[None]:
    """Gather, for the block, the partitioned ones of ``params`` that are sharded now (read-only)."""
    sharded = [p for p in params if p is not None and (s := sharded_param_of(p)) is not None
               and s.state is not ParamState.UNSHARDED]
    if not sharded:
        yield
        return
    with GatheredParameters(sharded):
        yield


class ForwardAutocast(NamedTuple):
    """The autocast state the forward ran under, for the backward to run under too."""

    device_type: str
    enabled: bool
    dtype: torch.dtype


class Zero3LinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` (``F.linear``'s math and autocast casts): see the module docstring."""

    generate_vmap_rule = True

    @staticmethod
    def forward(input: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        with _whole(weight, bias):
            return torch.nn.functional.linear(input, weight, bias)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        input, weight = inputs[0], inputs[1]
        bias = inputs[2] if len(inputs) > 2 else None
        device_type = input.device.type
        ctx.forward_autocast = ForwardAutocast(device_type, torch.is_autocast_enabled(device_type),
                                               torch.get_autocast_dtype(device_type))
        ctx.save_for_backward(input, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        state: ForwardAutocast = ctx.forward_autocast
        with torch.autocast(state.device_type, dtype=state.dtype, enabled=state.enabled), _whole(weight):
            if ctx.needs_input_grad[0]:
                grad_input = grad_output.matmul(weight)  # (..., out) @ (out, in) -> (..., in)
            # every leading dimension is a batch one: (N, out) and (N, in), N = their product (1 when unbatched)
            rows = grad_output.reshape(-1, grad_output.shape[-1])
            if ctx.needs_input_grad[1]:
                grad_weight = rows.t().matmul(input.reshape(-1, input.shape[-1]))  # (out, in)
            if bias is not None and ctx.needs_input_grad[2]:
                grad_bias = rows.sum(0)
        return grad_input, grad_weight, grad_bias


def zero3_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` through :class:`Zero3LinearFunction`."""
    return Zero3LinearFunction.apply(input, weight, bias)


class Zero3Linear(torch.nn.Module):
    """``nn.Linear`` (same parameters, initialization and ``extra_repr``) computing through
    :class:`Zero3LinearFunction`. Subclasses pick another function with ``function``."""

    function: type[torch.autograd.Function] = Zero3LinearFunction

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = (torch.nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialization: Kaiming-uniform weight, bias uniform in +-1/sqrt(fan_in)."""
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.function.apply(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
