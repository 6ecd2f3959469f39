"""Boolean config flags take JSON's 0 / 1 as DeepSpeed does (its own tests write ``"zero_allow_untested_optimizer":
1``), and still refuse other numbers and strings with the key named."""

from __future__ import annotations

import pytest

from zerotune.config.errors import ConfigError
from zerotune.config.loading import load_config


def test_zero_and_one_are_flags() -> None:
    config = load_config({"train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": 1,
                          "zero_optimization": {"stage": 2, "contiguous_gradients": 0}})
    assert config.zero_allow_untested_optimizer is True and config.zero_optimization.contiguous_gradients is False


@pytest.mark.parametrize("value", [2, -1, 1.0, "true", "1"])
def test_other_values_are_refused_naming_the_key(value: object) -> None:
    with pytest.raises(ConfigError, match="zero_allow_untested_optimizer.*expected a boolean"):
        load_config({"train_micro_batch_size_per_gpu": 2, "zero_allow_untested_optimizer": value})
