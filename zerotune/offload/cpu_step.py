"""The optimizer step on the host (ZeRO-Offload): which torch kernel, how many threads, how to chunk.

With ``offload_optimizer`` the fp32 masters and the optimizer state live in host memory and
the step runs on the CPU. That step is a stream over a few huge flat fp32 tensors, so it is
bound by memory bandwidth, and the only questions are which of torch's implementations gets
closest to it and how many threads to give it. Answers measured with
``benchmarks/bench_cpu_optimizer.py`` (2-core AMD EPYC VM, AVX2, torch 2.13 CPU build;
fp32, 100M elements; "bytes" counts the state each element must touch, e.g. 7 x 4 for Adam;
the machine's in-place-add bandwidth in the same run was ~28 GB/s):

=========  =================  =================  =================
type       fused              foreach            for-loop (default)
=========  =================  =================  =================
AdamW      27 GB/s  (0.96)    4.5 GB/s (0.16)    3.3 GB/s (0.12)
Adam       27 GB/s  (0.97)    5.1 GB/s (0.18)    2.2 GB/s (0.08)
SGD+mom.   20 GB/s  (0.71)    15 GB/s  (0.54)    15 GB/s  (0.54)
Adagrad    27 GB/s  (0.97)    1.5 GB/s (0.05)    3.1 GB/s (0.11)
=========  =================  =================  =================

(ratio to the measured bandwidth in brackets). torch's fused CPU kernels read and write every
element once, so they reach the bandwidth; foreach and the for-loop make one pass per
arithmetic op. ``zerotune.optim.build_optimizer`` already picks ``fused=True`` for these four
types, so :func:`build_cpu_optimizer` only adds what the host step needs on top: the
fp32-on-CPU check and a warning when fused could not be used. For one huge tensor foreach is
*not* reliably faster than the for-loop (Adagrad, RMSprop and ASGD were slower with it), so
other types keep torch's default.

Threads: one core already saturates this VM's memory bandwidth; a second thread changed a
single rank's AdamW step by -5..+10% (noise level), and with two ranks stepping at once on the
two cores, two threads each oversubscribe the cores and were slower. :func:`cpu_step_threads`
therefore gives each rank its share of the cores (here: 2 with one rank, 1 with two); on a
many-core server, where one core reaches a fraction of the bandwidth, that share is what helps.

Chunking (NVMe offload steps one ``sub_group_size`` chunk at a time, the others holding no
gradient): 1M-element chunks cost ~3% of the step and 10M+ no measurable time. The fused
kernels vectorise each tensor and finish its last ``len % 8`` (AVX2) elements with scalar
code, which rounds differently by up to 1 ulp; so chunk boundaries at a multiple of
:data:`STEP_ALIGNMENT_ELEMENTS` keep chunked stepping bitwise equal to stepping the whole
tensor. The thread count never changes the numbers.
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
"""Optimizer types torch has a fused CPU kernel for (measured 1.3-20x faster than the alternatives)."""


def build_cpu_optimizer(
    optimizer_type: str, hyperparameters: Mapping[str, Any], param_groups: Iterable
) -> torch.optim.Optimizer:
    """Build the optimizer for host-resident fp32 masters, on torch's fastest CPU kernel.

    Same arguments and DeepSpeed semantics as ``zerotune.optim.build_optimizer`` (which
    picks ``fused=True`` for Adam/AdamW/SGD/Adagrad). Every tensor must be fp32 on the CPU:
    the offloaded step runs there and keeps full-precision masters; anything else is a
    wiring bug upstream, reported here by position rather than as a kernel error later.
    Warns when one of :data:`FUSED_TYPES` ends up unfused without the user asking for it
    (a setting the fused kernel refuses): the step still works, ~6x slower (see the table above).
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
    if canonical_optimizer_name(optimizer_type) in FUSED_TYPES and not user_chose:
        if step_implementation(optimizer) != "fused":
            warnings.warn(
                f"optimizer {optimizer_type!r}: torch's fused CPU kernel refused these settings, so the "
                f"offloaded step runs the {step_implementation(optimizer)} implementation (measured ~6x slower)",
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
    cores (measured slower with 2 ranks x 2 threads on 2 cores); a share, rather than the
    single thread training ranks usually run with, lets a lone rank use the idle cores.
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
