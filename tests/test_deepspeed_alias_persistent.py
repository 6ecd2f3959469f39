"""``zerotune deepspeed-alias install | remove | status`` in a fresh virtual environment: every process
there (torchrun workers, their subprocesses) resolves ``import deepspeed`` to zerotune, a process that
never imports it does not import torch, and a real DeepSpeed is not shadowed without ``--force``."""

from __future__ import annotations

import importlib.machinery
import os
import re
import site
import subprocess
import sys
from pathlib import Path

import pytest

import zerotune
from zerotune.cli.main import main
from zerotune.compat import DEEPSPEED_VERSION
from zerotune.compat.alias_hook import LazyDeepSpeedAlias
from zerotune.compat.persistent import ACTIVATE, HOOK_NAME, PTH_NAME, PTH_TEXT, AliasInstallError, install_hook

OUTER_HAS_DEEPSPEED = importlib.machinery.PathFinder.find_spec("deepspeed") is not None
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}

WORKER = """\
import importlib.metadata, os, subprocess, sys
import deepspeed, zerotune
assert deepspeed.initialize.__wrapped__ is zerotune.initialize
grandchild = subprocess.run(
    [sys.executable, "-c", "import deepspeed, zerotune; "
                           "assert deepspeed.initialize.__wrapped__ is zerotune.initialize; "
                           "print('grandchild ok')"], capture_output=True, text=True, timeout=240)
print(f"rank {os.environ['RANK']}: {importlib.metadata.version('deepspeed')} {grandchild.stdout.strip()}"
      f"{grandchild.stderr[-2000:]}", flush=True)
"""


class Venv:
    """A ``python -m venv --without-pip`` environment and helpers to run its interpreter."""

    def __init__(self, root: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
        self.python, self.root = str(root / "bin" / "python"), root
        purelib = self.run("-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
        self.site = Path(purelib)

    def run(self, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
        return subprocess.run([self.python, *args], capture_output=True, text=True, timeout=timeout, env=ENV,
                              cwd=self.root)

    def zerotune(self, *args: str) -> subprocess.CompletedProcess:
        return self.run("-m", "zerotune.cli.main", "deepspeed-alias", *args)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """A venv that sees torch and zerotune through a .pth naming this process's site directories and the
    repository (a venv made inside a venv is based on the base interpreter, not on the outer venv)."""
    if OUTER_HAS_DEEPSPEED:
        pytest.skip("a real DeepSpeed is installed here; the venv would see it through its .pth")
    env = Venv(tmp_path_factory.mktemp("alias") / "venv")
    repo = str(Path(zerotune.__file__).resolve().parent.parent)
    (env.site / "outer_env.pth").write_text("\n".join([repo, *site.getsitepackages()]) + "\n")
    return env


@pytest.fixture
def clean(venv: Venv):
    """Each test starts and ends without the hook and without a fake DeepSpeed."""
    yield venv
    for name in (PTH_NAME, HOOK_NAME, "deepspeed/__init__.py", "deepspeed-0.16.0.dist-info/METADATA"):
        (venv.site / name).unlink(missing_ok=True)
    for name in ("deepspeed", "deepspeed-0.16.0.dist-info"):
        if (venv.site / name).is_dir():
            (venv.site / name).rmdir()


def test_install_is_idempotent_status_reports_it_and_remove_undoes_it(clean: Venv, capsys) -> None:
    venv = clean
    first = venv.zerotune("install")
    assert first.returncode == 0 and first.stdout.startswith("installed: "), first.stdout + first.stderr
    assert (venv.site / PTH_NAME).read_text() == PTH_TEXT == ("import _zerotune_deepspeed_alias; "
                                                              "_zerotune_deepspeed_alias.hook('zerotune.compat.alias:install_deepspeed_alias')\n")
    launcher = venv.root / "bin" / "deepspeed"  # DeepSpeed's launcher command, on zerotune
    assert f"`deepspeed` command: {launcher}" in first.stdout and os.access(launcher, os.X_OK)
    usage = subprocess.run([str(launcher), "--help"], capture_output=True, text=True, timeout=240, env=ENV)
    assert usage.returncode == 0 and "DeepSpeed's launcher on zerotune" in usage.stdout, usage.stderr

    status = venv.zerotune("status")
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"installed: yes ({venv.site / PTH_NAME})" in status.stdout and "hook: current" in status.stdout
    assert "real DeepSpeed installed: no" in status.stdout
    assert f"zerotune (deepspeed {DEEPSPEED_VERSION})" in status.stdout

    # A process that never imports deepspeed imports neither torch nor zerotune, yet reports the
    # version (transformers checks it before importing); pip's per-directory scan does not see it.
    probe = venv.run("-c", "import importlib.metadata as m, sys; print('torch' in sys.modules, "
                           "'zerotune' in sys.modules, m.version('deepspeed'), "
                           f"[d.name for d in m.distributions(path=[{str(venv.site)!r}])].count('deepspeed'))")
    assert probe.stdout.split() == ["False", "False", DEEPSPEED_VERSION, "0"], probe.stderr

    # The same commands from this process with --target (no torch import per call): idempotent,
    # a stale copy is reported and rewritten.
    target = ["--target", str(venv.site)]
    assert main(["deepspeed-alias", "install", *target]) == 0
    assert capsys.readouterr().out.startswith("already installed: ")
    with (venv.site / HOOK_NAME).open("a") as hook:
        hook.write("# an older zerotune's hook\n")
    assert main(["deepspeed-alias", "status", *target]) == 1  # this interpreter has no hook either
    assert "hook: stale: it differs from this zerotune's (run `zerotune deepspeed-alias install` again)" \
        in capsys.readouterr().out
    assert main(["deepspeed-alias", "install", *target]) == 0
    assert capsys.readouterr().out.startswith("updated: ")
    assert (venv.site / PTH_NAME).read_text() == PTH_TEXT

    removed = venv.zerotune("remove")
    assert removed.returncode == 0 and removed.stdout.startswith("removed: "), removed.stderr
    assert not (venv.site / PTH_NAME).exists() and not (venv.site / HOOK_NAME).exists() and not launcher.exists()
    assert main(["deepspeed-alias", "remove", *target]) == 0
    assert capsys.readouterr().out.startswith("not installed: ")
    gone = venv.run("-c", "import deepspeed")
    assert gone.returncode == 1 and "ModuleNotFoundError: No module named 'deepspeed'" in gone.stderr


def test_torchrun_workers_and_their_subprocesses_resolve_deepspeed(clean: Venv, tmp_path: Path) -> None:
    venv = clean
    assert venv.zerotune("install").returncode == 0
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    done = venv.run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker), timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: {DEEPSPEED_VERSION} grandchild ok" in done.stdout, done.stdout + done.stderr[-3000:]
    # The outer interpreter has no hook: the alias stays in the environment it was installed in.
    outer = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, text=True,
                           timeout=120, env=ENV)
    assert outer.returncode == 1 and "No module named 'deepspeed'" in outer.stderr


def test_a_real_deepspeed_is_not_shadowed_without_force(clean: Venv, capsys) -> None:
    venv = clean
    (venv.site / "deepspeed").mkdir()
    (venv.site / "deepspeed" / "__init__.py").write_text("REAL = True\n")
    (venv.site / "deepspeed-0.16.0.dist-info").mkdir()
    (venv.site / "deepspeed-0.16.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.16.0\n")

    refused = venv.zerotune("install")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert f"a real DeepSpeed 0.16.0 at {venv.site / 'deepspeed'}" in lines[0]
    assert "pip uninstall deepspeed" in lines[0] and "zerotune run --as-deepspeed" in lines[0] and "--force" in lines[0]
    assert not (venv.site / PTH_NAME).exists()

    assert main(["deepspeed-alias", "install", "--force", "--target", str(venv.site)]) == 0
    assert "shadowing the real DeepSpeed 0.16.0" in capsys.readouterr().out
    shadowed = venv.run("-c", "import importlib.metadata as m; v = m.version('deepspeed'); import deepspeed, zerotune; "
                              "print(v, deepspeed.initialize.__wrapped__ is zerotune.initialize, "
                              "hasattr(deepspeed, 'REAL'))")
    assert shadowed.stdout.split() == [DEEPSPEED_VERSION, "True", "False"], shadowed.stderr
    main(["deepspeed-alias", "status", "--target", str(venv.site)])
    assert f"real DeepSpeed installed: DeepSpeed 0.16.0 at {venv.site / 'deepspeed'} (shadowed by the alias)" \
        in capsys.readouterr().out


def test_a_hook_without_zerotune_keeps_starts_clean_and_deepspeed_missing(tmp_path: Path) -> None:
    bare = Venv(tmp_path / "bare")  # no torch, no zerotune: as after `pip uninstall zerotune`
    assert install_hook(bare.site).startswith("installed: ")
    started = bare.run("-c", "import importlib.metadata as m; print('started', [d.name for d in m.distributions()])")
    assert started.stdout.split() == ["started", "[]"] and started.stderr == ""
    missing = bare.run("-c", "import deepspeed")
    assert missing.stderr.strip().splitlines()[-1] == "ModuleNotFoundError: No module named 'deepspeed'"


def test_install_names_a_missing_or_unwritable_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(AliasInstallError, match=re.escape(f"{tmp_path / 'nope'} is not a directory; pass --target")):
        install_hook(tmp_path / "nope")
    monkeypatch.setattr("zerotune.compat.persistent.os.access", lambda path, mode: False)
    with pytest.raises(AliasInstallError, match=re.escape(f"{tmp_path} is not writable: activate")):
        install_hook(tmp_path)


def test_the_lazy_finder_answers_for_deepspeed_over_sys_path_only() -> None:
    from importlib.metadata import DistributionFinder

    finder = LazyDeepSpeedAlias(ACTIVATE)
    versions = [d.version for d in finder.find_distributions(DistributionFinder.Context(name="DeepSpeed"))]
    assert versions == [DEEPSPEED_VERSION]
    assert list(finder.find_distributions(DistributionFinder.Context(name="transformers"))) == []
    assert list(finder.find_distributions(DistributionFinder.Context(name="deepspeed", path=["/x"]))) == []
    assert finder.find_spec("torch") is None
