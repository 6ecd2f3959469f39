"""The persistent ``deepspeed`` alias: a ``.pth`` hook in an environment's site-packages.

``install_deepspeed_alias()`` reaches one process; launchers that start their own workers
(torchrun under a tool, Ray, ``subprocess``) need every process of the environment to resolve
``import deepspeed`` to zerotune. Two files do it, both named so that ``status`` and ``remove``
can find exactly what ``install`` wrote:

* ``_zerotune_deepspeed_alias.py``: a verbatim copy of ``alias_hook.py`` (stdlib only, lazy);
* ``zerotune_deepspeed_alias.pth``: one line, run by ``site`` at start, importing that module and calling
  its ``hook`` with the installer to activate (``zerotune.compat.alias:install_deepspeed_alias``);

and the ``deepspeed`` command in the environment's scripts directory (``zerotune.compat.launcher``),
marked as zerotune's so that ``remove`` deletes it and never a real DeepSpeed's.

Installing over a real DeepSpeed is refused unless forced: the alias would shadow it in every
process of the environment, which nobody should get by surprise.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from zerotune.compat.alias import install_deepspeed_alias
from zerotune.compat.alias_hook import HOOK_MODULE

PTH_NAME = "zerotune_deepspeed_alias.pth"
HOOK_NAME = HOOK_MODULE + ".py"
ACTIVATE = f"{install_deepspeed_alias.__module__}:{install_deepspeed_alias.__name__}"
PTH_TEXT = f"import {HOOK_MODULE}; {HOOK_MODULE}.hook({ACTIVATE!r})\n"
HOOK_SOURCE = Path(__file__).with_name("alias_hook.py")
LAUNCHER_MARK = "# written by zerotune deepspeed-alias install: DeepSpeed's launcher on zerotune"

_PROBE = """\
import sys
try:
    import deepspeed
except ImportError as error:
    print(f"import deepspeed fails ({type(error).__name__}: {error})")
    sys.exit(0)
import importlib.metadata, zerotune
if getattr(getattr(deepspeed, "initialize", None), "__wrapped__", None) is zerotune.initialize:
    print(f"zerotune (deepspeed {importlib.metadata.version('deepspeed')})")
else:
    print(f"a real DeepSpeed ({getattr(deepspeed, '__file__', None)})")
"""


class AliasInstallError(RuntimeError):
    """``install`` was refused or could not write; the message is one line saying why and what to do."""


@dataclass(frozen=True)
class RealDeepSpeed:
    """A DeepSpeed found by the path-based finders (a package and/or a ``.dist-info``)."""

    where: str
    version: str | None

    def describe(self) -> str:
        return f"DeepSpeed{' ' + self.version if self.version else ''} at {self.where}"


@dataclass(frozen=True)
class HookStatus:
    """What ``zerotune deepspeed-alias status`` reports."""

    pth: Path
    installed: bool
    hook: str
    """'current', 'stale' (differs from this zerotune's alias_hook.py) or 'missing'."""
    real: RealDeepSpeed | None
    resolves_to: str
    """What ``import deepspeed`` gives in a new process of this interpreter, in words."""

    @property
    def ok(self) -> bool:
        return self.installed and self.hook == "current" and self.resolves_to.startswith("zerotune")


def site_packages(target: str | os.PathLike | None = None) -> Path:
    """The directory the hook goes into: ``target``, else the running interpreter's purelib
    (a virtual environment's site-packages when it is the active one)."""
    return Path(target) if target is not None else Path(sysconfig.get_paths()["purelib"])


def find_real_deepspeed(search: list[str] | None = None) -> RealDeepSpeed | None:
    """A DeepSpeed installed on ``search`` (default: ``sys.path`` without the current directory).

    Only the path-based finders are asked, so the alias itself (a meta-path finder, and a hook
    file that is not named ``deepspeed``) is never mistaken for one. A bare namespace directory
    left behind by an uninstall is not a DeepSpeed."""
    if search is None:
        cwd = os.getcwd()
        search = [entry for entry in sys.path if entry and os.path.abspath(entry) != cwd]
    spec = importlib.machinery.PathFinder.find_spec("deepspeed", search)
    package = Path(spec.origin).parent if spec is not None and spec.origin not in (None, "namespace") else None
    context = importlib.metadata.DistributionFinder.Context(name="deepspeed", path=search)
    dist = next(iter(importlib.machinery.PathFinder.find_distributions(context)), None)
    version = dist.version if dist is not None else None
    if package is not None:
        return RealDeepSpeed(str(package), version)
    if dist is not None:
        return RealDeepSpeed(str(getattr(dist, "_path", None) or dist.locate_file("")), version)
    return None


def install_hook(target: str | os.PathLike | None = None, force: bool = False) -> str:
    """Write (or rewrite) the two hook files; returns one line saying what happened.

    Raises ``AliasInstallError`` when a real DeepSpeed is present and ``force`` is off, or the
    directory cannot be written."""
    directory = site_packages(target)
    if not directory.is_dir():
        raise AliasInstallError(f"{directory} is not a directory; pass --target an existing site-packages "
                                f"directory, or leave it out to use this interpreter's ({site_packages()})")
    real = find_real_deepspeed([str(directory)] if target is not None else None)
    if real is not None and not force:
        raise AliasInstallError(
            f"a real {real.describe()} is installed, and the alias would shadow it in every process of this "
            f"environment: run `pip uninstall deepspeed` first, or install zerotune in a separate virtual environment, "
            f"or use `zerotune run --as-deepspeed script.py` for one run (shadowing it for that run only); "
            f"--force installs the alias anyway")
    if not os.access(directory, os.W_OK):
        raise AliasInstallError(f"{directory} is not writable: activate a virtual environment you own "
                                f"(python -m venv), or run with permission to write there")
    pth, hook = directory / PTH_NAME, directory / HOOK_NAME
    before = _state(pth, hook)
    try:
        _write(hook, HOOK_SOURCE.read_text())  # the module first: a .pth never names a missing module
        _write(pth, PTH_TEXT)
        _forget_bytecode(hook)
    except OSError as error:
        raise AliasInstallError(f"could not write the hook into {directory}: {error}") from None
    said = {"absent": "installed", "current": "already installed", "other": "updated"}[before]
    launcher = _install_launcher(target)
    if real is None:
        return f"{said}: {pth}{launcher}"
    return (f"{said}: {pth}{launcher} (shadowing the real {real.describe()}; `zerotune deepspeed-alias remove` brings "
            "it back)")


def remove_hook(target: str | os.PathLike | None = None) -> str:
    """Delete the two hook files; returns one line ("removed: ..." or "not installed: ...")."""
    directory = site_packages(target)
    pth, hook = directory / PTH_NAME, directory / HOOK_NAME
    if not pth.exists() and not hook.exists():
        return f"not installed: no {PTH_NAME} in {directory}"
    try:
        for path in (pth, hook):  # the .pth first, so no start ever imports a deleted module
            path.unlink(missing_ok=True)
        _forget_bytecode(hook)
    except OSError as error:
        raise AliasInstallError(f"could not remove the hook from {directory}: {error}") from None
    launcher = launcher_path(target)
    if launcher is not None and is_zerotune_launcher(launcher):
        launcher.unlink()
    return f"removed: {pth}"


def hook_status(target: str | os.PathLike | None = None, timeout: float = 300.0) -> HookStatus:
    """Whether the hook is installed and current, whether a real DeepSpeed is there, and what
    ``import deepspeed`` resolves to in a fresh process of this interpreter."""
    directory = site_packages(target)
    pth, hook = directory / PTH_NAME, directory / HOOK_NAME
    installed = pth.is_file() and pth.read_text() == PTH_TEXT
    if not hook.is_file():
        hook_state = "missing"
    else:
        hook_state = "current" if hook.read_text() == HOOK_SOURCE.read_text() else "stale"
    real = find_real_deepspeed([str(directory)] if target is not None else None)
    return HookStatus(pth, installed, hook_state, real, _probe(timeout))


def launcher_path(target: str | os.PathLike | None = None) -> Path | None:
    """Where the ``deepspeed`` command goes: this interpreter's scripts directory (none with ``--target``,
    whose environment's scripts directory is not known)."""
    return None if target is not None else Path(sysconfig.get_paths()["scripts"]) / "deepspeed"


def is_zerotune_launcher(path: Path) -> bool:
    try:
        return LAUNCHER_MARK in path.read_text(errors="replace")[:500]
    except OSError:
        return False


def _install_launcher(target: str | os.PathLike | None) -> str:
    """Write the ``deepspeed`` command (DeepSpeed's launcher, run as ``zerotune run --as-deepspeed``) unless a
    real DeepSpeed's command is there; returns the words to add to install's line."""
    path = launcher_path(target)
    if path is None:
        return "; no `deepspeed` command written (--target names no scripts directory)"
    if path.exists() and not is_zerotune_launcher(path):
        return f"; `deepspeed` command left as it is ({path} is not zerotune's)"
    try:
        _write(path, f"#!{sys.executable}\n{LAUNCHER_MARK}\nimport sys\n\nfrom zerotune.compat.launcher import main\n\n"
                     "sys.exit(main())\n")
        path.chmod(0o755)
    except OSError as error:
        raise AliasInstallError(f"could not write the deepspeed command {path}: {error}") from None
    return f"; `deepspeed` command: {path}"


def _probe(timeout: float) -> str:
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"unknown: `{sys.executable} -c 'import deepspeed'` did not finish within {timeout:.0f} s"
    lines = (done.stdout if done.returncode == 0 else done.stderr).strip().splitlines()
    return lines[-1] if lines else f"unknown: the probe exited with status {done.returncode}"


def _state(pth: Path, hook: Path) -> str:
    if not pth.exists() and not hook.exists():
        return "absent"
    same = (pth.is_file() and pth.read_text() == PTH_TEXT and hook.is_file()
            and hook.read_text() == HOOK_SOURCE.read_text())
    return "current" if same else "other"


def _write(path: Path, text: str) -> None:
    """Replace ``path`` in one step: an interpreter starting meanwhile sees the old file or the new one."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def _forget_bytecode(hook: Path) -> None:
    """A rewrite within the same second and of the same size would otherwise keep the old bytecode."""
    Path(importlib.util.cache_from_source(str(hook))).unlink(missing_ok=True)
