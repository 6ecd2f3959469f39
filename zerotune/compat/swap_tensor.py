"""``deepspeed.runtime.swap_tensor``: the size thresholds of DeepSpeed's NVMe swapping, which tests and scripts
read to size a model that swaps (zerotune's swap files, ``offload/swap_files.py``, take tensors of any size)."""

from __future__ import annotations

MIN_AIO_BYTES = 1024**2
"""DeepSpeed's smallest asynchronous IO request worth issuing (1 MiB)."""
AIO_ALIGNED_BYTES = 1024
"""The alignment DeepSpeed pads swapped buffers to."""
MIN_SWAPPABLE_BYTES = MIN_AIO_BYTES
"""DeepSpeed swaps optimizer state only for tensors at least this large."""

__all__ = ["MIN_AIO_BYTES", "AIO_ALIGNED_BYTES", "MIN_SWAPPABLE_BYTES"]
