"""The ``zerotune`` command: ``check`` a config, ``run`` a script on several ranks, ``finetune`` a model,
``report`` a run, ``generate`` / ``chat`` with its result, ``export`` a checkpoint, ``compare-methods`` of fine-tuning,
``plan`` a layout's memory, ``deepspeed-alias`` to make ``import deepspeed`` zerotune in every process
of the environment."""

from __future__ import annotations

import argparse
import sys

from zerotune.cli.check import add_check_parser
from zerotune.cli.compare import add_compare_parser
from zerotune.cli.deepspeed_alias import add_deepspeed_alias_parser
from zerotune.cli.export import add_export_parser
from zerotune.cli.finetune import add_finetune_parser
from zerotune.cli.generate import add_generate_parsers
from zerotune.cli.plan import add_plan_parser
from zerotune.cli.report import add_report_parser
from zerotune.cli.run import add_run_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerotune", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_check_parser(subparsers)
    add_run_parser(subparsers)
    add_finetune_parser(subparsers)
    add_report_parser(subparsers)
    add_generate_parsers(subparsers)
    add_export_parser(subparsers)
    add_compare_parser(subparsers)
    add_plan_parser(subparsers)
    add_deepspeed_alias_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv and argv[0] == "run":  # everything after "run" belongs to torchrun, unparsed
        args = argparse.Namespace(func=None, rest=argv[1:])
        from zerotune.cli.run import run_launch
        return run_launch(args)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into `head` and friends
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
