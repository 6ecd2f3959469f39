"""DeepSpeed's tensor-fragment API (``deepspeed.utils.safe_get_full_grad`` & co.) at ZeRO stages 0-3 on 2 ranks.

Against single-process PyTorch on the global batch (an MLP with a frozen layer and two param groups): the
full gradient after a boundary backward is the reference gradient; the full fp32 parameter and optimizer
state are the reference's after each step; setting a parameter, an optimizer state or a gradient between
phases changes the following steps exactly as doing the same to the plain PyTorch model and optimizer.
Local pieces concatenated over the ranks are the full tensors; frozen parameters give None; a parameter
no engine trains is an error naming it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerotune
from tests.harness import run_distributed
from tests.models import loss_of, make_mlp, mlp_batch, mlp_param_groups, rank_slice
from zerotune.compat import tensor_fragment as tf

GAS, ROWS = 2, 4
ADAMW = {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}


def _engine(stage: int, precision: str):
    config = {"train_micro_batch_size_per_gpu": ROWS // 2, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "AdamW", "params": ADAMW}, "steps_per_print": 1000,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 50, "allgather_bucket_size": 40}}
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    model = make_mlp()
    engine, *_ = zerotune.initialize(model=model, model_parameters=mlp_param_groups(model), config=config)
    return engine, model


def _reference():
    model = make_mlp()
    optimizer = torch.optim.AdamW(mlp_param_groups(model), lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]),
                                  eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"])
    return model, optimizer


def _micro_steps(engine, reference, step: int, after_backward=None) -> None:
    """One optimizer step of both: the engine on this rank's rows, the reference on the global batch;
    ``after_backward(micro)`` between each micro-step's backward and ``engine.step()``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for micro in range(GAS):
        batch = mlp_batch(step, micro, ROWS)
        engine.backward(loss_of(engine, rank_slice(batch, rank, world)))
        (loss_of(reference[0], batch) / GAS).backward()
        if after_backward is not None:
            after_backward(micro)
        engine.step()
    reference[1].step()
    reference[1].zero_grad(set_to_none=True)


def _gathered_pieces(local: torch.Tensor) -> torch.Tensor:
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, local.cpu())
    return torch.cat(pieces)


def _piece_start(engine, local: torch.Tensor) -> int:
    """Where this rank's piece starts in the flattened parameter (stage 0: every piece is whole)."""
    if engine.zero_optimization_stage() == 0:
        return 0
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, local.numel())
    return sum(sizes[:dist.get_rank()])


def _check_state(engine, reference, *, rel: float, grads: bool) -> None:
    """Full getters equal the reference; local pieces concatenate to them (stage 0: each is whole)."""
    model, optimizer = reference
    stage = engine.zero_optimization_stage()
    for (name, param), ref in zip(engine.module.named_parameters(), model.parameters()):
        if not param.requires_grad:
            assert tf.safe_get_full_fp32_param(param) is None and tf.safe_get_full_grad(param) is None, name
            assert tf.safe_get_local_fp32_param(param) is None and tf.safe_get_local_grad(param) is None, name
            assert tf.safe_get_full_optimizer_state(param, "exp_avg") is None, name
            tf.safe_set_full_fp32_param(param, torch.zeros_like(ref))  # nothing happens, as DeepSpeed's
            continue
        values = {"fp32": (tf.safe_get_full_fp32_param(param), tf.safe_get_local_fp32_param(param), ref.detach())}
        if grads:
            values["grad"] = (tf.safe_get_full_grad(param), tf.safe_get_local_grad(param), ref.grad)
        if optimizer.state.get(ref):
            for key in ("exp_avg", "exp_avg_sq"):
                values[key] = (tf.safe_get_full_optimizer_state(param, key),
                               tf.safe_get_local_optimizer_state(param, key), optimizer.state[ref][key])
        for what, (full, local, expected) in values.items():
            assert full.dtype == torch.float32 and full.shape == ref.shape, (name, what)
            torch.testing.assert_close(full, expected, rtol=rel, atol=rel * 1e-2, msg=f"{name} {what}")
            joined = local if stage == 0 else _gathered_pieces(local)
            assert torch.equal(joined, full.reshape(-1)), (name, what)
            if stage == 3:
                assert local.numel() == param.ds_tensor.numel(), name


def _check_local_grads(engine, weights_from: torch.nn.Module, step: int, micro: int) -> None:
    """Before the boundary, stages 0 and 1 hold each rank's own (unreduced) accumulation."""
    model = make_mlp()
    model.load_state_dict(weights_from.state_dict())
    rank, world = dist.get_rank(), dist.get_world_size()
    (loss_of(model, rank_slice(mlp_batch(step, micro, ROWS), rank, world)) / GAS).backward()
    for (name, param), ref in zip(engine.module.named_parameters(), model.parameters()):
        if param.requires_grad:
            torch.testing.assert_close(tf.safe_get_full_grad(param), ref.grad, rtol=1e-5, atol=1e-7, msg=name)


def _parity(stage: int) -> None:
    engine, _ = _engine(stage, "fp32")
    reference = _reference()
    model, optimizer = reference
    _check_state(engine, reference, rel=0.0, grads=False)  # the initial weights, exactly

    # step 1: the gradients after each backward (before the boundary: stages 2-3 the mean so far, 0-1 the own)
    def check_grads(micro: int) -> None:
        if micro < GAS - 1 and stage < 2:
            _check_local_grads(engine, make_mlp(), 0, micro)
        else:
            _check_state(engine, reference, rel=1e-5, grads=True)
    _micro_steps(engine, reference, 0, check_grads)
    _check_state(engine, reference, rel=1e-5, grads=False)

    # between steps: a new weight (full), a new exp_avg (full) and a new exp_avg_sq (local pieces)
    named = dict(engine.module.named_parameters())
    ref_named = dict(model.named_parameters())
    new_weight = torch.linspace(-1, 1, ref_named["inp.weight"].numel()).view(ref_named["inp.weight"].shape)
    tf.safe_set_full_fp32_param(named["inp.weight"], new_weight)
    ref_named["inp.weight"].data.copy_(new_weight)
    new_avg = torch.full_like(ref_named["out.weight"], 0.01)
    tf.safe_set_full_optimizer_state(named["out.weight"], new_avg, "exp_avg")
    optimizer.state[ref_named["out.weight"]]["exp_avg"].copy_(new_avg)
    new_sq = torch.linspace(0, 1e-3, ref_named["out.bias"].numel())
    local = tf.safe_get_local_optimizer_state(named["out.bias"], "exp_avg_sq")
    start = _piece_start(engine, local)
    tf.safe_set_local_optimizer_state(named["out.bias"], new_sq[start:start + local.numel()], "exp_avg_sq")
    optimizer.state[ref_named["out.bias"]]["exp_avg_sq"].copy_(new_sq)
    _check_state(engine, reference, rel=1e-5, grads=False)

    # step 2 from there; before its optimizer step, a new gradient (full) and new gradient pieces (local)
    def set_grads(micro: int) -> None:
        if micro < GAS - 1:
            return
        grad = torch.linspace(-0.1, 0.1, ref_named["inp.bias"].numel())
        tf.safe_set_full_grad(named["inp.bias"], grad)
        ref_named["inp.bias"].grad.copy_(grad)
        piece = tf.safe_get_local_grad(named["out.weight"])
        tf.safe_set_local_grad(named["out.weight"], torch.full_like(piece, 0.05))  # the pieces cover it
        ref_named["out.weight"].grad.fill_(0.05)
        _check_state(engine, reference, rel=1e-5, grads=True)
    _micro_steps(engine, reference, 1, set_grads)
    _check_state(engine, reference, rel=1e-5, grads=False)
    _micro_steps(engine, reference, 2)
    _check_state(engine, reference, rel=1e-5, grads=False)
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fragments_match_single_process_pytorch(stage: int) -> None:
    run_distributed(_parity, 2, stage, timeout=120)


def _plain_adamw_step(master: torch.Tensor, grad: torch.Tensor, group: dict, state: dict | None) -> torch.Tensor:
    """What a plain torch AdamW makes of one parameter with this gradient and optimizer state."""
    param = torch.nn.Parameter(master.clone())
    optimizer = torch.optim.AdamW([param], lr=group["lr"], betas=tuple(ADAMW["betas"]), eps=ADAMW["eps"],
                                  weight_decay=group["weight_decay"])
    if state is not None:
        optimizer.state[param] = {key: value.clone() for key, value in state.items()}
    param.grad = grad.clone()
    optimizer.step()
    return param.detach()


def _bf16(stage: int) -> None:
    engine, _ = _engine(stage, "bf16")
    model, optimizer = reference = _reference()
    named = dict(engine.module.named_parameters())
    groups = {name: group for group in mlp_param_groups(model) for name, p in model.named_parameters()
              if any(p is q for q in group["params"])}
    for (name, param), ref in zip(named.items(), model.parameters()):  # masters: the weights before the cast
        if param.requires_grad:
            assert torch.equal(tf.safe_get_full_fp32_param(param), ref.detach()), name

    # after the boundary backward: the gradients the step uses (bf16 arithmetic: near the fp32 reference);
    # each master then moves exactly as a plain AdamW moves it with that gradient and state
    seen: dict[str, tuple] = {}

    def snapshot(micro: int) -> None:
        if micro < GAS - 1:
            return
        for (name, param), ref in zip(named.items(), model.parameters()):
            if not param.requires_grad:
                continue
            grad = tf.safe_get_full_grad(param)
            assert (grad - ref.grad).norm() <= 0.03 * ref.grad.norm(), name
            state = None
            if optimizer.state.get(ref):
                state = {key: tf.safe_get_full_optimizer_state(param, key) for key in ("exp_avg", "exp_avg_sq")}
                state["step"] = optimizer.state[ref]["step"].clone()
            seen[name] = (tf.safe_get_full_fp32_param(param), grad, state)

    for step in range(2):
        _micro_steps(engine, reference, step, snapshot)
        for name, (master, grad, state) in seen.items():
            expected = _plain_adamw_step(master, grad, groups[name], state)
            torch.testing.assert_close(tf.safe_get_full_fp32_param(named[name]), expected, rtol=1e-6, atol=1e-8,
                                       msg=name)
        # a new fp32 weight: the master keeps every bit, the model its bf16 rounding; a new exp_avg
        value = torch.linspace(-1, 1, named["inp.weight"].numel()).view(named["inp.weight"].shape) / 3
        tf.safe_set_full_fp32_param(named["inp.weight"], value)
        assert torch.equal(tf.safe_get_full_fp32_param(named["inp.weight"]), value)
        with zerotune.zero.GatheredParameters(named["inp.weight"]):
            assert torch.equal(named["inp.weight"].detach(), value.to(torch.bfloat16))
        model.inp.weight.data.copy_(value)
        tf.safe_set_full_optimizer_state(named["out.weight"], torch.full((4, 16), 0.01), "exp_avg")
        optimizer.state[model.out.weight]["exp_avg"].fill_(0.01)

    # clear errors, on every rank alike (none is left waiting in a collective)
    stray = torch.nn.Parameter(torch.zeros(3, 5))
    with pytest.raises(ValueError, match=r"shape \(3, 5\).*no engine trains"):
        tf.safe_get_full_grad(stray)
    with pytest.raises(ValueError, match="'momentum_buffer'|another rank"):
        tf.safe_get_full_optimizer_state(named["inp.bias"], "momentum_buffer")
    with pytest.raises(ValueError, match="has 3 elements"):
        tf.safe_set_full_fp32_param(named["out.weight"], torch.zeros(3))
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_masters_gradients_and_optimizer_state(stage: int) -> None:
    run_distributed(_bf16, 2, stage, timeout=120)
