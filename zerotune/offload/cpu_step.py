"""The optimizer step on the host (ZeRO-Offload): which torch kernel, how many threads, how to chunk.

With ``offload_optimizer`` the fp32 masters and the optimizer state live in host memory and
the step runs on the CPU. That step streams over a few huge flat fp32 tensors, so it is bound
by memory bandwidth; the questions are which of torch's implementations gets closest to it
and how many threads to give it. Measured with ``benchmarks/bench_cpu_optimizer.py`` (2-core
AMD EPYC VM, AVX2, torch 2.13 CPU build, 100M fp32 elements, medians of interleaved rounds,
other jobs sharing the cores: load ~3). GB/s counts the state each element must touch once
(Adam/AdamW 7 x 4 bytes, SGD+momentum and Adagrad 5 x 4); in brackets the ratio to the same
run's in-place ``add_`` bandwidth, 29.8 GB/s (the fused kernels can slightly exceed it):

=============  ==================  ==================  ==================  ===================
type           fused, 1 thread     fused, 2 threads    foreach, 1 thread   for-loop, 1 thread
=============  ==================  ==================  ==================  ===================
AdamW          29.2 GB/s (0.98)    31.7 GB/s (1.06)    4.7 GB/s (0.16)     2.9 GB/s (0.10)
Adam (L2)      32.7 GB/s (1.10)    35.3 GB/s (1.18)    3.1 GB/s (0.10)     2.4 GB/s (0.08)
SGD+momentum   26.1 GB/s (0.87)    30.5 GB/s (1.02)    16.4 GB/s (0.55)    17.3 GB/s (0.58)
Adagrad        25.1 GB/s (0.84)    27.7 GB/s (0.93)    1.6 GB/s (0.05)     4.3 GB/s (0.14)
=============  ==================  ==================  ==================  ===================

torch's fused CPU kernels read and write each element once; foreach and the for-loop make one
pass per arithmetic op (and allocate full-size temporaries). ``zerotune.optim.build_optimizer``
already picks ``fused=True`` for these four types, so :func:`build_cpu_optimizer` adds only
what the host step needs on top: the fp32-on-CPU check and a warning when fused could not be
used. For one huge tensor foreach is *not* reliably faster than the for-loop (Adagrad above;
RMSprop, Adadelta, ASGD in a side measurement), so types without a fused kernel keep torch's
default.

Threads (see :func:`cpu_step_threads`): a lone rank stepping AdamW with both cores was 8-30%
faster than with one in three runs (78 vs 91, 88 vs 96, 79 vs 117 ms; the add_ bandwidth
itself ranged 27-37 GB/s between runs). Two ranks stepping at once (50M elements each) gained
nothing reliable from 2 threads each, which oversubscribes the cores: aggregate 19-50 GB/s
(median 38) against 26-43 GB/s (median 35) with 1 each, over five runs. A hazard on shared
machines: every parallel region waits for all its threads, and a thread descheduled by some
other process costs a scheduler time slice (~5 ms); in a run with the cores busy, AdamW in
1M-element chunks took 625 ms with 2 threads against 117 ms with 1 (86 vs 119 ms when
quieter). Use ``step_threads(1)`` where the cores are not the job's own.

Chunking (NVMe offload steps one ``sub_group_size`` chunk at a time, the others holding no
gradient): 1M-element chunks cost +16..24% over one step of the whole 100M tensor, 10M chunks
+10..13% (noise level: -12% in another run). The fused kernels vectorise each tensor and
finish its last ``len % 8`` (AVX2) elements in scalar code, which rounds differently by up to
1 ulp; chunk boundaries at a multiple of :data:`STEP_ALIGNMENT_ELEMENTS` therefore keep
chunked stepping bitwise equal to stepping the whole tensor. The thread count never changes the numbers.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from zerotune.optim import build_optimizer, canonical_optimizer_name

STEP_ALIGNMENT_ELEMENTS = 64
"""Chunk boundaries at multiples of this (>= the widest CPU vector, 16 fp32 on AVX-512) keep
chunked fused steps bitwise equal to unchunked ones."""

FUSED_TYPES = ("Adam", "AdamW", "SGD", "Adagrad")
"""Optimizer types torch has a fused CPU kernel for (measured 1.6-10x faster than the better alternative)."""


def build_cpu_optimizer(
    optimizer_type: str, hyperparameters: Mapping[str, Any], param_groups: Iterable
) -> torch.optim.Optimizer:
    """Build the optimizer for host-resident fp32 masters, on torch's fastest CPU kernel.

    Same arguments and DeepSpeed semantics as ``zerotune.optim.build_optimizer`` (which
    picks ``fused=True`` for Adam/AdamW/SGD/Adagrad). Every tensor must be fp32 on the CPU:
    the offloaded step runs there and keeps full-precision masters; anything else is a
    wiring bug upstream, reported here by position rather than as a kernel error later.
    Warns when one of :data:`FUSED_TYPES` ends up unfused without the user asking for it
    (a setting the fused kernel refuses): the step still works, 1.6-10x slower (table above).
    """
    groups = list(param_groups)
    for group_index, group in enumerate(groups):
        tensors = group["params"] if isinstance(group, Mapping) else [group]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        for tensor_index, tensor in enumerate(tensors):
            if tensor.device.type != "cpu" or tensor.dtype != torch.float32:
                raise ValueError(
                    f"build_cpu_optimizer: param_groups[{group_index}] tensor {tensor_index} "
                    f"(shape {tuple(tensor.shape)}) is {tensor.dtype} on {tensor.device}; the host step "
                    "needs torch.float32 tensors on the CPU (the offloaded fp32 masters)"
                )
    optimizer = build_optimizer(optimizer_type, hyperparameters, groups)
    user_chose = any(key in (hyperparameters or {}) for key in ("fused", "foreach"))
    implementation = step_implementation(optimizer)
    if canonical_optimizer_name(optimizer_type) in FUSED_TYPES and not user_chose and implementation != "fused":
        warnings.warn(
            f"optimizer {optimizer_type!r}: torch's fused CPU kernel refused these settings, so the "
            f"offloaded step runs the {implementation} implementation (measured 1.6-10x slower)",
            stacklevel=2,
        )
    return optimizer


def step_implementation(optimizer: torch.optim.Optimizer) -> str:
    """``"fused"``, ``"foreach"`` or ``"for-loop"``: which torch kernel ``optimizer.step()`` runs on CPU tensors.

    torch keeps the choice in each param group's ``fused``/``foreach`` entries; ``foreach=None``
    means torch's default, which is the for-loop for CPU tensors.
    """
    group = optimizer.param_groups[0]
    if group.get("fused"):
        return "fused"
    return "foreach" if group.get("foreach") else "for-loop"


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which containers and taskset narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_step_threads(local_world_size: int) -> int:
    """Intra-op threads for one rank's host step: its equal share of this node's cores, at least 1.

    Every rank on the node steps at the same moment, so more than a share oversubscribes the
    cores (2 ranks x 2 threads on 2 cores: no reliable gain, twice the spread); a share, rather
    than the single thread training ranks usually run with, lets a lone rank use the idle
    cores (+8-30% here).
    On a many-core server one core reaches only a fraction of the memory bandwidth, so the
    share matters more there (expected, not measured: this machine has 2 cores). Assumes the
    node's cores are the job's own; see the module docstring for what happens when they are not.
    """
    if not isinstance(local_world_size, int) or local_world_size < 1:
        raise ValueError(f"cpu_step_threads: local_world_size must be an int >= 1, got {local_world_size!r}")
    return max(1, available_cores() // local_world_size)


@contextmanager
def step_threads(threads: int) -> Iterator[None]:
    """Run the enclosed code with ``threads`` torch intra-op threads, then restore the previous count.

    Training ranks usually run with one thread each (OMP_NUM_THREADS=1) so that ranks do not
    fight over cores during forward/backward; the host step may use the rank's whole share::

        with step_threads(cpu_step_threads(local_world_size)):
            optimizer.step()
    """
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"step_threads: threads must be an int >= 1, got {threads!r}")
    previous = torch.get_num_threads()
    if threads == previous:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
