"""``zerotune export CKPT_DIR OUT_DIR [--dtype bf16|fp16|fp32] [--merge]``: a checkpoint as a Hugging Face model
directory (sharded safetensors + index, config.json), streamed one tensor at a time.

CKPT_DIR is a save directory (its ``latest`` tag is used), a tag directory, or a DeepSpeed ZeRO checkpoint.
Bad input is one ``zerotune export: ...`` line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _size(text: str) -> int:
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "": 1}
    for suffix, factor in units.items():
        if text.upper().endswith(suffix) and text[:len(text) - len(suffix)].strip().isdigit():
            return int(text[:len(text) - len(suffix)]) * factor
    raise argparse.ArgumentTypeError(f"{text!r} is not a size like 2GB, 500MB or 1048576")


def add_export_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("export", help="write a checkpoint as a Hugging Face model directory",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", metavar="CKPT_DIR", help="save directory, tag directory or DeepSpeed checkpoint")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="new (or empty) output directory")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                        help="convert the weights (default: as saved; fp32 masters when the checkpoint has them)")
    parser.add_argument("--merge", action="store_true", help="LoRA runs: fold the adapters into the base weights")
    parser.add_argument("--max-shard-size", type=_size, default="2GB", help="largest output shard (default 2GB)")
    parser.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from zerotune.checkpoint.atomic import CheckpointError
    from zerotune.checkpoint.export import export_checkpoint

    try:
        files = export_checkpoint(Path(args.checkpoint), Path(args.out_dir), dtype=args.dtype, merge=args.merge,
                                  max_shard_bytes=args.max_shard_size)
    except (CheckpointError, OSError) as error:
        print(f"zerotune export: {error}", file=sys.stderr)
        return 2
    for name in files:
        print(Path(args.out_dir) / name)
    return 0
