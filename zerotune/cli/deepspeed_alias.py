"""``zerotune deepspeed-alias install | remove | status``: the ``deepspeed`` alias for every process of
the active Python environment.

``install`` writes two files into this interpreter's site-packages (a virtual environment's, when
one is active): ``_zerotune_deepspeed_alias.py`` and ``zerotune_deepspeed_alias.pth``, which
``site`` runs at every start. From then on ``import deepspeed`` resolves to zerotune in every
process there: scripts, torchrun workers started by a tool, Ray workers, subprocesses. A process
that never imports deepspeed pays nothing (the hook imports neither zerotune nor torch).
``importlib.metadata.version("deepspeed")`` reports zerotune's DeepSpeed version. It also writes the
``deepspeed`` command into the environment's scripts directory (DeepSpeed's launcher, which starts
``zerotune run --as-deepspeed``; see ``zerotune/compat/launcher.py``) unless a real one is there.

``install`` is refused when a real DeepSpeed is installed there (``--force`` shadows it anyway).
For a single run, ``zerotune run --as-deepspeed`` needs no install.

Exit status: 0 done (install, remove: also "already installed" / "not installed"); status: 0 when
the hook is installed, current, and ``import deepspeed`` resolves to zerotune in a new process,
1 otherwise; 2 refused or could not write (one ``zerotune deepspeed-alias: ...`` line on stderr).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_deepspeed_alias_parser(subparsers: Any) -> None:
    """Register the ``deepspeed-alias`` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "deepspeed-alias", help="make `import deepspeed` resolve to zerotune in every process of this environment",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["install", "remove", "status"],
                        help="write the .pth hook, delete it, or report on it")
    parser.add_argument("--force", action="store_true",
                        help="install: even over a real DeepSpeed, which the alias then shadows")
    parser.add_argument("--target", metavar="DIR", default=None,
                        help="a site-packages directory to use instead of this interpreter's")
    parser.set_defaults(func=run_deepspeed_alias)


def run_deepspeed_alias(args: argparse.Namespace) -> int:
    from zerotune.compat.persistent import AliasInstallError, install_hook, remove_hook

    if args.force and args.action != "install":
        print(f"zerotune deepspeed-alias: --force goes with install, not {args.action}", file=sys.stderr)
        return 2
    try:
        if args.action == "install":
            print(install_hook(args.target, force=args.force))
        elif args.action == "remove":
            print(remove_hook(args.target))
        else:
            return _print_status(args.target)
    except AliasInstallError as error:
        print(f"zerotune deepspeed-alias: {error}", file=sys.stderr)
        return 2
    return 0


def _print_status(target: str | None) -> int:
    from zerotune.compat.persistent import hook_status, is_zerotune_launcher, launcher_path

    status = hook_status(target)
    hook_words = {"current": "current", "missing": "missing (run `zerotune deepspeed-alias install`)",
                  "stale": "stale: it differs from this zerotune's (run `zerotune deepspeed-alias install` again)"}
    print(f"installed: {'yes' if status.installed else 'no'} ({status.pth})")
    print(f"hook: {hook_words[status.hook]}")
    real = status.real.describe() + (" (shadowed by the alias)" if status.installed else "") if status.real else "no"
    print(f"real DeepSpeed installed: {real}")
    print(f"import deepspeed in a new process of {sys.executable}: {status.resolves_to}")
    launcher = launcher_path(target)
    if launcher is not None:
        if not launcher.exists():
            state = "absent"
        else:
            state = "zerotune's" if is_zerotune_launcher(launcher) else "not zerotune's (left as it is)"
        print(f"deepspeed command: {launcher} ({state})")
    return 0 if status.ok else 1
