"""NVMe offload (ZeRO-Infinity): swap files, the bounded buffer pool, and the load/compute/store pipeline."""

from __future__ import annotations

from zerotune.offload.buffers import ALIGNMENT, BufferPool, BufferPoolExhausted, aligned_empty, aligned_numel
from zerotune.offload.pipeline import pipelined, wait_all
from zerotune.offload.aio import AioSettings, SwapFileError, direct_io_supported
from zerotune.offload.swap_files import SwapHandle, SwapStore

__all__ = [
    "ALIGNMENT", "AioSettings", "BufferPool", "BufferPoolExhausted", "SwapFileError", "SwapHandle", "SwapStore",
    "aligned_empty", "aligned_numel", "direct_io_supported", "pipelined", "wait_all",
]
