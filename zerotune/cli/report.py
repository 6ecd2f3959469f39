"""``zerotune report RUN_DIR [--out DIR]``: plots and a markdown summary of a fine-tuning run.

Reads only ``metrics.jsonl`` and ``summary.json`` from the run directory, so it works on
finished, crashed and copied runs alike. Bad input is one ``zerotune report: ...`` line on
stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

DESCRIPTION = ("Write loss / learning-rate / throughput / eval-metric plots (PNG) and report.md "
               "for a `zerotune finetune` output directory.")


def add_report_parser(subparsers: Any) -> None:
    """Register the ``report`` subcommand on an argparse subparsers object."""
    parser = subparsers.add_parser(
        "report",
        help="plot a fine-tuning run's metrics and write a markdown summary",
        description=DESCRIPTION,
    )
    _add_arguments(parser)
    parser.set_defaults(func=run_report)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="output directory of `zerotune finetune` "
                        "(holds metrics.jsonl and summary.json)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="where to write the PNGs and report.md (default: RUN_DIR/report)")


def run_report(args: argparse.Namespace) -> int:
    """Write the report and print each path written; on bad input print one line and return 2."""
    # Imported here so `zerotune --help` and other subcommands never pay for it.
    from zerotune.monitor.plots import DEFAULT_OUT_SUBDIR, ReportError, plot_run, write_summary_markdown

    run_dir = Path(args.run_dir)
    out_dir = Path(args.out) if getattr(args, "out", None) else run_dir / DEFAULT_OUT_SUBDIR
    try:
        images = plot_run(run_dir, out_dir)
        markdown = write_summary_markdown(run_dir, out_dir, images)
    except ReportError as exc:
        print(f"zerotune report: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # e.g. --out on a read-only path or a path that is a file
        target = exc.filename if exc.filename is not None else out_dir
        print(f"zerotune report: cannot write {target}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    for path in [*images, markdown]:
        print(path)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Standalone entry point: ``python -m zerotune.cli.report RUN_DIR``."""
    parser = argparse.ArgumentParser(prog="zerotune report", description=DESCRIPTION)
    _add_arguments(parser)
    return run_report(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
