"""resolve_config (batch triple, "auto"), assert_implemented and format_resolved."""

from __future__ import annotations

from pathlib import Path

import pytest

from zerotune.config import (
    ConfigError,
    NotSupportedYetError,
    assert_implemented,
    format_resolved,
    load_config,
    resolve_config,
    solve_batch,
)

CONFIGS = Path(__file__).parent / "data" / "configs"
TBS, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


def batch(dp, **given):
    cfg = resolve_config(given, dp_world_size=dp)
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


# --- batch arithmetic ------------------------------------------------------------------

@pytest.mark.parametrize(
    "given, dp, expected",
    [
        ({TBS: 32, MICRO: 4, GAS: 2}, 4, (32, 4, 2)),
        ({TBS: 32, MICRO: 4}, 4, (32, 4, 2)),
        ({TBS: 32, GAS: 2}, 4, (32, 4, 2)),
        ({MICRO: 4, GAS: 2}, 4, (32, 4, 2)),
        ({MICRO: 4}, 4, (16, 4, 1)),
        ({TBS: 32}, 4, (32, 8, 1)),
        ({TBS: 7}, 1, (7, 7, 1)),
    ],
)
def test_batch_triple_combinations(given, dp, expected):
    assert batch(dp, **given) == expected


def test_batch_inconsistent_shows_arithmetic():
    with pytest.raises(ConfigError) as info:
        batch(4, **{TBS: 30, MICRO: 4, GAS: 2})
    assert info.value.message == (
        "train_batch_size 30 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 2 * data-parallel size 4 = 32"
    )


@pytest.mark.parametrize(
    "given, dp, text",
    [
        ({TBS: 30, MICRO: 4}, 4, "train_batch_size 30 is not divisible by train_micro_batch_size_per_gpu 4 * data-parallel size 4 = 16"),
        ({TBS: 30, GAS: 4}, 2, "train_batch_size 30 is not divisible by gradient_accumulation_steps 4 * data-parallel size 2 = 8"),
        ({TBS: 30}, 4, "train_batch_size 30 is not divisible by data-parallel size 4"),
    ],
)
def test_batch_not_divisible_shows_arithmetic(given, dp, text):
    with pytest.raises(ConfigError) as info:
        batch(dp, **given)
    assert info.value.message == text


@pytest.mark.parametrize("given", [{}, {GAS: 4}])
def test_batch_needs_tbs_or_micro(given):
    with pytest.raises(ConfigError) as info:
        batch(2, **given)
    assert TBS in str(info.value) and MICRO in str(info.value)


def test_solve_batch_is_pure():
    assert tuple(solve_batch(None, 2, 3, 5)) == (30, 2, 3)


@pytest.mark.parametrize("dp", [0, -1, 1.5, True, "2"])
def test_bad_dp_world_size(dp):
    with pytest.raises(ConfigError):
        resolve_config({MICRO: 1}, dp_world_size=dp)


# --- provenance ------------------------------------------------------------------------

def test_provenance_file_default_inferred_auto():
    cfg = resolve_config(
        {MICRO: 4, GAS: "auto", "gradient_clipping": "auto", "fp16": {"enabled": True}},
        dp_world_size=2,
    )
    prov = cfg.provenance
    assert prov[MICRO] == "file"
    assert prov[TBS] == "inferred" and prov[GAS] == "inferred"
    assert prov["gradient_clipping"] == "auto" and cfg.gradient_clipping == 0.0
    assert prov["fp16.enabled"] == "file" and prov["fp16.hysteresis"] == "default"
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (8, 1)


def test_resolve_returns_new_config():
    original = load_config({TBS: "auto", MICRO: 2})
    resolved = resolve_config(original, dp_world_size=2)
    assert original.train_batch_size == "auto" and resolved.train_batch_size == 4
    assert original.provenance[TBS] == "auto"


# --- "auto" resolution -----------------------------------------------------------------

def test_auto_from_auto_values():
    cfg = resolve_config(
        CONFIGS / "ds_config_zero2.json",
        dp_world_size=2,
        auto_values={
            TBS: 32, MICRO: 8, GAS: 2, "fp16.enabled": True, "gradient_clipping": 1.0,
            "optimizer.params.lr": 1e-4, "optimizer.params.betas": [0.9, 0.999], "optimizer.params.eps": 1e-8,
            "optimizer.params.weight_decay": 0.0, "scheduler.params.warmup_min_lr": 0.0,
            "scheduler.params.warmup_max_lr": 1e-4, "scheduler.params.warmup_num_steps": 10,
            "unrelated.key": 1,
        },
    )
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (32, 8, 2)
    assert cfg.fp16.enabled is True and cfg.gradient_clipping == 1.0
    assert cfg.optimizer.params == {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    assert cfg.provenance["optimizer.params.lr"] == "auto" and cfg.provenance[TBS] == "auto"
    assert cfg.zero_optimization.allgather_bucket_size == 200_000_000
    assert "'auto'" not in repr(cfg.to_dict())


def test_auto_from_defaults():
    cfg = resolve_config(
        {MICRO: 1, "fp16": {"enabled": "auto"}, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                                       "stage3_prefetch_bucket_size": "auto"}},
        dp_world_size=1,
    )
    assert cfg.fp16.enabled is False
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 50_000_000
    assert cfg.provenance["zero_optimization.reduce_bucket_size"] == "auto"


def test_unresolvable_auto_strict_names_the_key():
    with pytest.raises(ConfigError) as info:
        resolve_config({MICRO: 1, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, dp_world_size=1)
    assert info.value.path == "optimizer.params.lr"
    assert "'auto' could not be resolved; set a value" in str(info.value)


def test_unresolvable_batch_auto_strict_names_the_key():
    with pytest.raises(ConfigError) as info:
        resolve_config({TBS: "auto", MICRO: "auto"}, dp_world_size=1)
    assert info.value.path == TBS and "could not be resolved" in str(info.value)


def test_non_strict_leaves_autos():
    cfg = resolve_config(CONFIGS / "ds_config_zero3.json", dp_world_size=8, strict=False)
    assert cfg.train_batch_size == "auto" and cfg.optimizer.params["lr"] == "auto"
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000  # has a default
    assert cfg.zero_optimization.stage3_param_persistence_threshold == 100_000
    assert cfg.fp16.enabled is False and cfg.bf16.enabled is False


def test_non_strict_still_reports_inconsistent_numbers():
    with pytest.raises(ConfigError):
        resolve_config({TBS: 30, MICRO: 4, GAS: "auto"}, dp_world_size=4, strict=False)


def test_auto_values_are_validated():
    with pytest.raises(ConfigError) as info:
        resolve_config({MICRO: 1, "fp16": {"enabled": "auto"}}, dp_world_size=1, auto_values={"fp16.enabled": "yes"})
    assert info.value.path == "fp16.enabled"
    with pytest.raises(ConfigError):
        resolve_config({MICRO: "auto"}, dp_world_size=1, auto_values={MICRO: 0})


def test_resolved_autos_rechecked_across_sections():
    with pytest.raises(ConfigError) as info:
        resolve_config(
            {MICRO: 1, "fp16": {"enabled": "auto"}, "bf16": {"enabled": True}},
            dp_world_size=1,
            auto_values={"fp16.enabled": True},
        )
    assert "fp16" in str(info.value) and "bf16" in str(info.value)


@pytest.mark.parametrize("name", ["ds_config_zero2.json", "ds_config_zero3.json"])
def test_hf_style_files_load_and_resolve_non_strict(name):
    cfg = resolve_config(load_config(CONFIGS / name), dp_world_size=2, strict=False)
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert "auto" in format_resolved(cfg)


# --- assert_implemented ----------------------------------------------------------------

def test_assert_implemented_accepts_plain_config():
    assert_implemented(resolve_config({MICRO: 1}, dp_world_size=1))
    assert_implemented(resolve_config({MICRO: 1, "tensor_parallel": {"autotp_size": 2}, "sequence_parallel_size": 2,
                                       "pipeline": {"stages": 2}}, dp_world_size=1))
    assert_implemented(resolve_config({MICRO: 1, "zero_optimization": {"stage": 2}}, dp_world_size=1), zero_stages=(0, 1, 2))


@pytest.mark.parametrize(
    "config, path, text",
    [
        ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage", "2 is not supported yet (implemented: 0)"),
        ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing.partition_activations", "true"),
        ({"checkpoint": {"use_node_local_storage": True}}, "checkpoint.use_node_local_storage", "true"),
        ({"memory_breakdown": True}, "memory_breakdown", "true"),
    ],
)
def test_assert_implemented_rejects(config, path, text):
    cfg = load_config(config)
    with pytest.raises(NotSupportedYetError) as info:
        assert_implemented(cfg)
    assert info.value.path == path and text in info.value.message
    assert isinstance(info.value, ConfigError)


def test_assert_implemented_message_format():
    with pytest.raises(NotSupportedYetError) as info:
        assert_implemented(load_config({"zero_optimization": {"stage": 3}}), zero_stages=(0, 1, 2))
    assert str(info.value) == "zerotune config: zero_optimization.stage: 3 is not supported yet (implemented: 0, 1, 2)"


# --- format_resolved -------------------------------------------------------------------

def test_format_resolved_table():
    cfg = resolve_config({MICRO: 2, "fp16": {"enabled": True}}, dp_world_size=3)
    lines = format_resolved(cfg).splitlines()
    assert lines[0].split() == ["key", "value", "source"]
    row = next(line for line in lines if line.startswith("train_batch_size "))
    assert row.split() == ["train_batch_size", "6", "inferred"]
    assert next(line for line in lines if line.startswith("fp16.enabled ")).split() == ["fp16.enabled", "true", "file"]
    assert any(line.split()[-1] == "default" for line in lines)
