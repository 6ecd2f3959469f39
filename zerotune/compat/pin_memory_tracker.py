"""``deepspeed.utils.pin_memory_tracker``: the process's pinned-host-memory total (``zerotune.offload.pinned``).

zerotune's offload paths (ZeRO-3 host shards, offloaded masters and staging buffers, swap and move buffers) and
the accelerator's ``pin_memory`` report into it; DeepSpeed's module names its tracker ``_tracker`` and its byte
formatter ``_fmt_bytes``, which DeepSpeed code (and its tests) read.
"""

from __future__ import annotations

from zerotune.offload.pinned import TRACKER as _tracker
from zerotune.offload.pinned import format_bytes as _fmt_bytes
from zerotune.offload.pinned import pinned_memory_summary, track_pinned_memory

__all__ = ["_tracker", "_fmt_bytes", "track_pinned_memory", "pinned_memory_summary"]
