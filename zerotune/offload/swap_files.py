"""Tensors kept in swap files under one directory, read and written asynchronously.

This is the NVMe layer of ZeRO-Infinity offload: optimizer state and ZeRO-3 parameter
shards live in ``<nvme_path>/<name>.swp`` and move through a small pool of host buffers.

How the I/O is done, and why. DeepSpeed drives libaio from C++; here every request is a
blocking ``os.pwrite``/``os.preadv`` of at most ``block_size`` bytes run on a thread pool.
Both calls release the GIL, so requests really overlap, and a blocking request in flight
occupies one thread: the pool therefore has ``thread_count x queue_depth`` threads, which is
DeepSpeed's own count of requests in flight (``thread_count`` threads each keeping
``queue_depth`` requests queued). ``single_submit`` and ``overlap_events`` tune how libaio
batches submissions and have nothing to act on here.

O_DIRECT (bypassing the page cache) needs the memory address, file offset and length
aligned to a page. A request whose memory and file offset are congruent modulo 4096 --
every BufferPool buffer read or written at a page-aligned offset -- sends its aligned middle
through an O_DIRECT descriptor and its unaligned head and tail (at most a page each) through
a buffered one; any other request is buffered throughout. Filesystems that refuse O_DIRECT
(tmpfs before Linux 6.6) are detected once, when the store opens, by a probe write. Which
directions use O_DIRECT by default was measured: see ``aio.DIRECT_WRITES_BY_DEFAULT``.

Errors are never deferred into garbage: a swap file that is missing or not the size it was
allocated with is refused when a read or write is issued, and a failed or short read or
write surfaces from ``SwapHandle.wait`` as a SwapFileError naming the file and byte range.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from zerotune.offload.aio import (
    DIRECT_READS_BY_DEFAULT,
    DIRECT_WRITES_BY_DEFAULT,
    AioSettings,
    SwapFileError,
    direct_io_supported,
)
from zerotune.offload.buffers import ALIGNMENT, round_up, tensor_memoryview

__all__ = ["AioSettings", "SwapFileError", "SwapHandle", "SwapStore", "direct_io_supported"]

@dataclass(frozen=True)
class _Allocation:
    numel: int
    dtype: torch.dtype
    itemsize: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


class _Request:
    """One read or write split into pieces; the last piece to finish closes the descriptors.

    It also holds the tensor, so its memory outlives the I/O even if the caller drops it."""

    def __init__(self, path: Path, fds: list[int], pieces: int, tensor: torch.Tensor):
        self.path, self.fds, self.remaining, self.tensor = path, fds, pieces, tensor
        self.lock = threading.Lock()

    def piece_done(self) -> None:
        with self.lock:
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            for fd in self.fds:
                os.close(fd)


class SwapHandle:
    """An issued read or write; ``wait`` blocks until every piece has finished."""

    def __init__(self, futures: list[Future] | None = None):
        self._futures = futures or []

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        """Wait for all pieces (even after one fails, so no I/O still touches the tensor),
        then re-raise the first failure as a SwapFileError naming the file."""
        errors = [f.exception() for f in self._futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first if isinstance(first, SwapFileError) else SwapFileError(str(first))


def _run_piece(request: _Request, fd: int, view: memoryview, offset: int, is_write: bool) -> None:
    """Move ``view`` to/from the file at ``offset``, looping over short reads and writes."""
    done, total = 0, len(view)
    what = "write" if is_write else "read"
    try:
        while done < total:
            if is_write:
                moved = os.pwrite(fd, view[done:], offset + done)
            else:
                moved = os.preadv(fd, [view[done:]], offset + done)
            if moved <= 0:
                raise SwapFileError(
                    f"{what} of bytes [{offset}, {offset + total}) of {request.path} stopped after "
                    f"{done} bytes: {'no progress' if is_write else 'end of file (was it truncated?)'}"
                )
            done += moved
    except OSError as error:
        raise SwapFileError(
            f"{what} of bytes [{offset}, {offset + total}) of {request.path} failed: "
            f"{error.strerror or error}"
        ) from error
    finally:
        request.piece_done()


class SwapStore:
    """Tensors kept in files under one directory; async reads and writes on a thread pool."""

    SUFFIX = ".swp"

    def __init__(self, directory: str | os.PathLike, settings: AioSettings = AioSettings(), *, create: bool = True):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            if not create or self.directory.exists():
                raise SwapFileError(f"swap directory {self.directory} does not exist or is not a directory")
            self.directory.mkdir(parents=True, exist_ok=True)
        self.settings = settings
        supported = direct_io_supported(self.directory)
        if settings.use_direct_io and not supported:
            raise SwapFileError(
                f"swap directory {self.directory} refuses O_DIRECT (tmpfs or a similar filesystem); "
                "use use_direct_io=None (decide automatically) or False"
            )
        if settings.use_direct_io is None:
            self.direct_writes = supported and DIRECT_WRITES_BY_DEFAULT
            self.direct_reads = supported and DIRECT_READS_BY_DEFAULT
        else:
            self.direct_writes = self.direct_reads = settings.use_direct_io
        self._files: dict[str, _Allocation] = {}
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=settings.max_in_flight, thread_name_prefix="zerotune-swap"
        )

    # -- files -------------------------------------------------------------------------
    def path(self, name: str) -> Path:
        """The swap file of ``name``: ``<directory>/<name>.swp``."""
        if not isinstance(name, str) or not name or "/" in name or "\0" in name or name in (".", ".."):
            raise ValueError(f"swap file name must be a non-empty string without '/', got {name!r}")
        return self.directory / f"{name}{self.SUFFIX}"

    def allocate(self, name: str, numel: int, dtype: torch.dtype) -> None:
        """Create (or resize) the file for ``numel`` elements of ``dtype``, reserving its
        disk space up front so a full disk fails here rather than mid-training. An
        existing file's contents within the new size are kept. No RAM buffer is made."""
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise ValueError(f"SwapStore.allocate({name!r}): numel must be an int >= 0, got {numel!r}")
        path = self.path(name)
        allocation = _Allocation(numel, dtype, torch.empty((), dtype=dtype).element_size())
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as error:
            raise SwapFileError(f"cannot create swap file {path}: {error.strerror or error}") from error
        try:
            os.ftruncate(fd, allocation.nbytes)
            if allocation.nbytes:
                try:
                    os.posix_fallocate(fd, 0, allocation.nbytes)
                except OSError as error:
                    if error.errno not in (95, 22):  # EOPNOTSUPP / EINVAL: no fallocate here, ftruncate sized it
                        raise
        except OSError as error:
            raise SwapFileError(
                f"cannot size swap file {path} to {allocation.nbytes} bytes: {error.strerror or error}"
            ) from error
        finally:
            os.close(fd)
        with self._lock:
            self._files[name] = allocation

    def verify(self, name: str) -> None:
        """Raise SwapFileError unless the file exists with exactly its allocated size."""
        self._check_file(name, self._allocation(name))

    def sync(self, name: str | None = None) -> None:
        """fsync one swap file (or all): makes buffered writes durable, e.g. before timing them."""
        for each in [name] if name is not None else list(self._files):
            self.verify(each)
            fd = os.open(self.path(each), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def remove(self, name: str) -> None:
        """Delete a swap file and forget its allocation."""
        with self._lock:
            self._files.pop(name, None)
        self.path(name).unlink(missing_ok=True)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._files)

    def close(self, remove_files: bool = False) -> None:
        """Finish all issued I/O, stop the threads, and delete the files if asked."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if remove_files:
            for name in self.names():
                self.remove(name)

    def __enter__(self) -> SwapStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- I/O ---------------------------------------------------------------------------
    def write(self, name: str, tensor: torch.Tensor, offset_numel: int = 0) -> SwapHandle:
        """Start writing ``tensor`` at element ``offset_numel`` of the file; ``tensor``
        must not be modified until ``wait()`` returns."""
        return self._issue(name, tensor, offset_numel, is_write=True)

    def read(self, name: str, out: torch.Tensor, offset_numel: int = 0) -> SwapHandle:
        """Start reading ``out.numel()`` elements from element ``offset_numel`` into ``out``."""
        return self._issue(name, out, offset_numel, is_write=False)

    def _allocation(self, name: str) -> _Allocation:
        with self._lock:
            allocation = self._files.get(name)
        if allocation is None:
            raise SwapFileError(f"swap file {self.path(name)} was never allocated in this store; call allocate() first")
        return allocation

    def _check_file(self, name: str, allocation: _Allocation, fd: int | None = None) -> None:
        path = self.path(name)
        try:
            size = os.fstat(fd).st_size if fd is not None else path.stat().st_size
        except FileNotFoundError:
            raise SwapFileError(f"swap file {path} is missing (deleted?)") from None
        except OSError as error:
            raise SwapFileError(f"swap file {path} is unreadable: {error.strerror or error}") from error
        if size != allocation.nbytes:
            raise SwapFileError(
                f"swap file {path} has {size} bytes but was allocated with {allocation.nbytes} "
                f"({allocation.numel} x {allocation.dtype}); it was truncated or overwritten"
            )

    def _open(self, path: Path, flags: int) -> int:
        try:
            return os.open(path, flags)
        except FileNotFoundError:
            raise SwapFileError(f"swap file {path} is missing (deleted?)") from None
        except OSError as error:
            raise SwapFileError(f"cannot open swap file {path}: {error.strerror or error}") from error

    def _issue(self, name: str, tensor: torch.Tensor, offset_numel: int, is_write: bool) -> SwapHandle:
        if self._executor is None:
            raise SwapFileError(f"swap store {self.directory} is closed")
        allocation, path = self._allocation(name), self.path(name)
        if tensor.dtype != allocation.dtype:
            raise ValueError(f"swap file {path} holds {allocation.dtype}, got a {tensor.dtype} tensor")
        if offset_numel < 0 or offset_numel + tensor.numel() > allocation.numel:
            raise ValueError(
                f"elements [{offset_numel}, {offset_numel + tensor.numel()}) are outside swap file {path} "
                f"of {allocation.numel} elements"
            )
        view = tensor_memoryview(tensor)
        if not len(view):
            return SwapHandle()
        buffered = self._open(path, os.O_RDWR)
        fds = [buffered]
        try:
            self._check_file(name, allocation, buffered)
            start = offset_numel * allocation.itemsize
            end = start + len(view)
            # (file range, fd) pieces; the aligned middle goes through O_DIRECT when possible.
            spans: list[tuple[int, int, int]] = []
            lo, hi = round_up(start, ALIGNMENT), end - end % ALIGNMENT
            direct = self.direct_writes if is_write else self.direct_reads
            if direct and (tensor.data_ptr() - start) % ALIGNMENT == 0 and lo < hi:
                fds.append(self._open(path, os.O_RDWR | os.O_DIRECT))
                spans = [(start, lo, buffered), (lo, hi, fds[1]), (hi, end, buffered)]
            else:
                spans = [(start, end, buffered)]
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        block = self.settings.block_size
        pieces = [(a, min(a + block, b), fd) for s, b, fd in spans if s < b for a in range(s, b, block)]
        request = _Request(path, fds, len(pieces), tensor)
        futures = [
            self._executor.submit(_run_piece, request, fd, view[a - start : b - start], a, is_write)
            for a, b, fd in pieces
        ]
        return SwapHandle(futures)
