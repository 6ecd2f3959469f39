"""load_config: schema, defaults, aliases, files, unknown keys, error translation."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest

from zerotune.config import (
    ConfigError,
    NotSupportedError,
    NotSupportedYetError,
    ZeroTuneConfig,
    load_config,
)

CONFIGS = Path(__file__).parent / "data" / "configs"


def error_of(source) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(source)
    return info.value


# --- defaults equal DeepSpeed's -------------------------------------------------------

def test_defaults_match_deepspeed():
    cfg = load_config({})
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (None, None, None)
    assert cfg.optimizer is None and cfg.scheduler is None and cfg.lr_scaling is None
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window) == (False, 0.0, 16, 1000)
    assert (fp16.hysteresis, fp16.consecutive_hysteresis, fp16.min_loss_scale, fp16.auto_cast) == (2, False, 1.0, False)
    assert cfg.bf16.enabled is False
    assert cfg.gradient_clipping == 0.0
    assert cfg.steps_per_print == 10 and cfg.wall_clock_breakdown is False
    assert cfg.sequence_parallel_size == 1 and cfg.gradient_predivide_factor == 1.0
    assert cfg.prescale_gradients is False and cfg.communication_data_type is None
    zero = cfg.zero_optimization
    assert zero.stage == 0
    assert zero.reduce_bucket_size == 500_000_000 and zero.allgather_bucket_size == 500_000_000
    assert zero.allgather_partitions and zero.reduce_scatter and zero.contiguous_gradients
    assert zero.overlap_comm is False
    assert zero.sub_group_size == 1_000_000_000
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    assert zero.stage3_param_persistence_threshold == 100_000
    assert zero.stage3_max_live_parameters == 1_000_000_000 and zero.stage3_max_reuse_distance == 1_000_000_000
    assert zero.stage3_gather_16bit_weights_on_model_save is False
    assert zero.ignore_unused_parameters is True and zero.round_robin_gradients is False
    assert zero.zero_hpz_partition_size == 1 and zero.mics_shard_size == -1 and zero.memory_efficient_linear
    assert zero.offload_optimizer.device == "none" and zero.offload_optimizer.buffer_count == 4
    assert zero.offload_param.device == "none" and zero.offload_param.buffer_count == 5
    assert zero.offload_param.buffer_size == 100_000_000 and zero.offload_param.max_in_cpu == 1_000_000_000
    assert cfg.tensorboard.job_name == "DeepSpeedJobName" and cfg.wandb.project == "deepspeed"
    assert cfg.checkpoint.tag_validation == "Warn"
    assert (cfg.aio.block_size, cfg.aio.queue_depth, cfg.aio.thread_count) == (1048576, 8, 1)
    assert cfg.aio.overlap_events is True and cfg.aio.single_submit is False
    assert cfg.pipeline.stages == 1 and cfg.tensor_parallel.autotp_size == 0


def test_overlap_comm_dynamic_default_is_true_for_stage3_only():
    assert load_config({"zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm is True
    assert load_config({"zero_optimization": {"stage": 2}}).zero_optimization.overlap_comm is False
    assert load_config({"zero_optimization": {"stage": 3, "overlap_comm": False}}).zero_optimization.overlap_comm is False


def test_every_field_has_a_description():
    def walk(cls):
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name} has no docstring"
            from zerotune.config.tree import section_class
            sub = section_class(field.annotation)
            if sub is not None:
                walk(sub)
    walk(ZeroTuneConfig)


def test_json_style_floats_for_integer_sizes():
    cfg = load_config({"zero_optimization": {"reduce_bucket_size": 2e8}})
    assert cfg.zero_optimization.reduce_bucket_size == 200_000_000
    assert isinstance(cfg.zero_optimization.reduce_bucket_size, int)


# --- aliases ---------------------------------------------------------------------------

def test_bfloat16_alias():
    assert load_config({"bfloat16": {"enabled": True}}).bf16.enabled is True


def test_gather_fp16_alias():
    cfg = load_config({"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}})
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save is True


def test_alias_and_canonical_key_together_is_an_error():
    err = error_of({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})
    assert "bf16" in str(err) and "alias" in str(err)


# --- sources ---------------------------------------------------------------------------

def test_accepts_config_object_as_is():
    cfg = load_config({"train_batch_size": 8})
    assert load_config(cfg) is cfg


def test_json_and_yaml_files(tmp_path):
    data = {"train_batch_size": 8, "zero_optimization": {"stage": 1}}
    (tmp_path / "c.json").write_text(json.dumps(data))
    import yaml

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    for name in ("c.json", "c.yaml"):
        for source in (str(tmp_path / name), tmp_path / name):
            cfg = load_config(source)
            assert cfg.train_batch_size == 8 and cfg.zero_optimization.stage == 1


def test_sample_yaml_file():
    cfg = load_config(CONFIGS / "zero1_adamw.yaml")
    assert cfg.bf16.enabled and cfg.zero_optimization.stage == 1
    assert cfg.optimizer.params["betas"] == [0.9, 0.95]
    assert cfg.lr_scaling.rule == "linear" and cfg.lr_scaling.base_batch_size == 256


def test_missing_file_names_it(tmp_path):
    err = error_of(tmp_path / "nope.json")
    assert "nope.json" in str(err) and "does not exist" in str(err)


def test_directory_names_it(tmp_path):
    assert str(tmp_path) in str(error_of(tmp_path))


def test_bad_json_names_file_line_and_column():
    err = error_of(CONFIGS / "broken_syntax.json")
    assert "broken_syntax.json" in str(err) and "line 5 column 5" in str(err)


def test_bad_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train_batch_size: 8\nzero_optimization: [\n")
    err = error_of(path)
    assert "bad.yaml" in str(err) and "line" in str(err)


def test_non_mapping_file(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    assert "mapping" in str(error_of(path))
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert "empty" in str(error_of(empty))


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """A YAML list whose anchors each repeat the previous one ``width`` times: ``width ** levels`` values."""
    rows = [f"&a0 [{', '.join(['x'] * width)}]"]
    rows += [f"&a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return f"steps_per_print: [{', '.join(rows)}]\n"


def test_yaml_alias_bomb_is_refused_while_loading_naming_file_and_bound(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    err = error_of(path)
    assert "bomb.yaml" in str(err) and "100000 values" in str(err) and "aliases" in str(err)


def test_recursive_yaml_alias_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("steps_per_print: &a [1, *a]\n")
    assert "loop.yaml" in str(error_of(path)) and "refers to" in str(error_of(path))


def test_yaml_aliases_within_the_bound_still_load(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text("zero_optimization: &z {stage: 1}\ntrain_batch_size: 8\n")
    assert load_config(path).zero_optimization.stage == 1


def test_error_message_shortens_a_huge_value_before_serialising_it():
    bomb = ["x"] * 9
    for _ in range(12):  # 9**13 values once expanded; serialising them whole would never finish
        bomb = [bomb] * 9
    err = error_of({"steps_per_print": bomb})
    assert err.path == "steps_per_print" and "[[[[" in str(err) and len(str(err)) < 300


def test_oversized_config_file_is_refused_by_size_before_reading(tmp_path, monkeypatch):
    path = tmp_path / "huge.json"
    with open(path, "wb") as f:
        f.truncate(200 * 2**20)  # sparse: 200 MiB on paper, no disk and no time
    monkeypatch.setattr(Path, "read_text", lambda *a, **k: pytest.fail("read a file it should refuse by size"))
    err = error_of(path)
    assert "huge.json" in str(err) and "200.0 MiB" in str(err) and "at most 16 MiB" in str(err)


def test_duplicate_json_key(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    assert "train_batch_size" in str(error_of(path))


def test_not_utf8(tmp_path):
    path = tmp_path / "bin.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    assert "bin.json" in str(error_of(path))


def test_wrong_source_type():
    assert "got int" in str(error_of(42))


# --- unknown and unsupported keys ------------------------------------------------------

def test_did_you_mean_nested():
    err = error_of({"zero_optimization": {"reduce_bucket_sise": 5}})
    assert str(err) == (
        "zerotune config: zero_optimization.reduce_bucket_sise: unknown key; did you mean 'reduce_bucket_size'?"
    )
    assert err.path == "zero_optimization.reduce_bucket_sise"


def test_did_you_mean_top_level_and_deep():
    assert "did you mean 'gradient_clipping'" in str(error_of({"gradient_cliping": 1.0}))
    err = error_of({"zero_optimization": {"offload_optimizer": {"devise": "cpu"}}})
    assert "zero_optimization.offload_optimizer.devise" in str(err) and "'device'" in str(err)


def test_did_you_mean_includes_aliases():
    assert "did you mean 'bfloat16'" in str(error_of({"bfloat17": {"enabled": True}}))


def test_unknown_key_without_close_match_lists_valid_keys():
    err = error_of({"fp16": {"zzzzzz": 1}})
    assert "fp16.zzzzzz" in str(err) and "valid keys are" in str(err) and "loss_scale_window" in str(err)


def test_unsupported_deepspeed_block():
    with pytest.raises(NotSupportedError) as info:
        load_config({"autotuning": {"enabled": True}})
    assert "'autotuning' is a DeepSpeed feature zerotune does not support; remove the block" in str(info.value)


@pytest.mark.parametrize("block, value", [("compression_training", {}), ("sparse_attention", {}),
                                          ("autotuning", {"enabled": True}),
                                          ("amp", {"enabled": True})])
def test_more_unsupported_blocks(block, value):
    with pytest.raises(NotSupportedError, match=f"'{block}' is a DeepSpeed feature zerotune does not support"):
        load_config({block: value})


def test_unsupported_nested_deepspeed_option():
    with pytest.raises(NotSupportedError) as info:
        load_config({"zero_optimization": {"zenflow": {}}})
    assert info.value.path == "zero_optimization.zenflow"


def test_non_string_key():
    err = error_of({1: 2})
    assert "keys must be strings" in str(err)


# --- types and ranges ------------------------------------------------------------------

@pytest.mark.parametrize(
    "config, path, fragment",
    [
        ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage", "5"),
        ({"zero_optimization": {"reduce_bucket_size": -1}}, "zero_optimization.reduce_bucket_size", "-1"),
        ({"fp16": {"loss_scale_window": 0}}, "fp16.loss_scale_window", "0"),
        ({"fp16": {"enabled": "yes"}}, "fp16.enabled", '"yes"'),
        ({"train_batch_size": "8"}, "train_batch_size", '"8"'),
        ({"train_batch_size": 8.5}, "train_batch_size", "8.5"),
        ({"gradient_clipping": True}, "gradient_clipping", "true"),
        ({"zero_optimization": {"offload_param": {"device": "gpu"}}}, "zero_optimization.offload_param.device", "'cpu'"),
        ({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}}, "zero_optimization.offload_optimizer.ratio", "1.5"),
        ({"optimizer": {"type": 3}}, "optimizer.type", "3"),
        ({"optimizer": {"type": "Adam", "params": [1]}}, "optimizer.params", "[1]"),
        ({"fp16": [1, 2]}, "fp16", "mapping"),
        ({"communication_data_type": "int8"}, "communication_data_type", "'fp32'"),
        ({"pipeline": {"partition": "random"}}, "pipeline.partition", "'uniform'"),
        ({"zero_optimization": {"mics_shard_size": 0}}, "zero_optimization.mics_shard_size", "-1"),
        ({"lr_scaling": {"rule": "sqrt", "base_batch_size": 256}}, "lr_scaling.rule", "'linear'"),
        ({"lr_scaling": {"rule": "linear"}}, "lr_scaling.base_batch_size", "missing"),
    ],
)
def test_bad_values_name_path_and_value(config, path, fragment):
    err = error_of(config)
    assert err.path == path
    assert str(err).startswith(f"zerotune config: {path}: ")
    assert fragment in str(err)
    assert "\n" not in str(err)


def test_fp16_and_bf16_both_enabled():
    err = error_of({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "fp16" in str(err) and "bf16" in str(err)


def test_nvme_needs_path_and_param_offload_below_stage3_is_noted():
    assert "nvme_path" in str(error_of({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}))
    # DeepSpeed reads offload_param only at stage 3; below it the key is accepted and said to change nothing
    cfg = load_config({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    notes = dict(cfg.notes)
    assert "stage 3" in notes["zero_optimization.offload_param.device"]
    assert notes["zero_optimization.offload_param.device"].startswith("no effect here")


@pytest.mark.parametrize("stage, model, accum, refused", [
    (0, "fp32", "bf16", True), (0, "fp16", "fp32", True), (0, "bf16", "fp32", True), (0, "bf16", "bf16", False),
    (0, "fp32", None, False), (1, "fp32", "bf16", False), (2, "fp16", "fp32", False), (3, "bf16", "fp16", False),
])
def test_grad_accum_dtype_follows_deepspeeds_support_matrix(stage, model, accum, refused):
    raw = {"zero_optimization": {"stage": stage}, "data_types": {"grad_accum_dtype": accum},
           "fp16": {"enabled": model == "fp16"}, "bf16": {"enabled": model == "bf16"}}
    if refused:  # DeepSpeed raises NotImplementedError for these; so does zerotune, naming the key
        with pytest.raises(NotImplementedError, match="data_types.grad_accum_dtype"):
            load_config(raw)
        return
    notes = dict(load_config(raw).notes)
    assert "data_types.grad_accum_dtype" in notes  # given, and fp32 sums here whatever its value


def test_grad_accum_dtype_refuses_unknown_values():
    err = error_of({"data_types": {"grad_accum_dtype": "fp8"}})
    assert err.path == "data_types.grad_accum_dtype"


def test_tag_validation_is_case_insensitive():
    assert load_config({"checkpoint": {"tag_validation": "FAIL"}}).checkpoint.tag_validation == "Fail"


# --- the error family ------------------------------------------------------------------

def test_error_hierarchy_and_format():
    assert issubclass(ConfigError, ValueError)
    assert issubclass(NotSupportedError, ConfigError) and issubclass(NotSupportedYetError, ConfigError)
    assert str(ConfigError("a.b", "bad")) == "zerotune config: a.b: bad"
    assert str(ConfigError("", "bad")) == "zerotune config: bad"


def test_errors_pickle():
    err = pickle.loads(pickle.dumps(NotSupportedYetError("x", "y")))
    assert type(err) is NotSupportedYetError and (err.path, err.message) == ("x", "y")


# --- output ----------------------------------------------------------------------------

def test_to_dict_round_trips():
    cfg = load_config(CONFIGS / "zero1_adamw.yaml")
    data = cfg.to_dict()
    assert data["bf16"]["enabled"] is True and "provenance" not in data and "_provenance" not in data
    json.dumps(data)
    assert load_config(data).to_dict() == data


def test_provenance_after_load():
    cfg = load_config({"fp16": {"enabled": True}, "train_batch_size": "auto", "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    prov = cfg.provenance
    assert prov["fp16.enabled"] == "file"
    assert prov["fp16.loss_scale_window"] == "default"
    assert prov["train_batch_size"] == "auto"
    assert prov["optimizer.params.lr"] == "file"
    assert prov["scheduler"] == "default"
    assert "provenance" not in cfg.model_dump()


def test_auto_values_are_kept():
    cfg = load_config(CONFIGS / "ds_config_zero3.json")
    assert cfg.train_batch_size == "auto" and cfg.zero_optimization.reduce_bucket_size == "auto"
    assert cfg.fp16.enabled == "auto" and cfg.optimizer.params["lr"] == "auto"
    assert cfg.zero_optimization.stage == 3 and cfg.zero_optimization.offload_param.device == "cpu"


def test_auto_not_allowed_for_string_choices():
    err = error_of({"zero_optimization": {"offload_optimizer": {"device": "auto"}}})
    assert err.path == "zero_optimization.offload_optimizer.device"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
