"""Crash-safe checkpoint directories: a tag either exists complete or not at all.

Protocol (all ranks see the same filesystem, as with DeepSpeed):
1. rank 0 creates ``<save_dir>/.<tag>.partial`` (removing a stale one from a crashed save);
2. every rank writes its files into it, each through a temporary name and ``os.replace``;
3. after a barrier, rank 0 renames the directory to ``<save_dir>/<tag>`` (an existing tag of
   the same name is moved aside first and deleted after) and only then rewrites ``latest``.
A crash at any point leaves the previous checkpoint and ``latest`` intact.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not fit this run; the message names the file."""


def partial_dir(save_dir: str | os.PathLike, tag: str) -> Path:
    return Path(save_dir) / f".{tag}.partial"


def prepare_partial_dir(save_dir: str | os.PathLike, tag: str) -> Path:
    """Rank 0 only: an empty staging directory for ``tag``."""
    staging = partial_dir(save_dir, tag)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def write_file_atomically(obj: Any, path: Path) -> None:
    """torch.save to a temporary name, fsync, then rename over ``path``."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def write_text_atomically(text: str, path: Path) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def publish(save_dir: str | os.PathLike, tag: str, update_latest: bool) -> Path:
    """Rank 0 only: make the staged tag visible, then point ``latest`` at it."""
    save_dir = Path(save_dir)
    final = save_dir / tag
    staging = partial_dir(save_dir, tag)
    retired = None
    if final.exists():
        retired = save_dir / f".{tag}.old"
        if retired.exists():
            shutil.rmtree(retired)
        os.replace(final, retired)
    os.replace(staging, final)
    if update_latest:
        write_text_atomically(tag, save_dir / LATEST)
    if retired is not None:
        shutil.rmtree(retired)
    return final


def resolve_tag(load_dir: str | os.PathLike, tag: str | None) -> str | None:
    """The tag to load: the given one, or what ``latest`` names; None when there is no ``latest``."""
    load_dir = Path(load_dir)
    if tag is not None:
        return str(tag)
    latest = load_dir / LATEST
    if not latest.is_file():
        return None
    return latest.read_text().strip()


def read_file(path: Path, what: str) -> Any:
    """torch.load with an error that names the file when it is missing or unreadable."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} ({what}) does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # noqa: BLE001 - re-raised with the file name
        raise CheckpointError(f"checkpoint file {path} ({what}) is unreadable or truncated: {error}") from error
