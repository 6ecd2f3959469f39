"""The collective-sequence guard: ranks that stop issuing the same collectives fail at once, saying where.

Collectives pair up by their order on a group: the n-th collective one rank issues on a group meets the
n-th of every other member. A rank that skips a micro-step, runs an extra one, or saves a checkpoint the
others do not save issues a different sequence, and gloo / NCCL then pair unrelated collectives: sizes
that differ abort the process from inside gloo, same-sized ones silently exchange garbage, different ops
hang until the 30-minute timeout. DeepSpeed, FSDP and Megatron do not check.

Here every collective zerotune issues (``comm.run_collective``) is folded into a running CRC of its
group: op, dtype, bytes and the call site (``record``). Before each engine phase that communicates
(the first of a micro-step's phases that communicates -- a forward at stage 3 or under model parallelism,
else a backward that reduces gradients, else the optimizer step -- and checkpoint save / load) the engine
calls ``comm.guard_point``: one all-gather of a small integer vector -- the phase, the step and
micro-step counters, and each group's (count, CRC) -- on the guard's own gloo group, so it never pairs
with a data collective. It is launched there and waited for by the rank's next collective, so it
overlaps the computation that comes first. Every rank then sees every other
rank's vector and reaches the same verdict; on any difference every rank raises ``CollectiveMismatch``,
naming each rank's phase and its last collectives with their call sites (a second, object exchange on
the same group). ``check_same_setup`` compares the configs (and each data-parallel group's model
structure) at ``initialize``, so ranks started differently fail before their first step.

What it cannot see: collectives of different size inside one phase (gloo aborts those before the next
guard point) and a rank that waits in a user collective while the others wait at a guard point (the
watchdog ends that after ``comm_timeout_s``, unless ``guard_torch.py`` brings the script's own
``torch.distributed`` calls under the guard). Config key ``collective_guard`` (default on) turns it off.
Each engine has its own guard (``engine_guards.py``); ``guard_scope.py`` says which one a collective reports to.
"""

from __future__ import annotations

import atexit
import itertools
import sys
import time
import weakref
import zlib
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from types import FrameType
from typing import Any, Iterable

import torch
import torch.distributed as dist

SLOTS = 16
"""Groups compared per rank (a rank belongs to at most a handful: mesh axes, world, pipeline neighbours);
groups beyond this many, in key order, are not compared."""
HEADER = 5  # phase id, step, micro-step, slots used, the rank's guard cost (not compared: it differs by rank)
COST = 4  # the header column with the rank's guard cost, parts per million of its time since the last decision
RECENT = 6  # collectives remembered per group, for the error message
BUDGET = 0.01
"""The share of a rank's time the guard may take: above it, micro-steps between exchanges double."""
WINDOW = 16
"""Exchanges between two decisions on the interval (every rank decides at the same exchange, from its rows)."""
MAX_INTERVAL = 64


class CollectiveMismatch(RuntimeError):
    """Ranks issued different collectives (or were started with different setups); raised on every rank."""


@dataclass
class GroupLog:
    """The running record of one group's collectives on this rank: how many, their running CRC, and the
    last few as (index, running CRC after it, description)."""

    name: str
    ranks: tuple[int, ...]
    count: int = 0
    crc: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))


def _key_id(name: str) -> int:
    return zlib.crc32(name.encode())


@dataclass
class PendingExchange:
    """A guard point's all-gather in flight: the next collective waits for it and checks the rows."""

    work: Any
    rows: torch.Tensor
    phase: str
    step: int
    micro_step: int
    arrived: float = 0.0  # perf_counter when this rank reached the point
    launch_s: float = 0.0  # the training thread's time launching the exchange


_GENERATIONS = itertools.count(1)
"""Guards started in this process, numbered alike on every rank (``start`` is collective): each guard's notes in
the rendezvous store live under its own number, so two engines' guards never read each other's."""
_STARTED: weakref.WeakSet[CollectiveGuard] = weakref.WeakSet()
"""Guards started in this process and still alive, for ``release_at_exit``."""


class CollectiveGuard:
    """One engine's record (``engine_guards.py``): the group logs, the guard's group, and the phase/point logic."""

    def __init__(self) -> None:
        self.group: dist.ProcessGroup | None = None
        self.backend: Any = None  # the group's gloo backend, when it can be called directly (``_direct_backend``)
        self.store: dist.Store | None = None  # where stalled ranks compare notes (guard_stall.py)
        self.rank = 0
        self.points = 0  # guard points passed (benchmarks: exchanges per step)
        self.seconds = 0.0  # time the training thread spent launching and waiting for exchanges (benchmarks)
        self.pending: PendingExchange | None = None
        self._paused: tuple[dist.ProcessGroup, float] | None = None
        self.interval = 1  # micro-steps per exchange at the engine's per-micro-step point (``adapt``)
        self._window = (0.0, 0.0, 0)  # (perf_counter, guard seconds, exchanges) when the current window began
        self.timings: list[tuple[float, float, float, float]] | None = None
        """Benchmarks set a list: per settled point (arrived, launch seconds, wait start, wait end), perf_counter
        times, which is one clock for every process of a machine."""
        self._logs: dict[str, GroupLog] = {}
        # id(group) -> (group, log name, its ranks)
        self._names: dict[int, tuple[dist.ProcessGroup | None, str, tuple[int, ...]]] = {}

    @property
    def active(self) -> bool:
        return self.group is not None

    def start(self, groups: Iterable[dist.ProcessGroup | None], rank: int, store: dist.Store | None = None) -> None:
        """Arm (collectively: every rank of the world calls it, as ``initialize`` does). Logs restart from
        zero on every rank alike; ``groups`` (the mesh's) are registered so a member that never used one
        still reports it (count 0). ``store``: the rendezvous store, for stalled ranks to compare notes."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            self.stop()
            return
        self.group = dist.new_group(backend="gloo")  # its own: a guard exchange never pairs with data
        self.backend = _direct_backend(self.group)
        _STARTED.add(self)
        generation = next(_GENERATIONS)  # every rank starts guards alike, so the numbers agree
        self.store = None if store is None else dist.PrefixStore(f"zerotune/guard/{generation}", store)
        self.rank = rank
        self.pending = None
        self.interval = 1
        self._window = (time.perf_counter(), self.seconds, 0)
        self._logs.clear()
        self._names.clear()
        for group in [dist.group.WORLD, *groups]:
            if group is not None:
                self._log(group, None)

    def pause(self) -> None:
        """Stop recording and exchanging, on every rank alike (benchmarks: the same engine with and without)."""
        if self.group is not None:
            self._paused = (self.group, time.perf_counter())
            self.group = None

    def resume(self) -> None:
        """Undo ``pause``; the paused time does not count in the guard's cost share."""
        if self._paused is not None:
            (self.group, paused_at), self._paused = self._paused, None
            started, seconds, exchanges = self._window
            self._window = (started + time.perf_counter() - paused_at, seconds, exchanges)

    def release_at_exit(self) -> None:
        """At interpreter exit: let the last exchange (launched at the run's final guard point, with no later
        collective to wait for it) finish on its own group before finalization tears the process group down
        under a gloo thread still using it, then drop the group and store."""
        pending, self.pending = self.pending, None
        if pending is not None:
            try:
                pending.work.wait(timedelta(seconds=5))
            except Exception:  # noqa: BLE001 - a peer already gone is no reason to fail the exit
                pass
        self.stop()

    def stop(self) -> None:
        self.group = None
        self._paused = None
        self.backend = None
        self.store = None
        self.pending = None
        self._logs.clear()
        self._names.clear()

    def _log(self, group: dist.ProcessGroup | None, transfer: tuple[int, int] | None) -> GroupLog:
        if transfer is not None:  # one log per direction: each is in order on both ends, their interleaving is not
            ranks = tuple(sorted(transfer))
            name = "p2p {}->{}".format(*transfer)
        else:
            group = dist.group.WORLD if group is None else group
            cached = self._names.get(id(group))
            if cached is None or cached[0] is not group:
                members = tuple(dist.get_process_group_ranks(group))
                cached = (group, "ranks " + ",".join(map(str, members)) if len(members) <= 8
                          else f"ranks {members[0]}..{members[-1]} ({len(members)})", members)
                self._names[id(group)] = cached
            _, name, ranks = cached
        log = self._logs.get(name)
        if log is None:
            log = self._logs[name] = GroupLog(name, ranks)
        return log

    def record(self, op: str, group: dist.ProcessGroup | None, dtype: torch.dtype | None, nbytes: int, site: str,
               peer: int | None = None) -> tuple[str, int]:
        """Fold one collective into its group's running CRC (point-to-point: the pair's, with no call site:
        the two ends call from different lines); returns (group name, its index there)."""
        log = self._log(group, None if peer is None else (self.rank, peer) if op == "send" else (peer, self.rank))
        dtype_name = str(dtype).removeprefix("torch.") if dtype is not None else "-"
        described = f"{op} {dtype_name} {nbytes} B"
        # Point-to-point: the two ends are a send and a recv issued from different lines, counted differently.
        log.crc = zlib.crc32((f"p2p {dtype_name}" if peer is not None else f"{described} at {site}").encode(), log.crc)
        log.recent.append((log.count, log.crc, f"#{log.count} {described} at {site}"))
        log.count += 1
        return log.name, log.count - 1

    # ---- the guard point ------------------------------------------------------------------------
    def vector(self, phase: str, step: int, micro_step: int) -> torch.Tensor:
        """This rank's row: phase, counters, and (group id, count, CRC) per group in name order."""
        logs = [self._logs[name] for name in sorted(self._logs)][:SLOTS]
        values = [_key_id(phase), step, micro_step, len(logs), self._cost_ppm()]
        for log in logs:
            values += (_key_id(log.name), log.count, log.crc)
        return torch.tensor(values + [0] * (HEADER + 3 * SLOTS - len(values)), dtype=torch.int64)

    def _cost_ppm(self) -> int:
        """This rank's time in guard exchanges since the window began, in parts per million of the time since."""
        started, seconds, _ = self._window
        elapsed = time.perf_counter() - started
        return int(1e6 * (self.seconds - seconds) / elapsed) if elapsed > 0 else 0

    def adapt(self, rows: torch.Tensor) -> None:
        """After an agreed exchange: every ``WINDOW``-th one, each rank's guard cost is in the rows, and every
        rank sets the same interval from them -- doubled while the costliest rank spends more than ``BUDGET`` of
        its time in exchanges, halved (down to one) when it spends under a quarter of it. A divergence between
        exchanges is still caught: at the next exchange (the counters differ) or by the stalled ranks' notes."""
        started, seconds, exchanges = self._window
        if exchanges + 1 < WINDOW:
            self._window = (started, seconds, exchanges + 1)
            return
        share = int(rows[:, COST].max()) / 1e6
        before = self.interval
        if share > BUDGET:
            self.interval = min(2 * self.interval, MAX_INTERVAL)
        elif share < BUDGET / 4:
            self.interval = max(1, self.interval // 2)
        self._window = (time.perf_counter(), self.seconds, 0)
        if self.interval != before and self.rank == 0:
            from zerotune.monitor.logging import get_logger

            get_logger().info("collective guard: exchanges took %.2f%% of the time; now one per %d micro-step(s)",
                              100 * share, self.interval)

    @staticmethod
    def disagreements(rows: torch.Tensor) -> list[str]:
        """What the ranks' rows disagree on (all but their cost column); every rank computes the same list from
        the same rows."""
        rows = rows.clone()
        rows[:, COST] = 0
        if torch.equal(rows, rows[:1].expand_as(rows)):  # the usual verdict, cheaply
            return []
        problems = []
        if not bool((rows[:, :3] == rows[0, :3]).all()):
            problems.append("phase")
        by_group: dict[int, set[tuple[int, int]]] = {}
        for row in rows.tolist():
            for slot in range(row[3]):
                key, count, crc = row[HEADER + 3 * slot:HEADER + 3 * slot + 3]
                by_group.setdefault(key, set()).add((count, crc))
        problems += [f"group {key}" for key, seen in by_group.items() if len(seen) > 1]
        return problems

    def describe(self, phase: str, step: int, micro_step: int) -> dict:
        """For the error message: this rank's phase and its recent collectives per group."""
        return {"phase": f"{phase} (step {step}, micro-step {micro_step})",
                "groups": self.snapshot()}

    def snapshot(self) -> dict[str, tuple]:
        """Each group's (count, running CRC, recent [(index, CRC after, description)], member ranks)."""
        return {log.name: (log.count, log.crc, [list(entry) for entry in list(log.recent)], list(log.ranks))
                for log in list(self._logs.values())}


def _direct_backend(group: dist.ProcessGroup) -> Any:
    """The guard group's gloo backend if it has ``_allgather_base``: an exchange launched there costs ~10 us of
    the training thread, through ``torch.distributed``'s wrappers ~150 us (this machine) -- at one exchange per
    micro-step, a tenth of a percent of a step. None where torch does not expose it (then the public call)."""
    try:
        backend = group._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError):
        return None
    return backend if callable(getattr(backend, "_allgather_base", None)) else None


def mismatch_message(described: list[dict], problems: list[str]) -> str:
    """Each rank's phase, then, per group whose record differs between its members (every group when the
    phases differ), each member's collective count and last collectives."""
    lines = ["ranks issued different collectives (a rank skipped or added a micro-step or step, saved a checkpoint "
             "the others did not, or issued a collective of its own); stopping every rank before gloo/NCCL pairs "
             "unrelated collectives:"]
    for rank, entry in enumerate(described):
        lines.append(f"  rank {rank} is about to run {entry['phase']}")
    for name in sorted({name for entry in described for name in entry["groups"]}):
        members = {rank: entry["groups"][name] for rank, entry in enumerate(described) if name in entry["groups"]}
        if len({(count, crc) for count, crc, *_ in members.values()}) <= 1 and "phase" not in problems:
            continue
        lines += group_lines(name, {rank: (count, recent) for rank, (count, _, recent, _) in members.items()})
    return "\n".join(lines)


def group_lines(name: str, members: dict[int, tuple[int, list]]) -> list[str]:
    """One group's part of a mismatch message: each member's collective count and last three collectives."""
    lines = [f"  group {name}:"]
    for rank, (count, recent) in sorted(members.items()):
        last = "; ".join(text for *_, text in recent[-3:]) or "none"
        lines.append(f"    rank {rank}: {count} collectives; the last: {last}")
    return lines


LOCAL_KEYS = ("nvme_path", "aio.", "tensorboard.", "csv_monitor.", "wandb.", "comm_timeout_s")
"""Config keys that may differ between ranks: where each machine swaps and logs, and how long it waits. They
change no collective (a path key ends with, or a block starts with, one of these)."""


def setup_differences(setups: list[dict]) -> list[str]:
    """Lines naming each config key whose value differs between ranks (dotted path, each rank's value);
    ``LOCAL_KEYS`` may differ."""
    flat = [_flatten(setup) for setup in setups]
    keys = sorted(key for key in set().union(*flat)
                  if not any(key.endswith(local) or key.startswith(local) for local in LOCAL_KEYS))
    lines = []
    for key in keys:
        values = [entry.get(key, "<absent>") for entry in flat]
        if any(value != values[0] for value in values):
            lines.append(f"  {key}: " + ", ".join(f"rank {rank} has {value!r}" for rank, value in enumerate(values)))
    return lines


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: value}


_LAYER_FILES = ("distributed/comm.py", "compat/comm.py", "distributed/guard.py", "distributed/guard_torch.py",
                "distributed/comm_timing.py", "contextlib.py")


def call_site() -> str:
    """The first frame outside the collective layer, as a path inside the package (or the script's file
    name), so it reads -- and hashes -- the same on every rank wherever zerotune is installed."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.endswith(_LAYER_FILES):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    path = frame.f_code.co_filename
    cut = path.rfind("zerotune/")
    short = path[cut:] if cut >= 0 else path.rsplit("/", 1)[-1]
    return f"{short}:{frame.f_lineno} ({frame.f_code.co_name})"


@atexit.register
def _release_started_guards() -> None:
    for guard in list(_STARTED):
        guard.release_at_exit()


GUARD = CollectiveGuard()
"""The process default guard, off unless armed directly (benchmarks): collectives issued before any engine was
built report to it (``guard_scope.py``). Each engine owns its own guard (``engine_guards.py``)."""
