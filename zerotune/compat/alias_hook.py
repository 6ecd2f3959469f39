"""The persistent ``deepspeed`` alias hook: stdlib only, run by ``site`` at every interpreter start.

``zerotune deepspeed-alias install`` copies this file's text into the environment's site-packages
as ``_zerotune_deepspeed_alias.py`` next to ``zerotune_deepspeed_alias.pth``, whose one line ``site``
executes: ``import _zerotune_deepspeed_alias; _zerotune_deepspeed_alias.hook("MODULE:FUNCTION")``.
``hook`` puts a ``LazyDeepSpeedAlias`` first on ``sys.meta_path``; imported as
``zerotune.compat.alias_hook`` (by ``alias.py``) the module only lends out ``DEEPSPEED_VERSION`` and
the distribution.

Why lazy: every Python process of the environment runs this (pip, linters, tools), and most of
them never import DeepSpeed. So nothing here imports zerotune, torch, or even ``importlib.metadata``
(~20 ms) at start. The first ``deepspeed`` / ``deepspeed.*`` lookup activates the real alias -- the
function the ``.pth`` line names (``persistent.py`` writes ``zerotune.compat.alias``'s
``install_deepspeed_alias``) -- and the lazy finder steps aside. The installer is named by the
``.pth`` line, not imported here, so this stdlib-only bottom layer does not depend on the alias
that depends on it.

Why the version answer lives here: transformers and accelerate ask
``importlib.metadata.version("deepspeed")`` before they import it, so the answer must come
without activating anything. It is given to lookups over the interpreter's own ``sys.path`` only:
pip scans site directories one by one (``distributions(path=[dir])``) and should not see, offer
to uninstall, or count as installed a distribution that has no files.

A broken hook must never break interpreter start: the activation at import is wrapped, and a
zerotune that is no longer importable turns ``import deepspeed`` back into an ordinary
``ModuleNotFoundError``.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is not imported at interpreter start
    from typing import Any, Iterable

# The DeepSpeed release whose public API the compatibility package follows. transformers needs
# >= 0.9.3, accelerate checks feature gates against it; the local part says what it really is.
DEEPSPEED_VERSION = "0.18.0+zerotune"

HOOK_MODULE = "_zerotune_deepspeed_alias"
"""The name this file has once copied into site-packages (the ``.pth`` line imports it)."""

_DISTRIBUTION_CLASS: Any = None


def deepspeed_distribution() -> Any:
    """The ``importlib.metadata.Distribution`` for "deepspeed" that reports ``DEEPSPEED_VERSION``.

    The class is built on first use: whoever asks for distributions has imported
    ``importlib.metadata`` already, and a process that never asks does not pay for it."""
    global _DISTRIBUTION_CLASS
    if _DISTRIBUTION_CLASS is None:
        import importlib.metadata
        from pathlib import Path

        class _DeepSpeedDistribution(importlib.metadata.Distribution):
            """What ``importlib.metadata.version("deepspeed")`` finds while the alias is on."""

            def read_text(self, filename: str) -> str | None:
                if filename == "METADATA":
                    return (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {DEEPSPEED_VERSION}\n"
                            "Summary: zerotune's DeepSpeed compatibility alias\nAuthor: zerotune\n")
                return None

            def locate_file(self, path: Any) -> Path:
                return Path(__file__).parent / str(path)

        _DISTRIBUTION_CLASS = _DeepSpeedDistribution
    return _DISTRIBUTION_CLASS()


def deepspeed_distributions(context: Any) -> Iterable[Any]:
    """``find_distributions`` for both alias finders: the "deepspeed" distribution when asked for
    that name or for every distribution, over the interpreter's ``sys.path`` (not a given path)."""
    name = getattr(context, "name", None)
    if getattr(context, "path", sys.path) is not sys.path:
        return iter(())
    if name is None or name.replace("_", "-").lower() == "deepspeed":
        return iter([deepspeed_distribution()])
    return iter(())


def _is_deepspeed(fullname: str) -> bool:
    return fullname == "deepspeed" or fullname.startswith("deepspeed.")


class LazyDeepSpeedAlias:
    """A meta-path finder that turns the real alias on at the first ``deepspeed`` lookup, then leaves.

    ``activate`` names the function that installs the real alias, as ``"package.module:function"``."""

    _zerotune_findable: bool | None = None

    def __init__(self, activate: str) -> None:
        module, _, function = activate.partition(":")
        if not module or not function:
            raise ValueError(f"activate must read 'package.module:function', got {activate!r}")
        self.activate_module, self.activate_function = module, function

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not _is_deepspeed(fullname):
            return None
        # Leave first: importing zerotune may itself look ``deepspeed`` up, which must not recurse.
        self.leave()
        import importlib

        package = self.activate_module.partition(".")[0]
        try:
            installer = getattr(importlib.import_module(self.activate_module), self.activate_function)
        except ModuleNotFoundError as error:
            if error.name is not None and (error.name == package or error.name.startswith(package + ".")):
                return None  # zerotune was uninstalled: an ordinary "No module named 'deepspeed'"
            raise
        installer()
        for finder in sys.meta_path:  # the alias's finder now goes first
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                return spec
        return None

    def find_distributions(self, context: Any = None) -> Iterable[Any]:
        # No version for a deepspeed that would not import (zerotune uninstalled since the hook was written).
        if self._zerotune_findable is None:
            import importlib.util

            self._zerotune_findable = importlib.util.find_spec(self.activate_module.partition(".")[0]) is not None
        return deepspeed_distributions(context) if self._zerotune_findable else iter(())

    def leave(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def hook(activate: str) -> None:
    """Put the lazy finder first on ``sys.meta_path`` (once per interpreter); the ``.pth`` line's call.

    Never raises: a broken hook must not put a traceback on every interpreter start."""
    try:
        if not any(type(finder).__name__ == LazyDeepSpeedAlias.__name__ for finder in sys.meta_path):
            sys.meta_path.insert(0, LazyDeepSpeedAlias(activate))
    except Exception:
        pass
