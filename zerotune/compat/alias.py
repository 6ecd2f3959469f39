"""The ``deepspeed`` import alias: ``import deepspeed.<path>`` resolves to zerotune's modules.

Three pieces, installed together by ``install_deepspeed_alias()``:

* a meta-path finder that answers every ``deepspeed`` / ``deepspeed.*`` import from the table
  in ``zerotune.compat.paths``: a mapped path becomes *the same module object* as its zerotune
  target (so ``isinstance`` and monkey-patching see one class, one module); a refused path
  raises ``DeepSpeedFeatureNotSupported`` naming the feature; any other path is a
  ``ModuleNotFoundError`` naming what is supported (never a silent fall-through that would
  import a second copy of a zerotune file under a DeepSpeed name);
* the same finder answers ``importlib.metadata`` for the distribution "deepspeed" with
  ``DEEPSPEED_VERSION``, which is what transformers and accelerate check before using it;
* nothing else: no file is written and nothing outside this process changes.

The finder goes first on ``sys.meta_path``, so an installed DeepSpeed is shadowed while the
alias is on (that is the point: the script runs on zerotune).

For every process of an environment (torchrun workers, Ray workers, subprocesses) ``zerotune
deepspeed-alias install`` writes a ``.pth`` hook (``alias_hook.py``, see ``persistent.py``) that
calls ``install_deepspeed_alias()`` at a process's first ``deepspeed`` import.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
from types import ModuleType
from typing import Any, Iterable

from zerotune.compat.alias_hook import DEEPSPEED_VERSION, deepspeed_distributions
from zerotune.compat.paths import DEEPSPEED_MODULES, REFUSED_MODULES, DeepSpeedFeatureNotSupported

__all__ = ["DEEPSPEED_VERSION", "DeepSpeedAliasFinder", "deepspeed_alias_installed", "install_deepspeed_alias",
           "install_zerotune_deepspeed_paths", "uninstall_deepspeed_alias"]

_DEFAULT_CONTEXT = importlib.metadata.DistributionFinder.Context()
"""``find_distributions``'s default context (importlib's signature), built once."""


class _AliasLoader(importlib.abc.Loader):
    """Hands out the already-imported target module under the DeepSpeed name."""

    def __init__(self, target: str, deepspeed_name: str) -> None:
        self._target, self._deepspeed_name = target, deepspeed_name
        self._target_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self._target)
        self._target_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # importlib stamped the alias spec on the module; the module keeps its own identity.
        module.__spec__ = self._target_spec
        # ``from deepspeed.runtime.zero import partition_parameters`` looks the child up as an attribute
        # (the module's real name would send the import elsewhere): bind every mapped child now.
        prefix = self._deepspeed_name + "."
        for path, mapped in DEEPSPEED_MODULES.items():
            child = path[len(prefix):]
            if path.startswith(prefix) and "." not in child and not hasattr(module, child):
                setattr(module, child, importlib.import_module(mapped.module))


class _RefusingLoader(importlib.abc.Loader):
    def __init__(self, name: str, feature: str) -> None:
        self._name, self._feature = name, feature

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        raise DeepSpeedFeatureNotSupported(self._name, self._feature)

    def exec_module(self, module: ModuleType) -> None:  # never reached
        raise DeepSpeedFeatureNotSupported(self._name, self._feature)


class DeepSpeedAliasFinder(importlib.abc.MetaPathFinder):
    """Resolves ``deepspeed`` and ``deepspeed.*`` (see the module docstring)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        if fullname in REFUSED_MODULES:
            return importlib.machinery.ModuleSpec(fullname, _RefusingLoader(fullname, REFUSED_MODULES[fullname]))
        mapped = DEEPSPEED_MODULES.get(fullname)
        if mapped is None:
            raise ModuleNotFoundError(
                f"zerotune's DeepSpeed alias has no module '{fullname}'; the supported DeepSpeed modules are "
                f"listed by `python -m zerotune.compat.listing` (README: Using it from a DeepSpeed script)",
                name=fullname)
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(mapped.module, fullname), is_package=True)

    def find_distributions(self, context: Any = _DEFAULT_CONTEXT
                           ) -> Iterable[importlib.metadata.Distribution]:
        return deepspeed_distributions(context)


class ZerotuneDeepSpeedPathsFinder(importlib.abc.MetaPathFinder):
    """``import zerotune as deepspeed`` also for submodules: ``zerotune.<path>`` answers as
    ``deepspeed.<path>`` when zerotune has no module of that name (``zerotune.runtime.pipe.engine``,
    ``zerotune.accelerator``, ``zerotune.pt``; also ``zerotune.comm`` and ``zerotune.checkpointing``, which are
    ``compat.comm`` / ``compat.checkpointing``). It sits last on ``sys.meta_path``, so zerotune's own modules
    (``zerotune.zero``, ``zerotune.pipe``...) always win."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("zerotune."):
            return None
        deepspeed_name = "deepspeed." + fullname.split(".", 1)[1]
        if deepspeed_name in REFUSED_MODULES:
            return importlib.machinery.ModuleSpec(fullname, _RefusingLoader(deepspeed_name,
                                                                            REFUSED_MODULES[deepspeed_name]))
        mapped = DEEPSPEED_MODULES.get(deepspeed_name)
        if mapped is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(mapped.module, deepspeed_name), is_package=True)


_FINDER = DeepSpeedAliasFinder()
_ZEROTUNE_PATHS = ZerotuneDeepSpeedPathsFinder()


def install_zerotune_deepspeed_paths() -> None:
    """Done once when zerotune is imported (see ``ZerotuneDeepSpeedPathsFinder``)."""
    if _ZEROTUNE_PATHS not in sys.meta_path:
        sys.meta_path.append(_ZEROTUNE_PATHS)


def install_deepspeed_alias() -> None:
    """Make ``import deepspeed`` (and every supported ``deepspeed.<path>``) resolve to zerotune in
    this process, and ``importlib.metadata.version("deepspeed")`` report ``DEEPSPEED_VERSION``.
    Idempotent. Modules already imported under a ``deepspeed`` name (a real DeepSpeed) are dropped
    from ``sys.modules`` so the next import sees zerotune."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
        _forget_deepspeed_modules()


def uninstall_deepspeed_alias() -> None:
    """Undo ``install_deepspeed_alias`` (the aliased names are removed from ``sys.modules``)."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
        _forget_deepspeed_modules()


def deepspeed_alias_installed() -> bool:
    return _FINDER in sys.meta_path


def _forget_deepspeed_modules() -> None:
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
        del sys.modules[name]
