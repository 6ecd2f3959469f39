"""DeepSpeed's config models and getters under their DeepSpeed paths: ``runtime.config_utils`` (the base model
with deprecated fields), ``runtime.precision_config`` (fp16 / bf16 validation, mapped onto zerotune's sections),
``runtime.config.get_gradient_clipping`` / ``get_log_level``, ``runtime.constants``, and the ``log_level`` key."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import List, Optional

import pytest
from pydantic import Field, ValidationError
from torch import nn

import zerotune
from tests.harness import run_distributed
from zerotune.compat import config_utils, precision_config, runtime, runtime_constants
from zerotune.config import ConfigError, load_config
from zerotune.config.sections import BF16Config, FP16Config
from zerotune.monitor.logging import get_logger


class _Block(config_utils.DeepSpeedConfigModel):
    size: int = 0
    old_names: Optional[str] = Field(None, json_schema_extra={"deprecated": True, "new_param": "names",
                                                              "new_param_fn": lambda value: [value]})
    names: Optional[List[str]] = None
    renamed: int = Field(0, alias="renamed_alias")


def test_config_model_moves_a_deprecated_field_and_refuses_both_names() -> None:
    assert _Block(old_names="a").names == ["a"]
    with pytest.raises(AssertionError, match="old_names.*names"):
        _Block(old_names="a", names=["b"])


def test_config_model_takes_names_and_aliases_refuses_unknown_keys_and_drops_auto() -> None:
    assert _Block(renamed=3).renamed == 3 and _Block(renamed_alias=4).renamed == 4
    with pytest.raises(ValidationError):
        _Block(sizes=1)
    with pytest.raises(ValidationError):
        _Block(size="many")
    assert _Block(size="auto").size == 0  # non-strict: "auto" keeps the default for the HF Trainer to fill
    with pytest.raises(ValidationError):
        _Block(strict=True, size="auto")
    block = _Block()
    with pytest.raises(ValidationError):  # assignments are validated too
        block.size = "x"


def test_config_utils_helpers() -> None:
    assert config_utils.get_config_default(_Block, "size") == 0
    assert config_utils.get_scalar_param({"a": None}, "a", 1) is None
    assert config_utils.get_list_param({}, "a", [1]) == [1]
    assert repr(config_utils.pp_int(10000)) == "10,000" and repr(config_utils.pp_int(5, "five")) == "five"
    text = json.dumps({"bucket": 500000000, "on": True, "xs": [1, 2]}, cls=config_utils.ScientificNotationEncoder)
    assert "5.000000e+08" in text and "true" in text and json.loads(text)["xs"] == [1, 2]
    with pytest.raises(ValueError, match=r"Duplicate keys in DeepSpeed config: \['a'\]"):
        json.loads('{"a": 1, "b": 2, "a": 3}', object_pairs_hook=config_utils.dict_raise_error_on_duplicate_keys)


@pytest.mark.parametrize("key", ["loss_scale_window", "min_loss_scale"])
def test_fp16_scale_fields_must_be_positive_only_while_dynamic(key: str) -> None:
    with pytest.raises(ValidationError, match=key):
        precision_config.DeepSpeedFP16Config(enabled=True, loss_scale=0, **{key: 0})
    assert getattr(precision_config.DeepSpeedFP16Config(enabled=True, loss_scale=128, **{key: -1}), key) == -1
    assert getattr(precision_config.DeepSpeedFP16Config(enabled=False, **{key: 0}), key) == 0
    for bad in (True, float("nan"), "abc", None):
        with pytest.raises(ValidationError):
            precision_config.DeepSpeedFP16Config(enabled=True, **{key: bad})


def test_fp16_loss_scale_is_a_finite_non_negative_number() -> None:
    assert precision_config.DeepSpeedFP16Config(loss_scale="3").loss_scale == 3.0
    for bad in (-1, math.inf, math.nan, True):
        with pytest.raises(ValidationError):
            precision_config.DeepSpeedFP16Config(loss_scale=bad)
    with pytest.raises(ValidationError, match="must be a number"):
        precision_config.DeepSpeedFP16Config(loss_scale=[])


def test_precision_models_default_and_map_onto_zerotunes_sections() -> None:
    fp16 = precision_config.get_float16_config({"fp16": {"enabled": True, "initial_scale_power": 8}})
    assert fp16.initial_dynamic_scale() == 256
    assert fp16.dynamic_loss_scale_args() == {"init_scale": 256, "scale_window": 1000, "delayed_shift": 2,
                                              "consecutive_hysteresis": False, "min_scale": 1}
    section = fp16.to_section()
    assert isinstance(section, FP16Config) and section.enabled is True and section.initial_scale_power == 8
    assert precision_config.DeepSpeedFP16Config().loss_scale_window == FP16Config().loss_scale_window
    with pytest.raises(ConfigError, match="fp16.fp16_master_weights_and_grads"):
        precision_config.DeepSpeedFP16Config(fp16_master_weights_and_grads=True).to_section()
    for key in ("bf16", "bfloat16"):
        bf16 = precision_config.get_bfloat16_config({key: {"enabled": True, "immediate_grad_update": True}})
        assert bf16.enabled is True and isinstance(bf16.to_section(), BF16Config)
    assert precision_config.get_bfloat16_config({}).enabled is False


def test_runtime_config_getters_and_constants() -> None:
    assert runtime.get_gradient_clipping({}) == runtime_constants.GRADIENT_CLIPPING_DEFAULT == 0.0
    assert runtime.get_gradient_clipping({"gradient_clipping": 0.5}) == 0.5
    assert runtime.get_log_level({}) is runtime_constants.LOG_LEVEL_DEFAULT is None
    assert runtime.get_log_level({"log_level": "ERROR"}) == "ERROR"
    config = runtime.DeepSpeedConfig({"train_batch_size": 2, "fp16": {"enabled": True}, "log_level": "info"})
    assert config.float16_config.enabled is True and config.bfloat16_config.enabled is False
    assert config.log_level == "info"


def test_log_level_key_is_checked_and_applied_by_initialize() -> None:
    with pytest.raises(ConfigError, match="log_level.*'loud'.*debug, info, warning, error, critical"):
        load_config({"train_batch_size": 1, "log_level": "loud"})
    run_distributed(_log_level_applied, 1)  # (initialize makes a process group: never in the pytest process)


def _log_level_applied() -> None:
    logger = get_logger()
    saved = logger.level, [handler.level for handler in logger.handlers]
    try:
        engine, *_ = zerotune.initialize(model=nn.Linear(2, 2), config={"train_batch_size": 1, "log_level": "ERROR",
                                                                        "optimizer": {"type": "SGD",
                                                                                      "params": {"lr": 0.1}}})
        assert engine.log_level() == "ERROR" and logger.getEffectiveLevel() == logging.ERROR
        logger.setLevel(logging.WARNING)
        engine, *_ = zerotune.initialize(model=nn.Linear(2, 2), config={"train_batch_size": 1, "optimizer": {
            "type": "SGD", "params": {"lr": 0.1}}})
        assert engine.log_level() is None and logger.getEffectiveLevel() == logging.WARNING  # left alone
    finally:
        logger.setLevel(saved[0])
        for handler, level in zip(logger.handlers, saved[1]):
            handler.setLevel(level)


@pytest.mark.parametrize("given, expected", [
    ((32, 16, None), (32, 16, 1)), ((32, None, 2), (32, 8, 2)), ((None, 8, 2), (32, 8, 2)), ((32, None, None),
                                                                                             (32, 16, 1))])
def test_deepspeed_config_resolves_the_batch_triple_again(given: tuple, expected: tuple) -> None:
    config = runtime.DeepSpeedConfig({"train_batch_size": 2})
    config.world_size = 2
    config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps = given
    config._configure_train_batch_size()
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps) == expected


@pytest.mark.parametrize("given", [(33, 17, 2), (32, 18, 1), (None, None, 2)])
def test_deepspeed_config_batch_assertion(given: tuple) -> None:
    config = runtime.DeepSpeedConfig({"train_batch_size": 2})
    config.world_size = 2
    config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps = given
    with pytest.raises(AssertionError, match="train_batch_size"):
        config._configure_train_batch_size()


def test_initialize_without_a_model_is_an_assertion_too() -> None:
    with pytest.raises(AssertionError, match="needs model="):
        zerotune.initialize(model=None, config={"train_batch_size": 1})
    with pytest.raises(ValueError, match="first argument, args="):
        zerotune.initialize(nn.Linear(2, 2), config={"train_batch_size": 1})


def test_config_file_in_hjson_is_read_when_hjson_is_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ds.json"
    path.write_text("{\n  train_batch_size: 4\n  # a comment\n}\n")
    try:
        import hjson  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="not valid JSON.*hjson package"):
            load_config(str(path))
    else:
        assert load_config(str(path)).train_batch_size == 4
        path.write_text('{"train_batch_size": 4, "train_batch_size": 4,}')
        with pytest.raises(ConfigError, match="twice"):
            load_config(str(path))

    monkeypatch.setitem(sys.modules, "hjson", None)  # absent: plain JSON only, and the error says why
    path.write_text("{\n  train_batch_size: 4\n}\n")
    with pytest.raises(ConfigError, match="not valid JSON.*hjson package"):
        load_config(str(path))
