"""NVMe swap layer: swap files (buffered and O_DIRECT) and the buffer pool.

Sizes are deliberately odd (not multiples of the block size or of a page) and the block
size is small, so one request splits into many pieces with unaligned heads and tails.
"""

from __future__ import annotations

import errno
import os
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from zerotune.config.sections import AioConfig
from zerotune.offload import (AioSettings, BufferPool, BufferPoolExhausted, SwapFileError, SwapStore,
                              aligned_numel, direct_io_supported)
from zerotune.offload import swap_files

SMALL_BLOCKS = AioSettings(block_size=8192, queue_depth=4, thread_count=2)


def _disk_dir(tmp_path: Path) -> Path:
    """A directory that accepts O_DIRECT: tmp_path, or else one on a disk-backed filesystem."""
    for candidate in (tmp_path, Path("/var/tmp"), Path.cwd()):
        if candidate.is_dir() and direct_io_supported(candidate):
            return Path(tempfile.mkdtemp(dir=candidate)) if candidate != tmp_path else tmp_path
    pytest.skip("no directory here accepts O_DIRECT")


@pytest.fixture(params=["buffered", "direct"])
def store(request, tmp_path):
    direct = request.param == "direct"
    directory = _disk_dir(tmp_path) if direct else tmp_path
    with SwapStore(directory / "swap", AioSettings(8192, 4, 2, use_direct_io=direct)) as s:
        assert s.direct_writes is direct and s.direct_reads is direct
        yield s
    s.close(remove_files=True)


def _random(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-100, 100, (numel,), generator=g).to(dtype)


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8])
@pytest.mark.parametrize("numel", [1, 1023, 12_345, 100_003])
def test_round_trip_whole_file(store, dtype, numel):
    data = _random(numel, dtype)
    store.allocate("t", numel, dtype)
    store.write("t", data).wait()
    out = torch.empty_like(data)
    store.read("t", out).wait()
    assert torch.equal(out, data)
    store.verify("t")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_offsets_write_and_read_only_their_range(store, dtype):
    numel = 50_001
    store.allocate("t", numel, dtype)
    base = _random(numel, dtype, seed=1)
    store.write("t", base).wait()
    for offset, length in [(0, 7), (3, 4099), (1025, 20_000), (numel - 333, 333), (4096, 8192)]:
        patch = _random(length, dtype, seed=offset + 2)
        store.write("t", patch, offset_numel=offset).wait()
        base[offset : offset + length] = patch
    whole = torch.empty_like(base)
    store.read("t", whole).wait()
    assert torch.equal(whole, base)
    part = torch.empty(777, dtype=dtype)
    store.read("t", part, offset_numel=12_345).wait()
    assert torch.equal(part, base[12_345 : 12_345 + 777])


def test_pool_buffers_round_trip_at_aligned_and_unaligned_offsets(store):
    pool = BufferPool(2, 30_000)
    chunk = aligned_numel(10_000, torch.float32)  # page-aligned chunk starts: O_DIRECT eligible
    store.allocate("t", 3 * chunk, torch.float32)
    for offset in (chunk, chunk + 5):
        src = pool.acquire(12_001)
        src.copy_(_random(12_001, torch.float32, seed=offset))
        store.write("t", src, offset).wait()
        dst = pool.acquire(12_001)
        store.read("t", dst, offset).wait()
        assert torch.equal(dst, src)
        pool.release(src)
        pool.release(dst)


def test_many_concurrent_reads_and_writes(store):
    tensors = {f"p{i}": _random(3_000 + 97 * i, torch.float32, seed=i) for i in range(48)}
    for name, t in tensors.items():
        store.allocate(name, t.numel(), t.dtype)
    handles = [store.write(name, t) for name, t in tensors.items()]  # all in flight before any wait
    for h in handles:
        h.wait()
    outs = {name: torch.empty_like(t) for name, t in tensors.items()}
    handles = [store.read(name, outs[name]) for name in tensors]
    for h in handles:
        h.wait()
    for name, t in tensors.items():
        assert torch.equal(outs[name], t), name


def test_zero_sized_tensor_and_file(store):
    store.allocate("empty", 0, torch.float32)
    store.write("empty", torch.empty(0)).wait()
    store.read("empty", torch.empty(0)).wait()
    store.verify("empty")


# ----------------------------------------------------------------------------- O_DIRECT vs buffered


def _count_direct_opens(monkeypatch) -> list[bool]:
    seen: list[bool] = []
    real_open = os.open

    def recording_open(path, flags, *args):
        seen.append(bool(flags & os.O_DIRECT))
        return real_open(path, flags, *args)

    monkeypatch.setattr(swap_files.os, "open", recording_open)
    return seen


def test_direct_io_is_used_for_aligned_requests_only(tmp_path, monkeypatch):
    directory = _disk_dir(tmp_path)
    with SwapStore(directory, AioSettings(8192, 2, 1, use_direct_io=True)) as s:
        pool = BufferPool(1, 20_000)
        s.allocate("t", 20_000, torch.float32)
        seen = _count_direct_opens(monkeypatch)
        buf = pool.acquire(10_000)
        buf.copy_(_random(10_000, torch.float32))
        s.write("t", buf, offset_numel=1024).wait()  # 4096-byte offset, aligned buffer
        assert any(seen)
        seen.clear()
        s.write("t", buf, offset_numel=1).wait()  # memory and file offset not congruent
        assert seen and not any(seen)
        out = torch.empty(10_000)
        s.read("t", out, offset_numel=1).wait()
        assert torch.equal(out, buf)
        s.close(remove_files=True)


def test_default_mode_is_the_measured_one(tmp_path):
    directory = _disk_dir(tmp_path)
    with SwapStore(directory, SMALL_BLOCKS) as s:  # use_direct_io=None
        assert (s.direct_writes, s.direct_reads) == (True, True)  # see aio.DIRECT_*_BY_DEFAULT
        data = _random(30_001, torch.float32)
        s.allocate("t", data.numel(), data.dtype)
        s.write("t", data).wait()
        out = torch.empty_like(data)
        s.read("t", out).wait()
        assert torch.equal(out, data)
        s.close(remove_files=True)


def _check_fallback(directory: Path) -> None:
    with SwapStore(directory, SMALL_BLOCKS) as s:
        assert s.direct_writes is False and s.direct_reads is False
        data = _random(9_999, torch.bfloat16)
        s.allocate("t", data.numel(), data.dtype)
        s.write("t", data, 0).wait()
        out = torch.empty_like(data)
        s.read("t", out).wait()
        assert torch.equal(out, data)
        s.close(remove_files=True)
    with pytest.raises(SwapFileError, match="refuses O_DIRECT"):
        SwapStore(directory, AioSettings(use_direct_io=True))


def test_filesystem_refusing_o_direct_falls_back_to_buffered_io(tmp_path, monkeypatch):
    """Simulated with an open() that refuses O_DIRECT as tmpfs did before Linux 6.6 (EINVAL)."""
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(swap_files.os, "open", refusing_open)
    assert not direct_io_supported(tmp_path)
    assert not list(tmp_path.iterdir())  # the probe cleans up after itself
    _check_fallback(tmp_path)


def test_real_tmpfs_without_o_direct_falls_back():
    shm = Path("/dev/shm")
    if not shm.is_dir() or direct_io_supported(shm):
        pytest.skip("no tmpfs refusing O_DIRECT here (Linux >= 6.6 tmpfs accepts it)")
    directory = Path(tempfile.mkdtemp(dir=shm))
    _check_fallback(directory)
    directory.rmdir()


# ----------------------------------------------------------------------------- broken files


def test_deleted_file_is_a_swap_file_error_naming_it(store):
    store.allocate("gone", 5_000, torch.float32)
    store.write("gone", torch.ones(5_000)).wait()
    store.path("gone").unlink()
    for attempt in (lambda: store.verify("gone"), lambda: store.read("gone", torch.empty(5_000)).wait(),
                    lambda: store.write("gone", torch.ones(5_000)).wait()):
        with pytest.raises(SwapFileError, match="missing") as info:
            attempt()
        assert str(store.path("gone")) in str(info.value)


def test_truncated_file_is_a_swap_file_error_naming_it(store):
    store.allocate("short", 5_000, torch.float32)
    store.write("short", torch.ones(5_000)).wait()
    os.truncate(store.path("short"), 12_345)
    for attempt in (lambda: store.verify("short"), lambda: store.read("short", torch.empty(10)).wait()):
        with pytest.raises(SwapFileError, match="12345 bytes but was allocated with 20000") as info:
            attempt()
        assert str(store.path("short")) in str(info.value)


def test_bad_requests_are_clear_errors(store):
    with pytest.raises(SwapFileError, match="never allocated"):
        store.read("nope", torch.empty(3)).wait()
    store.allocate("t", 100, torch.float32)
    with pytest.raises(ValueError, match="holds torch.float32, got a torch.bfloat16"):
        store.write("t", torch.ones(10, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"elements \[95, 105\) are outside"):
        store.write("t", torch.ones(10), offset_numel=95)
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        store.write("t", torch.ones(20)[::2])
    with pytest.raises(ValueError, match="without '/'"):
        store.allocate("a/b", 1, torch.float32)


def test_failed_write_raises_from_wait_after_all_pieces_finish(store, monkeypatch):
    store.allocate("t", 40_000, torch.float32)  # 160 kB in 8 kB pieces
    calls = {"n": 0}
    real_pwrite = os.pwrite

    def failing_pwrite(fd, data, offset):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(errno.EIO, "Input/output error")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(swap_files.os, "pwrite", failing_pwrite)
    handle = store.write("t", torch.ones(40_000))
    with pytest.raises(SwapFileError, match="Input/output error") as info:
        handle.wait()
    assert str(store.path("t")) in str(info.value) and "write of bytes" in str(info.value)
    assert handle.done()


def test_short_read_at_end_of_file_is_an_error(store, monkeypatch):
    store.allocate("t", 5_000, torch.float32)
    monkeypatch.setattr(swap_files.os, "preadv", lambda fd, buffers, offset: 0)
    with pytest.raises(SwapFileError, match="end of file"):
        store.read("t", torch.empty(5_000)).wait()


def test_missing_directory_without_create(tmp_path):
    with pytest.raises(SwapFileError, match="does not exist"):
        SwapStore(tmp_path / "absent", create=False)


def test_close_joins_and_removes_files(tmp_path):
    s = SwapStore(tmp_path, SMALL_BLOCKS)
    s.allocate("a", 10, torch.float32)
    s.write("a", torch.ones(10))  # not waited: close must finish it
    s.close(remove_files=True)
    assert not s.path("a").exists()
    with pytest.raises(SwapFileError, match="closed"):
        s.write("a", torch.ones(10))


def test_aio_settings_from_config():
    assert AioSettings.from_config(None) == AioSettings()
    assert AioSettings.from_config(AioConfig(block_size="auto", queue_depth=4)) == AioSettings(queue_depth=4)
    assert AioSettings.from_config({"thread_count": 2, "single_submit": True}).thread_count == 2
    assert AioSettings(queue_depth=4, thread_count=2).max_in_flight == 8
    with pytest.raises(ValueError, match="aio.block_size must be a multiple of 4096"):
        AioSettings(block_size=1000)
    with pytest.raises(ValueError, match="aio.queue_depth must be a positive int"):
        AioSettings(queue_depth=0)


# ----------------------------------------------------------------------------- BufferPool


def test_buffer_pool_bounds_and_alignment():
    pool = BufferPool(3, 1001)
    views = [pool.acquire(1001), pool.acquire(5), pool.acquire(0)]
    assert all(v.data_ptr() % 4096 == 0 for v in views)
    assert len({v.data_ptr() for v in views}) == 3 and pool.free_count == 0
    with pytest.raises(BufferPoolExhausted, match="all 3 swap buffers of 1001 elements are in use"):
        pool.acquire(1)
    pool.release(views[1])
    with pytest.raises(ValueError, match="already released"):
        pool.release(views[1])
    with pytest.raises(ValueError, match="holds 1001 elements"):
        pool.acquire(1002)
    with pytest.raises(ValueError, match="not a view returned by this pool"):
        pool.release(torch.empty(5))
    half = pool.acquire(2002, torch.bfloat16)  # same bytes, another dtype
    assert half.dtype == torch.bfloat16 and half.numel() == 2002
    with pytest.raises(ValueError, match="positive int"):
        BufferPool(0, 10)


def test_buffer_pool_acquire_can_wait_for_a_release():
    pool = BufferPool(1, 10)
    held = pool.acquire(10)
    threading.Timer(0.05, pool.release, args=(held,)).start()
    again = pool.acquire(10, timeout=5.0)
    assert again.data_ptr() == held.data_ptr()
    with pytest.raises(BufferPoolExhausted):
        pool.acquire(1, timeout=0.01)
