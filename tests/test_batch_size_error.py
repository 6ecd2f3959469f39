"""A batch triple that does not fit is a ConfigError and, as in DeepSpeed (whose ``_batch_assertion`` is an
assert), an AssertionError: what accelerate on a CPU-only host with a DEEPSPEED config runs into on both."""

from __future__ import annotations

import pickle

import pytest

from zerotune.config import load_config
from zerotune.config.errors import BatchSizeError, ConfigError
from zerotune.config.resolve import resolve_config


@pytest.mark.parametrize("config", [
    {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1},  # 2 != 2*1*2
    {"train_batch_size": 3, "train_micro_batch_size_per_gpu": 1},  # 3 not divisible by 1*2
])
def test_a_batch_triple_that_does_not_fit_is_an_assertion_error_too(config) -> None:
    with pytest.raises(AssertionError, match="train_batch_size") as raised:
        resolve_config(load_config(config), dp_world_size=2)
    assert isinstance(raised.value, ConfigError) and isinstance(raised.value, ValueError)
    again = pickle.loads(pickle.dumps(raised.value))  # crosses process boundaries intact
    assert type(again) is BatchSizeError and str(again) == str(raised.value)
