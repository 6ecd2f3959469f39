"""The DeepSpeed names and config habits that tools built on DeepSpeed hit (issue 28, item 3): dotted
top-level keys (TRL's reference-model setup), ``deepspeed.utils.logging`` (Lightning), ``from deepspeed
import get_accelerator`` (DeepSpeed-Chat), and an ``activation_checkpointing`` block on a model that
declares no blocks (Lightning writes one for every model)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import zerotune
from tests.harness import run_distributed
from tests.models import make_gpt2, make_mlp, mlp_batch
from zerotune.config import ConfigError, load_config
from zerotune.parallel import activation_checkpointing as ac
from zerotune.parallel.block_checkpointing import (
    checkpoint_blocks_at_initialize,
    checkpointed_module_names,
    remove_activation_checkpointing,
)


def test_dotted_top_level_keys_go_into_their_sections() -> None:
    # what TRL's prepare_deepspeed adds beside the zero_optimization block for its reference model
    config = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3},
                          "zero_optimization.reduce_bucket_size": 4096,
                          "zero_optimization.stage3_param_persistence_threshold": 640,
                          "zero_optimization.stage3_prefetch_bucket_size": 3686})
    zero = config.zero_optimization
    assert (zero.stage, zero.reduce_bucket_size, zero.stage3_param_persistence_threshold) == (3, 4096, 640)
    assert zero.stage3_prefetch_bucket_size == 3686
    # no block beside them: the dotted keys make it; equal values in both places are one value
    assert load_config({"bf16.enabled": True}).bf16.enabled is True
    assert load_config({"fp16": {"enabled": False}, "fp16.enabled": False}).fp16.enabled is False


def test_a_dotted_key_gives_way_to_its_block_with_a_note() -> None:
    # TRL writes 0.9 * hidden**2 beside the int(0.9 * hidden**2) accelerate filled in; DeepSpeed reads only the block
    config = load_config({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 3686},
                          "zero_optimization.stage3_prefetch_bucket_size": 0.9 * 64 * 64})
    assert config.zero_optimization.stage3_prefetch_bucket_size == 3686
    assert ("zero_optimization.stage3_prefetch_bucket_size",
            "given twice: 3686 in the 'zero_optimization' block is used, not 3686.4 beside it (as DeepSpeed does)"
            ) in config.notes
    alone = load_config({"zero_optimization.stage3_prefetch_bucket_size": 0.9 * 64 * 64})  # a budget: rounded down
    assert alone.zero_optimization.stage3_prefetch_bucket_size == 3686


@pytest.mark.parametrize("raw, message", [
    ({"zero_optimization.reduce_bucket_sise": 1}, r"zero_optimization\.reduce_bucket_sise: unknown key"),
    ({"fp16": True, "fp16.enabled": True}, r"fp16\.enabled: 'fp16' is true, not a section"),
    ({"zero_optimization..stage": 1}, r"zero_optimization\.\.stage: a dotted key needs a name between every pair"),
])
def test_a_bad_dotted_key_is_one_line_naming_it(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(raw)


def test_utils_logging_is_deepspeeds_logging_module(alias) -> None:
    import deepspeed
    from deepspeed.utils.logging import log_dist, logger, should_log_le

    assert deepspeed.utils.logging.logger is logger is logging.getLogger("zerotune")
    assert deepspeed.utils.log_dist is log_dist
    before = logger.level
    try:
        deepspeed.utils.logging.logger.setLevel(logging.WARNING)  # what Lightning's DeepSpeedStrategy does
        assert not should_log_le("info") and should_log_le("warning")
        with pytest.raises(ValueError, match="'loud' is not one of debug, info, warning, error, critical"):
            should_log_le("loud")
    finally:
        logger.setLevel(before)


def test_get_accelerator_from_the_top_level(alias) -> None:
    from deepspeed import get_accelerator
    from deepspeed.accelerator import get_accelerator as from_accelerator

    assert get_accelerator is from_accelerator
    assert get_accelerator().device_name() in ("cpu", "cuda")


class _PlainNet(nn.Module):
    """A model with no declared blocks, as a LightningModule or a hand-written network."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_the_block_wraps_only_declared_blocks_unless_told() -> None:
    plain = _PlainNet()
    assert checkpoint_blocks_at_initialize(plain, None)[0] == []
    assert "declares no transformer blocks" in checkpoint_blocks_at_initialize(plain, None)[1]
    with pytest.raises(ValueError, match="has no _no_split_modules"):
        checkpoint_blocks_at_initialize(plain, True)
    gpt2 = make_gpt2()
    assert checkpoint_blocks_at_initialize(gpt2, False)[0] == [] and checkpointed_module_names(gpt2) == []
    assert checkpoint_blocks_at_initialize(gpt2, None)[0] == ["transformer.h.0", "transformer.h.1"]
    remove_activation_checkpointing(gpt2)
    hf_checkpointed = make_gpt2()
    enable = getattr(hf_checkpointed, "activation_checkpointing_enable", None) or \
        hf_checkpointed.gradient_checkpointing_enable
    enable()
    wrapped, why = checkpoint_blocks_at_initialize(hf_checkpointed, None)
    assert wrapped == [] and "gradient checkpointing is on" in why


def _plain_module_with_a_checkpointing_block() -> dict:
    model = make_mlp()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                           "contiguous_memory_optimization": False, "synchronize_checkpoint_boundary":
                                           False}}  # Lightning's block, as it writes it
    engine, *_ = zerotune.initialize(model=model, config=config)
    try:
        batch = mlp_batch(0, 0, 2)
        loss = engine(batch["x"], batch["y"])
        engine.backward(loss)
        engine.step()
        return {"loss": float(loss), "wrapped": checkpointed_module_names(model),
                "configured": zerotune.checkpointing.is_configured()}
    finally:
        engine.destroy()
        ac._configured_policy = None  # pool workers outlive the test


def test_a_plain_module_with_an_activation_checkpointing_block_trains() -> None:
    result = run_distributed(_plain_module_with_a_checkpointing_block, 2, timeout=120)[0]
    assert result["wrapped"] == [] and result["configured"] and result["loss"] > 0


def test_what_deepspeeds_own_test_harness_reads(alias) -> None:
    """DeepSpeed's tests/unit read these before any test runs (git_version_info, op builders, torch version)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import compatible_ops, installed_ops, torch_info
    from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder, InferenceBuilder
    from deepspeed.utils.torch import required_torch_version

    assert torch_info["version"] == ".".join(torch.__version__.split(".")[:2])
    assert deepspeed.ops.__compatible_ops__ is compatible_ops and not any(installed_ops.values())
    assert compatible_ops[CPUAdamBuilder.NAME] and compatible_ops[FusedAdamBuilder.NAME]
    assert not compatible_ops[InferenceBuilder.NAME]  # a feature zerotune does not have: DeepSpeed's tests skip
    assert get_accelerator().create_op_builder("FusedAdamBuilder").is_compatible()
    assert get_accelerator().get_op_builder("NoSuchBuilder") is None
    assert CPUAdamBuilder().load().DeepSpeedCPUAdam is deepspeed.ops.adam.DeepSpeedCPUAdam
    with pytest.raises(ImportError, match="the compiled op 'transformer_inference'"):
        InferenceBuilder().load()
    assert required_torch_version(min_version=1.8) and not required_torch_version(min_version=99)
    from deepspeed.ops.op_builder import OpBuilder  # (test_onebit.py gates on it at import)

    assert OpBuilder.installed_rocm_version() == ((0, 0) if not torch.version.hip else
                                                  tuple(int(x) for x in torch.version.hip.split(".")[:2]))
    assert required_torch_version(max_version=torch.__version__.split("+")[0])


def test_moe_names_deepspeed_code_imports_for_every_model(alias) -> None:
    """DeepSpeed's test models import MoE and split every model's parameters into MoE groups; without expert
    parameters the groups come back as given, an expert-marked parameter is refused by name."""
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

    model = nn.Linear(4, 4)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": model.parameters(), "name": "p"})
    assert groups == [{"params": list(model.parameters()), "name": "p"}] and not is_moe_param(model.weight)
    with pytest.raises(ImportError, match="deepspeed.moe.layer.MoE: Mixture-of-Experts layers"):
        MoE(hidden_size=4, expert=nn.Linear(4, 4), num_experts=2)
    model.weight.allreduce = False  # how DeepSpeed's experts mark their parameters
    with pytest.raises(ImportError, match=r"expert parallelism for MoE parameters \(1 marked allreduce=False"):
        split_params_into_different_moe_groups_for_optimizer([{"params": list(model.parameters())}])


def test_engine_members_deepspeeds_checkpoint_tests_compare() -> None:
    from zerotune.engine_queries import EngineQueries

    from types import SimpleNamespace

    model = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 1))
    names = EngineQueries.sparse_tensor_module_names.fget  # DeepSpeed's: the embeddings sparse_gradients covers
    assert names(SimpleNamespace(_config=SimpleNamespace(sparse_gradients=False), module=model)) == set()
    assert names(SimpleNamespace(_config=SimpleNamespace(sparse_gradients=True), module=model)) == {"0.weight"}


def _sparse_names_after_load(tmp: str, saved_sparse: bool, loaded_sparse: bool) -> dict:
    def engine(sparse: bool):
        return zerotune.initialize(model=nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 1)), config={
            "train_micro_batch_size_per_gpu": 1, "sparse_gradients": sparse})[0]

    saved, loaded = engine(saved_sparse), engine(loaded_sparse)
    saved.save_checkpoint(tmp, tag="t")
    before = loaded.sparse_tensor_module_names
    loaded.load_checkpoint(tmp, tag="t", load_module_only=True)
    module_only = loaded.sparse_tensor_module_names
    loaded.load_checkpoint(tmp, tag="t", load_optimizer_states=False)
    return {"before": before, "module_only": module_only, "after": loaded.sparse_tensor_module_names,
            "saved": saved.sparse_tensor_module_names}


@pytest.mark.parametrize("saved_sparse, loaded_sparse", [(False, True), (True, False)])
def test_a_checkpoint_load_takes_the_saved_sparse_tensor_module_names(tmp_path, saved_sparse, loaded_sparse) -> None:
    # DeepSpeed's load_checkpoint restores the engine's sparse_tensor_module_names from the checkpoint
    result, = run_distributed(_sparse_names_after_load, 1, str(tmp_path), saved_sparse, loaded_sparse)
    assert result["before"] == result["module_only"] == ({"0.weight"} if loaded_sparse else set())
    assert result["after"] == result["saved"] == ({"0.weight"} if saved_sparse else set())


def test_a_non_strict_load_merges_sparse_names_by_deepspeeds_rule() -> None:
    from zerotune.checkpoint.engine_parts import loaded_sparse_names

    # kept unless the checkpoint had it dense; the checkpoint's sparse names added where they are parameters here
    assert loaded_sparse_names({"emb.weight"}, set(), {"emb.weight", "linear.weight"}, {"linear.weight"},
                               strict=False) == ["emb.weight"]
    assert loaded_sparse_names({"emb.weight"}, set(), {"emb.weight"}, {"emb.weight"}, strict=False) == []
    assert loaded_sparse_names(set(), {"emb.weight"}, {"linear.weight"}, {"emb.weight"}, strict=False) == []
    assert loaded_sparse_names(set(), {"emb.weight"}, {"emb.weight"}, {"emb.weight"}, strict=False) == ["emb.weight"]
    assert loaded_sparse_names({"a.weight"}, {"emb.weight"}, {"a.weight"}, set(), strict=True) == ["emb.weight"]


def _tags_and_dirs() -> list[str]:
    """What DeepSpeed's checkpoint tests expect: different tags under tag_validation Fail raise an AssertionError
    on every rank, and an empty save directory is a ValueError (not a save into the working directory)."""
    rank = torch.distributed.get_rank()
    model = make_mlp()
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "checkpoint": {"tag_validation": "FAIL"}}
    engine, *_ = zerotune.initialize(model=model, model_parameters=model.parameters(), config=config)
    caught = []
    try:
        for save_dir, tag in (("/tmp/unused-by-this-test", f"tag-{rank}"), ("", None)):
            try:
                engine.save_checkpoint(save_dir=save_dir, tag=tag)
            except (AssertionError, ValueError) as error:
                caught.append(f"{type(error).__name__}: {error}")
    finally:
        engine.destroy()
    return caught


def test_checkpoint_tag_mismatch_and_empty_directory_are_the_errors_deepspeed_raises(alias) -> None:
    import deepspeed

    for tag_error, dir_error in run_distributed(_tags_and_dirs, 2, timeout=120):
        assert tag_error.startswith("CheckpointTagMismatch: ranks passed different checkpoint tags: ['tag-0', 'tag-1']")
        assert dir_error.startswith("ValueError: engine.save_checkpoint() needs a directory")
    with pytest.raises(deepspeed.DeepSpeedConfigError, match="checkpoint.tag_validation"):
        load_config({"checkpoint": {"tag_validation": "foo"}})


class _SparseEmbeddingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.EmbeddingBag(10, 4, sparse=True)
        self.out = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.out(self.emb(ids)), y)


def _sparse_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randint(0, 10, (4, 3), generator=generator), torch.randn(4, 1, generator=generator)


def _sparse_gradients_run(stage: int) -> list[float]:
    config = {"train_micro_batch_size_per_gpu": 2, "sparse_gradients": True, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = zerotune.initialize(model=_SparseEmbeddingModel(), config=config)
    assert engine.sparse_tensor_module_names == {"emb.weight"}  # DeepSpeed's bookkeeping of what the key covers
    rank = torch.distributed.get_rank()
    losses = []
    for step in range(3):
        ids, y = _sparse_batch(step)
        loss = engine(ids[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / 2)
    engine.destroy()
    return losses


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sparse_gradients_true_trains_a_sparse_embedding_as_pytorch_does(stage: int) -> None:
    """``sparse_gradients: true`` is accepted (with a note: reduced dense, the same values) and an
    ``nn.EmbeddingBag(sparse=True)`` trains to the single-process result."""
    assert any(path == "sparse_gradients" for path, _ in load_config({"train_batch_size": 2,
                                                                      "sparse_gradients": True}).notes)
    model = _SparseEmbeddingModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = []
    for step in range(3):
        loss = model(*_sparse_batch(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    for losses in run_distributed(_sparse_gradients_run, 2, stage):
        assert losses == pytest.approx(expected, rel=1e-5)
