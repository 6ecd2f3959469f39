"""Every modelled config key is honoured, reported as having no effect, or refused -- never ignored.

The walk visits every field of every config section reachable from the training config
(``ZeroTuneConfig``) and the inference config (``InferenceConfig``), through optional, list and
dict fields, and asks of each one of three things:

* it is read by the package outside the config modules: its name is accessed as an attribute
  (``cfg.aio.block_size``) or spelled as a string (``getattr(section, "block_size")``) in a module of
  ``zerotune/`` other than ``zerotune/config/`` and the root's own module. A name shared with an
  unrelated attribute elsewhere passes too -- the check is textual -- but a key nothing names at all
  (``pipeline.seed_layers``, ``aio.single_submit`` and ``aio.overlap_events`` were such keys) fails;
* it is listed in its section's ``NO_EFFECT_FIELDS`` with the reason (``zerotune check`` prints it and
  ``initialize`` logs it when a config sets it);
* it is refused for the values the engine cannot run: by ``assert_implemented``, or by its own section
  (a ``NotSupportedError`` naming the field in the section's class, e.g. a curriculum kind other than seqlen).

A field holding a block (``checkpoint.parallel_write``) is judged by the block's own fields.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest

import zerotune
from zerotune.config import ZeroTuneConfig, load_config
from zerotune.config.implemented import refused_paths
from zerotune.config.section import Section
from zerotune.inference.config import InferenceConfig

PACKAGE = Path(zerotune.__file__).parent
ROOTS = {"": (ZeroTuneConfig, PACKAGE / "config"), "inference": (InferenceConfig, PACKAGE / "inference" / "config.py")}


def _sections_in(annotation: object) -> Iterator[tuple[type[Section], str]]:
    """The Section classes an annotation holds, with the path suffix of how (``[]`` for list items and dict values)."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        yield annotation, ""
        return
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (list, dict, tuple, set, frozenset):
        for arg in args[-1:]:
            for section, suffix in _sections_in(arg):
                yield section, "[]" + suffix
    elif origin in (typing.Union, types.UnionType, typing.Annotated):
        for arg in args:
            yield from _sections_in(arg)


def walk_fields(root: type[Section], prefix: str = "") -> Iterator[tuple[str, type[Section], str]]:
    """(dotted path, the section class declaring it, field name) for every field under ``root``."""
    for name, info in root.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        yield path, root, name
        for section, suffix in _sections_in(info.annotation):
            yield from walk_fields(section, path + suffix)


def names_read(excluded: list[Path]) -> set[str]:
    """Attribute names accessed and string constants spelled in the package, outside ``excluded``."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if any(path == skip or skip in path.parents for skip in excluded):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)
    return names


@functools.cache
def refused_by_section(section: type[Section], name: str) -> bool:
    """Whether the section's class (or a base) raises NotSupportedError / NotSupportedYetError naming the field."""
    for cls in section.__mro__:
        if not (isinstance(cls, type) and issubclass(cls, Section)) or cls is Section:
            continue
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls)))):
            if (isinstance(node, ast.Call) and node.args
                    and getattr(node.func, "id", getattr(node.func, "attr", "")).startswith("NotSupported")
                    and any(isinstance(c, ast.Constant) and c.value == name for c in ast.walk(node.args[0]))):
                return True
    return False


def _cases() -> list[tuple[str, type[Section], str, set[str]]]:
    cases = []
    for label, (root, own_module) in ROOTS.items():
        read = names_read([PACKAGE / "config", own_module])
        cases += [(f"{label}:{path}" if label else path, section, name, read)
                  for path, section, name in walk_fields(root)]
    return cases


CASES = _cases()


def test_the_walk_reaches_nested_sections():
    paths = {path for path, *_ in CASES}
    assert {"aio.single_submit", "pipeline.seed_layers", "zero_optimization.offload_param.max_in_cpu",
            "tensor_parallel.partition_config.layer_specs[].patterns",
            "data_efficiency.data_sampling.curriculum_learning.curriculum_metrics[].clustering_type",
            "inference:tensor_parallel.tp_size"} <= paths
    assert len(CASES) > 150


@pytest.mark.parametrize("path,section,name,read", CASES, ids=[case[0] for case in CASES])
def test_every_field_is_read_reported_or_refused(path, section, name, read):
    if any(True for _ in _sections_in(section.model_fields[name].annotation)):
        return  # a block: its fields are cases of their own
    if name in section.NO_EFFECT_FIELDS:
        assert section.NO_EFFECT_FIELDS[name].strip(), f"{path}: a no-effect key needs its reason"
        return
    if path in refused_paths() or refused_by_section(section, name):
        return
    assert name in read, (f"{path} is accepted but nothing outside zerotune/config/ reads it: honour it, list it in "
                          f"{section.__name__}.NO_EFFECT_FIELDS with the reason, or refuse it in config/implemented.py")


def test_no_effect_lists_name_real_fields():
    """A NO_EFFECT_FIELDS entry for a field that does not exist would report nothing."""
    for section in {section for _, section, _, _ in CASES}:
        assert set(section.NO_EFFECT_FIELDS) <= set(section.model_fields), section.__name__


@pytest.mark.parametrize("key,block", [("seed_layers", "pipeline"), ("single_submit", "aio"),
                                       ("overlap_events", "aio")])
def test_the_keys_the_review_found_are_reported_when_set(key, block):
    cfg = load_config({block: {key: True if key != "overlap_events" else False}})
    notes = dict(cfg.notes)
    assert notes[f"{block}.{key}"].startswith("no effect here: ")
