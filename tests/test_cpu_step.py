"""The host optimizer step: fused kernels match torch's reference, chunking and threads change nothing."""

from __future__ import annotations

import warnings

import pytest
import torch

from zerotune.config.errors import ConfigError
from zerotune.optim.deepspeed_adam import FusedAdam
from zerotune.offload.cpu_step import (
    FUSED_TYPES,
    STEP_ALIGNMENT_ELEMENTS,
    available_cores,
    build_cpu_optimizer,
    cpu_step_threads,
    step_implementation,
    step_threads,
)

NUMEL = 10_007  # odd, so the vector loop's scalar tail is exercised
STEPS = 5

# (DeepSpeed type, DeepSpeed params, torch reference class, its kwargs)
CASES = {
    "AdamW": ("AdamW", {"lr": 1e-2, "weight_decay": 0.1}, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "AdamW-amsgrad": ("AdamW", {"lr": 1e-2, "amsgrad": True}, torch.optim.AdamW,
                      {"lr": 1e-2, "weight_decay": 0.0, "amsgrad": True}),
    "Adam-L2": ("Adam", {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False}, torch.optim.Adam,
                {"lr": 1e-2, "weight_decay": 0.1}),
    "SGD-momentum": ("SGD", {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.1}, torch.optim.SGD,
                     {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.1}),
    "SGD-nesterov": ("SGD", {"lr": 1e-2, "momentum": 0.9, "nesterov": True}, torch.optim.SGD,
                     {"lr": 1e-2, "momentum": 0.9, "nesterov": True}),
    "Adagrad": ("Adagrad", {"lr": 1e-2, "weight_decay": 0.1, "lr_decay": 0.01}, torch.optim.Adagrad,
                {"lr": 1e-2, "weight_decay": 0.1, "lr_decay": 0.01}),
}


def _data(seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(NUMEL, generator=generator), [torch.randn(NUMEL, generator=generator) for _ in range(STEPS)]


def _run_whole(make, initial: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    param = torch.nn.Parameter(initial.clone())
    optimizer = make([param])
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    return param.detach()


def _run_chunked(make, initial: torch.Tensor, grads: list[torch.Tensor], chunk: int) -> torch.Tensor:
    """NVMe offload's pattern: one parameter per chunk, each stepped alone (the others hold no gradient)."""
    proxies = [torch.nn.Parameter(piece.clone()) for piece in initial.split(chunk)]
    optimizer = make(proxies)
    for grad in grads:
        for proxy, piece in zip(proxies, grad.split(chunk)):
            proxy.grad = piece.clone()
            optimizer.step()
            proxy.grad = None
    return torch.cat([proxy.detach() for proxy in proxies])


def _chosen(case: str):
    opt_type, params, _, _ = CASES[case]
    return lambda tensors: build_cpu_optimizer(opt_type, params, tensors)


@pytest.mark.parametrize("case", sorted(CASES))
def test_chosen_kernel_matches_torch_reference(case):
    opt_type, params, reference_class, reference_kwargs = CASES[case]
    initial, grads = _data()
    assert step_implementation(build_cpu_optimizer(opt_type, params, [torch.zeros(4)])) == "fused"
    chosen = _run_whole(_chosen(case), initial, grads)
    reference = _run_whole(lambda t: reference_class(t, foreach=False, **reference_kwargs), initial, grads)
    assert not torch.equal(chosen, initial)  # the steps did move the parameters
    torch.testing.assert_close(chosen, reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", sorted(CASES))
def test_chunked_stepping_is_bitwise_equal_at_aligned_boundaries(case):
    initial, grads = _data(seed=1)
    whole = _run_whole(_chosen(case), initial, grads)
    for chunk in (STEP_ALIGNMENT_ELEMENTS, 40 * STEP_ALIGNMENT_ELEMENTS, NUMEL):
        assert torch.equal(_run_chunked(_chosen(case), initial, grads, chunk), whole), chunk


@pytest.mark.parametrize("case", ["AdamW", "SGD-momentum"])
def test_chunked_stepping_at_unaligned_boundaries_is_within_an_ulp(case):
    """Unaligned boundaries move elements between the vector loop and its scalar tail: rounding only."""
    initial, grads = _data(seed=2)
    whole = _run_whole(_chosen(case), initial, grads)
    for chunk in (37, 4099):  # ragged sizes; 37 gives 271 chunks (each step scans them all: keep it modest)
        torch.testing.assert_close(_run_chunked(_chosen(case), initial, grads, chunk), whole, rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", ["AdamW", "Adagrad"])
def test_thread_count_does_not_change_the_numbers(case):
    initial, grads = _data(seed=3)
    with step_threads(1):
        one = _run_whole(_chosen(case), initial, grads)
    with step_threads(2):
        two = _run_whole(_chosen(case), initial, grads)
    assert torch.equal(one, two)


def test_step_threads_sets_and_restores():
    before = torch.get_num_threads()
    target = 2 if before != 2 else 1
    with step_threads(target):
        assert torch.get_num_threads() == target
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="boom"), step_threads(target):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before
    with step_threads(before):  # already there: nothing to change
        assert torch.get_num_threads() == before


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_step_threads_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match="threads must be an int >= 1"), step_threads(bad):
        pass


def test_cpu_step_threads_shares_the_cores():
    cores = available_cores()
    assert cpu_step_threads(1) == cores
    assert cpu_step_threads(cores) == 1
    assert cpu_step_threads(cores * 4) == 1  # oversubscribed node: still one thread, never zero
    with pytest.raises(ValueError, match="local_world_size must be an int >= 1, got 0"):
        cpu_step_threads(0)


@pytest.mark.parametrize(
    "tensor, what",
    [(torch.zeros(4, dtype=torch.bfloat16), "torch.bfloat16 on cpu"), (torch.zeros(4, device="meta"), "on meta")],
)
def test_build_rejects_tensors_that_are_not_host_fp32(tensor, what):
    groups = [{"params": [torch.zeros(3)]}, {"params": [torch.zeros(2), tensor], "lr": 0.1}]
    with pytest.raises(ValueError, match=r"param_groups\[1\] tensor 1 \(shape \(4,\)\) is .*" + what):
        build_cpu_optimizer("AdamW", {"lr": 1e-3}, groups)


def test_build_keeps_param_groups_and_deepspeed_semantics():
    first, second = torch.zeros(8), torch.zeros(8)
    optimizer = build_cpu_optimizer("Adam", {"lr": 1e-3}, [{"params": [first]}, {"params": [second], "lr": 0.5}])
    assert isinstance(optimizer, FusedAdam)  # DeepSpeed "Adam": its FusedAdam, decoupled decay by default
    assert all(g["decoupled_weight_decay"] for g in optimizer.param_groups)
    assert [g["lr"] for g in optimizer.param_groups] == [1e-3, 0.5]
    assert all(g["fused"] for g in optimizer.param_groups)
    with pytest.raises(ConfigError, match="optimizer.params"):
        build_cpu_optimizer("AdamW", {"lrr": 1e-3}, [first])


def test_user_choice_of_implementation_is_kept_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert step_implementation(build_cpu_optimizer("AdamW", {"foreach": True}, [torch.zeros(4)])) == "foreach"
        assert step_implementation(build_cpu_optimizer("SGD", {"lr": 0.1, "foreach": False}, [torch.zeros(4)])) == "for-loop"


def test_warns_when_fused_is_refused():
    """``differentiable=True`` is a setting torch's fused kernels refuse; the step still works, unfused."""
    with pytest.warns(UserWarning, match="fused CPU kernel refused"):
        optimizer = build_cpu_optimizer("AdamW", {"lr": 1e-3, "differentiable": True}, [torch.zeros(4)])
    assert step_implementation(optimizer) == "for-loop"


def test_types_without_fused_kernel_keep_torch_default():
    assert set(FUSED_TYPES) == {"Adam", "AdamW", "SGD", "Adagrad"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert step_implementation(build_cpu_optimizer("RMSprop", {"lr": 1e-3}, [torch.zeros(4)])) == "for-loop"
