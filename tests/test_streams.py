"""The side streams' bookkeeping (issue 19): which buffer may be reused when, the CPU path running in place,
and the profiler ranges a trace shows. The event logic runs here with fake events; the CUDA tests skip
cleanly without a GPU (``benchmarks/gpu_check.py`` runs the engine on one)."""

from __future__ import annotations

import pytest
import torch

from zerotune.distributed.streams import DeferredRelease, Streams, host_wait, phase, streams_for
from zerotune.zero.stage3.unit import BufferPool


class FakeEvent:
    """Completes when the test says so; counts host waits."""

    def __init__(self) -> None:
        self.done = False
        self.host_waits = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.host_waits += 1
        self.done = True


def test_a_buffer_comes_back_only_after_the_event_recorded_after_its_last_use() -> None:
    given: list[str] = []
    release = DeferredRelease(given.append)
    release.later("cpu buffer", None)  # no event (CPU: used is done): at once
    assert given == ["cpu buffer"]
    first, second = FakeEvent(), FakeEvent()
    release.later("a", first)
    release.later("b", second)
    assert release.poll() == 2 and given == ["cpu buffer"] and release.waiting() == ["a", "b"]
    second.done = True  # a later event done first: the older still holds, nothing overtakes it
    assert release.poll() == 2 and given == ["cpu buffer"]
    first.done = True
    assert release.poll() == 0 and given == ["cpu buffer", "a", "b"]
    third = FakeEvent()
    release.later("c", third)
    release.drain()  # e.g. before dropping the pool: the host waits for the last use
    assert given[-1] == "c" and third.host_waits == 1 and release.waiting() == []


def test_the_reduce_buffer_pool_reuses_a_buffer_only_after_the_reduce_stream_is_done_with_it() -> None:
    pool = BufferPool(capacity_numel=1 << 20)
    like = torch.empty(0)
    used = pool.take(1000, like, zero=False)
    reduced = FakeEvent()
    pool.give(used, after=reduced)
    assert pool.nbytes() == 1000 * 4  # still held while the reduce stream may read it
    fresh = pool.take(1000, like, zero=False)
    assert fresh.data_ptr() != used.data_ptr()  # not handed out while in use
    reduced.done = True
    again = pool.take(1000, like, zero=True)
    assert again.data_ptr() == used.data_ptr() and bool((again == 0).all())


def test_the_host_waits_for_a_host_shards_copy_to_the_device_before_rewriting_it() -> None:
    """offload_param with pinned memory: a gather copies the host shard to the device asynchronously; the
    optimizer's write of the new shard (and a checkpoint load's) must wait for that copy, or the gather could
    read half-updated values. Off CUDA no copy is in flight (the event is None); here a fake one stands in."""
    from zerotune.zero.stage3.segment import FlatSegment

    segment = FlatSegment([torch.nn.Parameter(torch.ones(8))], None)
    for write in (lambda: segment.write_local_range(0, torch.zeros(2)),
                  lambda: segment.overwrite_local(torch.full((8,), 2.0), notify=False)):
        in_flight = FakeEvent()
        segment._copied_out = in_flight
        write()
        assert in_flight.host_waits == 1 and segment._copied_out is None
    assert segment.local.tolist() == [2.0] * 8


def test_off_cuda_every_stream_runs_in_place() -> None:
    streams = Streams(torch.device("cpu"))
    assert not streams.enabled and streams.stream("gather") is None
    log = []
    with streams.on("gather"), streams.on("reduce", after=None):
        log.append("ran")
    assert log == ["ran"]
    assert streams.mark("reduce") is None and streams.mark() is None
    streams.wait(None)
    streams.join("copy")
    streams.keep_until_used(torch.ones(3))
    host_wait(None)
    assert streams_for(torch.device("cpu")) is streams_for(torch.device("cpu"))


def _profiled_step_names(stage: int) -> set[str]:
    import zerotune
    from tests.models import make_mlp, mlp_batch

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu" if stage else "none"}},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = zerotune.initialize(model=make_mlp(), config=config)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        engine.backward(engine(**mlp_batch(0, engine.global_rank, 2)))
        engine.step()
    names = {event.name for event in profile.events() if event.name.startswith("zerotune.")}
    engine.destroy()
    return names


def test_a_trace_names_the_phases() -> None:
    from tests.harness import run_distributed

    for stage in (0, 2, 3):
        names = run_distributed(_profiled_step_names, 2, stage)[0]
        expected = {"zerotune.reduce", "zerotune.step"} | ({"zerotune.offload_copy"} if stage else set()) | (
            {"zerotune.gather"} if stage == 3 else set())
        assert expected <= names, (stage, names)


def test_phase_is_a_profiler_range() -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        with phase("gather"):
            torch.ones(4).sum()
    assert "zerotune.gather" in {event.name for event in profile.events()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_work_on_a_side_stream_is_ordered_by_its_events() -> None:
    streams = Streams(torch.device("cuda"))
    assert streams.enabled
    source = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    source.mul_(2)  # queued on the computation's stream
    with streams.on("gather"):  # behind it
        copy = source.clone()
    ready = streams.mark("gather")
    streams.wait(ready)
    assert torch.equal(copy, source)
    given = []
    release = DeferredRelease(given.append)
    release.later(copy, streams.mark())
    torch.cuda.synchronize()
    assert release.poll() == 0 and given == [copy]
