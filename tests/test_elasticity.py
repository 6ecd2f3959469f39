"""Elastic batches: the search's known answers (the values DeepSpeed 0.19.5 computes for the same blocks),
each refusal naming its key, the scheduler check, and DeepSpeed's API through the alias."""

from __future__ import annotations

import json
import logging

import pytest

from zerotune.compat.elasticity import ElasticityConfig as DeepSpeedElasticityConfig
from zerotune.compat.elasticity import compute_elastic_config, elasticity_enabled, ensure_immutable_elastic_config
from zerotune.config import ConfigError
from zerotune.config.elastic_batch import (
    SCHEDULER_CONFIG_ENV,
    check_scheduler_agrees,
    elastic_batch_sizes,
    plan_elastic_batch,
)
from zerotune.config.elasticity import (
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    elasticity_from_dict,
)

VERSION = "0.19.5"
VALID_10K = [32, 34, 36, 48, 51, 64, 68, 72, 96, 102, 136, 144, 153, 192, 204, 272, 288, 306, 408, 576, 612, 816, 1224]


def block(**changes):
    base = {"enabled": True, "max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17], "min_gpus": 32,
            "max_gpus": 1500, "min_time": 20, "version": 0.1}
    return {**base, **changes}


def compute(world_size=0, return_microbatch=False, **changes):
    return compute_elastic_config({"elasticity": block(**changes)}, VERSION, world_size=world_size,
                                  return_microbatch=return_microbatch)


def test_version_01_picks_the_batch_with_the_most_world_sizes():
    batch, valid = compute()
    assert (batch, valid) == (9792, VALID_10K)
    # every valid size takes a listed micro batch with whole accumulation steps
    assert all(any(batch // w % m == 0 for m in (8, 12, 16, 17)) for w in valid)


@pytest.mark.parametrize("world_size, micro", [(64, 17), (32, 17), (1224, 8), (48, 17)])
def test_a_valid_world_size_takes_the_largest_micro_batch_dividing_its_share(world_size, micro):
    assert compute(world_size) == (9792, VALID_10K, micro)


def test_small_blocks():
    assert compute(7, max_train_batch_size=32, micro_batch_sizes=[1, 2, 3, 7], min_gpus=1)[2] == 3
    small = {"max_train_batch_size": 4, "micro_batch_sizes": [1, 2, 3, 4], "min_gpus": 1, "max_gpus": 4}
    assert compute(2, **small) == (12, [1, 2, 3, 4], 3)
    assert compute(1, **small) == (12, [1, 2, 3, 4], 4)


@pytest.mark.parametrize("prefer_larger", [True, False])
def test_ties_and_defaults(prefer_larger):
    batch, valid = compute(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], min_gpus=1, max_gpus=10000,
                           prefer_larger_batch=prefer_larger)
    assert batch == 1680 and len(valid) == 32 and valid[:5] == [1, 2, 3, 4, 5] and valid[-3:] == [280, 420, 840]


def test_version_02_searches_whole_nodes(monkeypatch):
    nodes = {"version": 0.2, "model_parallel_size": 2, "num_gpus_per_node": 4, "min_gpus": 4, "max_gpus": 64,
             "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6]}
    valid = [2, 4, 6, 8, 10, 12, 16, 20, 24, 30, 32]
    assert compute(8, **nodes) == (1920, valid, 6)
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert compute(return_microbatch=True, **nodes) == (1920, valid, 6)
    assert compute(**nodes) == (1920, valid)


def test_version_02_outside_the_search_takes_the_largest_batch_the_world_divides(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")
    changes = {"version": 0.2, "model_parallel_size": 4, "num_gpus_per_node": 8}
    assert compute(**changes) == (9996, [4])
    assert compute(return_microbatch=True, **changes) == (9996, [4], 16)


def test_the_plan_is_the_same_for_string_and_number_versions():
    assert plan_elastic_batch(elasticity_from_dict(block(version="0.1"))) == plan_elastic_batch(
        elasticity_from_dict(block()))


@pytest.mark.parametrize("key, value, path", [
    ("micro_batch_sizes", [1, 4, -1, 2, -10], "elasticity.micro_batch_sizes.2"),
    ("micro_batch_sizes", 5, "elasticity.micro_batch_sizes"),
    ("micro_batch_sizes", ["a", None, 0.5], "elasticity.micro_batch_sizes.0"),
    ("micro_batch_sizes", [2, 0.5, 4], "elasticity.micro_batch_sizes.1"),
    ("micro_batch_sizes", [], "elasticity.micro_batch_sizes"),
    ("min_gpus", -1, "elasticity.min_gpus"),
    ("max_gpus", -1, "elasticity.max_gpus"),
    ("min_time", -1, "elasticity.min_time"),
    ("version", "0.3", "elasticity.version"),
    ("version", 0.15, "elasticity.version"),
    ("version", "latest", "elasticity.version"),
    ("enabled", "yes", "elasticity.enabled"),
])
def test_invalid_values_name_their_key(key, value, path):
    with pytest.raises(ElasticityConfigError) as info:
        compute(**{key: value})
    assert info.value.path == path


def test_newer_version_says_which_are_known():
    with pytest.raises(ElasticityConfigError, match="newer than the latest elasticity version 0.2"):
        compute(version=0.3)


@pytest.mark.parametrize("changes, path, words", [
    ({"max_gpus": 16}, "elasticity.max_gpus", "below min_gpus 32"),
    ({"model_parallel_size": 4, "num_gpus_per_node": 8}, "elasticity.model_parallel_size", "needs version 0.2"),
    ({"model_parallel_size": 16, "num_gpus_per_node": 8, "version": 0.2}, "elasticity.num_gpus_per_node",
     "not divisible by model_parallel_size 16"),
    ({"max_train_batch_size": 12}, "elasticity.micro_batch_sizes", "[16, 17] exceed max_train_batch_size 12"),
    ({"max_train_batch_size": 40, "version": 0.2, "num_gpus_per_node": 4}, "elasticity.micro_batch_sizes",
     "40 / 4 data-parallel ranks per node = 10"),
    ({"max_train_batch_size": 100, "micro_batch_sizes": [17], "min_gpus": 246, "max_gpus": 246},
     "elasticity.min_gpus", "no world size from 246 to 246"),
    ({"clever": 1}, "elasticity.clever", "unknown key"),
    ({"max_train_batch": 1}, "elasticity.max_train_batch", "did you mean 'max_train_batch_size'"),
])
def test_blocks_that_cannot_be_searched(changes, path, words):
    with pytest.raises(ElasticityConfigError) as info:
        compute(world_size=16, **changes)
    assert info.value.path == path and words in str(info.value)


@pytest.mark.parametrize("key", ["max_train_batch_size", "micro_batch_sizes"])
def test_an_enabled_block_needs_its_batch_keys(key):
    raw = block()
    del raw[key]
    with pytest.raises(ElasticityConfigError, match=f"elasticity.{key}: required when elasticity is enabled"):
        compute_elastic_config({"elasticity": raw}, VERSION)
    with pytest.raises(ElasticityConfigError, match="elasticity.max_train_batch_size: required"):
        compute_elastic_config({"elasticity": {"enabled": True}}, VERSION)


def test_disabled_or_missing_block_is_an_error():
    with pytest.raises(ElasticityConfigError, match="elasticity.enabled: is false"):
        compute(enabled=False)
    with pytest.raises(ElasticityConfigError, match="elasticity: missing"):
        compute_elastic_config({"train_batch_size": 8}, VERSION)
    with pytest.raises(ValueError, match="ds_config"):
        compute_elastic_config("ds_config.json", VERSION)  # type: ignore[arg-type]


@pytest.mark.parametrize("target, words", [("0.2", "predates elasticity"), ("0.3.7", "predates"),
                                           ("not-a-version", "not a version number")])
def test_target_deepspeed_version(target, words):
    with pytest.raises(ElasticityError, match=words):
        compute_elastic_config({"elasticity": block()}, target)
    assert compute_elastic_config({"elasticity": block()}, "0.3.8")[0] == 9792


def test_world_size_the_batch_does_not_run_on():
    with pytest.raises(ElasticityIncompatibleWorldSize, match="does not run on world size 128; valid world sizes"):
        compute(128)


def test_version_02_needs_a_world_size(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ElasticityConfigError, match="WORLD_SIZE"):
        compute(version=0.2)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ElasticityConfigError, match="'two'"):
        compute(version=0.2)
    with pytest.raises(ElasticityIncompatibleWorldSize, match="no model replica of 4 ranks"):
        compute(2, version=0.2, model_parallel_size=4, num_gpus_per_node=4)


def test_return_microbatch_with_version_01_needs_the_world_size():
    with pytest.raises(ElasticityConfigError, match="needs world_size"):
        compute(return_microbatch=True)


def test_elasticity_errors_are_config_errors_that_cross_processes():
    import pickle

    error = ElasticityIncompatibleWorldSize("elasticity", "world size 3")
    assert isinstance(error, ConfigError) and isinstance(error, ElasticityError)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is ElasticityIncompatibleWorldSize and copy.path == "elasticity" and str(copy) == str(error)


def test_engine_batch_triple():
    cfg = elasticity_from_dict(block(max_train_batch_size=4, micro_batch_sizes=[1, 2, 3, 4], min_gpus=1, max_gpus=4))
    assert elastic_batch_sizes(cfg, 2) == (12, 3, 2)
    assert elastic_batch_sizes(cfg, 1) == (12, 4, 3)
    with pytest.raises(ElasticityIncompatibleWorldSize):
        elastic_batch_sizes(cfg, 5)


def test_scheduler_must_scale_by_the_same_block(monkeypatch, caplog):
    cfg = elasticity_from_dict(block())
    check_scheduler_agrees(cfg, None)
    check_scheduler_agrees(cfg, json.dumps(block(min_gpus=1)))  # bounds are the scheduler's own business
    with pytest.raises(ElasticityConfigError) as info:
        check_scheduler_agrees(cfg, json.dumps(block(max_train_batch_size=27)))
    assert info.value.path == "elasticity.max_train_batch_size" and SCHEDULER_CONFIG_ENV in str(info.value)
    with pytest.raises(ElasticityConfigError, match=f"{SCHEDULER_CONFIG_ENV}: is not JSON"):
        check_scheduler_agrees(cfg, "{")
    # DeepSpeed's own test puts a whole config there: not an elasticity block
    with pytest.raises(ElasticityConfigError, match=f"{SCHEDULER_CONFIG_ENV}.train_batch_size: unknown key"):
        check_scheduler_agrees(cfg, json.dumps({"train_batch_size": 2, "elasticity": block()}))

    monkeypatch.setenv(SCHEDULER_CONFIG_ENV, json.dumps(block(micro_batch_sizes=[8, 16])))
    with pytest.raises(ElasticityConfigError, match="elasticity.micro_batch_sizes"):
        ensure_immutable_elastic_config(block())
    monkeypatch.delenv(SCHEDULER_CONFIG_ENV)
    logger = logging.getLogger("zerotune")  # it does not propagate: listen on it directly
    logger.addHandler(caplog.handler)
    try:
        ensure_immutable_elastic_config(block())
    finally:
        logger.removeHandler(caplog.handler)
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and SCHEDULER_CONFIG_ENV in caplog.text


def test_deepspeed_names_of_the_block():
    ds = DeepSpeedElasticityConfig(block(prefer_larger_batch=False))
    assert (ds.max_acceptable_batch_size, ds.micro_batches, ds.prefer_larger_batch_size) == (10000, [8, 12, 16, 17],
                                                                                             False)
    assert (ds.min_gpus, ds.max_gpus, ds.version, ds.model_parallel_size, ds.num_gpus_per_node) == (32, 1500, 0.1, 1, 1)
    assert "section" not in ds.repr() and "max_train_batch_size" in repr(ds)
    assert DeepSpeedElasticityConfig({"enabled": False}).micro_batches == [2, 4, 6]
    with pytest.raises(ElasticityConfigError, match="required when elasticity is enabled"):
        DeepSpeedElasticityConfig({"enabled": True})
    assert elasticity_enabled({"elasticity": block()}) and not elasticity_enabled({"elasticity": {"enabled": False}})
    assert not elasticity_enabled({})


def test_deepspeed_paths_after_a_plain_import(alias):
    import deepspeed
    from deepspeed.elasticity.constants import DEEPSPEED_ELASTICITY_CONFIG
    from deepspeed.elasticity.elasticity import compute_elastic_config as imported

    assert deepspeed.elasticity.compute_elastic_config is compute_elastic_config is imported
    assert deepspeed.elasticity.config.ElasticityError is ElasticityError
    assert deepspeed.elasticity.config.ElasticityIncompatibleWorldSize is ElasticityIncompatibleWorldSize
    assert DEEPSPEED_ELASTICITY_CONFIG == SCHEDULER_CONFIG_ENV
    assert deepspeed.elasticity.is_torch_elastic_compatible()


ELASTIC_ENGINE = {"enabled": True, "max_train_batch_size": 4, "micro_batch_sizes": [1, 2, 3, 4], "min_gpus": 1,
                  "max_gpus": 4, "min_time": 20, "version": 0.1}


def test_an_enabled_block_sets_the_batch_triple(monkeypatch):
    from zerotune.config import load_config, resolve_config

    monkeypatch.delenv(SCHEDULER_CONFIG_ENV, raising=False)
    cfg = resolve_config({"elasticity": ELASTIC_ENGINE}, dp_world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (12, 3, 2)
    assert cfg.provenance["train_batch_size"] == "inferred"
    assert "runs unchanged on data-parallel sizes [1, 2, 3, 4]" in dict(cfg.notes)["elasticity"]
    assert resolve_config(cfg, dp_world_size=2).train_batch_size == 12  # a resolved config resolves the same
    auto = resolve_config({"elasticity": ELASTIC_ENGINE, "train_batch_size": "auto"}, dp_world_size=1,
                          auto_values={"train_batch_size": 64})
    assert (auto.train_batch_size, auto.train_micro_batch_size_per_gpu, auto.gradient_accumulation_steps) == (12, 4, 3)
    # the block is checked when the config loads, and only an enabled one needs its batch keys
    assert not load_config({"elasticity": {"enabled": False}}).elasticity.enabled
    with pytest.raises(ConfigError, match="elasticity.min_gpus"):
        load_config({"elasticity": {"enabled": False, "min_gpus": 0}})
    with pytest.raises(ElasticityConfigError, match="elasticity.max_train_batch_size: required"):
        resolve_config({"elasticity": {"enabled": True}}, dp_world_size=2)


@pytest.mark.parametrize("key", ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"])
def test_a_batch_key_beside_an_enabled_block(key, monkeypatch):
    from zerotune.config import resolve_config

    monkeypatch.delenv(SCHEDULER_CONFIG_ENV, raising=False)
    with pytest.raises(ElasticityConfigError) as info:
        resolve_config({key: 2, "elasticity": ELASTIC_ENGINE}, dp_world_size=2)
    assert info.value.path == key and "elasticity.ignore_non_elastic_batch_info" in str(info.value)
    cfg = resolve_config({key: 2, "elasticity": {**ELASTIC_ENGINE, "ignore_non_elastic_batch_info": True}},
                         dp_world_size=2)
    assert cfg.train_batch_size == 12 and dict(cfg.notes)[key].startswith("no effect here: elasticity sets it to")


def test_the_engine_refuses_a_world_size_or_scheduler_the_batch_does_not_fit(monkeypatch):
    from zerotune.config import resolve_config

    monkeypatch.delenv(SCHEDULER_CONFIG_ENV, raising=False)
    with pytest.raises(ElasticityIncompatibleWorldSize, match="does not run on world size 5"):
        resolve_config({"elasticity": ELASTIC_ENGINE}, dp_world_size=5)
    monkeypatch.setenv(SCHEDULER_CONFIG_ENV, json.dumps({**ELASTIC_ENGINE, "max_train_batch_size": 27}))
    with pytest.raises(ElasticityConfigError, match="elasticity.max_train_batch_size: 4 differs from the 27"):
        resolve_config({"elasticity": ELASTIC_ENGINE}, dp_world_size=2)
