"""Property tests: any bad config fails with ConfigError naming the key, never another exception."""

from __future__ import annotations

import copy
import json
import typing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from zerotune.config import ConfigError, ZeroTuneConfig, load_config, resolve_config
from zerotune.config.tree import is_free_dict, section_class, set_path

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CONFIGS = Path(__file__).parent / "data" / "configs"

# A valid config that instantiates every optional section, so any section path exists.
BASE: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "scheduler": {"type": "WarmupLR", "params": {}},
    "lr_scaling": {"rule": "linear", "base_batch_size": 256},
}


def _schema_paths(cls=ZeroTuneConfig, prefix=""):
    """(section paths, scalar leaf paths with their annotation, free-dict paths)."""
    sections, leaves, free = [(prefix, cls)], [], []
    for name, field in cls.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        sub = section_class(field.annotation)
        if sub is not None:
            s, l, f = _schema_paths(sub, path)
            sections += s
            leaves += l
            free += f
        elif is_free_dict(field.annotation):
            free.append(path)
        else:
            leaves.append((path, field.annotation))
    return sections, leaves, free


SECTIONS, LEAVES, FREE_DICTS = _schema_paths()


def _accepts_strings(annotation) -> bool:
    """Whether some string other than "auto" could be valid for the field."""
    if annotation is str:
        return True
    if typing.get_origin(annotation) is typing.Literal:
        return any(isinstance(v, str) and v != "auto" for v in typing.get_args(annotation))
    return any(_accepts_strings(arg) for arg in typing.get_args(annotation))


def _expect_config_error(call, path: str) -> ConfigError:
    try:
        call()
    except ConfigError as err:
        assert path in str(err), f"{path!r} not named in {str(err)!r}"
        assert "\n" not in str(err)
        return err
    raise AssertionError(f"no ConfigError for bad value at {path}")


@FUZZ
@given(
    section=st.sampled_from(SECTIONS),
    key=st.one_of(st.text(alphabet="abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=24), st.text(min_size=1, max_size=8)),
    value=st.one_of(st.integers(), st.booleans(), st.text(max_size=5), st.none()),
)
def test_unknown_key_at_any_depth(section, key, value):
    path, cls = section
    assume(key not in cls.model_fields and key not in cls.ALIASES and key not in cls.NO_EFFECT)
    assume(not key.startswith("_"))  # "_comment" keys are comments
    assume(key not in ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"))  # legacy, translated
    config = copy.deepcopy(BASE)
    node = config
    for part in path.split(".") if path else []:
        node = node.setdefault(part, {})
    node[key] = value
    shown = key if key.isprintable() else json.dumps(key)
    _expect_config_error(lambda: load_config(config), f"{path}.{shown}" if path else shown)


def _scalar_list(annotation) -> bool:
    """A list of numbers (``Optional`` unwrapped), where a list of integers is a good value."""
    lists = [a for a in (annotation, *typing.get_args(annotation)) if typing.get_origin(a) is list]
    return bool(lists) and section_class(typing.get_args(lists[0])[0]) is None


def _bad_value(annotation):
    is_list = typing.get_origin(annotation) is list  # an empty list is a good value for a list of sections
    items = st.dictionaries(st.text(max_size=4), st.integers(), min_size=1, max_size=2) \
        if _scalar_list(annotation) else st.integers()
    junk = st.one_of(
        st.lists(items, min_size=1 if is_list else 0, max_size=3),
        st.dictionaries(st.text(max_size=4), st.integers(), min_size=1, max_size=2),
    )
    if _accepts_strings(annotation):
        return st.one_of(junk, st.integers(min_value=-5, max_value=10**12))
    return st.one_of(junk, st.text(max_size=6).filter(lambda s: s != "auto"))


@FUZZ
@given(data=st.data(), leaf=st.sampled_from(LEAVES))
def test_wrong_type_for_known_field(data, leaf):
    path, annotation = leaf
    value = data.draw(_bad_value(annotation), label="value")
    config = copy.deepcopy(BASE)
    set_path(config, path, value)
    _expect_config_error(lambda: load_config(config), path)


@FUZZ
@given(path=st.sampled_from(FREE_DICTS), value=st.one_of(st.lists(st.integers()), st.integers(), st.text()))
def test_params_must_be_a_mapping(path, value):
    config = copy.deepcopy(BASE)
    set_path(config, path, value)
    _expect_config_error(lambda: load_config(config), path)


@FUZZ
@given(
    tbs=st.integers(1, 512), micro=st.integers(1, 64), gas=st.integers(1, 16), dp=st.integers(1, 16),
    drop=st.sampled_from([None, "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"]),
)
def test_inconsistent_batch_triple(tbs, micro, gas, dp, drop):
    config = {"train_batch_size": tbs, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas}
    if drop is None:
        assume(tbs != micro * gas * dp)
    else:
        del config[drop]
        other = gas if drop == "train_micro_batch_size_per_gpu" else micro
        assume(tbs % (other * dp) != 0)
    err = _expect_config_error(lambda: resolve_config(config, dp_world_size=dp), "train_batch_size")
    assert str(tbs) in err.message and str(dp) in err.message


@FUZZ
@given(bf16_key=st.sampled_from(["bf16", "bfloat16"]), extra=st.dictionaries(
    st.sampled_from(["loss_scale", "hysteresis", "initial_scale_power"]), st.integers(1, 30)))
def test_fp16_and_bf16_together(bf16_key, extra):
    config = {"fp16": {"enabled": True, **extra}, bf16_key: {"enabled": True}}
    err = _expect_config_error(lambda: load_config(config), "bf16")
    assert "fp16" in str(err)


JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=6), st.just("auto")),
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(st.text(max_size=6), children, max_size=3)),
    max_leaves=8,
)
KNOWN_TOP = sorted(ZeroTuneConfig.model_fields) + ["bfloat16", "autotuning"]


@FUZZ
@given(config=st.dictionaries(st.sampled_from(KNOWN_TOP), JSON_VALUES, max_size=5), dp=st.integers(1, 8),
       strict=st.booleans())
def test_arbitrary_values_never_leak_other_exceptions(config, dp, strict):
    try:
        resolve_config(load_config(config), dp_world_size=dp, strict=strict)
    except ConfigError:
        pass


def _leaf_paths(node, prefix=""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaf_paths(value, f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix


HF_ZERO3 = json.loads((CONFIGS / "ds_config_zero3.json").read_text())
HF_LEAVES = list(_leaf_paths(HF_ZERO3))


@FUZZ
@given(path=st.sampled_from(HF_LEAVES), value=JSON_VALUES, strict=st.booleans())
def test_mutated_hf_config_never_leaks_other_exceptions(path, value, strict):
    config = copy.deepcopy(HF_ZERO3)
    set_path(config, path, value)
    try:
        resolve_config(load_config(config), dp_world_size=2, strict=strict)
    except ConfigError as err:
        # the mutated key (or a neighbour it is checked against) is named
        assert err.path, str(err)


def test_fuzz_covers_the_schema():
    assert len(LEAVES) > 80 and len(SECTIONS) > 15
    assert "zero_optimization.offload_optimizer" in [p for p, _ in SECTIONS]
    assert "optimizer.params" in FREE_DICTS


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
