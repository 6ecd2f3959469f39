"""``"zero_optimization": {"stage": "auto"}`` and ``zerotune plan --auto``: the fastest layout that fits.

Candidates: tensor-parallel size, pipeline stages or sequence-parallel size (``splits.py``; ``zerotune plan
--auto`` only), ZeRO stage 0-3, optimizer offload to the host (and, at stage 3, parameter offload) -- as far
as they compose (``parallel/composition.py``: the engine's own rule) -- activation checkpointing on or off,
and every micro-batch that divides each data-parallel replica's share of the global batch (the rest is
gradient accumulation). Each candidate's per-rank memory comes from ``memory.plan_from_profile``; its
step time from a cost model:

* compute: 6 flops per parameter the rank holds per token (forward + backward; an input embedding that is
  only looked up, none), 8 with activation
  checkpointing (the forward runs again), over the device's flops; with ``p`` pipeline stages the slowest
  stage's compute, stretched by the 1F1B bubble to (accumulation + p - 1) micro-batches;
* data-parallel communication per rank, ring collectives moving (N - 1) / N of the buffer: stage 0
  all-reduces the fp32 gradients once per step (2 x 4 bytes per trainable parameter); stage 1
  reduce-scatters and all-gathers once per step (2 x width); stage 2 reduces every micro-step and
  all-gathers once; stage 3 gathers the parameters twice and reduce-scatters the gradients every
  micro-step -- over the given bandwidth; the gradient buckets zerotune reduces while the backward runs
  cost only what exceeds that backward's compute;
* tensor parallelism: every block (of the rank's stage) all-reduces its output twice in the forward and
  twice in the backward (three times each way with checkpointing: the forward runs again), each all-reduce
  moving 2 (t - 1) / t of one block input (the traced bytes), over the node's links (``intra_node_bandwidth``);
* sequence parallelism (Ulysses): every block's attention all-to-alls q, k and v to head-split and its
  output back, in the forward, the backward and a checkpointed block's recomputed forward, each moving
  (s - 1) / s of one block input of the rank's tokens, over the node's links;
* pipeline: each micro-batch's activations go to the next stage and their gradients come back (one block
  input each way), over the given bandwidth (tensor-parallel and pipeline traffic is on the critical path);
* offload: gradients to the host and parameters back every step (every micro-step for offloaded
  parameters) over the host link, and the host optimizer's update.

Layouts whose device total exceeds the budget (or whose offloaded state exceeds the host memory) are out;
the rest are ranked by modeled step time, ties going to less communication. The choice, its reason and
the runner-up are printed.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from zerotune.parallel.composition import refusal
from zerotune.plan.measure import Measured
from zerotune.plan.memory import Layout, ModelProfile, plan_from_profile, stage_profiles

HOST_OPTIMIZER_PARAMS_PER_S = 1e9  # parameters a host Adam updates per second per rank (order of magnitude)


@dataclass(frozen=True)
class Hardware:
    device_memory: int
    flops: float = 400e12  # per device, dense 16-bit
    bandwidth: float = 50e9  # bytes/s per rank in a ring collective
    intra_node_bandwidth: float = 300e9  # bytes/s per rank within a node (tensor parallelism's all-reduces)
    host_bandwidth: float = 25e9  # bytes/s device <-> host
    host_memory: int | None = None  # per node
    ranks_per_node: int = 8
    headroom: float = 0.9  # the share of device memory a layout may plan to use: the rest is for the allocator's
    # fragmentation and what the plan does not see (its measured error is within 10%: bench_plan_accuracy.py)


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    checkpointing: bool
    gas: int
    device_bytes: int
    host_bytes: int
    comm_bytes: float
    seconds: float
    # the communication compute does not hide (tensor-parallel, pipeline, exposed data-parallel)
    comm_seconds: float = 0.0

    def describe(self) -> str:
        offload = []
        if self.layout.offload_optimizer != "none":
            offload.append(f"optimizer on {self.layout.offload_optimizer}")
        if self.layout.offload_param != "none":
            offload.append(f"parameters on {self.layout.offload_param}")
        split = (f"tensor parallel {self.layout.tp}, " if self.layout.tp > 1 else "") + (
            f"{self.layout.pp} pipeline stages, " if self.layout.pp > 1 else "") + (
            f"sequence parallel {self.layout.sp}, " if self.layout.sp > 1 else "")
        offloads = ", " + ", ".join(offload) if offload else ""
        return (f"{split}ZeRO {self.layout.stage}{offloads}, activation checkpointing "
                f"{'on' if self.checkpointing else 'off'}, micro-batch {self.layout.micro_batch} x {self.gas} "
                f"accumulation: {self.device_bytes / 2**30:.2f} GiB per rank, {self.comm_bytes / 2**30:.2f} GiB "
                f"communicated per rank per step, {self.seconds * 1e3:.1f} ms per step (modeled)")


def data_parallel_bytes(layout: Layout, trainable: int, params: int, gas: int) -> tuple[float, float]:
    """Bytes each rank sends per optimizer step (ring: (N - 1) / N of each collective's buffer), as (sent while
    the backward pass runs, sent outside it): gradient buckets are reduced as the backward produces them;
    stage 1 / 2's all-gather of the updated parameters follows the optimizer step, and stage 3's gathers are
    counted whole: each unit waits for its own (prefetch hides some of it, how much depends on the model's
    units and the link, so none is credited)."""
    n = layout.zero_group
    if n == 1:
        return 0.0, 0.0
    ring = (n - 1) / n
    width = 2 if layout.precision in ("bf16", "fp16") else 4
    if layout.stage == 0:
        return 2 * ring * 4 * trainable, 0.0
    if layout.stage == 1:
        return ring * width * trainable, ring * width * params
    if layout.stage == 2:
        return ring * width * gas * trainable, ring * width * params
    return 0.0, ring * width * gas * (2 * params + trainable)  # each unit's forward and backward wait for its gather


def communication_bytes(layout: Layout, trainable: int, params: int, gas: int) -> float:
    """Data-parallel bytes each rank sends per optimizer step."""
    return sum(data_parallel_bytes(layout, trainable, params, gas))


def step_seconds(layout: Layout, profile: ModelProfile, gas: int, checkpointing: bool,
                 hardware: Hardware) -> tuple[float, float, float]:
    """(modeled seconds per optimizer step, bytes communicated per rank, seconds of that communication compute
    does not hide); ``profile``: what this rank holds (with pipeline stages, one stage's: ``stage_profiles``)."""
    params = profile.trainable + profile.frozen
    multiplied = params - profile.lookup  # an embedding lookup costs no flops per parameter
    tokens = layout.micro_batch * profile.seq_len
    micro_batches = gas + layout.pp - 1  # the 1F1B bubble: the last micro-batch leaves pp - 1 slots later
    per_micro_batch = (8 if checkpointing else 6) * multiplied * tokens / hardware.flops
    backward = (6 if checkpointing else 4) * multiplied * tokens / hardware.flops  # (with the forward run again)
    compute = per_micro_batch * micro_batches
    overlapped, exposed = data_parallel_bytes(layout, profile.trainable, params, gas)
    # what gradient reduction can hide under: the last backward (stages 0 / 1 reduce at the boundary), every
    # backward (stage 2 reduces every micro-step)
    window = gas * backward if layout.stage == 2 else backward
    communicating = exposed / hardware.bandwidth + max(0.0, overlapped / hardware.bandwidth - window)
    comm = overlapped + exposed
    block_input = layout.micro_batch * (profile.per_example.block_inputs[0] if profile.per_example.block_inputs else 0)
    blocks = len(profile.stages[0].blocks) if profile.stages else len(profile.per_example.block_saved)
    if layout.tp > 1:  # the blocks this rank runs: its stage's when pipelined
        all_reduces = gas * blocks * (6 if checkpointing else 4)
        tensor_parallel = all_reduces * 2 * (layout.tp - 1) / layout.tp * block_input
        communicating += tensor_parallel / hardware.intra_node_bandwidth
        comm += tensor_parallel
    if layout.sp > 1:  # Ulysses: q, k, v to head-split and the output back, in each pass (an upper bound with
        # grouped-query attention, whose k and v are smaller); each all-to-all moves (sp - 1) / sp of a block input
        all_to_alls = gas * blocks * 4 * (3 if checkpointing else 2)
        sequence_parallel = all_to_alls * (layout.sp - 1) / layout.sp * block_input
        communicating += sequence_parallel / hardware.intra_node_bandwidth
        comm += sequence_parallel
    if layout.pp > 1:
        transfers = gas * 2 * block_input  # activations forward, their gradients back
        communicating += transfers / hardware.bandwidth
        comm += transfers
    seconds = compute + communicating
    shard = profile.trainable / (1 if layout.stage == 0 else layout.zero_group)
    if layout.offload_optimizer != "none":
        width = 2 if layout.precision in ("bf16", "fp16") else 4
        seconds += (4 * shard + width * shard) / hardware.host_bandwidth + shard / HOST_OPTIMIZER_PARAMS_PER_S
    if layout.offload_param != "none":
        width = 2 if layout.precision in ("bf16", "fp16") else 4
        seconds += gas * 2 * width * params / layout.zero_group / hardware.host_bandwidth
    return seconds, comm, communicating


def candidates(profile: ModelProfile, base: Layout, per_rank_batch: int, hardware: Hardware,
               micro_batches: list[int] | None = None, checkpointing: tuple[bool, ...] = (False, True),
               vary_offload: bool = True) -> list[Candidate]:
    """Every layout of the space for ``base``'s split (tensor-parallel size, pipeline stages, data-parallel
    size), with its memory and modeled time (fitting or not). ``per_rank_batch``: examples per data-parallel
    replica per step; ``micro_batches``: the micro-batches to consider (default: every divisor of it);
    ``vary_offload`` False keeps ``base``'s offload settings."""
    result = []
    micros = micro_batches or [m for m in range(1, per_rank_batch + 1) if per_rank_batch % m == 0]
    for stage in (0, 1, 2, 3):
        offloads = [("none", "none"), ("cpu", "none")] + ([("cpu", "cpu")] if stage == 3 else [])
        if not vary_offload:
            offloads = [(base.offload_optimizer, base.offload_param if stage == 3 else "none")]
        for offload_optimizer, offload_param in offloads:
            if offload_optimizer != "none" and stage == 0:
                continue  # offload needs a partitioned optimizer
            if refusal(stage, offload_optimizer, base.tp, base.pp, base.sp) is not None:
                continue  # a layout the engine would refuse (parallel/composition.py)
            for micro in micros:
                gas = max(1, per_rank_batch // micro)
                layout = dataclasses.replace(base, stage=stage, micro_batch=micro, gas=gas,
                                             offload_optimizer=offload_optimizer, offload_param=offload_param)
                plan = plan_from_profile(profile, layout)  # the fullest rank's memory
                for ckpt in checkpointing:  # the slowest rank's time (pipeline stages wait for each other)
                    seconds, comm, communicating = max(step_seconds(layout, held, gas, ckpt, hardware)
                                                       for held in stage_profiles(profile, layout))
                    result.append(Candidate(layout, ckpt, gas, plan.total("device", ckpt), plan.total("host"), comm,
                                            seconds, communicating))
    return result


def fits(candidate: Candidate, hardware: Hardware) -> bool:
    if candidate.device_bytes > hardware.headroom * hardware.device_memory:
        return False
    if hardware.host_memory is not None and candidate.host_bytes * hardware.ranks_per_node > hardware.host_memory:
        return False
    return True


@dataclass
class Choice:
    best: Candidate
    runner_up: Candidate | None
    considered: int
    fitting: int
    headroom: float

    def explain(self) -> str:
        lines = [f"auto layout: {self.best.describe()}",
                 f"  why: the fastest by the cost model of the {self.fitting} of {self.considered} candidate layouts "
                 f"that fit in {self.headroom:.0%} of the device (compute + the communication it does not hide + "
                 "offload traffic)"]
        if self.runner_up is not None:
            slower = self.runner_up.seconds / self.best.seconds - 1 if self.best.seconds else 0.0
            lines.append(f"  runner-up ({slower:+.1%}): {self.runner_up.describe()}")
        return "\n".join(lines)


class NoLayoutFits(ValueError):
    """Not even the most frugal layout fits; the message names it and its needs."""


def choose(profile: ModelProfile, base: Layout, per_rank_batch: int, hardware: Hardware,
           micro_batches: list[int] | None = None, checkpointing: tuple[bool, ...] = (False, True),
           vary_offload: bool = True) -> Choice:
    """The fastest fitting candidate of ``base``'s split and the runner-up; NoLayoutFits when none fits."""
    return _pick(candidates(profile, base, per_rank_batch, hardware, micro_batches, checkpointing, vary_offload),
                 hardware)


def choose_layout(profiles: dict[tuple[int, int, int], ModelProfile], base: Layout, world: int, global_batch: int,
                  hardware: Hardware, vary_offload: bool = True) -> Choice:
    """Over every split in ``profiles`` ({(tp, pp, sp): profile}, ``splits.split_profiles``) whose data-parallel
    size divides ``global_batch``: the fastest fitting layout and the runner-up."""
    everything = []
    for (tp, pp, sp), profile in sorted(profiles.items()):
        dp = world // (tp * pp * sp)
        if world % (tp * pp * sp) or global_batch % dp:
            continue
        split = dataclasses.replace(base, tp=tp, pp=pp, sp=sp, dp=dp)
        everything += candidates(profile, split, global_batch // dp, hardware, vary_offload=vary_offload)
    if not everything:
        raise NoLayoutFits(f"no split of {world} ranks divides the global batch of {global_batch} examples evenly")
    return _pick(everything, hardware)


def _pick(everything: list[Candidate], hardware: Hardware) -> Choice:
    # ties: less communication, then fewer micro-steps (larger kernels), then less memory
    fitting = sorted((c for c in everything if fits(c, hardware)),
                     key=lambda c: (round(c.seconds, 9), c.comm_bytes, c.gas, c.device_bytes))
    if not fitting:
        smallest = min(everything, key=lambda c: c.device_bytes)
        raise NoLayoutFits(f"no layout fits {hardware.headroom:.0%} of {hardware.device_memory / 2**30:.2f} GiB per "
                           f"device: the smallest, "
                           f"{smallest.describe()}; add ranks, lower the sequence length or offload to NVMe")
    best = fitting[0]
    # the runner-up: the fastest of another kind (split, stage, offload or checkpointing), not the same layout with
    # another micro-batch
    runner_up = next((c for c in fitting if _kind(c) != _kind(best)), None)
    return Choice(best, runner_up, len(everything), len(fitting), hardware.headroom)


def _kind(candidate: Candidate) -> tuple:
    layout = candidate.layout
    return (layout.tp, layout.pp, layout.sp, layout.stage, layout.offload_optimizer, layout.offload_param,
            candidate.checkpointing)


def choose_stage_at_initialize(model: torch.nn.Module, config: Any, dp: int, device: torch.device,
                               measured: Measured, tp: int = 1, pp: int = 1, sp: int = 1) -> Choice:
    """``initialize`` with ``"stage": "auto"``: the same choice for the live model, over the ZeRO stages with
    the config's micro-batch, accumulation, precision, offload and ``tp`` / ``pp`` / ``sp`` sizes (the stages
    those compose with), for the bandwidth and flops ``measured`` on the job's own ranks (``measure.py``).
    Activations are not in it (initialize does not know the sequence length; ``zerotune plan --seq-len``
    does), so the device budget is the device's memory (CUDA) or this rank's share of the host's (CPU)."""
    from zerotune.plan.activations import ActivationProfile
    from zerotune.plan.memory import largest_unit_params
    from zerotune.plan.meta_model import parameter_counts

    def number(value: Any) -> int:
        return value if isinstance(value, int) and not isinstance(value, bool) else 1

    zero = config.zero_optimization
    precision = "bf16" if config.bf16.enabled else "fp16" if config.fp16.enabled else "fp32"
    base = Layout(stage=0, dp=dp, tp=tp, pp=pp, sp=sp, precision=precision,
                  micro_batch=number(config.train_micro_batch_size_per_gpu),
                  gas=number(config.gradient_accumulation_steps),
                  optimizer=config.optimizer.type if config.optimizer is not None else "adamw",
                  offload_optimizer=zero.offload_optimizer.device, offload_param=zero.offload_param.device)
    trainable, frozen = parameter_counts(model)
    profile = ModelProfile(trainable, frozen, largest_unit_params(model), ActivationProfile(0), 1,
                           2 if precision != "fp32" else 4)
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local
    hardware = Hardware(device_memory=memory, flops=measured.flops,
                        bandwidth=measured.bandwidth or Hardware.bandwidth)  # (no traffic at dp 1: any figure)
    return choose(profile, base, base.micro_batch * base.gas, hardware,
                  micro_batches=[base.micro_batch], checkpointing=(False,), vary_offload=False)
