"""``zerotune check CONFIG [--world-size N]``: validate a config and show what it resolves to.

It validates the schema only (no ``assert_implemented``), so a config meant for a
feature the engine lacks still checks clean; unresolvable "auto"s are shown as such.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional, Sequence

from zerotune.config import ConfigError, format_resolved, load_config, resolve_config

DESCRIPTION = "Validate a DeepSpeed-style config (JSON or YAML) and print every resolved value with its source."


def add_check_parser(subparsers: Any) -> None:
    """Register the ``check`` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "check",
        help="validate a DeepSpeed-style config and print every resolved value with its source",
        description=DESCRIPTION,
    )
    _add_arguments(parser)
    parser.set_defaults(func=run_check)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="config file (.json, .yaml or .yml)")
    parser.add_argument(
        "--world-size",
        type=_positive_int,
        default=1,
        metavar="N",
        help="data-parallel size used to solve the batch-size triple (default: 1)",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def run_check(args: argparse.Namespace) -> int:
    """Print the resolved table and return 0, or print one error line and return 2."""
    try:
        cfg = resolve_config(load_config(args.config), dp_world_size=args.world_size, strict=False)
    except ConfigError as exc:
        print(f"zerotune check: {exc}", file=sys.stderr)
        return 2
    print(format_resolved(cfg))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Standalone entry point: ``python -m zerotune.cli.check CONFIG``."""
    parser = argparse.ArgumentParser(prog="zerotune check", description=DESCRIPTION)
    _add_arguments(parser)
    return run_check(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
