"""Activation checkpointing: exact equality with the uncheckpointed run (dropout on), the DeepSpeed
global API, block selection, idempotent and reversible wrapping, host-memory inputs, hooks, caches,
and parity through the engine (ZeRO stages 0 and 3) on 2 ranks."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import zerotune
import zerotune.checkpointing as ds_checkpointing
from tests.harness import run_distributed
from tests.models import assert_close_traces, engine_run, gpt2_batch, make_gpt2, reference_run
from zerotune.config import ConfigError, NotSupportedYetError
from zerotune.parallel import activation_checkpointing as ac
from zerotune.parallel import block_checkpointing as blocks
from zerotune.parallel.activation_checkpointing import CheckpointPolicy
from zerotune.parallel.block_checkpointing import (
    apply_activation_checkpointing,
    checkpointed_module_names,
    remove_activation_checkpointing,
)


@pytest.fixture(autouse=True)
def _unconfigured(monkeypatch):
    """Each test starts without a configured global policy (and leaves none behind)."""
    monkeypatch.setattr(ac, "_configured_policy", None)


def _gpt2_with_dropout(n_layer: int = 2, seed: int = 0, n_embd: int = 32):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=2, vocab_size=96, n_positions=32, resid_pdrop=0.1,
                        embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).train()


def _batch() -> dict:
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 96, (3, 16), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, 12:] = 0  # padding: the attention mask reaches the blocks as a keyword-built mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def _loss_and_grads(model: nn.Module, seed: int = 123) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**_batch()).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _assert_identical(expected: tuple, actual: tuple) -> None:
    assert torch.equal(expected[0], actual[0]), (expected[0], actual[0])
    assert expected[1].keys() == actual[1].keys()
    for name, grad in expected[1].items():
        assert torch.allclose(actual[1][name], grad, rtol=0, atol=1e-6), name


@pytest.mark.parametrize("policy", [CheckpointPolicy(), CheckpointPolicy(number_checkpoints=1),
                                    CheckpointPolicy(cpu_checkpointing=True),
                                    CheckpointPolicy(synchronize_checkpoint_boundary=True, profile=True)],
                         ids=["all-blocks", "one-block", "cpu", "sync-profile"])
def test_losses_and_gradients_equal_the_uncheckpointed_run_with_dropout(policy: CheckpointPolicy) -> None:
    model = _gpt2_with_dropout()
    expected = _loss_and_grads(model)
    assert not torch.equal(expected[0], _loss_and_grads(model, seed=5)[0])  # dropout really is on
    names = apply_activation_checkpointing(model, policy)
    assert names == (["transformer.h.0"] if policy.number_checkpoints == 1 else ["transformer.h.0", "transformer.h.1"])
    _assert_identical(expected, _loss_and_grads(model))


def test_checkpointed_blocks_keep_only_their_inputs_for_backward() -> None:
    """Saved-tensor bytes fall: the blocks' internals are no longer held between forward and backward."""
    def saved_bytes(model: nn.Module) -> int:
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**_batch()).loss
        loss.backward()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return sum(n for ptr, n in storages.items() if ptr not in params)

    model = _gpt2_with_dropout(n_layer=4)
    plain = saved_bytes(model)
    apply_activation_checkpointing(model, CheckpointPolicy())
    assert saved_bytes(model) < 0.6 * plain


def test_cpu_checkpointing_packs_the_block_inputs_into_host_copies_and_unpacks_them_for_recompute(monkeypatch) -> None:
    packed, unpacked = [], []
    real_pack, real_unpack = ac._pack_to_host, ac._unpack_from_host

    def pack(t):
        result = real_pack(t)
        packed.append((t, result[1]))
        return result

    def unpack(p):
        unpacked.append(p)
        return real_unpack(p)
    monkeypatch.setattr(ac, "_pack_to_host", pack)
    monkeypatch.setattr(ac, "_unpack_from_host", unpack)
    model = _gpt2_with_dropout()
    expected = _loss_and_grads(model)
    apply_activation_checkpointing(model, CheckpointPolicy(cpu_checkpointing=True))
    _assert_identical(expected, _loss_and_grads(model))
    hidden = [(t, host) for t, host in packed if t.dim() == 3 and t.shape[-1] == 32]
    assert len(hidden) == 2  # each block's hidden states
    assert all(host.device.type == "cpu" and host.data_ptr() != t.data_ptr() for t, host in hidden)  # a real copy
    assert len(unpacked) == len(packed)  # every saved input came back for the recompute


def test_parameters_passed_as_inputs_are_not_copied_to_host() -> None:
    weight = nn.Parameter(torch.randn(4, 4))
    device, kept = ac._pack_to_host(weight)
    assert device is None and kept is weight and ac._unpack_from_host((device, kept)) is weight


def test_deepspeed_checkpoint_of_a_function_with_dropout_equals_the_plain_call() -> None:
    weight = nn.Parameter(torch.randn(8, 8))

    def block(x: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.nn.functional.dropout(torch.tanh(x @ weight) * scale, p=0.5, training=True)

    x = torch.randn(4, 8, requires_grad=True)
    results = []
    for run in (lambda: block(x, 2.0), lambda: ds_checkpointing.checkpoint(block, x, 2.0)):
        torch.manual_seed(9)
        out = run()
        out.pow(2).sum().backward()
        results.append((out.detach(), x.grad.clone(), weight.grad.clone()))
        x.grad = weight.grad = None
    for plain, checkpointed in zip(*results):
        assert torch.equal(plain, checkpointed)
    ds_checkpointing.configure(None, checkpoint_in_cpu=True)
    torch.manual_seed(9)
    assert torch.equal(ds_checkpointing.checkpoint(block, x, 2.0), results[0][0])
    with torch.no_grad():  # no autograd: a plain call
        torch.manual_seed(9)
        assert torch.equal(ds_checkpointing.checkpoint(block, x, 2.0), results[0][0])


def test_zerotune_checkpointing_reexports_the_deepspeed_api() -> None:
    for name in ("checkpoint", "configure", "is_configured", "reset", "non_reentrant_checkpoint"):
        assert callable(getattr(ds_checkpointing, name))


def test_configure_reads_the_section_and_keywords_override_it(tmp_path) -> None:
    assert not ds_checkpointing.is_configured()
    assert ds_checkpointing.configured_policy() == CheckpointPolicy()
    policy = ds_checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {
        "cpu_checkpointing": True, "number_checkpoints": 3, "profile": "auto"}})
    assert ds_checkpointing.is_configured()
    assert policy == CheckpointPolicy(cpu_checkpointing=True, number_checkpoints=3)
    assert ds_checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}},
                                      checkpoint_in_cpu=False, synchronize=True, num_checkpoints=2) == \
        CheckpointPolicy(synchronize_checkpoint_boundary=True, number_checkpoints=2)
    path = tmp_path / "ds.json"
    path.write_text('{"activation_checkpointing": {"synchronize_checkpoint_boundary": true}}')
    assert ds_checkpointing.configure(None, deepspeed_config=str(path)).synchronize_checkpoint_boundary
    ds_checkpointing.reset()  # Megatron calls it after evaluation: the policy stays
    assert ds_checkpointing.configured_policy().synchronize_checkpoint_boundary
    assert ds_checkpointing.configure() == CheckpointPolicy()  # a new configure starts from the defaults


def test_configured_policy_is_followed_by_blocks_wrapped_before_configure(monkeypatch) -> None:
    model = _gpt2_with_dropout()
    apply_activation_checkpointing(model)  # no explicit policy: each call reads the configured one
    calls = []
    monkeypatch.setattr(ac, "_inputs_to_host", lambda: (calls.append(1), torch.autograd.graph.saved_tensors_hooks(
        lambda t: t, lambda t: t))[1])
    _loss_and_grads(model)
    assert calls == []
    ds_checkpointing.configure(None, checkpoint_in_cpu=True)
    _loss_and_grads(model)
    assert len(calls) == 2


@pytest.mark.parametrize("build", [lambda: CheckpointPolicy(partition_activations=True),
                                   lambda: ds_checkpointing.configure(None, partition_activations=True),
                                   lambda: ds_checkpointing.configure(None, deepspeed_config={
                                       "activation_checkpointing": {"partition_activations": True}})])
def test_partition_activations_is_refused_with_a_clear_error(build) -> None:
    with pytest.raises(NotSupportedYetError, match=r"activation_checkpointing\.partition_activations: .*tensor "
                                                   r"parallelism, which is not supported yet"):
        build()
    assert not ds_checkpointing.is_configured()


def test_bad_policy_values_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.contiguous_memory_optimization: .*partition"):
        CheckpointPolicy(contiguous_memory_optimization=True)
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.number_checkpoints: 0 is not a positive"):
        CheckpointPolicy(number_checkpoints=0)
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.profile: 'yes' is not a boolean"):
        CheckpointPolicy(profile="yes")
    with pytest.raises(NotSupportedYetError, match="mpu"):
        ds_checkpointing.configure(object())
    with pytest.raises(TypeError, match="deepspeed_config"):
        ds_checkpointing.configure(None, deepspeed_config=42)


def test_contiguous_checkpointing_needs_partitioning_then_the_number_of_layers_as_deepspeed_asserts() -> None:
    with pytest.raises(ac.ContiguousCheckpointingError, match="needs partition_activations"):
        ds_checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=4)
    with pytest.raises(AssertionError, match="number of layers"):  # checked before partitioning is refused
        ds_checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True)
    assert not ds_checkpointing.is_configured()


def test_deepspeeds_module_globals_read_and_write_the_policy_in_force() -> None:
    cp = ds_checkpointing
    saved = (cp.PARTITION_ACTIVATIONS, cp.CONTIGUOUS_CHECKPOINTING, cp.num_layers, cp.CPU_CHECKPOINT, cp.SYNCHRONIZE,
             cp.PROFILE_TIME, cp.mpu, cp.deepspeed_checkpointing_enabled)
    assert saved == (False, False, None, False, False, False, None, False)
    (cp.PARTITION_ACTIVATIONS, cp.CONTIGUOUS_CHECKPOINTING, cp.num_layers, cp.CPU_CHECKPOINT, cp.SYNCHRONIZE,
     cp.PROFILE_TIME, cp.mpu, cp.deepspeed_checkpointing_enabled) = saved  # restoring what is in force: no-op
    assert not cp.is_configured()
    cp.configure(None, num_checkpoints=3, profile=True)
    assert (cp.num_layers, cp.PROFILE_TIME, cp.deepspeed_checkpointing_enabled) == (3, True, True)
    cp.CPU_CHECKPOINT = True  # one setting changes, the others stay
    assert cp.configured_policy() == CheckpointPolicy(cpu_checkpointing=True, number_checkpoints=3, profile=True)
    with pytest.raises(NotSupportedYetError, match="partition_activations"):
        cp.PARTITION_ACTIVATIONS = True
    with pytest.raises(NotSupportedYetError, match="mpu"):
        cp.mpu = object()
    with pytest.raises(AttributeError, match="follows configure"):
        cp.deepspeed_checkpointing_enabled = False


def test_non_reentrant_checkpoint_is_its_own_function_with_the_same_results() -> None:
    assert ds_checkpointing.non_reentrant_checkpoint is not ds_checkpointing.checkpoint
    x = torch.randn(3, 4, requires_grad=True)
    weight = torch.randn(4, 4, requires_grad=True)
    first = ds_checkpointing.checkpoint(lambda a: torch.tanh(a @ weight), x)
    second = ds_checkpointing.non_reentrant_checkpoint(lambda a: torch.tanh(a @ weight), x)
    assert torch.equal(first, second)
    (first.sum() + second.sum()).backward()
    assert x.grad is not None and weight.grad is not None


def test_number_checkpoints_spreads_the_blocks_evenly() -> None:
    model = _gpt2_with_dropout(n_layer=12, n_embd=8)
    assert apply_activation_checkpointing(model, CheckpointPolicy(number_checkpoints=4)) == \
        [f"transformer.h.{i}" for i in (0, 3, 6, 9)]
    assert apply_activation_checkpointing(model, CheckpointPolicy(number_checkpoints=5)) == \
        [f"transformer.h.{i}" for i in (0, 2, 4, 7, 9)]
    assert len(apply_activation_checkpointing(model, CheckpointPolicy(number_checkpoints=40))) == 12


def test_wrapping_is_idempotent_and_reversible() -> None:
    model = _gpt2_with_dropout()
    block = model.transformer.h[0]
    other_forward = block.forward  # an existing instance-level forward (as accelerate's hooks install) is kept
    model.transformer.h[1].forward = model.transformer.h[1].forward
    previous = model.transformer.h[1].forward
    first = apply_activation_checkpointing(model)
    wrapped_forward = block.forward
    assert apply_activation_checkpointing(model) == first == checkpointed_module_names(model)
    assert block.forward.__func__ is wrapped_forward.__func__ is blocks._checkpointed_forward
    assert block.__dict__[blocks._STATE].previous_forward is blocks._ABSENT  # the second apply did not wrap the wrapper
    expected = _loss_and_grads(model)
    assert remove_activation_checkpointing(model) == first
    assert "forward" not in block.__dict__ and block.forward.__func__ is other_forward.__func__
    assert model.transformer.h[1].forward is previous
    assert checkpointed_module_names(model) == [] and remove_activation_checkpointing(model) == []
    _assert_identical(expected, _loss_and_grads(model))


def test_explicit_modules_by_class_class_name_or_module_name() -> None:
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    model = _gpt2_with_dropout()
    assert apply_activation_checkpointing(model, modules=[GPT2MLP]) == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    assert apply_activation_checkpointing(model, modules=["GPT2Attention"]) == ["transformer.h.0.attn",
                                                                              "transformer.h.1.attn"]
    assert apply_activation_checkpointing(model, modules=["transformer.h.1", "GPT2MLP"]) == \
        ["transformer.h.0.mlp", "transformer.h.1"]  # the MLP inside h.1 is not checkpointed twice
    with pytest.raises(ValueError, match=r"modules=\['GPT2Blok'\] match no module of GPT2LMHeadModel"):
        apply_activation_checkpointing(model, modules=["GPT2Blok"])
    with pytest.raises(ValueError, match="has no _no_split_modules"):
        apply_activation_checkpointing(nn.Sequential(nn.Linear(2, 2)))
    mlp = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    assert apply_activation_checkpointing(mlp, modules=[nn.Linear]) == ["0", "2"]


def test_hf_gradient_checkpointing_already_on_is_refused() -> None:
    model = _gpt2_with_dropout()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    with pytest.raises(ValueError, match="activation_checkpointing_disable"):
        apply_activation_checkpointing(model)


def test_module_hooks_run_once_for_the_call_and_submodule_hooks_run_inside_backward_during_recompute() -> None:
    """The ZeRO-3 contract: a block's own hooks surround the real forward only; its recompute runs in backward."""
    model = _gpt2_with_dropout()
    events = []
    block = model.transformer.h[0]
    block.register_forward_pre_hook(lambda m, a: events.append(("block", torch._C._current_graph_task_id() != -1)))
    block.mlp.register_forward_pre_hook(lambda m, a: events.append(("mlp", torch._C._current_graph_task_id() != -1)))
    apply_activation_checkpointing(model)
    _loss_and_grads(model)
    assert events == [("block", False), ("mlp", False), ("mlp", True)]


def test_an_empty_cache_is_dropped_and_one_holding_a_prefix_runs_uncheckpointed(caplog) -> None:
    from transformers import DynamicCache

    model = _gpt2_with_dropout()
    ids = _batch()["input_ids"]

    def run(cache_factory):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        loss = model(input_ids=ids, labels=ids, cache=cache_factory(), use_cache=True).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    def prefix_cache():
        cache = DynamicCache(config=model.config)
        torch.manual_seed(4)
        for layer in range(2):
            cache.update(torch.randn(3, 2, 4, 16), torch.randn(3, 2, 4, 16), layer)
        return cache

    plain_empty, plain_prefix = run(lambda: DynamicCache(config=model.config)), run(prefix_cache)
    apply_activation_checkpointing(model)
    _assert_identical(plain_empty, run(lambda: DynamicCache(config=model.config)))
    logger = logging.getLogger("zerotune")
    logger.addHandler(caplog.handler)
    try:
        _assert_identical(plain_prefix, run(prefix_cache))
    finally:
        logger.removeHandler(caplog.handler)
    assert "past key/values" in caplog.text and "transformer.h.0" in caplog.text


def test_profile_logs_forward_and_recompute_time_per_region(caplog) -> None:
    model = _gpt2_with_dropout()
    apply_activation_checkpointing(model, CheckpointPolicy(profile=True))
    logger = logging.getLogger("zerotune")
    logger.addHandler(caplog.handler)
    try:
        _loss_and_grads(model)
    finally:
        logger.removeHandler(caplog.handler)
    for name in ("transformer.h.0", "transformer.h.1"):
        for phase in ("forward", "recompute"):
            assert f"activation checkpoint {name}: {phase} " in caplog.text


def test_policy_from_a_config_section() -> None:
    from zerotune.config import load_config

    section = load_config({"activation_checkpointing": {"cpu_checkpointing": True, "number_checkpoints": 2,
                                                        "synchronize_checkpoint_boundary": "auto"}}).activation_checkpointing
    assert ds_checkpointing.policy_from_section(section) == CheckpointPolicy(cpu_checkpointing=True, number_checkpoints=2)


# ---- through the engine, 2 ranks ------------------------------------------------------------
STEPS, GAS, CLIP = 4, 2, 0.5


def _engine_parity(stage: int, cpu: bool) -> dict:
    world = torch.distributed.get_world_size()
    reference_model = make_gpt2()
    reference = reference_run(reference_model, torch.optim.AdamW(reference_model.parameters(), lr=0.01, weight_decay=0.0),
                              gpt2_batch, steps=STEPS, gas=GAS, global_rows=2 * world, clip=CLIP)
    model = make_gpt2()
    wrapped = apply_activation_checkpointing(model, CheckpointPolicy(cpu_checkpointing=cpu))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}, "steps_per_print": 1000,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": 600}}
    engine, *_ = zerotune.initialize(model=model, config=config)
    trace = engine_run(engine, gpt2_batch, steps=STEPS, gas=GAS, global_rows=2 * world)
    still_wrapped = checkpointed_module_names(model)
    engine.destroy()
    return {"trace": trace, "reference": reference, "wrapped": wrapped, "still_wrapped": still_wrapped}


@pytest.mark.parametrize("stage,cpu", [(0, False), (3, False), (3, True)])
def test_engine_with_checkpointed_blocks_matches_single_process(stage: int, cpu: bool) -> None:
    result = run_distributed(_engine_parity, 2, stage, cpu, timeout=120)[0]
    assert result["wrapped"] == result["still_wrapped"] == ["transformer.h.0", "transformer.h.1"]
    assert_close_traces(result["trace"], result["reference"], rel=1e-5)


def _engine_config_parity() -> dict:
    """An activation_checkpointing block makes initialize wrap the HF blocks, following its settings."""
    world = torch.distributed.get_world_size()
    reference_model = make_gpt2()
    reference = reference_run(reference_model, torch.optim.AdamW(reference_model.parameters(), lr=0.01, weight_decay=0.0),
                              gpt2_batch, steps=STEPS, gas=GAS, global_rows=2 * world, clip=CLIP)
    model = make_gpt2()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}, "steps_per_print": 1000,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "activation_checkpointing": {"cpu_checkpointing": True}}
    engine, *_ = zerotune.initialize(model=model, config=config)
    try:
        trace = engine_run(engine, gpt2_batch, steps=STEPS, gas=GAS, global_rows=2 * world)
        return {"trace": trace, "reference": reference, "policy": ds_checkpointing.configured_policy(),
                "wrapped": checkpointed_module_names(model)}
    finally:
        engine.destroy()
        ac._configured_policy = None  # pool workers outlive the test


def test_engine_config_section_drives_checkpointing() -> None:
    result = run_distributed(_engine_config_parity, 2, timeout=120)[0]
    assert result["wrapped"] == ["transformer.h.0", "transformer.h.1"]
    assert result["policy"] == CheckpointPolicy(cpu_checkpointing=True)
    assert_close_traces(result["trace"], result["reference"], rel=1e-5)
