"""zerotune.optim: DeepSpeed optimizer/scheduler names -> torch objects with DeepSpeed's numbers.

The schedule references below are written out from DeepSpeed's documented formulas
(``deepspeed/runtime/lr_schedules.py``) independently of the implementation, in terms of
DeepSpeed's counter ``it`` (= ``last_batch_iteration``, -1 before the first step).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from zerotune.config import ConfigError, NotSupportedYetError
from zerotune.optim.deepspeed_adam import FusedAdam
from zerotune.optim import (
    OPTIMIZER_NAMES,
    SCHEDULER_NAMES,
    Lamb,
    apply_lr_scaling,
    build_optimizer,
    build_scheduler,
    optimizer_defaults,
    scale_lr_linear,
)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=gen)), torch.nn.Parameter(torch.randn(3, generator=gen))]


def _set_grads(params: list[torch.Tensor], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _run(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], steps: int = 3) -> list[torch.Tensor]:
    for step in range(steps):
        _set_grads(params, step)
        optimizer.step()
    return [p.detach().clone() for p in params]


# ----------------------------------------------------------------------------- optimizers


@pytest.mark.parametrize(
    ("opt_type", "params", "expected_class", "expected"),
    [
        # DeepSpeed's FusedAdam (torch's kernels), decoupled decay unless adam_w_mode is false for "Adam"
        ("Adam", {"lr": 2e-3, "betas": [0.8, 0.9]}, FusedAdam,
         {"lr": 2e-3, "betas": (0.8, 0.9), "weight_decay": 0.0, "decoupled_weight_decay": True}),
        ("adam", {"weight_decay": 0.1}, FusedAdam, {"weight_decay": 0.1, "eps": 1e-8, "decoupled_weight_decay": True}),
        ("Adam", {"adam_w_mode": False, "weight_decay": 0.1}, FusedAdam,
         {"weight_decay": 0.1, "decoupled_weight_decay": False}),
        ("Adam", {"torch_adam": True, "adam_w_mode": False, "amsgrad": True}, torch.optim.Adam, {"amsgrad": True}),
        ("AdamW", {"adam_w_mode": False}, FusedAdam, {"weight_decay": 0.0, "decoupled_weight_decay": True}),
        ("ADAMW", {"torch_adam": True}, torch.optim.AdamW, {"weight_decay": 0.01}),  # DeepSpeed builds torch's own
        ("Adam", {"bias_correction": True, "set_grad_none": True}, FusedAdam, {"lr": 1e-3}),
        ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}, torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
        ("Adagrad", {"lr": 0.05, "lr_decay": 0.01}, torch.optim.Adagrad, {"lr": 0.05, "lr_decay": 0.01}),
        ("Lamb", {"lr": 1e-2, "max_coeff": 0.3, "min_coeff": 0.02, "betas": [0.9, 0.99]}, Lamb,
         {"max_coeff": 0.3, "min_coeff": 0.02, "betas": (0.9, 0.99), "bias_correction": True}),
        ("RMSprop", {"alpha": 0.9}, torch.optim.RMSprop, {"alpha": 0.9}),
    ],
)  # fmt: skip
def test_each_name_builds_the_right_class_and_hyperparameters(opt_type, params, expected_class, expected):
    optimizer = build_optimizer(opt_type, params, _params())
    assert type(optimizer) is expected_class
    for key, value in expected.items():
        assert optimizer.defaults[key] == value, key
        assert optimizer.param_groups[0][key] == value, key


def test_adam_with_weight_decay_is_decoupled_like_torch_adamw():
    ours_params, ref_params = _params(), _params()
    ours = build_optimizer("Adam", {"lr": 0.05, "weight_decay": 0.2}, ours_params)
    reference = torch.optim.AdamW(ref_params, lr=0.05, weight_decay=0.2, fused=True)
    for got, want in zip(_run(ours, ours_params), _run(reference, ref_params)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_adam_w_mode_false_is_l2_coupled_torch_adam():
    ours_params, ref_params, adamw_params = _params(), _params(), _params()
    ours = build_optimizer("Adam", {"lr": 0.05, "weight_decay": 0.2, "adam_w_mode": False}, ours_params)
    reference = torch.optim.Adam(ref_params, lr=0.05, weight_decay=0.2, fused=True)
    ours_out, ref_out = _run(ours, ours_params), _run(reference, ref_params)
    for got, want in zip(ours_out, ref_out):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    adamw_out = _run(torch.optim.AdamW(adamw_params, lr=0.05, weight_decay=0.2), adamw_params)
    assert not torch.allclose(ours_out[0], adamw_out[0])  # the two decay modes really differ


def test_group_values_win_over_params_and_json_betas_become_tuples():
    first, second = _params()
    optimizer = build_optimizer(
        "AdamW",
        {"lr": 1e-3, "weight_decay": 0.1},
        [{"params": [first]}, {"params": [second], "lr": 5e-3, "weight_decay": 0.0, "betas": [0.5, 0.6]}],
    )
    assert optimizer.param_groups[0]["lr"] == 1e-3 and optimizer.param_groups[0]["weight_decay"] == 0.1
    assert optimizer.param_groups[1]["lr"] == 5e-3 and optimizer.param_groups[1]["weight_decay"] == 0.0
    assert optimizer.param_groups[1]["betas"] == (0.5, 0.6)


@pytest.mark.parametrize(
    ("opt_type", "nearest"),
    [("ZeroOneAdam", "Adam"), ("OneBitLamb", "Lamb"), ("MuAdam", "Adam"),
     ("MuAdamW", "AdamW"), ("MuSGD", "SGD"), ("CPUAdam", "Adam"), ("Lion", "AdamW"), ("zerooneadam", "Adam")],
)  # fmt: skip
def test_deepspeed_only_optimizers_name_the_nearest_supported_one(opt_type, nearest):
    with pytest.raises(NotSupportedYetError) as info:
        build_optimizer(opt_type, {}, _params())
    assert info.value.path == "optimizer.type"
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)
    assert f"not supported yet; use {nearest}" in str(info.value)
    assert opt_type.lower() in str(info.value).lower()


def test_unknown_type_lists_valid_names_with_did_you_mean():
    with pytest.raises(ConfigError, match="Did you mean 'AdamW'") as info:
        build_optimizer("AdamWW", {}, _params())
    assert info.value.path == "optimizer.type"
    assert all(name in str(info.value) for name in OPTIMIZER_NAMES)


@pytest.mark.parametrize(
    ("opt_type", "params", "path", "needle"),
    [
        ("Adam", {"weight_decy": 0.1}, "optimizer.params.weight_decy", "Did you mean 'weight_decay'"),
        ("SGD", {"betas": [0.9, 0.99]}, "optimizer.params.betas", "momentum"),
        ("Lamb", {"amsgrad": True}, "optimizer.params.amsgrad", "max_coeff"),
        ("Adam", {"max_grad_norm": 1.0}, "optimizer.params.max_grad_norm", "gradient_clipping"),
        ("Adam", {"bias_correction": False}, "optimizer.params.bias_correction", "not supported"),
        ("Adam", {"lr": "auto"}, "optimizer.params.lr", "auto"),
        ("Adam", {"betas": [0.9]}, "optimizer.params.betas", "two numbers"),
        ("Adam", {"lr": -1.0}, "optimizer.params", "Invalid learning rate"),
        ("Lamb", {"min_coeff": 2.0, "max_coeff": 1.0}, "optimizer.params", "min_coeff"),
    ],
)
def test_bad_params_name_the_key(opt_type, params, path, needle):
    with pytest.raises(ConfigError) as info:
        build_optimizer(opt_type, params, _params())
    assert info.value.path == path
    assert needle in str(info.value)


def test_optimizer_defaults_are_the_values_build_uses():
    assert optimizer_defaults("Adam") == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False}
    assert optimizer_defaults("adamw")["weight_decay"] == 0.0  # DeepSpeed FusedAdam's default, not torch's 0.01
    lamb = optimizer_defaults("Lamb")
    assert lamb["max_coeff"] == 10.0 and lamb["min_coeff"] == 0.01 and lamb["bias_correction"] is True
    assert optimizer_defaults("SGD")["momentum"] == 0
    assert "foreach" not in optimizer_defaults("Adam")
    built = build_optimizer("Adam", {}, _params())
    for key, value in optimizer_defaults("Adam").items():
        assert built.defaults[key] == value


# ----------------------------------------------------------------------------- LAMB


def _reference_lamb(params, grads_per_step, lr, betas, eps, weight_decay, max_coeff, min_coeff, bias_correction=True):
    """Per-parameter LAMB as in DeepSpeed's CUDA kernel, written out element by element."""
    beta1, beta2 = betas
    params = [p.detach().clone().double() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, grads in enumerate(grads_per_step, start=1):
        for i, (p, g) in enumerate(zip(params, grads)):
            g = g.double()
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            update = m[i] / (v[i].sqrt() + eps) + weight_decay * p
            w_norm, u_norm = p.norm().item(), update.norm().item()
            coeff = min(max(w_norm / u_norm, min_coeff), max_coeff) if w_norm > 0 and u_norm > 0 else 1.0
            step_size = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t) if bias_correction else lr
            params[i] = p - step_size * coeff * update
    return params


def test_lamb_first_step_by_hand():
    # p = [3, 4] (norm 5), g = [1, 1]: update = 0.1 / sqrt(0.001) = sqrt(10) per element, norm sqrt(20),
    # trust ratio 5 / sqrt(20) = sqrt(5) / 2; step size lr * sqrt(0.001) / 0.1 = lr / sqrt(10).
    p = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    optimizer = Lamb([p], lr=0.1, eps=0.0)
    p.grad = torch.ones(2, dtype=torch.float64)
    optimizer.step()
    torch.testing.assert_close(p.detach(), torch.tensor([3.0, 4.0], dtype=torch.float64) - 0.1 * math.sqrt(5) / 2)
    assert optimizer.lamb_coeffs == pytest.approx([math.sqrt(5) / 2])


@pytest.mark.parametrize("bias_correction", [True, False])
def test_lamb_matches_reference_for_three_steps(bias_correction):
    params = _params(seed=3) + [torch.nn.Parameter(torch.zeros(2))]  # a zero weight takes trust ratio 1
    params[1].data.mul_(100.0)  # a large weight so the ratio hits max_coeff
    hyper = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05, max_coeff=5.0, min_coeff=0.01)
    initial = [p.detach().clone() for p in params]
    grads_per_step = []
    optimizer = build_optimizer("Lamb", {**hyper, "bias_correction": bias_correction}, params)
    first_step_coeffs = None
    for step in range(3):
        _set_grads(params, step)
        grads_per_step.append([p.grad.clone() for p in params])
        optimizer.step()
        first_step_coeffs = first_step_coeffs or optimizer.lamb_coeffs
    expected = _reference_lamb(initial, grads_per_step, bias_correction=bias_correction, **hyper)
    for got, want in zip(params, expected):
        torch.testing.assert_close(got.detach().double(), want, rtol=1e-5, atol=1e-6)
    assert first_step_coeffs[1] == pytest.approx(5.0) and first_step_coeffs[2] == pytest.approx(1.0)


def test_lamb_eps_inside_sqrt_and_state_dict_round_trip():
    params, twin_params = _params(seed=5), _params(seed=5)
    optimizer = Lamb(params, lr=0.01, eps=1e-3, eps_inside_sqrt=True)
    _run(optimizer, params, steps=2)
    twin = Lamb(twin_params, lr=0.5, eps=0.1)  # different hyperparameters: the checkpoint must restore them
    for twin_param, param in zip(twin_params, params):
        twin_param.data.copy_(param.data)
    twin.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # deepcopy: a reload from disk
    _set_grads(params, 7), _set_grads(twin_params, 7)
    optimizer.step(), twin.step()
    for a, b in zip(params, twin_params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    exp_avg_sq = optimizer.state[params[1]]["exp_avg_sq"]
    assert optimizer.state[params[1]]["step"] == 3 and exp_avg_sq.shape == params[1].shape


# ----------------------------------------------------------------------------- schedules (references)


def ref_warmup(it, min_lr, max_lr, warmup, kind):
    warmup = max(2, warmup)
    if it < 0:
        return min_lr
    if it >= warmup:
        return max_lr
    gamma = math.log(it + 1) / math.log(warmup) if kind == "log" else it / warmup
    return min_lr + (max_lr - min_lr) * gamma


def ref_warmup_decay(it, min_lr, max_lr, warmup, total, kind):
    warmup = max(2, warmup)
    if it < warmup:
        return ref_warmup(it, min_lr, max_lr, warmup, kind)
    gamma = max(0.0, (total - it) / max(1.0, total - warmup))
    return min_lr + (max_lr - min_lr) * gamma


def ref_cosine(it, base_lr, warmup, total, min_ratio, cos_min, kind):
    warmup = max(2, warmup)
    if it < 0:
        return 0.0
    if it < warmup:
        gamma = math.log(it + 1) / math.log(warmup) if kind == "log" else it / warmup
        return base_lr * (min_ratio + gamma * (1 - min_ratio))
    progress = min(it - warmup + 1, total - warmup) / (total - warmup)
    return base_lr * max(0.0, cos_min + (1 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)


def ref_one_cycle(it, low, high, first, second, decay_rate, decay_size):
    total = first + second
    if it < total:
        x = (it + 1) % total  # position in the cycle, in steps
        scale = x / first if x <= first else (total - x) / second
        return low + (high - low) * scale
    if decay_size == 0 or decay_rate == 0:
        return low
    return low / (1 + decay_rate * (it - total + 1) / decay_size)


def ref_range_test(it, min_lr, step_size, rate, staircase):
    interval = (it + 1) / step_size
    return min_lr * (1 + rate * (math.floor(interval) if staircase else interval))


SCHEDULE_CASES = {
    "WarmupLR-linear": ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 10, "warmup_type": "linear"},
                        lambda it: ref_warmup(it, 0.01, 0.1, 10, "linear")),
    "WarmupLR-log": ("WarmupLR", {"warmup_max_lr": 0.1, "warmup_num_steps": 20},
                     lambda it: ref_warmup(it, 0.0, 0.1, 20, "log")),
    "WarmupDecayLR": ("WarmupDecayLR", {"total_num_steps": 40, "warmup_max_lr": 0.1, "warmup_num_steps": 10,
                                        "warmup_type": "linear"},
                      lambda it: ref_warmup_decay(it, 0.0, 0.1, 10, 40, "linear")),
    "WarmupDecayLR-log": ("WarmupDecayLR", {"total_num_steps": 30, "warmup_num_steps": 5},  # default max_lr 0.001
                          lambda it: ref_warmup_decay(it, 0.0, 0.001, 5, 30, "log")),
    "WarmupCosineLR": ("WarmupCosineLR", {"total_num_steps": 40, "warmup_num_steps": 8, "cos_min_ratio": 0.1,
                                          "warmup_min_ratio": 0.05, "warmup_type": "linear"},
                       lambda it: ref_cosine(it, 0.5, 8, 40, 0.05, 0.1, "linear")),
    "WarmupCosineLR-log": ("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 6},
                           lambda it: ref_cosine(it, 0.5, 6, 30, 0.0, 0.0001, "log")),
    "OneCycle": ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 10,
                              "cycle_second_step_size": 15, "decay_lr_rate": 0.5, "decay_step_size": 4,
                              "cycle_momentum": False},
                 lambda it: ref_one_cycle(it, 0.01, 0.1, 10, 15, 0.5, 4)),
    "OneCycle-nodecay": ("OneCycle", {"cycle_min_lr": 0.02, "cycle_max_lr": 0.2, "cycle_first_step_size": 8,
                                      "cycle_momentum": False},
                         lambda it: ref_one_cycle(it, 0.02, 0.2, 8, 8, 0.0, 0)),
    "LRRangeTest": ("LRRangeTest", {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 5, "lr_range_test_step_rate": 2.0},
                    lambda it: ref_range_test(it, 0.01, 5, 2.0, False)),
    "LRRangeTest-stairs": ("LRRangeTest", {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 5,
                                           "lr_range_test_staircase": True},
                           lambda it: ref_range_test(it, 0.01, 5, 1.0, True)),
}  # fmt: skip


def _sgd(lr: float = 0.5, groups: int = 1) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(groups)]
    return torch.optim.SGD([{"params": [p]} for p in params], lr=lr)


def _trace(scheduler, optimizer, steps: int) -> list[float]:
    """lr in group 0 before each of ``steps`` optimizer steps (the constructor sets the first)."""
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        assert scheduler.get_last_lr()[0] == optimizer.param_groups[0]["lr"]
        scheduler.step()
    return lrs


@pytest.mark.parametrize("case", list(SCHEDULE_CASES))
def test_schedule_sequence_matches_deepspeed_formula(case):
    sched_type, params, reference = SCHEDULE_CASES[case]
    optimizer = _sgd()
    scheduler = build_scheduler(sched_type, params, optimizer)
    got = _trace(scheduler, optimizer, 50)
    expected = [reference(it) for it in range(-1, 49)]
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_hand_checked_values_at_known_steps():
    def lr_at(sched_type, params, iteration, lr=0.5):
        optimizer = _sgd(lr)
        build_scheduler(sched_type, params, optimizer).step(iteration)
        return optimizer.param_groups[0]["lr"]

    linear = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 10, "warmup_type": "linear"}
    assert lr_at("WarmupLR", linear, 0) == 0.0
    assert lr_at("WarmupLR", linear, 5) == pytest.approx(0.05)
    assert lr_at("WarmupLR", linear, 10) == pytest.approx(0.1) == lr_at("WarmupLR", linear, 1000)
    assert lr_at("WarmupLR", {"warmup_num_steps": 10}, 9) == pytest.approx(0.5 * math.log(10) / math.log(10))
    decay = {**linear, "total_num_steps": 50}
    assert lr_at("WarmupDecayLR", decay, 30) == pytest.approx(0.05)  # halfway through the 40 decay steps
    assert lr_at("WarmupDecayLR", decay, 50) == 0.0 and lr_at("WarmupDecayLR", decay, 60) == 0.0
    cosine = {"total_num_steps": 50, "warmup_num_steps": 10, "cos_min_ratio": 0.1, "warmup_type": "linear"}
    assert lr_at("WarmupCosineLR", cosine, 9) == pytest.approx(0.5 * 0.9)
    assert lr_at("WarmupCosineLR", cosine, 29) == pytest.approx(0.5 * (0.1 + 0.9 * 0.5))  # cosine midpoint
    assert lr_at("WarmupCosineLR", cosine, 49) == pytest.approx(0.5 * 0.1)  # cos_min_ratio * lr at the end
    assert lr_at("WarmupCosineLR", cosine, 80) == pytest.approx(0.5 * 0.1)  # and held afterwards
    cycle = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 10, "cycle_momentum": False}
    assert lr_at("OneCycle", cycle, 9) == pytest.approx(0.1)  # peak after cycle_first_step_size steps
    assert lr_at("OneCycle", cycle, 4) == pytest.approx(0.01 + 0.09 * 0.5)
    assert lr_at("OneCycle", cycle, 19) == pytest.approx(0.01)
    assert lr_at("LRRangeTest", {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 10}, 9) == pytest.approx(0.02)


def test_one_cycle_cycles_beta1_inversely_and_sets_beta2_like_deepspeed():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    params = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 10, "cycle_min_mom": 0.85,
              "cycle_max_mom": 0.95, "decay_step_size": 5, "decay_mom_rate": 0.01}  # fmt: skip
    scheduler = build_scheduler("OneCycle", params, optimizer)
    assert optimizer.param_groups[0]["betas"] == (0.85, 0.99)  # DeepSpeed's pre-first-step value
    scheduler.step(9)
    assert optimizer.param_groups[0]["betas"] == pytest.approx((0.85, 0.99))  # lr peak = momentum trough
    scheduler.step(4)
    assert optimizer.param_groups[0]["betas"][0] == pytest.approx(0.95 - 0.1 * 0.5)
    scheduler.step(19)
    assert optimizer.param_groups[0]["betas"][0] == pytest.approx(0.95)
    scheduler.step(24)  # 5 steps into the decay phase: one decay interval
    assert optimizer.param_groups[0]["betas"][0] == pytest.approx(0.95 * 1.01)


def test_one_cycle_without_betas_warns_and_leaves_sgd_momentum_alone():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    with pytest.warns(UserWarning, match="cycle_momentum"):
        build_scheduler("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}, optimizer).step()
    assert optimizer.param_groups[0]["momentum"] == 0.9 and "betas" not in optimizer.param_groups[0]


def test_multiple_param_groups_behave_like_deepspeed():
    # WarmupCosineLR scales each group's own lr.
    optimizer = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2},
                                 {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.02}])  # fmt: skip
    scheduler = build_scheduler("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 4}, optimizer)
    assert scheduler.get_last_lr() == [0.0, 0.0]  # every group starts at 0
    for _ in range(7):
        scheduler.step()
    lrs = [group["lr"] for group in optimizer.param_groups]
    assert lrs[0] == pytest.approx(10 * lrs[1]) and lrs[0] > 0
    # WarmupLR: a scalar warmup_max_lr applies to all groups, a list gives one per group ...
    optimizer = _sgd(groups=2)
    scheduler = build_scheduler("WarmupLR", {"warmup_max_lr": [0.1, 0.3], "warmup_min_lr": 0.0, "warmup_num_steps": 2}, optimizer)
    scheduler.step(5)
    assert [group["lr"] for group in optimizer.param_groups] == [0.1, 0.3]
    # ... and without warmup_max_lr, the first group's lr is the target for all (DeepSpeed's rule).
    optimizer = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.4},
                                 {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.04}])  # fmt: skip
    build_scheduler("WarmupLR", {"warmup_num_steps": 2}, optimizer).step(5)
    assert [group["lr"] for group in optimizer.param_groups] == [0.4, 0.4]


@pytest.mark.parametrize("case", list(SCHEDULE_CASES))
def test_state_dict_round_trip_continues_the_same_sequence(case):
    sched_type, params, _ = SCHEDULE_CASES[case]
    optimizer = _sgd()
    scheduler = build_scheduler(sched_type, params, optimizer)
    _trace(scheduler, optimizer, 17)
    saved = scheduler.state_dict()
    uninterrupted = _trace(scheduler, optimizer, 20)

    fresh_optimizer = _sgd()
    resumed = build_scheduler(sched_type, params, fresh_optimizer)
    resumed.load_state_dict(saved)
    assert _trace(resumed, fresh_optimizer, 20) == uninterrupted


def test_cosine_resume_uses_checkpointed_base_lrs_even_if_optimizer_lr_was_overwritten():
    optimizer = _sgd(lr=0.5)
    scheduler = build_scheduler("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 5}, optimizer)
    _trace(scheduler, optimizer, 12)
    saved = scheduler.state_dict()
    expected = _trace(scheduler, optimizer, 5)
    restored_optimizer = _sgd(lr=0.123)  # e.g. optimizer state loaded before the schedule was built
    resumed = build_scheduler("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 5}, restored_optimizer)
    resumed.load_state_dict(saved)
    assert _trace(resumed, restored_optimizer, 5) == expected


@pytest.mark.parametrize(
    ("sched_type", "params", "path", "needle"),
    [
        ("WarmupCosine", {}, "scheduler.type", "Did you mean 'WarmupCosineLR'"),
        ("WarmupLR", {"warmup_num_step": 10}, "scheduler.params.warmup_num_step", "Did you mean 'warmup_num_steps'"),
        ("WarmupDecayLR", {}, "scheduler.params.total_num_steps", "missing"),
        ("OneCycle", {"cycle_min_lr": 0.1}, "scheduler.params.cycle_max_lr", "missing"),
        ("WarmupLR", {"warmup_type": "cosine"}, "scheduler.params.warmup_type", "log, linear"),
        ("WarmupLR", {"warmup_max_lr": [0.1, 0.2]}, "scheduler.params.warmup_max_lr", "1 param groups"),
        ("WarmupLR", {"warmup_num_steps": -3}, "scheduler.params.warmup_num_steps", "integer >= 0"),
        ("WarmupLR", {"warmup_max_lr": "auto"}, "scheduler.params.warmup_max_lr", "auto"),
        ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 10}, "scheduler.params.total_num_steps", "exceed"),
        ("LRRangeTest", {"lr_range_test_step_size": 0}, "scheduler.params.lr_range_test_step_size", ">= 1"),
    ],
)
def test_bad_scheduler_config_names_the_key(sched_type, params, path, needle):
    with pytest.raises(ConfigError) as info:
        build_scheduler(sched_type, params, _sgd())
    assert info.value.path == path
    assert needle in str(info.value)


def test_scheduler_names_are_case_insensitive_and_complete():
    assert set(SCHEDULER_NAMES) == {"LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"}
    assert type(build_scheduler("warmuplr", {}, _sgd())).__name__ == "WarmupLR"


def test_schedule_drives_a_built_optimizer_end_to_end():
    params = _params()
    optimizer = build_optimizer("Lamb", {"lr": 0.01}, params)
    scheduler = build_scheduler("WarmupDecayLR", {"total_num_steps": 10, "warmup_max_lr": 0.01, "warmup_num_steps": 3}, optimizer)
    for step in range(11):  # the 11th scheduler step reaches iteration 10 = total_num_steps
        _set_grads(params, step)
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.0 and all(torch.isfinite(p).all() for p in params)


# ----------------------------------------------------------------------------- LR scaling


def test_linear_lr_scaling():
    assert scale_lr_linear(1e-3, 256, 32) == pytest.approx(8e-3)
    optimizer = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1, "initial_lr": 0.1},
                                 {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.01}])  # fmt: skip
    assert apply_lr_scaling(optimizer, "linear", 64, 16) == 4.0
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.4) and optimizer.param_groups[0]["initial_lr"] == pytest.approx(0.4)
    assert optimizer.param_groups[1]["lr"] == pytest.approx(0.04) and "initial_lr" not in optimizer.param_groups[1]
    with pytest.raises(ConfigError, match="linear") as info:
        apply_lr_scaling(optimizer, "sqrt", 64, 16)
    assert info.value.path == "lr_scaling.rule"
    with pytest.raises(ConfigError, match="positive integer"):
        scale_lr_linear(1e-3, 0, 32)


def test_fused_kernel_is_the_default_unless_the_user_chooses() -> None:
    params = [torch.nn.Parameter(torch.randn(4))]
    assert build_optimizer("AdamW", {"lr": 0.1}, params).defaults["fused"] is True
    assert build_optimizer("SGD", {"lr": 0.1}, params).defaults["fused"] is True
    assert not build_optimizer("AdamW", {"lr": 0.1, "foreach": True}, params).defaults["fused"]
    assert not build_optimizer("AdamW", {"lr": 0.1, "fused": False}, params).defaults["fused"]
