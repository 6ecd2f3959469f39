"""``deepspeed.utils.zero_to_fp32``: one fp32 state dict from a ZeRO checkpoint, under DeepSpeed's names.

Reads zerotune's own checkpoints (any ZeRO stage, data/tensor/pipeline layout) and DeepSpeed's ZeRO 1-3 ones
(``checkpoint/consolidate.py`` does the work). The command line is DeepSpeed's::

    python -m zerotune.compat.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [--max_shard_size 5GB]
        [--safe_serialization] [-t TAG] [--exclude_frozen_parameters]

``get_optim_files`` / ``get_model_state_files`` are DeepSpeed's file helpers: its file names (``*_optim_states.pt``,
``*_model_states.pt``) in a directory, in natural order (``rank_2`` before ``rank_10``). zerotune's own checkpoints
name their files otherwise (``shard_rank{r}.pt``, ``model_states.pt``: ``checkpoint/engine_parts.py``).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from typing import Any

import torch

from zerotune.checkpoint.consolidate import LazyTensor, consolidate, write_consolidated
from zerotune.compat.ds_logging import logger

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "load_state_dict_from_zero_checkpoint", "get_optim_files", "get_model_state_files",
           "get_checkpoint_files", "natural_keys", "LazyTensor"]

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def natural_keys(text: str) -> list[Any]:
    """Sort key that orders the digit runs of ``text`` by value (``x_2`` before ``x_10``)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def get_checkpoint_files(checkpoint_dir: str | os.PathLike, glob_pattern: str) -> list[str]:
    """The files of ``checkpoint_dir`` matching ``glob_pattern``, in natural order; FileNotFoundError if none."""
    files = sorted(glob.glob(os.path.join(checkpoint_dir, glob_pattern)), key=natural_keys)
    if not files:
        raise FileNotFoundError(f"can't find {glob_pattern} files in directory '{checkpoint_dir}'")
    return files


def get_optim_files(checkpoint_dir: str | os.PathLike) -> list[str]:
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir: str | os.PathLike) -> list[str]:
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, Any]:
    """The checkpoint's full state dict on the CPU: fp32 masters (the weights in fp32 runs), buffers, frozen
    parameters unless excluded; tied names share one tensor. ``tag``: default what ``latest`` names.
    ``lazy_mode``: ``LazyTensor`` handles instead, each read by its ``contiguous()``."""
    consolidation = consolidate(checkpoint_dir, tag, exclude_frozen_parameters=exclude_frozen_parameters)
    if lazy_mode:
        return consolidation.lazy_state_dict()
    values = dict(consolidation.items())
    return {name: values[name] for name in consolidation.names}


def _shard_bytes(max_shard_size: int | str | None) -> int | None:
    """Hugging Face's size spelling: an int, or ``5GB`` (10**9) / ``5GiB`` (2**30)."""
    if max_shard_size is None or isinstance(max_shard_size, int):
        return max_shard_size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(max_shard_size).upper())
    if match is None:
        raise ValueError(f"max_shard_size {max_shard_size!r} is not a size: write an int or e.g. 5GB, 500MB, 2GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or ""])


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                                               max_shard_size: int | str | None = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> list[str]:
    """Write the consolidated state dict into ``output_dir``: ``pytorch_model.bin`` (``model.safetensors``), or
    shards ``pytorch_model-0000i-of-0000N.bin`` with ``pytorch_model.bin.index.json`` beyond ``max_shard_size``
    (None: never sharded). Read and written one tensor at a time. Returns the files written (DeepSpeed: None)."""
    max_bytes = _shard_bytes(max_shard_size)
    consolidation = consolidate(checkpoint_dir, tag, exclude_frozen_parameters=exclude_frozen_parameters)
    return write_consolidated(consolidation, output_dir, max_bytes, safe_serialization)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str | os.PathLike,
                                         tag: str | None = None) -> torch.nn.Module:
    """Move ``model`` to the CPU and load the consolidated state dict into it (``strict=False``); the model."""
    logger.info("Extracting fp32 weights")
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    logger.info("Overwriting model with fp32 weights")
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Consolidate a ZeRO checkpoint into one fp32 state dict.")
    parser.add_argument("checkpoint_dir", help="the save directory (with 'latest'), e.g. path/checkpoint-12")
    parser.add_argument("output_dir", help="directory for the fp32 state dict files")
    parser.add_argument("--max_shard_size", default="5GB", help="largest output file before sharding (default 5GB)")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors instead of pickle")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag, e.g. global_step1 (default: 'latest')")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave frozen parameters out")
    parser.add_argument("-d", "--debug", action="store_true", help="print each file written")
    args = parser.parse_args(argv)
    try:
        files = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir, args.output_dir, max_shard_size=args.max_shard_size,
            safe_serialization=args.safe_serialization, tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters)
    except (RuntimeError, ValueError, OSError) as error:  # CheckpointError is a RuntimeError
        print(f"zero_to_fp32: {error}", file=sys.stderr)
        return 2
    if args.debug:
        for name in files:
            print(os.path.join(args.output_dir, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
