"""``deepspeed.checkpoint.ds_to_universal``: make the "universal" checkpoint of a checkpoint tag directory.

DeepSpeed's converter rewrites its ZeRO files (flat, rank-partitioned) into one folder per parameter, which its
engine then loads at another ZeRO stage, world size or parallel layout with ``checkpoint.load_universal``.
zerotune needs no such step: its own checkpoints are kept by parameter name and load at any layout
(``checkpoint/logical.py``), and a DeepSpeed-layout checkpoint (ZeRO 1-3) is read into full tensors by
``checkpoint/deepspeed_format.py`` and loads at any layout too. So the universal checkpoint of either is the same
files: ``main`` checks the whole input (a zerotune checkpoint: every file against its manifest; a DeepSpeed one:
read and merged entirely, as a load would) and then publishes a copy at ``output_folder`` (staged, then renamed),
which ``engine.load_checkpoint(parent, tag=<output name>)`` loads, with or without ``checkpoint.load_universal``.

DeepSpeed's tuning arguments have nothing to act on here and are accepted as such: ``num_extract_workers`` /
``num_merge_workers`` (no extract or merge step), ``keep_temp_folder`` (no temporary folder), ``strict`` and
``inject_missing_state`` (DeepSpeed requires ``UNIVERSAL_CHECKPOINT_INFO`` in the client state to know how to merge
tensor-parallel slices; zerotune's files record their own layout, so nothing is missing to inject).
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

from zerotune.checkpoint.atomic import (
    MANIFEST,
    CheckpointError,
    check_tag,
    partial_dir,
    read_manifest,
    verify_files,
)
from zerotune.checkpoint.deepspeed_format import read_deepspeed_checkpoint

__all__ = ["main", "parse_arguments"]


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """DeepSpeed's command line: ``--input_folder TAG_DIR --output_folder OUT_DIR`` (and its tuning flags)."""
    parser = argparse.ArgumentParser(description="Publish the universal (any-layout) copy of a checkpoint tag "
                                                 "directory, zerotune's or DeepSpeed's ZeRO 1-3 layout")
    parser.add_argument("--input_folder", type=str, required=True, help="checkpoint tag directory to convert")
    parser.add_argument("--output_folder", type=str, required=True, help="universal checkpoint directory to write")
    parser.add_argument("--num_extract_workers", type=int, default=4, help="accepted; there is no extract step")
    parser.add_argument("--num_merge_workers", type=int, default=2, help="accepted; there is no merge step")
    parser.add_argument("--keep_temp_folder", action="store_true", help="accepted; there is no temporary folder")
    parser.add_argument("--no_strict", dest="strict", action="store_false",
                        help="accepted; the input's own layout records are always enough")
    parser.add_argument("--inject_missing_state", action="store_true",
                        help="accepted; no universal checkpoint info is required")
    return parser.parse_args(argv)


def _checked_files(source: Path) -> list[str]:
    """The files of the checkpoint in ``source``, after checking all of it; raises ``CheckpointError`` naming the
    file that is missing, damaged or unreadable."""
    if (source / MANIFEST).is_file():
        files = sorted(read_manifest(source))
        verify_files(source, files, read_manifest(source))
        return [*files, MANIFEST]
    read_deepspeed_checkpoint(source)  # raises unless it is a whole, readable DeepSpeed ZeRO checkpoint
    return sorted(entry.name for entry in source.iterdir() if entry.is_file())


def main(args: Any) -> None:
    """Check the checkpoint in ``args.input_folder`` and publish its universal copy at ``args.output_folder``."""
    source, target = Path(args.input_folder), Path(args.output_folder)
    if not source.is_dir():
        raise CheckpointError(f"ds_to_universal: input_folder {source} is not a directory")
    if target.exists():
        raise CheckpointError(f"ds_to_universal: output_folder {target} already exists; remove it or choose another")
    files = _checked_files(source)
    staging = partial_dir(target.parent, check_tag(target.name, source="output_folder name"))
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    for name in files:
        shutil.copy2(source / name, staging / name)
    os.replace(staging, target)
    print(f"ds_to_universal: {source} -> {target} ({len(files)} files; it loads at any ZeRO stage and world size)")


if __name__ == "__main__":
    main(parse_arguments())
