"""Page-aligned host buffers for NVMe swapping, and the bounded pool that hands them out.

Why aligned: ``O_DIRECT`` reads and writes bypass the page cache only when the memory
address, the file offset and the length are all multiples of the device's logical block
size; 4096 bytes satisfies every device and filesystem we meet. Why a bounded pool: the
point of NVMe offload is that resident host memory stays at ``buffer_count x buffer_size``
elements however large the swapped state is, so running out of buffers must be a clear
error (or an explicit wait), never a silent extra allocation.
"""

from __future__ import annotations

import ctypes
import threading
import time

import torch

from zerotune.offload.pinned import track_pinned

ALIGNMENT = 4096
"""Bytes; the alignment O_DIRECT needs of addresses, offsets and lengths (a page)."""


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


def aligned_numel(numel: int, dtype: torch.dtype) -> int:
    """``numel`` rounded up so that ``numel`` elements of ``dtype`` span whole pages.

    Laying swap-file chunks out at multiples of this keeps every chunk's file offset
    page-aligned, which is what lets a read or write of a pool buffer go through O_DIRECT.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    return round_up(numel * itemsize, ALIGNMENT) // itemsize


def aligned_empty(nbytes: int, *, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of ``nbytes`` whose ``data_ptr`` is 4096-aligned.

    torch's allocator only promises 64-byte alignment, so we over-allocate by one page and
    slice at the first aligned address; the slice keeps the whole allocation alive.
    """
    raw = track_pinned(torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=pin_memory))
    skip = (-raw.data_ptr()) % ALIGNMENT
    return raw[skip : skip + nbytes]


def tensor_memoryview(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory, without copying.

    Works for every dtype (``Tensor.numpy()`` refuses bfloat16). The view holds a
    reference to ``tensor``, so its memory lives as long as the view does.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"swap I/O needs a contiguous CPU tensor, got device={tensor.device}, "
            f"contiguous={tensor.is_contiguous()}"
        )
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    exporter = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    # from_address alone would not keep the tensor alive (a ctypes instance takes attributes; no type declares it)
    exporter.owner = tensor  # type: ignore[attr-defined]
    return memoryview(exporter).cast("B")


class BufferPoolExhausted(RuntimeError):
    """Every buffer of a BufferPool is in use."""


class BufferPool:
    """``buffer_count`` buffers of ``buffer_size`` elements (page-aligned for O_DIRECT;
    pinned when CUDA is available, so host-device copies can be asynchronous).

    All buffers come from one allocation made up front; ``acquire`` returns a view of a
    free buffer and ``release`` gives it back. The memory is not zeroed between uses.
    """

    def __init__(self, buffer_count: int, buffer_size: int, dtype: torch.dtype = torch.float32):
        for key, value in (("buffer_count", buffer_count), ("buffer_size", buffer_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BufferPool {key} must be a positive int, got {value!r}")
        self.buffer_count = buffer_count
        self.buffer_size = buffer_size
        self.dtype = dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.buffer_bytes = buffer_size * itemsize
        # Each buffer starts on a page boundary, so the stride is rounded up to a page.
        stride = round_up(self.buffer_bytes, ALIGNMENT)
        self.pinned = torch.cuda.is_available()
        self._storage = aligned_empty(stride * buffer_count, pin_memory=self.pinned)
        self._buffers = [self._storage[i * stride : i * stride + self.buffer_bytes] for i in range(buffer_count)]
        self._start_to_index = {b.data_ptr(): i for i, b in enumerate(self._buffers)}
        self._free = list(range(buffer_count - 1, -1, -1))  # a stack: reuse the warmest buffer
        self._cond = threading.Condition()

    @property
    def free_count(self) -> int:
        """Buffers not currently acquired."""
        with self._cond:
            return len(self._free)

    def acquire(self, numel: int, dtype: torch.dtype | None = None, *, timeout: float | None = 0.0) -> torch.Tensor:
        """A 1-D view of ``numel`` elements (of ``dtype``, default the pool's) at the start
        of a free buffer.

        ``timeout`` is how long to wait for another thread to release a buffer: 0 (the
        default) raises BufferPoolExhausted at once -- in single-threaded code waiting
        would deadlock -- and None waits for ever.
        """
        dtype = self.dtype if dtype is None else dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        if not isinstance(numel, int) or numel < 0 or numel * itemsize > self.buffer_bytes:
            raise ValueError(
                f"BufferPool.acquire({numel!r}, {dtype}): a buffer holds {self.buffer_size} elements of "
                f"{self.dtype} ({self.buffer_bytes} bytes); ask for 0..{self.buffer_bytes // itemsize} "
                f"elements of {dtype}, or raise buffer_size"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._free:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise BufferPoolExhausted(
                        f"all {self.buffer_count} swap buffers of {self.buffer_size} elements are in use; "
                        "release one first or raise buffer_count"
                    )
                self._cond.wait(remaining)
            index = self._free.pop()
        return self._buffers[index].view(dtype)[:numel]

    def release(self, tensor: torch.Tensor) -> None:
        """Give back a view returned by ``acquire``; anything else is a ValueError."""
        index = self._start_to_index.get(tensor.data_ptr())
        if index is None or tensor.untyped_storage().data_ptr() != self._storage.untyped_storage().data_ptr():
            raise ValueError("BufferPool.release: tensor is not a view returned by this pool's acquire()")
        with self._cond:
            if index in self._free:
                raise ValueError(f"BufferPool.release: buffer {index} was already released")
            self._free.append(index)
            self._cond.notify()
