"""The comms log: each collective's latency and bandwidth by message size, while profiling is on.

``comm.comm_stats()`` always counts every collective's calls and bytes; that is the accounting tests and
benchmarks check against theory. What it cannot say is how long a collective took. DeepSpeed's
``comms_logger`` config block asks for that, and this is where it lands: the one collective layer
(``comm.run_collective``) times a call when the process's log wants its op and writes the result here,
at the same point where it counts the call -- there is no second layer wrapping the collectives (as
DeepSpeed's ``timed_op`` decorator is) and nothing here issues or intercepts a collective.

Layout, DeepSpeed's ``comms_dict``: ``{record name: {message bytes: [count, [latency ms], [algbw Gbps],
[busbw Gbps]]}}``, the three lists parallel (index i is the i-th call). The record name is the op's name in
``comm_stats()`` (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``, ``all_to_all``, ...),
with the caller appended under ``debug``. Message bytes follow DeepSpeed: the tensor handed to the call
(an all-gather's input, a reduce-scatter's full input, an all-reduce's tensor).

Timing a call makes it blocking for the clock (an asynchronous one is timed from launch to its ``wait``), so
profiling is off unless the config or ``configure`` turns it on.
"""

from __future__ import annotations

import math
import sys
from datetime import datetime
from typing import Any, Mapping

import torch
import torch.distributed as dist

from zerotune.distributed import comm, comm_timing
from zerotune.monitor.logging import get_logger
from zerotune.monitor.timers import trim_mean

# DeepSpeed's names of the calls whose op zerotune counts under another name: prof_ops may use either.
_OP_OF_CALL = {"all_gather_into_tensor": "all_gather", "allgather_fn": "all_gather",
               "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_fn": "reduce_scatter",
               "all_to_all_single": "all_to_all", "isend": "send", "irecv": "recv",
               "inference_all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce"}
_GATHERS = ("all_gather", "sparse_all_gather", "reduce_scatter")


def get_caller_func(frame: int = 3) -> str:
    """The name of the function ``frame`` levels up the stack (DeepSpeed's helper for debug record names)."""
    return sys._getframe(frame).f_code.co_name


def convert_size(size_bytes: float) -> str:
    """``1536`` -> ``"1.5 KB"`` (powers of 1024, two decimals), as the log's tables print sizes."""
    if size_bytes == 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
    i = int(math.floor(math.log(size_bytes, 1024)))
    return f"{round(size_bytes / math.pow(1024, i), 2)} {names[i]}"


def calc_bw_log(comm_op: str, size: float, duration: float, world: int | None = None) -> tuple[float, float]:
    """Algorithm and bus bandwidth in Gbps of ``comm_op`` moving a ``size``-byte message in ``duration`` ms over
    ``world`` ranks (default: the world), by nccl-tests' formulas: an all-gather or reduce-scatter moves n
    messages, an all-reduce two, each rank's links carry (n - 1) / n of the traffic."""
    if world is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
    n = max(world, 1)
    op = _OP_OF_CALL.get(comm_op, comm_op)
    if duration <= 0:
        return 0.0, 0.0
    if op == "all_to_all":
        algbw, busbw = size / duration, size / duration * (n - 1) / n
    elif op in _GATHERS:
        algbw = size * n / duration
        busbw = algbw * (n - 1) / n
    elif op == "all_reduce":
        algbw, busbw = size * 2 / duration, size / duration * 2 * (n - 1) / n
    else:  # point to point, broadcast, reduce, gather, scatter, barrier: the message crosses once
        algbw = busbw = size / duration
    return algbw * 8 / 1e6, busbw * 8 / 1e6  # bytes per ms -> Gbps


class CommsLogger:
    """Switches (DeepSpeed's ``comms_logger`` block) and the timed records they produce.

    ``enabled`` arms timing at all; then ``prof_all`` times every op, else only the ops named in ``prof_ops``.
    ``verbose`` logs each timed call on rank 0; ``debug`` appends the calling site to the record name."""

    def __init__(self) -> None:
        self.comms_dict: dict[str, dict[int, list[Any]]] = {}
        self.enabled = False
        self.verbose = False
        self.debug = False
        self.prof_all = True
        self.prof_ops: list[str] = []

    # --- switches ----------------------------------------------------------------------------
    def configure(self, comms_config: Any) -> None:
        """Apply a ``comms_logger`` block (a dict, zerotune's config section, or DeepSpeed's comms config, whose
        block sits under ``.comms_logger``); a disabled block only switches timing off."""
        block = getattr(comms_config, "comms_logger", comms_config)
        read = block.get if isinstance(block, Mapping) else lambda key, default: getattr(block, key, default)
        self.enabled = bool(read("enabled", False))
        if self.enabled:
            self.verbose = bool(read("verbose", False))
            self.debug = bool(read("debug", False))
            self.prof_all = bool(read("prof_all", True))
            self.prof_ops = list(read("prof_ops", []) or [])

    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = list(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = [op for op in self.prof_ops if op not in op_name_list]

    def wants(self, op: str) -> bool:
        """Whether a call of ``op`` (zerotune's op name) is to be timed now."""
        if not self.enabled:
            return False
        return self.prof_all or any(_OP_OF_CALL.get(name, name) == op for name in self.prof_ops)

    # --- records -----------------------------------------------------------------------------
    def append(self, raw_name: str, record_name: str, latency: float, msg_size: int, world: int | None = None) -> None:
        """Record one call of ``raw_name`` under ``record_name``: ``latency`` ms for a ``msg_size``-byte message."""
        algbw, busbw = calc_bw_log(raw_name, msg_size, latency, world)
        record = self.comms_dict.setdefault(record_name, {}).setdefault(msg_size, [0, [], [], []])
        record[0] += 1
        record[1].append(latency)
        record[2].append(algbw)
        record[3].append(busbw)
        if self.verbose:
            if not dist.is_initialized() or dist.get_rank() == 0:
                get_logger().info("comm op: %s | time (ms): %.2f | msg size: %s | algbw (Gbps): %.2f | "
                                  "busbw (Gbps): %.2f", record_name, latency, convert_size(msg_size), algbw, busbw)

    def record_call(self, op: str, latency_ms: float, msg_size: int, world: int, caller: str | None) -> None:
        """The collective layer's report of one timed call (``comm_timing.start``)."""
        self.append(op, op if caller is None else f"{op} | [Caller Func: {caller}]", latency_ms, msg_size, world)

    def get_raw_data(self) -> dict[str, dict[int, list[Any]]]:
        """The records, ``{record name: {message bytes: [count, latencies, algbws, busbws]}}`` (a shallow copy)."""
        return self.comms_dict.copy()

    def has_data(self) -> bool:
        return len(self.comms_dict) > 0

    def reset_data(self) -> None:
        self.comms_dict.clear()

    def get_operation_names(self) -> list[str]:
        return list(self.comms_dict)

    def get_total_operations(self) -> int:
        return sum(vals[0] for sizes in self.comms_dict.values() for vals in sizes.values())

    def get_operation_summary(self, operation_name: str) -> dict[int, dict[str, Any]] | None:
        """Per message size of one record: count, total and trimmed-mean latency, mean bandwidths (10% trimmed
        from each end); None if the record does not exist. The records themselves are left as they were."""
        if operation_name not in self.comms_dict:
            return None
        return {size: _summary(vals, size) for size, vals in self.comms_dict[operation_name].copy().items()}

    def log_all(self, print_log: bool = True, show_straggler: bool = False,
                return_dict: bool = False) -> dict[str, Any] | None:
        """Print (each rank its own records) and/or return every record's summary; ``show_straggler`` adds, per
        record, the latency every rank shares (the minimum over ranks: one all-reduce per message size through
        the collective layer, so every rank must call it) and each rank's wait beyond it."""
        snapshot = self.comms_dict.copy()
        initialized = dist.is_initialized()
        result: dict[str, Any] = {"summary": {}, "straggler_analysis": None, "metadata": {
            "world_size": dist.get_world_size() if initialized else 1, "rank": dist.get_rank() if initialized else 0,
            "timestamp": datetime.now().isoformat()}}
        columns = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)",
                   "busbw_avg (Gbps)")
        lines = ["".join(f"{c: <20}" for c in columns)]
        for name, sizes in snapshot.items():
            lines.append(name)
            result["summary"][name] = {}
            for size, vals in sorted(sizes.items()):
                row = result["summary"][name][size] = _summary(vals, size)
                lines.append(f"{' ': <20}{row['msg_size_str']: <20}{row['count']: <20}{row['total_latency_ms']: <20.2f}"
                             f"{row['avg_latency_ms']: <20.2f}{row['tput_avg_gbps']: <20.2f}"
                             f"{row['busbw_avg_gbps']: <20.2f}")
        if show_straggler:
            result["straggler_analysis"] = {}
            lines += ["_______________________________", "Breakdown with straggler effect",
                      "-------------------------------"]
            world_group = dist.group.WORLD if initialized else None
            for name, sizes in snapshot.items():
                lines.append(name)
                result["straggler_analysis"][name] = {}
                for size, vals in sorted(sizes.items()):
                    lats = torch.tensor(vals[1], dtype=torch.float64)
                    shared = lats.clone()
                    comm.all_reduce(shared, world_group, op=comm.ReduceOp.MIN)
                    straggler = lats - shared
                    row = result["straggler_analysis"][name][size] = {
                        "count": vals[0], "total_comm_lat_ms": shared.sum().item(),
                        "total_straggler_ms": straggler.sum().item(),
                        "avg_comm_lat_ms": trim_mean(shared.tolist(), 0.1),
                        "avg_straggler_ms": trim_mean(straggler.tolist(), 0.1),
                        "msg_size_bytes": size, "msg_size_str": convert_size(size)}
                    lines.append(f"{' ': <20}{row['msg_size_str']: <20}{row['count']: <20}"
                                 f"{row['total_comm_lat_ms']: <20.2f}{row['total_straggler_ms']: <20.2f}"
                                 f"{row['avg_comm_lat_ms']: <20.2f}{row['avg_straggler_ms']: <20.2f}")
        if print_log:
            print("\n".join(lines))
        return result if return_dict else None


def _summary(vals: list[Any], size: int) -> dict[str, Any]:
    return {"count": vals[0], "total_latency_ms": sum(vals[1]), "avg_latency_ms": trim_mean(vals[1], 0.1),
            "tput_avg_gbps": trim_mean(vals[2], 0.1), "busbw_avg_gbps": trim_mean(vals[3], 0.1),
            "msg_size_bytes": size, "msg_size_str": convert_size(size)}


COMMS_LOGGER = CommsLogger()
"""The process's log, which the collective layer writes into (``deepspeed.comm.comms_logger``)."""
comm_timing.set_call_log(COMMS_LOGGER)
