"""The process's total of page-locked host memory that the offload paths allocated.

Pinned memory cannot be swapped out and counts against the host's memlock limit (``ulimit -l``); a host
out-of-memory error or a failing ``pin_memory`` often surfaces far from the allocations that used up the
budget. Each long-lived pinned buffer zerotune allocates (ZeRO-3 host shards, offloaded masters and their
staging copies, swap buffers, moved-out states) reports its bytes here through ``track_pinned``; the total is
logged at INFO each time it crosses the next doubling from 32 GB (a few readable milestones, not one line per
buffer) and summarised by ``pinned_memory_summary``. Allocations are counted, not frees: the figure is what was
pinned since the last ``reset``. Activation checkpointing's per-forward host copies are not counted (they are
freed every step; a running sum of them would say nothing about what is resident).
"""

from __future__ import annotations

import torch

from zerotune.monitor.logging import get_logger

_GB = 1024**3
FIRST_CHECKPOINT_BYTES = 32 * _GB


def format_bytes(num_bytes: int) -> str:
    """``512 B``, ``2.0 KB``, ``1.00 MB``, ``1.500 GB``: more decimals as the unit grows."""
    kb, mb = 1024, 1024**2
    if num_bytes >= _GB:
        return f"{num_bytes / _GB:.3f} GB"
    if num_bytes >= mb:
        return f"{num_bytes / mb:.2f} MB"
    if num_bytes >= kb:
        return f"{num_bytes / kb:.1f} KB"
    return f"{num_bytes} B"


class PinnedMemoryTracker:
    """A running total of pinned bytes and allocations, with the next total that gets logged."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._bytes = 0
        self._calls = 0
        self._next_checkpoint = FIRST_CHECKPOINT_BYTES

    @property
    def total_bytes(self) -> int:
        return self._bytes

    @property
    def allocations(self) -> int:
        return self._calls

    def track(self, num_bytes: int) -> None:
        """Add one allocation of ``num_bytes``; log each doubling threshold the total crossed."""
        if num_bytes < 0:
            raise ValueError(f"pinned memory: an allocation cannot be {num_bytes} bytes")
        self._bytes += num_bytes
        self._calls += 1
        logger = get_logger()
        logger.debug("pin_memory: +%s (allocation %d, total %s)", format_bytes(num_bytes), self._calls,
                     format_bytes(self._bytes))
        while self._bytes >= self._next_checkpoint:
            logger.info("[pinned-memory checkpoint] crossed %s: %s pinned across %d allocations",
                        format_bytes(self._next_checkpoint), format_bytes(self._bytes), self._calls)
            self._next_checkpoint *= 2

    def log_summary(self, tag: str = "") -> None:
        prefix = f"[pinned-memory {tag}] " if tag else "[pinned-memory] "
        get_logger().info("%s%s pinned across %d allocations", prefix, format_bytes(self._bytes), self._calls)


TRACKER = PinnedMemoryTracker()
"""The process's tracker (pinned memory is a per-host, per-process budget)."""


def track_pinned_memory(num_bytes: int) -> None:
    TRACKER.track(num_bytes)


def pinned_memory_summary(tag: str = "") -> None:
    """Log the total so far on this rank, labelled ``tag`` (e.g. the phase that just allocated)."""
    TRACKER.log_summary(tag)


def track_pinned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, its bytes counted if it is page-locked: wrap a host allocation that may have been pinned."""
    if tensor.device.type == "cpu" and tensor.is_pinned():
        TRACKER.track(tensor.untyped_storage().nbytes())
    return tensor
