"""The ``deepspeed`` import alias: every listed DeepSpeed name resolves to zerotune's object, refused
features fail with one line naming them, and the README's list is generated from the table."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from pathlib import Path

import pytest

import zerotune
from zerotune.compat import DEEPSPEED_VERSION, DeepSpeedFeatureNotSupported, install_deepspeed_alias
from zerotune.compat.alias import uninstall_deepspeed_alias
from zerotune.compat.listing import BEGIN, END, render, with_listing
from zerotune.compat.paths import DEEPSPEED_MODULES, REFUSED_MODULES, REFUSED_NAMES

README = Path(__file__).resolve().parent.parent / "README.md"


def test_import_zerotune_comm_is_a_module_with_deepspeed_signatures() -> None:
    import inspect

    import zerotune.comm

    assert zerotune.comm is zerotune.__dict__["comm"]
    assert list(inspect.signature(zerotune.comm.all_reduce).parameters)[:4] == ["tensor", "op", "group", "async_op"]
    assert inspect.signature(zerotune.comm.all_reduce).parameters["group"].default is None


def test_every_listed_name_resolves_through_the_alias(alias) -> None:
    for path, mapped in DEEPSPEED_MODULES.items():
        module = importlib.import_module(path)
        assert module is importlib.import_module(mapped.module), path  # the same object, not a copy
        for name in mapped.names:
            assert hasattr(module, name), f"{path}.{name}"
        # ``from <path> import <names>`` works too (the statement's own machinery)
        imported = __import__(path, fromlist=list(mapped.names))
        assert all(getattr(imported, name) is getattr(module, name) for name in mapped.names)


def test_aliased_objects_are_zerotunes_own(alias) -> None:
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters, Init

    # deepspeed.initialize is zerotune's with DeepSpeed's process-wide effects around it (compat/deepspeed.py)
    assert deepspeed.initialize.__wrapped__ is zerotune.initialize and deepspeed.comm is zerotune.comm
    assert DeepSpeedEngine is zerotune.Engine and deepspeed.DeepSpeedEngine is zerotune.Engine
    assert Init is zerotune.zero.Init and GatheredParameters is zerotune.zero.GatheredParameters
    assert zerotune.comm.__spec__.name == "zerotune.compat.comm"  # the alias does not rename the module


def test_metadata_version_is_what_transformers_and_accelerate_accept(alias) -> None:
    from packaging.version import Version

    assert importlib.metadata.version("deepspeed") == DEEPSPEED_VERSION
    assert Version(DEEPSPEED_VERSION) >= Version("0.14.4")
    import deepspeed

    assert deepspeed.__version__ == DEEPSPEED_VERSION
    from transformers.integrations.deepspeed import is_deepspeed_available

    assert is_deepspeed_available()
    from transformers.utils.versions import require_version

    require_version("deepspeed>=0.9.3")


def test_alias_off_means_no_deepspeed() -> None:
    uninstall_deepspeed_alias()
    if importlib.util.find_spec("deepspeed") is None:  # no real DeepSpeed installed here
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("deepspeed")


@pytest.mark.parametrize("path", sorted(REFUSED_MODULES))
def test_refused_modules_name_the_feature(alias, path: str) -> None:
    with pytest.raises(DeepSpeedFeatureNotSupported) as info:
        importlib.import_module(path)
    message = str(info.value)
    assert "\n" not in message and "zerotune does not support" in message
    assert REFUSED_MODULES[path] in message or REFUSED_MODULES.get(path.rsplit(".", 1)[0], "?") in message
    assert isinstance(info.value, ImportError)  # try/except ImportError probes keep working


@pytest.mark.parametrize("name", sorted(REFUSED_NAMES))
def test_refused_names_fail_when_called(alias, name: str) -> None:
    module_name, attribute = name.rsplit(".", 1)
    refused = getattr(importlib.import_module(module_name), attribute)
    with pytest.raises(DeepSpeedFeatureNotSupported, match=REFUSED_NAMES[name].split(" (")[0]):
        refused(object())


def test_unknown_deepspeed_module_is_an_error_naming_it(alias) -> None:
    with pytest.raises(ModuleNotFoundError, match="no module 'deepspeed.runtime.fancy'.*zerotune.compat.listing"):
        importlib.import_module("deepspeed.runtime.fancy")
    # a zerotune file must never be imported a second time under a DeepSpeed name
    assert not any(name.startswith("deepspeed.") and "stage3" in name for name in sys.modules)


def test_install_is_idempotent_and_uninstall_forgets(alias) -> None:
    install_deepspeed_alias()
    import deepspeed  # noqa: F401

    assert sum(type(f).__name__ == "DeepSpeedAliasFinder" for f in sys.meta_path) == 1
    uninstall_deepspeed_alias()
    assert "deepspeed" not in sys.modules
    install_deepspeed_alias()
    assert importlib.import_module("deepspeed").initialize.__wrapped__ is zerotune.initialize


def test_zerotune_exposes_the_installer() -> None:
    assert zerotune.install_deepspeed_alias is install_deepspeed_alias


def test_readme_lists_exactly_what_the_table_says() -> None:
    text = README.read_text()
    assert BEGIN in text and END in text
    assert with_listing(text) == text, "README's DeepSpeed list is stale: python -m zerotune.compat.listing --write-readme README.md"
    assert "`deepspeed.comm`" in render() and "init_inference" in render()
