"""Every zerotune exception survives pickling with its message: process pools (DeepSpeed's own test harness,
``multiprocessing``) and Ray send a worker's exception to the parent pickled, and one that cannot be rebuilt
there kills the pool's result thread, so every later task waits forever instead of failing."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

import pytest

import zerotune


def _exception_classes() -> list[type[BaseException]]:
    found = {}
    for module_info in pkgutil.walk_packages(zerotune.__path__, "zerotune."):
        try:
            module = importlib.import_module(module_info.name)
        except Exception:  # noqa: BLE001 - an optional extra (a plotting or hub package) is not installed
            continue
        for value in vars(module).values():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__.startswith("zerotune."):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return [found[name] for name in sorted(found)]


def _instance(cls: type[BaseException]) -> BaseException:
    parameters = [p for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
                  if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return cls(*(f"{p.name}-value" for p in parameters)) if parameters else cls("a message")


CLASSES = _exception_classes()


def test_the_classes_are_found() -> None:
    names = {cls.__name__ for cls in CLASSES}
    assert {"ConfigError", "DeepSpeedFeatureNotSupported", "CheckpointError", "CollectiveMismatch"} <= names


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_an_exception_pickles_with_its_message(cls: type[BaseException]) -> None:
    error = _instance(cls)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is cls and str(again) == str(error)
