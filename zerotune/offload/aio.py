"""How swap I/O is issued (the ``aio`` config section) and whether a directory allows O_DIRECT."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerotune.offload.buffers import ALIGNMENT, aligned_empty, round_up, tensor_memoryview

DIRECT_WRITES_BY_DEFAULT = True
DIRECT_READS_BY_DEFAULT = True
"""Modes used when ``AioSettings.use_direct_io`` is None and the filesystem allows O_DIRECT.

Chosen from benchmarks/bench_nvme_swap.py on the project machine (ext4 on a virtio disk,
1 GiB through 4 pool buffers, default aio settings, repeated runs). Swap writes: O_DIRECT
1.1-1.7 GB/s, buffered plus fsync 0.2-1.2 GB/s (many threads writing one file through the
page cache contend). Swap reads: buffered 1.1-1.7 GB/s (kernel readahead) against 0.7-1.0 GB/s
for O_DIRECT -- but only for files that were written buffered; after O_DIRECT writes,
buffered reads fell to 0.3-0.6 GB/s, so the tempting mix (direct writes, buffered reads) is
the worst in steady state. O_DIRECT both ways is best overall and keeps swapped state out of
the page cache, the memory offload exists to free."""


class SwapFileError(RuntimeError):
    """A swap file is missing, has the wrong size (truncated), or could not be read or written."""


def _settings_value(section: Any, key: str, default: Any) -> Any:
    if section is None:
        return default
    value = section.get(key, default) if isinstance(section, dict) else getattr(section, key, default)
    return default if value in (None, "auto") else value


@dataclass(frozen=True)
class AioSettings:
    """How swap I/O is issued: ``block_size`` bytes per request, up to
    ``queue_depth x thread_count`` requests in flight. ``use_direct_io``: True or False for
    both directions; None lets the store decide (where the filesystem allows O_DIRECT:
    DIRECT_WRITES_BY_DEFAULT / DIRECT_READS_BY_DEFAULT, chosen by measurement)."""

    block_size: int = 1 << 20
    queue_depth: int = 8
    thread_count: int = 1
    use_direct_io: bool | None = None

    def __post_init__(self) -> None:
        for key in ("block_size", "queue_depth", "thread_count"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"aio.{key} must be a positive int, got {value!r}")
        if self.block_size % ALIGNMENT:
            raise ValueError(
                f"aio.block_size must be a multiple of {ALIGNMENT} bytes so O_DIRECT requests stay "
                f"aligned, got {self.block_size} (e.g. {round_up(self.block_size, ALIGNMENT)})"
            )
        if self.use_direct_io not in (None, True, False):
            raise ValueError(f"use_direct_io must be None, True or False, got {self.use_direct_io!r}")

    @property
    def max_in_flight(self) -> int:
        """Requests the store keeps in flight at once (its thread-pool size)."""
        return self.queue_depth * self.thread_count

    @classmethod
    def from_config(cls, aio_section: Any) -> AioSettings:
        """From the config's ``aio`` section (an AioConfig, a dict, or None); "auto" means default."""
        defaults = cls()
        return cls(**{key: _settings_value(aio_section, key, getattr(defaults, key))
                      for key in ("block_size", "queue_depth", "thread_count", "use_direct_io")})


def direct_io_supported(directory: str | os.PathLike) -> bool:
    """Whether files in ``directory`` accept an aligned O_DIRECT write and read (tmpfs does not)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = Path(directory) / f".odirect-probe-{uuid.uuid4().hex}"
    page = aligned_empty(ALIGNMENT)
    view = tensor_memoryview(page)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        try:
            return os.pwrite(fd, view, 0) == ALIGNMENT and os.preadv(fd, [view], 0) == ALIGNMENT
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


