"""NVMe swap bandwidth: SwapStore through a BufferPool against raw sequential file I/O, one run.

    python benchmarks/bench_nvme_swap.py                       # 1 GiB, disk-backed temp dir
    python benchmarks/bench_nvme_swap.py --dir /mnt/nvme/tmp   # another disk
    python benchmarks/bench_nvme_swap.py --size-mib 256 --repeats 1   # smoke test

Raw baseline, per mode, in the same directory and on the same amount of data:
- buffered: ``os.pwrite`` of 8 MiB blocks then ``fsync`` (timed together, so the figure is the
  disk's, not the page cache's); read back with ``os.preadv`` of 8 MiB blocks.
- O_DIRECT: the same calls on an O_DIRECT descriptor from a page-aligned buffer.

Dropping the page cache: ``/proc/sys/vm/drop_caches`` is not writable in this container, so
before every read the file's own cached pages are evicted with ``posix_fadvise(DONTNEED)``
after an ``fsync`` (clean pages are dropped immediately; works without root). The figure
"re-read from page cache" is printed as a check: it must be far above the measured reads,
or the eviction did not happen. O_DIRECT reads never touch the cache.

SwapStore: a file of the same size, written then read through a BufferPool of
``--buffer-count`` buffers of ``--buffer-mib`` MiB, keeping every buffer in flight (a buffer is
reused once its oldest transfer is waited for), with the store's aio settings (block size,
queue depth, threads). Buffered writes are followed by ``SwapStore.sync`` inside the timing,
as for the raw baseline. Each figure is the best of ``--repeats`` runs; ratios are swap/raw of
the same mode (target >= 0.8) and swap/best raw of either mode.

The measured result decides ``zerotune.offload.aio.DIRECT_WRITES_BY_DEFAULT`` and
``DIRECT_READS_BY_DEFAULT``; the row "default" is the store with ``use_direct_io=None`` (its
ratios are against the best raw figure of either mode).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zerotune.offload import AioSettings, BufferPool, SwapStore, aligned_empty, direct_io_supported  # noqa: E402
from zerotune.offload.buffers import tensor_memoryview  # noqa: E402

MiB = 1 << 20
RAW_BLOCK = 8 * MiB


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding ``path``, from the longest matching /proc/mounts entry."""
    best, kind = "", "unknown"
    resolved = str(path.resolve())
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, mount_point, fs_type, *_ = line.split()
            if (resolved == mount_point or resolved.startswith(mount_point.rstrip("/") + "/")) and len(mount_point) > len(best):
                best, kind = mount_point, fs_type
    return kind


def default_dir() -> Path:
    for candidate in ("/var/tmp", tempfile.gettempdir(), os.getcwd()):
        if os.path.isdir(candidate) and filesystem_type(Path(candidate)) not in ("tmpfs", "ramfs", "overlay"):
            return Path(candidate)
    return Path(tempfile.gettempdir())


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_pass(path: Path, nbytes: int, direct: bool) -> tuple[float, float]:
    """Seconds to write then read ``nbytes`` sequentially in RAW_BLOCK calls."""
    view = tensor_memoryview(aligned_empty(RAW_BLOCK).random_(0, 256))
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        start = time.perf_counter()
        for offset in range(0, nbytes, RAW_BLOCK):
            os.pwrite(fd, view, offset)
        os.fsync(fd)
        write_s = time.perf_counter() - start
        evict(path)
        start = time.perf_counter()
        for offset in range(0, nbytes, RAW_BLOCK):
            os.preadv(fd, [view], offset)
        read_s = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink()
    return write_s, read_s


def cached_reread(path: Path, nbytes: int) -> float:
    view = tensor_memoryview(aligned_empty(RAW_BLOCK))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for offset in range(0, nbytes, RAW_BLOCK):
            os.pwrite(fd, view, offset)
        start = time.perf_counter()
        for offset in range(0, nbytes, RAW_BLOCK):
            os.preadv(fd, [view], offset)
        return time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink()


def swap_pass(directory: Path, nbytes: int, settings: AioSettings, pool: BufferPool) -> tuple[float, float]:
    """Seconds to write then read ``nbytes`` through ``pool`` with all buffers in flight."""
    chunk = pool.buffer_size
    numel = nbytes // 4
    with SwapStore(directory, settings) as store:
        store.allocate("bench", numel, torch.float32)
        timings = []
        for is_write in (True, False):
            if not is_write:
                evict(store.path("bench"))
            in_flight: collections.deque = collections.deque()
            start = time.perf_counter()
            for offset in range(0, numel, chunk):
                if pool.free_count == 0:
                    handle, buffer = in_flight.popleft()
                    handle.wait()
                    pool.release(buffer)
                buffer = pool.acquire(min(chunk, numel - offset))
                issue = store.write if is_write else store.read
                in_flight.append((issue("bench", buffer, offset), buffer))
            for handle, buffer in in_flight:
                handle.wait()
                pool.release(buffer)
            if is_write and not store.direct_writes:
                store.sync("bench")
            timings.append(time.perf_counter() - start)
        store.close(remove_files=True)
    return timings[0], timings[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure (default: disk-backed temp dir)")
    parser.add_argument("--size-mib", type=int, default=1024, help="data moved per pass")
    parser.add_argument("--buffer-mib", type=int, default=64, help="BufferPool buffer size")
    parser.add_argument("--buffer-count", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=1 << 20, help="aio.block_size, bytes")
    parser.add_argument("--queue-depth", type=int, default=8)
    parser.add_argument("--thread-count", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="best of this many passes")
    args = parser.parse_args()

    base = args.dir or default_dir()
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="zerotune-bench-swap-", dir=base))
    nbytes = args.size_mib * MiB
    direct_ok = direct_io_supported(work)
    print(f"dir {work} ({filesystem_type(work)}), {args.size_mib} MiB per pass, O_DIRECT "
          f"{'supported' if direct_ok else 'refused'}; pool {args.buffer_count} x {args.buffer_mib} MiB; "
          f"aio block {args.block_size} B, queue_depth {args.queue_depth}, threads {args.thread_count}")
    pool = BufferPool(args.buffer_count, args.buffer_mib * MiB // 4)
    views = [pool.acquire(pool.buffer_size) for _ in range(args.buffer_count)]
    for v in views:
        v.uniform_()  # random data, so no layer below can shortcut zeros
        pool.release(v)
    try:
        cached = cached_reread(work / "cached.bin", min(nbytes, 512 * MiB))
        print(f"re-read from page cache (sanity check): {min(nbytes, 512 * MiB) / cached / 1e6:8.0f} MB/s")
        print(f"{'mode':9s} {'raw write':>10s} {'swap write':>11s} {'ratio':>6s}   "
              f"{'raw read':>9s} {'swap read':>10s} {'ratio':>6s}   (MB/s)")
        results = {}
        for direct in ([False, True] if direct_ok else [False]):
            settings = AioSettings(args.block_size, args.queue_depth, args.thread_count, use_direct_io=direct)
            raw = [raw_pass(work / "raw.bin", nbytes, direct) for _ in range(args.repeats)]
            swap = [swap_pass(work, nbytes, settings, pool) for _ in range(args.repeats)]
            bw = lambda seconds: nbytes / min(seconds) / 1e6  # noqa: E731
            results[direct] = (bw([w for w, _ in raw]), bw([w for w, _ in swap]),
                               bw([r for _, r in raw]), bw([r for _, r in swap]))
            rw, sw, rr, sr = results[direct]
            print(f"{'O_DIRECT' if direct else 'buffered':9s} {rw:10.0f} {sw:11.0f} {sw / rw:6.2f}   "
                  f"{rr:9.0f} {sr:10.0f} {sr / rr:6.2f}")
        best_raw_write = max(r[0] for r in results.values())
        best_raw_read = max(r[2] for r in results.values())
        settings = AioSettings(args.block_size, args.queue_depth, args.thread_count, use_direct_io=None)
        swap = [swap_pass(work, nbytes, settings, pool) for _ in range(args.repeats)]
        sw, sr = (nbytes / min(t[k] for t in swap) / 1e6 for k in (0, 1))
        print(f"{'default':9s} {best_raw_write:10.0f} {sw:11.0f} {sw / best_raw_write:6.2f}   "
              f"{best_raw_read:9.0f} {sr:10.0f} {sr / best_raw_read:6.2f}   (raw: best of both modes)")
        for direct, (_, sw, _, sr) in results.items():
            print(f"{'O_DIRECT' if direct else 'buffered':9s} swap / best raw: write {sw / best_raw_write:.2f}, "
                  f"read {sr / best_raw_read:.2f}")
        if len(results) == 2:
            faster = max(results, key=lambda d: results[d][1] * results[d][3] / (results[d][1] + results[d][3]))
            print(f"faster swap mode (harmonic mean of write and read): {'O_DIRECT' if faster else 'buffered'}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
