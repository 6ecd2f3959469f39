"""DeepSpeed's ZeRO-3 parameter markers and hook handle, as the tools built on DeepSpeed use them, on 2 ranks.

* the ``ds_*`` attributes (``zero/stage3/ds_markers.py``) are true in every state: sharded, in flight,
  gathered by ``GatheredParameters``, in use by a running forward, after optimizer steps, swapped out,
  moved by ``engine.offload_states``; peft counts the whole model from them;
* TRL's generation detour (trl/models/utils.py ``unwrap_model_for_generation`` with ``remove_hooks`` /
  ``add_hooks``, reproduced below) through ``engine.optimizer.parameter_offload`` generates what
  single-process PyTorch generates and leaves training on single-process PyTorch's numbers;
* TRL's reference model (``prepare_deepspeed``: a second stage-3 engine from the policy's config with
  TRL's dotted keys, no optimizer, ``eval()``) runs forward-only beside the training engine, and the
  policy trained against it matches single-process PyTorch.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist

import zerotune
from tests.harness import run_distributed
from tests.models import Trace, assert_close_traces, gpt2_batch, loss_of, make_gpt2, make_mlp, mlp_batch, rank_slice
from zerotune.compat.zero import ZeroParamStatus
from zerotune.zero import GatheredParameters

AVAILABLE, NOT_AVAILABLE, INFLIGHT = ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE, ZeroParamStatus.INFLIGHT
ADAMW = {"lr": 0.01, "weight_decay": 0.0}


def _config(**zero: object) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": ADAMW},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
                                  **zero}}


def _statuses(model: torch.nn.Module) -> set:
    return {p.ds_status for p in model.parameters()}


def _pieces_joined(param: torch.nn.Parameter) -> torch.Tensor:
    """Every rank's ``ds_tensor``, concatenated in rank order."""
    pieces: list = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, param.ds_tensor.detach().clone())
    return torch.cat(pieces)


def _markers_through_the_states() -> dict:
    rank = dist.get_rank()
    initial = {name: p.detach().clone() for name, p in make_mlp().named_parameters()}
    model = make_mlp()
    engine, *_ = zerotune.initialize(model=model, config=_config())
    params = dict(model.named_parameters())
    facts = {
        "marked": all(hasattr(p, "ds_id") for p in params.values()),  # transformers' test for "partitioned"
        "ids_unique": len({p.ds_id for p in params.values()}) == len(params),
        "sizes": all(p.ds_numel == initial[n].numel() and tuple(p.ds_shape) == initial[n].shape
                     for n, p in params.items()),
        "sharded": _statuses(model) == {NOT_AVAILABLE},
        "idle": all(p.ds_active_sub_modules == set() and p.ds_persist is False for p in params.values()),
        "pieces_sized": all(p.ds_tensor.dim() == 1
                            and p.ds_tensor.numel() == p.ds_tensor.ds_numel == p.partition_numel()
                            for p in params.values()),
        "pieces_join": all(torch.equal(_pieces_joined(p), initial[n].reshape(-1)) for n, p in params.items()),
    }
    unit = next(u for u in engine.state.units if u.module is model.out)  # launched, not waited for: in flight
    unit.start_gather()
    facts["inflight"] = {p.ds_status for p in model.out.parameters()} == {INFLIGHT}
    unit.finish_gather()
    facts["gathered"] = {p.ds_status for p in model.out.parameters()} == {AVAILABLE}
    unit.release()
    seen: dict = {}

    def record(module: torch.nn.Module, args: tuple) -> None:  # runs after zerotune's pre-hook
        seen["out"] = {p.ds_status for p in module.parameters()}
        seen["users"] = [set(p.ds_active_sub_modules) for p in module.parameters()]
        seen["inp"] = {p.ds_status for p in model.inp.parameters()}

    handle = model.out.register_forward_pre_hook(record)
    batch = rank_slice(mlp_batch(0, 0, 4), rank, 2)
    engine.backward(loss_of(engine, batch))
    engine.step()
    handle.remove()
    facts["in_forward"] = seen["out"] == {AVAILABLE} and all(users == {id(model.out)} for users in seen["users"])
    facts["passed_released"] = seen["inp"] == {NOT_AVAILABLE}
    facts["after_step"] = _statuses(model) == {NOT_AVAILABLE} and all(not p.ds_active_sub_modules
                                                                       for p in params.values())
    with GatheredParameters(list(params.values())):
        facts["in_gathered"] = _statuses(model) == {AVAILABLE}
        trained = {n: p.detach().clone() for n, p in params.items()}
    facts["pieces_follow_the_step"] = all(torch.equal(_pieces_joined(p), trained[n].reshape(-1))
                                          for n, p in params.items())
    with GatheredParameters([model.inp.weight], modifier_rank=0):
        model.inp.weight.data.fill_(0.5)
    facts["pieces_follow_a_modification"] = bool((model.inp.weight.ds_tensor == 0.5).all())
    facts["released"] = _statuses(model) == {NOT_AVAILABLE}
    engine.destroy()
    return facts


def test_markers_are_true_in_every_state() -> None:
    for facts in run_distributed(_markers_through_the_states, 2, timeout=120):
        assert all(facts.values()), [name for name, ok in facts.items() if not ok]


def _swapped_and_persistent(path: str) -> dict:
    offload = {"offload_param": {"device": "nvme", "nvme_path": path, "buffer_count": 4, "buffer_size": 4096}}
    model = make_mlp()
    engine, *_ = zerotune.initialize(model=model, config=_config(**offload))
    pieces = {n: p.ds_tensor.ds_numel for n, p in model.named_parameters()}
    segment = next(u for u in engine.state.units if u.module is model.inp).trainable
    swapped = all(p.ds_tensor.numel() == 0 for p in model.inp.parameters())
    segment.make_resident()
    resident = [p.ds_tensor.numel() == p.ds_tensor.ds_numel for p in model.inp.parameters()]
    segment.store_local()
    engine.destroy()
    persistent_model = make_mlp()
    persistent, *_ = zerotune.initialize(model=persistent_model,
                                         config=_config(stage3_param_persistence_threshold=10**6))
    kept = all(p.ds_persist is True for p in persistent_model.parameters())
    persistent.destroy()
    return {"pieces": sum(pieces.values()), "swapped": swapped, "resident": all(resident),
            "persist": kept}


def test_a_swapped_shard_shows_an_empty_piece_and_persistent_units_say_so(tmp_path) -> None:
    results = run_distributed(_swapped_and_persistent, 2, str(tmp_path), timeout=120)
    assert sum(r["pieces"] for r in results) == sum(p.numel() for p in make_mlp().parameters())
    assert all(r["swapped"] and r["resident"] and r["persist"] for r in results), results


def _pieces_across_offload_states() -> dict:
    model = make_mlp()
    engine, *_ = zerotune.initialize(model=model, config=_config())
    before = [p.ds_tensor.clone() for p in model.parameters()]
    engine.offload_states(include=["lp_params"])  # the shards' storage is freed; the pieces point at the host copy
    during = all(torch.equal(p.ds_tensor, b) for p, b in zip(model.parameters(), before))
    engine.reload_states()
    after = all(torch.equal(p.ds_tensor, b) for p, b in zip(model.parameters(), before))
    engine.backward(loss_of(engine, rank_slice(mlp_batch(0, 0, 4), dist.get_rank(), 2)))
    engine.step()
    with GatheredParameters(list(model.parameters())):
        trained = [p.detach().clone() for p in model.parameters()]
    followed = all(torch.equal(_pieces_joined(p), t.reshape(-1)) for p, t in zip(model.parameters(), trained))
    engine.destroy()
    return {"during": during, "after": after, "followed": followed}


def test_pieces_stay_true_across_offload_states() -> None:
    for facts in run_distributed(_pieces_across_offload_states, 2, timeout=120):
        assert all(facts.values()), facts


# ---- TRL: unwrap_model_for_generation (trl/models/utils.py:52-102, 139-147), verbatim but for the lookup of
# optimizer_offload, which TRL writes out in both remove_hooks and add_hooks -----------------------------------------
def _optimizer_offload(model):
    if model.optimizer is not None and hasattr(model.optimizer, "parameter_offload"):
        return model.optimizer.parameter_offload
    if model.optimizer is not None:
        return model.optimizer
    raise RuntimeError("The model optimizer is None, which is not yet supported.")


def _remove_hooks(model) -> None:
    if not hasattr(model, "optimizer"):
        return
    optimizer_offload = _optimizer_offload(model)
    for param in _iter_params(optimizer_offload.module, recurse=True):
        param.ds_active_sub_modules.clear()
    for hook in optimizer_offload.forward_hooks:
        hook.remove()
    for hook in optimizer_offload.backward_hooks:
        hook.remove()
    optimizer_offload.forward_hooks = []
    optimizer_offload.backward_hooks = []


def _iter_params(module, recurse=False):
    return [param for _, param in itertools.chain(module.named_parameters(recurse=recurse),
                                                  module.ds_external_parameters())]


def _add_hooks(model) -> None:
    if not hasattr(model, "optimizer"):
        return
    optimizer_offload = _optimizer_offload(model)
    if hasattr(optimizer_offload, "param_coordinator"):
        coordinator = optimizer_offload.param_coordinator
        if not coordinator.is_invalid_trace():
            coordinator._invalidate_trace()
    optimizer_offload._register_deepspeed_module(optimizer_offload.module)


STEPS, DETOUR_AT, ROWS = 4, 2, 4
PROMPT = torch.tensor([[3, 17, 42, 5], [8, 8, 61, 2]])


def _hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _generate(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        logits = model(input_ids=PROMPT).logits
        tokens = model.generate(PROMPT, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return logits, tokens


def _train(model, step_fn, steps: range, rows: int) -> list[float]:
    return [step_fn(model, gpt2_batch(step, 0, rows)) for step in steps]


def _reference_step(optimizer: torch.optim.Optimizer):
    def step(model, batch):
        loss = loss_of(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return step


def _engine_step(model, batch) -> float:
    loss = loss_of(model, rank_slice(batch, dist.get_rank(), dist.get_world_size()))
    model.backward(loss)
    model.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _reference_with_generation() -> tuple[list[float], torch.Tensor, torch.Tensor]:
    """Single-process PyTorch: the losses of STEPS steps, and what it generates after DETOUR_AT of them."""
    reference = make_gpt2()
    step = _reference_step(torch.optim.AdamW(reference.parameters(), **ADAMW))
    want = _train(reference, step, range(DETOUR_AT), ROWS)
    want_logits, want_tokens = _generate(reference)
    want += _train(reference, step, range(DETOUR_AT, STEPS), ROWS)
    return want, want_logits, want_tokens


def _generation_detour() -> dict:
    want, want_logits, want_tokens = _reference_with_generation()
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=_config(stage3_prefetch_bucket_size=10**6))
    got = _train(engine, _engine_step, range(DETOUR_AT), ROWS)
    hooks = _hook_count(engine.module)
    with GatheredParameters(engine.module.parameters()):
        _remove_hooks(engine)
        unhooked = _hook_count(engine.module)
        logits, tokens = _generate(engine.module)
        available = _statuses(engine.module) == {AVAILABLE}
        _add_hooks(engine)
        _add_hooks(engine)  # twice: still one set
    rehooked = _hook_count(engine.module)
    got += _train(engine, _engine_step, range(DETOUR_AT, STEPS), ROWS)
    engine.destroy()
    return {"got": got, "want": want, "logits": torch.allclose(logits, want_logits, rtol=1e-5, atol=1e-6),
            "tokens": torch.equal(tokens, want_tokens), "hooks": (hooks, unhooked, rehooked), "available": available}


def test_trl_generation_detour_matches_single_process_and_training_continues() -> None:
    for result in run_distributed(_generation_detour, 2, timeout=180):
        assert result["logits"] and result["tokens"] and result["available"]
        hooks, unhooked, rehooked = result["hooks"]
        assert hooks > 0 and unhooked == 0 and rehooked == hooks
        assert_close_traces(Trace(result["got"], [0.0] * STEPS), Trace(result["want"], [0.0] * STEPS), rel=1e-5)


def test_parameter_offload_names_a_wrong_module_and_refuses_foreign_hooks() -> None:
    from zerotune.compat.parameter_offload import DeepSpeedZeRoOffload

    class _Scheduler:
        forward_hooks: list = []

        def attach_forward_hooks(self) -> None: ...

        def detach_forward_hooks(self) -> None: ...

    offload = DeepSpeedZeRoOffload(torch.nn.Linear(2, 2), _Scheduler())
    with pytest.raises(ValueError, match="pass the engine's module .*Linear.*not a ReLU"):
        offload._register_deepspeed_module(torch.nn.ReLU())
    with pytest.raises(ValueError, match="forward_hooks can only be cleared"):
        offload.forward_hooks = ["a handle"]
    offload.forward_hooks = []
    assert offload.backward_hooks == [] and list(offload.module.ds_external_parameters()) == []


# ---- TRL: prepare_deepspeed (trl/models/utils.py:246-289) for the reference model --------------------------------
def _trl_reference_config(policy_config: dict, model: torch.nn.Module) -> dict:
    """What TRL's prepare_deepspeed passes to deepspeed.initialize for a reference model at stage 3."""
    config_kwargs = copy.deepcopy(policy_config)
    hidden_size = model.config.hidden_size
    config_kwargs.update({"zero_optimization.reduce_bucket_size": hidden_size * hidden_size,
                          "zero_optimization.stage3_param_persistence_threshold": 10 * hidden_size,
                          "zero_optimization.stage3_prefetch_bucket_size": 0.9 * hidden_size * hidden_size})
    config_kwargs.pop("optimizer", None)
    config_kwargs.pop("scheduler", None)
    config_kwargs["zero_optimization"].pop("offload_optimizer", None)
    return config_kwargs


def _anchored_loss(policy: torch.nn.Module, reference: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The policy's LM loss plus a pull towards the frozen reference's logits (DPO-like: both forwards per step)."""
    with torch.no_grad():
        anchor = reference(input_ids=batch["input_ids"]).logits
    out = policy(**batch)
    return out.loss + 0.1 * (out.logits - anchor).pow(2).mean()


def _policy_and_reference_engines() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    policy_model, reference_model = make_gpt2(), make_gpt2(seed=1)
    optimizer = torch.optim.AdamW(policy_model.parameters(), **ADAMW)
    reference_model.eval()
    want = []
    for step in range(3):
        loss = _anchored_loss(policy_model, reference_model, gpt2_batch(step, 0, ROWS))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        want.append(loss.item())
    policy_config = _config()
    del policy_config["zero_optimization"]["stage3_prefetch_bucket_size"]  # (TRL's 0.9 * hidden**2 then applies)
    policy, *_ = zerotune.initialize(model=make_gpt2(), config=policy_config)
    ref_model = make_gpt2(seed=1)
    ref_config = _trl_reference_config(policy_config, ref_model)
    ref, ref_optimizer, *_ = zerotune.initialize(model=ref_model, config=ref_config)
    ref.eval()
    got = []
    for step in range(3):
        loss = _anchored_loss(policy, ref, rank_slice(gpt2_batch(step, 0, ROWS), rank, world))
        policy.backward(loss)
        policy.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        got.append(total.item() / world)
    zero = ref._config.zero_optimization
    facts = {"no_optimizer": ref_optimizer is None and ref.optimizer is None,
             "dotted_keys": (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size,  # 921.6 rounded down;
                             zero.stage3_param_persistence_threshold) == (32 * 32, 921, 0),  # the block's 0 wins
             "ref_sharded": _statuses(ref.module) == {NOT_AVAILABLE},
             "ref_unchanged": True}
    fresh = make_gpt2(seed=1)
    with GatheredParameters(ref.module.parameters()):
        facts["ref_unchanged"] = all(torch.equal(a, b) for a, b in zip(ref.module.parameters(), fresh.parameters()))
    policy.destroy()
    ref.destroy()
    return {"got": got, "want": want, **facts}


def test_trl_reference_model_beside_the_policy_matches_single_process() -> None:
    for result in run_distributed(_policy_and_reference_engines, 2, timeout=180):
        assert result["no_optimizer"] and result["dotted_keys"] and result["ref_sharded"] and result["ref_unchanged"]
        assert_close_traces(Trace(result["got"], [0.0] * 3), Trace(result["want"], [0.0] * 3), rel=1e-5)


def _peft_count() -> tuple[tuple[int, int], tuple[int, int]]:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], lora_dropout=0.0)
    before = get_peft_model(make_gpt2(), config).get_nb_trainable_parameters()
    model = get_peft_model(make_gpt2(), config)
    engine, *_ = zerotune.initialize(model=model, config=_config())
    after = model.get_nb_trainable_parameters()
    counted = (sum(p.ds_numel for p in model.parameters() if p.requires_grad),
               sum(p.ds_numel for p in model.parameters()))
    engine.destroy()
    return before, after, counted


def test_peft_counts_the_whole_model_at_stage3() -> None:
    for before, after, counted in run_distributed(_peft_count, 2, timeout=120):
        assert before == after == counted


def _unwrap_detour() -> dict:
    """The same detour through DeepSpeed's own ``deepspeed.runtime.zero.unwrap_model_for_generation``."""
    from zerotune.compat.zero import unwrap_model_for_generation

    want, want_logits, want_tokens = _reference_with_generation()
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=_config(stage3_prefetch_bucket_size=10**6))
    got = _train(engine, _engine_step, range(DETOUR_AT), ROWS)
    hooks = _hook_count(engine.module)
    offload = engine.optimizer.parameter_offload
    listed = len(offload.forward_hooks)
    with unwrap_model_for_generation(engine) as unwrapped:
        unhooked = _hook_count(engine.module)
        listed_inside = len(offload.forward_hooks)  # DeepSpeed's own test counts this list
        available = _statuses(engine.module) == {AVAILABLE}
        logits, tokens = _generate(unwrapped.module)
    rehooked = _hook_count(engine.module)
    listed_after = len(offload.forward_hooks)
    got += _train(engine, _engine_step, range(DETOUR_AT, STEPS), ROWS)
    engine.destroy()
    return {"got": got, "want": want, "logits": torch.allclose(logits, want_logits, rtol=1e-5, atol=1e-6),
            "tokens": torch.equal(tokens, want_tokens), "hooks": (hooks, unhooked, rehooked), "available": available,
            "same": unwrapped is engine, "listed": (listed, listed_inside, listed_after)}


def test_deepspeed_unwrap_model_for_generation_matches_single_process_and_training_continues() -> None:
    for result in run_distributed(_unwrap_detour, 2, timeout=180):
        assert result["logits"] and result["tokens"] and result["available"] and result["same"]
        listed, listed_inside, listed_after = result["listed"]
        assert listed > 0 and listed_inside == 0 and listed_after == listed
        hooks, unhooked, rehooked = result["hooks"]
        assert hooks > 0 and unhooked == 0 and rehooked == hooks
        assert_close_traces(Trace(result["got"], [0.0] * STEPS), Trace(result["want"], [0.0] * STEPS), rel=1e-5)


def _zero_optimizer_members(stage: int) -> dict:
    from zerotune.compat.stage3 import DeepSpeedZeroOptimizer_Stage3
    from zerotune.compat.stage_1_and_2 import DeepSpeedZeroOptimizer
    from zerotune.compat.utils import safe_get_local_grad, safe_set_local_grad

    rank = dist.get_rank()
    model = make_mlp()
    config = {**_config(), "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, optimizer, _, _ = zerotune.initialize(model=model, model_parameters=model.parameters(), config=config)
    out = {"is_stage3": isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3),
           "is_stage12": isinstance(optimizer, DeepSpeedZeroOptimizer)}
    engine.backward(loss_of(engine, rank_slice(mlp_batch(0, 0, 4), rank, 2)))
    if stage == 3:
        out["norm"] = torch.linalg.vector_norm(torch.stack(optimizer._get_norm_groups())).item()
        for param in engine.module.parameters():  # DeepSpeed's test_zero_grad_clip: custom clipping of the pieces
            piece = safe_get_local_grad(param)
            if piece is not None:
                safe_set_local_grad(param, torch.clamp(piece, -0.01, 0.01))
        out["clipped"] = torch.linalg.vector_norm(torch.stack(optimizer._get_norm_groups())).item()
    engine.step()
    out["global_grad_norm"] = (optimizer._global_grad_norm, engine.get_global_grad_norm())
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_the_returned_optimizer_answers_as_deepspeeds_zero_optimizer(stage: int) -> None:
    model = make_mlp()
    loss_of(model, mlp_batch(0, 0, 4)).backward()  # the 2-rank mean of the two halves: the whole batch's mean
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()
                                                     if p.grad is not None])).item()
    for out in run_distributed(_zero_optimizer_members, 2, stage):
        assert (out["is_stage3"], out["is_stage12"]) == (stage == 3, stage != 3)
        saved, engine_norm = out["global_grad_norm"]
        assert saved == engine_norm
        if stage == 3:
            assert out["norm"] == pytest.approx(expected, rel=1e-5)
            assert out["clipped"] < out["norm"] and saved == pytest.approx(out["clipped"], rel=1e-5)
