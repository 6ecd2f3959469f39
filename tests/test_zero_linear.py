"""The explicit ZeRO-3 linear (``zero/linear.py``; DeepSpeed's ``runtime.zero.linear`` names in
``compat/zero_linear.py``): ``F.linear``'s values and gradients for any input rank, the forward's autocast state
kept for the backward, ``torch.func`` transforms, and on 2 ranks a weight left sharded is gathered for the
computation while a ZeRO-3 model of these layers trains like single-process ``nn.Linear``."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import zerotune
from tests.harness import run_distributed
from tests.models import Trace, assert_close_traces, engine_run, mlp_batch, reference_run
from zerotune.compat import zero_linear
from zerotune.zero.linear import Zero3Linear, zero3_linear


@pytest.mark.parametrize("shape", [(8,), (3, 8), (2, 3, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_gradients_are_f_linear_s(shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    tensors = [torch.randn(*shape), torch.randn(4, 8)] + ([torch.randn(4)] if bias else [])
    mine = [t.clone().requires_grad_() for t in tensors]
    theirs = [t.clone().requires_grad_() for t in tensors]
    out = zero3_linear(*mine)
    torch.testing.assert_close(out, nn.functional.linear(*theirs))
    (out ** 2).sum().backward()
    (nn.functional.linear(*theirs) ** 2).sum().backward()
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a.grad, b.grad)


def test_the_forward_s_autocast_state_is_kept_for_the_backward() -> None:
    weight = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = zero3_linear(x, weight, torch.randn(4))
    assert out.dtype == torch.bfloat16 and out.grad_fn.forward_autocast == ("cpu", True, torch.bfloat16)
    out.float().sum().backward()
    assert weight.grad.dtype == x.grad.dtype == torch.float32  # fp32 leaves get fp32 gradients

    weight.grad = x.grad = None
    out = zero3_linear(x, weight)
    assert out.dtype == torch.float32 and out.grad_fn.forward_autocast.enabled is False
    with torch.autocast("cpu", dtype=torch.bfloat16):  # an autocast region around backward() does not leak in
        out.sum().backward()
    expected = torch.ones(2, 4).t() @ x.detach()
    assert torch.equal(weight.grad, expected)  # exact: computed in fp32, not bf16


def test_torch_func_transforms() -> None:
    torch.manual_seed(0)
    weight, bias, xs = torch.randn(4, 8), torch.randn(4), torch.randn(3, 8)
    grads, value = torch.func.grad_and_value(lambda w, x: zero3_linear(x, w, bias).sum(), argnums=(0, 1))(weight, xs)
    torch.testing.assert_close(value, (xs @ weight.t() + bias).sum())
    torch.testing.assert_close(grads[0], torch.ones(3, 4).t() @ xs)
    torch.testing.assert_close(grads[1], torch.ones(3, 4) @ weight)
    per_row = torch.func.vmap(lambda x: zero3_linear(x, weight, bias).sum())(xs)
    torch.testing.assert_close(per_row, (xs @ weight.t() + bias).sum(-1))


def test_module_is_nn_linear_with_this_function() -> None:
    torch.manual_seed(0)
    ours = Zero3Linear(6, 5)
    torch.manual_seed(0)
    theirs = nn.Linear(6, 5)
    assert torch.equal(ours.weight, theirs.weight) and torch.equal(ours.bias, theirs.bias)
    assert repr(ours) == "Zero3Linear(in_features=6, out_features=5, bias=True)"
    assert Zero3Linear(6, 5, bias=False).bias is None
    assert "Zero3LinearFunction" in type(ours(torch.randn(6)).grad_fn).__name__


def test_deepspeed_names() -> None:
    out = zero_linear.zero3_linear_wrap(torch.randn(2, 3), torch.randn(4, 3, requires_grad=True))
    assert type(out.grad_fn).__name__ == "LinearFunctionForZeroStage3Backward"  # DeepSpeed's users check this name
    assert out.grad_fn._fwd_used_autocast is False and out.grad_fn._dtype == torch.get_autocast_dtype("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = zero_linear.zero3_linear_wrap(torch.randn(2, 3), torch.randn(4, 3, requires_grad=True))
    assert half.grad_fn._fwd_used_autocast is True and half.grad_fn._dtype == torch.bfloat16
    layer = zero_linear.LinearModuleForZeroStage3(3, 4).half()
    assert layer(torch.randn(3).half()).dtype == torch.float16
    assert type(layer(torch.randn(3).half()).grad_fn).__name__ == "LinearFunctionForZeroStage3Backward"
    for decorator, of in ((zero_linear.autocast_custom_fwd, torch.amp.custom_fwd),
                          (zero_linear.autocast_custom_bwd, torch.amp.custom_bwd)):
        assert isinstance(decorator, functools.partial) and decorator.func is of
        assert decorator.keywords == {"device_type": "cpu"}


# ---- ZeRO-3 on 2 ranks ----------------------------------------------------------------------------------------
def _sharded_weight_gathered_for_the_computation() -> dict:
    torch.manual_seed(0)
    whole = nn.Linear(6, 5)
    with zerotune.zero.Init():
        layer = Zero3Linear(6, 5)
    with torch.no_grad(), zerotune.zero.GatheredParameters(list(layer.parameters()), modifier_rank=0):
        layer.weight.copy_(whole.weight)
        layer.bias.copy_(whole.bias)
    sharded_before = layer.weight.ds_status.name
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    x_whole = x.clone().requires_grad_()
    x.requires_grad_()
    out = layer(x)
    sharded_after = layer.weight.ds_status.name  # released again after the forward
    out.pow(2).sum().backward()
    whole(x_whole).pow(2).sum().backward()
    return {"statuses": (sharded_before, sharded_after), "out": torch.allclose(out, whole(x_whole)),
            "x_grad": torch.allclose(x.grad, x_whole.grad),
            "w_grad": torch.allclose(layer.weight.grad, whole.weight.grad),
            "b_grad": torch.allclose(layer.bias.grad, whole.bias.grad), "still": layer.weight.ds_status.name}


def test_a_sharded_weight_is_gathered_for_forward_and_backward_on_two_ranks() -> None:
    for result in run_distributed(_sharded_weight_gathered_for_the_computation, 2):
        assert result == {"statuses": ("NOT_AVAILABLE", "NOT_AVAILABLE"), "out": True, "x_grad": True,
                          "w_grad": True, "b_grad": True, "still": "NOT_AVAILABLE"}


def _weight_being_prefetched() -> dict:
    """A weight whose gather is in flight (a prefetch) is waited for, and stays gathered for the schedule."""
    from zerotune.zero.stage3.sharded_param import sharded_param_of

    torch.manual_seed(0)
    with zerotune.zero.Init():
        layer = Zero3Linear(6, 5)
    segment = sharded_param_of(layer.weight).segment
    segment.start_gather()  # as the schedule's prefetch does
    statuses = [layer.weight.ds_status.name]
    out = layer(torch.ones(2, 6))
    statuses.append(layer.weight.ds_status.name)
    expected = nn.functional.linear(torch.ones(2, 6), layer.weight, layer.bias)  # (gathered: real values)
    segment.release()
    return {"statuses": statuses, "equal": torch.equal(out, expected)}


def test_a_weight_being_prefetched_is_waited_for_and_left_gathered_on_two_ranks() -> None:
    for result in run_distributed(_weight_being_prefetched, 2):
        assert result == {"statuses": ["INFLIGHT", "AVAILABLE"], "equal": True}


class _Net(nn.Module):
    def __init__(self, layer: type[nn.Module]) -> None:
        super().__init__()
        self.inp, self.mid, self.out = layer(8, 16), layer(16, 16), layer(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        return nn.functional.mse_loss(self.out(hidden), y)


def _stage3_of_these_layers() -> dict:
    world = torch.distributed.get_world_size()
    torch.manual_seed(0)
    reference_model = _Net(nn.Linear)
    optimizer = torch.optim.AdamW(reference_model.parameters(), lr=0.01, weight_decay=0.0)
    reference = reference_run(reference_model, optimizer, mlp_batch, steps=4, gas=1, global_rows=2 * world, clip=0.0)
    torch.manual_seed(0)  # the same initialization as nn.Linear's
    model = _Net(zero_linear.LinearModuleForZeroStage3)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zerotune.initialize(model=model, config=config)
    trace: Trace = engine_run(engine, mlp_batch, steps=4, gas=1, global_rows=2 * world)
    engine.destroy()
    return {"trace": trace, "reference": reference}


def test_a_zero3_model_of_these_layers_trains_like_nn_linear_on_two_ranks() -> None:
    for result in run_distributed(_stage3_of_these_layers, 2, timeout=120):
        assert_close_traces(result["trace"], result["reference"], rel=1e-5)
