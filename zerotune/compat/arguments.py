"""DeepSpeed's command-line flags: ``deepspeed.add_config_arguments(parser)``.

``--deepspeed_config`` (zerotune's name: ``--zerotune_config``) lands in ``args.deepspeed_config``, which
``zerotune.initialize(args=...)`` reads as DeepSpeed's does; ``--deepspeed`` and the older ``--deepscale``
spellings are accepted and change nothing (the engine is on because the script calls ``initialize``).
"""

from __future__ import annotations

import argparse

__all__ = ["add_config_arguments"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line flags (and zerotune's own name for the config flag)."""
    group = parser.add_argument_group("zerotune", "zerotune / DeepSpeed configuration")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable the engine (accepted for DeepSpeed compatibility)")
    group.add_argument("--deepspeed_config", "--zerotune_config", dest="deepspeed_config", default=None, type=str,
                       help="path to the DeepSpeed-style JSON/YAML config")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
