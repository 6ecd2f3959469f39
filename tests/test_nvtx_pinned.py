"""``deepspeed.utils.nvtx.instrument_w_nvtx`` (``zerotune.compat.nvtx``) ranges a call through the accelerator, and
``zerotune.offload.pinned`` (``deepspeed.utils.pin_memory_tracker``) totals the pinned host memory offload allocated."""

from __future__ import annotations

import logging

import pytest
import torch

import zerotune.compat.nvtx as nvtx
from zerotune.offload.pinned import FIRST_CHECKPOINT_BYTES, TRACKER, format_bytes, track_pinned


class _DomainAccelerator:
    supports_nvtx_domain = True

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def range_push(self, msg: str, domain: str | None = None) -> None:
        self.calls.append(("push", msg, domain))

    def range_pop(self, domain: str | None = None) -> None:
        self.calls.append(("pop", domain))


def _work(x: int) -> int:
    if x < 0:
        raise ValueError("negative")
    return 2 * x


def test_instrumented_call_is_ranged_by_name_and_popped_when_it_raises(monkeypatch) -> None:
    calls: list = []
    monkeypatch.setattr(nvtx, "get_accelerator", lambda: _DomainAccelerator(calls))
    wrapped = nvtx.instrument_w_nvtx(_work)
    assert wrapped(3) == 6 and wrapped.__name__ == "_work"
    with pytest.raises(ValueError):
        wrapped(-1)
    assert calls == [("push", "_work", "DeepSpeed"), ("pop", "DeepSpeed")] * 2


def test_no_range_when_disabled_or_compiling(monkeypatch) -> None:
    calls: list = []
    monkeypatch.setattr(nvtx, "get_accelerator", lambda: _DomainAccelerator(calls))
    wrapped = nvtx.instrument_w_nvtx(_work)
    monkeypatch.setattr(nvtx, "enable_nvtx", False)
    assert wrapped(1) == 2
    monkeypatch.setattr(nvtx, "enable_nvtx", True)
    monkeypatch.setattr(nvtx, "is_compiling", lambda: True)
    assert wrapped(1) == 2
    assert calls == []


def test_zerotune_accelerator_takes_the_plain_form() -> None:
    # zerotune's accelerator has no nvtx domains: range_push(msg) / range_pop(), no-ops without CUDA
    from zerotune.compat.utils import instrument_w_nvtx

    assert instrument_w_nvtx is nvtx.instrument_w_nvtx
    assert instrument_w_nvtx(_work)(4) == 8


@pytest.fixture
def tracker():
    TRACKER.reset()
    yield TRACKER
    TRACKER.reset()


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (512, 2048, 2**20, 3 * 2**29)] == ["512 B", "2.0 KB", "1.00 MB", "1.500 GB"]


def test_totals_and_doubling_checkpoints(tracker, caplog) -> None:
    from zerotune.monitor.logging import get_logger

    logger = get_logger()
    logger.addHandler(caplog.handler)  # the zerotune logger does not propagate
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            tracker.track(FIRST_CHECKPOINT_BYTES - 1)
            assert not [r for r in caplog.records if "checkpoint" in r.getMessage()]
            tracker.track(1 + 4 * FIRST_CHECKPOINT_BYTES)  # crosses 32 GB, 64 GB and 128 GB in one call
            tracker.log_summary("unit")
    finally:
        logger.removeHandler(caplog.handler)
    messages = [r.getMessage() for r in caplog.records]
    crossed = [m for m in messages if "checkpoint" in m]
    assert [m.split("crossed ")[1].split(":")[0] for m in crossed] == ["32.000 GB", "64.000 GB", "128.000 GB"]
    assert tracker.total_bytes == 5 * FIRST_CHECKPOINT_BYTES and tracker.allocations == 2
    assert "[pinned-memory unit] 160.000 GB pinned across 2 allocations" in messages
    with pytest.raises(ValueError, match="-1 bytes"):
        tracker.track(-1)


def test_only_pinned_host_tensors_are_counted(tracker) -> None:
    plain = torch.zeros(16)
    assert track_pinned(plain) is plain and tracker.allocations == 0  # not page-locked: nothing to count
    if torch.cuda.is_available():
        pinned = track_pinned(torch.zeros(16, pin_memory=True))
        assert tracker.total_bytes == pinned.untyped_storage().nbytes()


def test_host_buffers_report_when_pinned(tracker) -> None:
    from zerotune.offload.buffers import aligned_empty

    aligned_empty(8192, pin_memory=False)
    assert tracker.allocations == 0
    if torch.cuda.is_available():  # pinning needs a CUDA driver
        aligned_empty(8192, pin_memory=True)
        assert tracker.allocations == 1 and tracker.total_bytes >= 8192
