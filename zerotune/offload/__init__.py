"""NVMe offload (ZeRO-Infinity): swap files and the bounded buffer pool;
the chunked optimizer step over them is ``nvme_optimizer``."""

from __future__ import annotations

from zerotune.offload.aio import AioSettings, SwapFileError, direct_io_supported
from zerotune.offload.buffers import ALIGNMENT, BufferPool, BufferPoolExhausted, aligned_empty, aligned_numel
from zerotune.offload.swap_files import SwapHandle, SwapStore

__all__ = [
    "ALIGNMENT", "AioSettings", "BufferPool", "BufferPoolExhausted", "SwapFileError", "SwapHandle", "SwapStore",
    "aligned_empty", "aligned_numel", "direct_io_supported",
]
