"""Crash-safe, verified checkpoint directories: a tag either exists complete and intact, or not at all.

Save protocol (all ranks see the same filesystem, as with DeepSpeed):
1. rank 0 first repairs what a crashed save can leave (``recover``): a ``.<tag>.old`` whose
   ``<tag>`` is missing goes back to ``<tag>``; leftover ``.old`` copies and stale ``.partial``
   staging directories of any tag are removed;
2. rank 0 creates ``<save_dir>/.<tag>.partial``; every rank writes its files into it, each
   through a temporary name, fsync and ``os.replace``, and hashes what it wrote (SHA-256);
3. rank 0 writes ``manifest.json`` (every file's size and SHA-256) *last* into the staging directory;
4. rank 0 publishes: an existing ``<tag>`` is renamed to ``.<tag>.old``, the staging directory to
   ``<tag>``, then ``latest`` is rewritten (temporary name + rename) and the ``.old`` copy deleted.
A crash between any two of these filesystem operations leaves a loadable checkpoint that ``latest``
(or the tag) resolves to: the previous one, or the new one once it is complete. Reading resolves a
tag to ``<tag>``, or to ``.<tag>.old`` in the one window where the rename was interrupted.

Trust: tags and ``latest`` must name a directory inside the save directory (one path component,
no dot prefix); files are read with ``torch.load(weights_only=True)`` -- tensors, numbers, strings
and containers, never arbitrary objects -- only after their SHA-256 matched the manifest, so a
malicious pickle or a flipped bit is refused with the file's name before anything is loaded.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import torch

LATEST = "latest"
MANIFEST = "manifest.json"
FORMAT = 2
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]*")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, damaged or does not fit this run; the message names the file."""


class CheckpointTagMismatch(CheckpointError, AssertionError):
    """Ranks saved under different tags with ``checkpoint.tag_validation`` Fail. Also an AssertionError, which is
    what DeepSpeed raises there, so code catching that keeps working."""


# Every filesystem mutation of a save goes through this hook, so tests can crash a save between any
# two operations (``set_crash_hook``) and check that what is left always loads.
_crash_hook: Callable[[str], None] | None = None


def set_crash_hook(hook: Callable[[str], None] | None) -> None:
    global _crash_hook
    _crash_hook = hook


def _step(what: str) -> None:
    if _crash_hook is not None:
        _crash_hook(what)


def check_tag(tag: str, source: str = "tag") -> str:
    """``tag`` if it names a directory inside the save directory (one component, no dot prefix)."""
    if not isinstance(tag, str) or not _TAG.fullmatch(tag) or tag in (LATEST, MANIFEST):
        raise CheckpointError(f"checkpoint {source} {tag!r} is not a valid tag: use letters, digits and _ . + = - "
                              "(not starting with '.'), so it names a directory inside the save directory")
    return tag


def partial_dir(save_dir: str | os.PathLike, tag: str) -> Path:
    return Path(save_dir) / f".{check_tag(tag)}.partial"


def _old_dir(save_dir: Path, tag: str) -> Path:
    return save_dir / f".{tag}.old"


def recover(save_dir: str | os.PathLike) -> None:
    """Rank 0, before a save: undo what an interrupted save left (see the module docstring)."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return
    for entry in save_dir.iterdir():
        name = entry.name
        if name.startswith(".") and name.endswith(".old") and entry.is_dir():
            live = save_dir / name[1:-len(".old")]
            if live.exists():
                _step(f"rmtree {entry}")
                shutil.rmtree(entry)
            else:
                _step(f"replace {entry} -> {live}")
                os.replace(entry, live)
        elif name.startswith(".") and name.endswith(".partial") and entry.is_dir():
            _step(f"rmtree {entry}")
            shutil.rmtree(entry)


def prepare_partial_dir(save_dir: str | os.PathLike, tag: str) -> Path:
    """Rank 0 only: repair the directory, then an empty staging directory for ``tag``."""
    recover(save_dir)
    staging = partial_dir(save_dir, tag)
    _step(f"mkdir {staging}")
    staging.mkdir(parents=True)
    return staging


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_file_atomically(obj: Any, path: Path) -> tuple[str, int, str]:
    """torch.save to a temporary name, fsync, then rename over ``path``; returns (name relative to
    the checkpoint directory, size, SHA-256) for the manifest."""
    temporary = path.with_name(path.name + ".tmp")
    _step(f"write {temporary}")
    with _write_failure_named(temporary, path), open(temporary, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    _step(f"replace {temporary} -> {path}")
    os.replace(temporary, path)
    return path.name, path.stat().st_size, file_digest(path)


@contextlib.contextmanager
def _write_failure_named(temporary: Path, path: Path) -> Iterator[None]:
    """A failed write (a full disk: ``OSError``, or torch's ``inline_container.cc`` enforce ``RuntimeError``)
    becomes a CheckpointError naming the checkpoint and the file, with the space left; the half-written
    temporary file is removed. The bare errors name neither, and the enforce error not even the cause."""
    try:
        yield
    except (OSError, RuntimeError) as error:
        temporary.unlink(missing_ok=True)
        reason = (error.strerror if isinstance(error, OSError) and error.strerror
                  else (str(error).strip().splitlines() or [type(error).__name__])[0])
        try:
            free = f"; {shutil.disk_usage(path.parent).free / 2**20:.1f} MiB free there"
        except OSError:
            free = ""
        raise CheckpointError(f"saving checkpoint {_checkpoint_of(path.parent)} failed writing {path.name} "
                              f"({reason}{free}); the previous checkpoint is kept") from error


def _checkpoint_of(directory: Path) -> Path:
    """The checkpoint a staging directory (``.<tag>.partial``) becomes; other directories are themselves."""
    name = directory.name
    if name.startswith(".") and name.endswith(".partial"):
        return directory.with_name(name[1:-len(".partial")])
    return directory


def describe_files(directory: Path, relative_to: Path) -> list[tuple[str, int, str]]:
    """Manifest entries for every file under ``directory`` (e.g. copied swap files)."""
    return [(str(p.relative_to(relative_to)), p.stat().st_size, file_digest(p))
            for p in sorted(directory.rglob("*")) if p.is_file()]


def write_text_atomically(text: str, path: Path) -> None:
    temporary = path.with_name(path.name + ".tmp")
    _step(f"write {temporary}")
    with _write_failure_named(temporary, path), open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    _step(f"replace {temporary} -> {path}")
    os.replace(temporary, path)


def write_manifest(staging: Path, entries: list[tuple[str, int, str]]) -> None:
    """Rank 0, after every rank's files are in place: the manifest, the staging directory's last file."""
    files = {name: {"bytes": size, "sha256": digest} for name, size, digest in sorted(entries)}
    write_text_atomically(json.dumps({"format": FORMAT, "files": files}, indent=1), staging / MANIFEST)


def publish(save_dir: str | os.PathLike, tag: str, update_latest: bool) -> Path:
    """Rank 0 only: make the staged tag visible, then point ``latest`` at it."""
    save_dir = Path(save_dir)
    final = save_dir / check_tag(tag)
    staging = partial_dir(save_dir, tag)
    retired = _old_dir(save_dir, tag)
    if final.exists():
        _step(f"replace {final} -> {retired}")
        os.replace(final, retired)
    _step(f"replace {staging} -> {final}")
    os.replace(staging, final)
    _fsync_directory(save_dir)
    if update_latest:
        write_text_atomically(tag, save_dir / LATEST)
    if retired.exists():
        _step(f"rmtree {retired}")
        shutil.rmtree(retired)
    return final


def retain_newest(save_dir: str | os.PathLike, keep: int) -> list[str]:
    """Rank 0, after a publish: delete all but the ``keep`` newest complete tags (by the time their
    manifest was written), never the one ``latest`` names. Returns the deleted tags."""
    save_dir = Path(save_dir)
    latest = (save_dir / LATEST).read_text().strip() if (save_dir / LATEST).is_file() else None
    tags = sorted((p for p in save_dir.iterdir() if not p.name.startswith(".") and (p / MANIFEST).is_file()),
                  key=lambda p: (p / MANIFEST).stat().st_mtime_ns)
    deleted = []
    for directory in tags[:max(0, len(tags) - keep)]:
        if directory.name != latest:
            _step(f"rmtree {directory}")
            shutil.rmtree(directory)
            deleted.append(directory.name)
    return deleted


def _fsync_directory(directory: Path) -> None:
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def resolve_tag(load_dir: str | os.PathLike, tag: str | None) -> str | None:
    """The tag to load: the given one, or what ``latest`` names; None when there is no ``latest``."""
    load_dir = Path(load_dir)
    if tag is not None:
        return check_tag(str(tag))
    latest = load_dir / LATEST
    if not latest.is_file():
        return None
    return check_tag(latest.read_text().strip(), f"named by {latest}")


def tag_directory(load_dir: str | os.PathLike, tag: str) -> Path:
    """Where ``tag`` lives: ``<tag>``, or ``.<tag>.old`` if a save was interrupted between its renames."""
    load_dir = Path(load_dir)
    for candidate in (load_dir / check_tag(tag), _old_dir(load_dir, tag)):
        if candidate.is_dir():
            return candidate
    raise CheckpointError(f"checkpoint directory {load_dir / tag} does not exist")


def read_manifest(directory: Path) -> dict[str, dict]:
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {MANIFEST}: not a complete zerotune checkpoint (a save that did "
                              "not finish, or one written before checkpoints were verified)")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if not isinstance(files, dict):
            raise ValueError("no file table")
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{path} is not a zerotune checkpoint manifest: {error}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is checkpoint format {manifest.get('format')!r}; this zerotune reads format "
                              f"{FORMAT} (checkpoints by parameter name, loadable at any layout): load it with the "
                              "zerotune version that wrote it and export the weights (save_16bit_model)")
    return files


def verify_files(directory: Path, names: list[str], manifest: dict[str, dict]) -> None:
    """Check each file's size and SHA-256 against the manifest before anything is read from it."""
    for name in names:
        path = directory / name
        entry = manifest.get(name)
        if entry is None:
            raise CheckpointError(f"checkpoint file {path} is not listed in {directory / MANIFEST}")
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} does not exist")
        if path.stat().st_size != entry["bytes"] or file_digest(path) != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {path} is damaged: its SHA-256 does not match {MANIFEST}")


_LOADABLE_LEAVES = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.Tensor, torch.nn.Parameter,
                    torch.dtype, torch.device, torch.Size, torch.layout)
_LOADABLE_MAPPINGS = (dict, collections.OrderedDict, collections.Counter)
_LOADABLE_SEQUENCES = (list, tuple, set)
LOADABLE_TYPES = ("tensors, numbers, strings, bytes, None, torch dtypes / devices / sizes, and dicts, lists, tuples "
                  "and sets of them")


def check_loadable(value: Any, where: str) -> None:
    """Refuse, naming its key path (``client_state['model']``), a value :func:`read_file` would refuse.

    Checkpoints are read with ``torch.load(weights_only=True)`` only, so one object of another class (an
    ``nn.Module``, a numpy scalar, a dataclass) saves fine and makes the whole checkpoint unloadable; this
    says so before the save writes anything. Exact types, as the loader checks them (a dict subclass such as
    ``defaultdict`` is refused too), plus whatever ``torch.serialization.add_safe_globals`` allowed.
    """
    allowed = set(_LOADABLE_LEAVES) | {g for g in torch.serialization.get_safe_globals() if isinstance(g, type)}
    pending, seen = [(value, where)], set()
    while pending:
        item, path = pending.pop()
        kind = type(item)
        if kind in allowed:
            continue
        if kind in _LOADABLE_MAPPINGS or kind in _LOADABLE_SEQUENCES:
            if id(item) in seen:
                continue
            seen.add(id(item))
            pairs = item.items() if kind in _LOADABLE_MAPPINGS else enumerate(item)
            children = [(child, f"{path}[{key!r}]") for key, child in pairs]
            if kind in _LOADABLE_MAPPINGS:
                children = [(key, f"{path} key {key!r}") for key in item] + children
            pending.extend(reversed(children))  # first offender in order is the one named
            continue
        raise CheckpointError(f"{path} is a {kind.__module__}.{kind.__qualname__}, which a checkpoint cannot hold: "
                              f"checkpoints load with torch.load(weights_only=True), so only {LOADABLE_TYPES} can be "
                              "saved (save a module's state_dict(), not the module)")


def read_file(path: Path, what: str, mmap: bool = False, map_location: Any = "cpu") -> Any:
    """``torch.load(weights_only=True)``: tensors, numbers, strings and containers only -- a file that
    needs anything else (code, arbitrary classes) is refused with its name. ``mmap``: tensors stay in the
    file until read (a reader touches only the bytes it uses)."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} ({what}) does not exist")
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as error:  # noqa: BLE001 - re-raised with the file name
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"checkpoint file {path} ({what}) was refused or is unreadable: only tensors, "
                              f"numbers, strings and containers load ({reason})") from None
