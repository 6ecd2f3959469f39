"""The link and the device that ``initialize`` with ``"stage": "auto"`` plans for, timed on the spot.

``zerotune plan`` runs before launch, often on a machine with neither the cluster's links nor its devices,
so it takes them as flags (``--bandwidth``, ``--flops``). ``initialize`` runs on the ranks that will train,
so it times them: an all-reduce over the group the ZeRO stages' traffic goes over, and a square matmul in
the training precision. Every rank then takes the slowest rank's figures (one all-reduce each over the
world), so every rank makes the same choice -- ranks choosing different ZeRO stages would wait for each
other's collectives forever.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerotune.distributed import comm

PROBE_BYTES = 8 * 2**20  # large enough to leave the latency-bound regime on common links, small enough to be instant
REPEATS = 3  # after one warm-up; the fastest run counts (the others include scheduling noise)


@dataclass(frozen=True)
class Measured:
    bandwidth: float | None  # bytes/s each rank sends in a ring all-reduce (None: one rank in the group)
    flops: float  # dense matmul flops/s in the training precision
    group_size: int

    def describe(self) -> str:
        link = (f"{self.bandwidth / 1e9:.2f} GB/s per rank (all-reduce of {PROBE_BYTES // 2**20} MiB over "
                f"{self.group_size} ranks)" if self.bandwidth is not None else "no data-parallel traffic (1 rank)")
        return f"measured: {link}, {self.flops / 1e12:.3f} TFLOP/s (matmul)"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fastest(run, device: torch.device) -> float:
    run()
    _synchronize(device)
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def ring_bandwidth(group: dist.ProcessGroup | None, size: int, device: torch.device) -> float | None:
    """Bytes/s each rank sends in a ring all-reduce over ``group`` of ``size`` ranks: 2 (n - 1) / n of the buffer
    per rank, over the time of the slowest rank (this rank's own figure; ``measure`` agrees them)."""
    if group is None or size == 1:
        return None
    buffer = torch.zeros(PROBE_BYTES // 4, dtype=torch.float32, device=device)
    seconds = _fastest(lambda: comm.all_reduce(buffer, group), device)
    return 2 * (size - 1) / size * PROBE_BYTES / seconds


def matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Flops/s of a square matmul in ``dtype`` (4096 on a GPU, 512 on a CPU: a few milliseconds either way)."""
    n = 4096 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _fastest(lambda: a @ b, device)


def measure(group: dist.ProcessGroup | None, size: int, device: torch.device, dtype: torch.dtype) -> Measured:
    """This job's data-parallel bandwidth and matmul flops, the slowest rank's on every rank."""
    bandwidth = ring_bandwidth(group, size, device)
    flops = matmul_flops(device, dtype)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # the slowest rank's: the largest seconds per byte and per flop, one MAX all-reduce
        slowness = torch.tensor([1 / bandwidth if bandwidth else 0.0, 1 / flops], dtype=torch.float64, device=device)
        comm.all_reduce(slowness, dist.group.WORLD, op=dist.ReduceOp.MAX)
        bandwidth = 1 / slowness[0].item() if bandwidth else None
        flops = 1 / slowness[1].item()
    return Measured(bandwidth, flops, size)
