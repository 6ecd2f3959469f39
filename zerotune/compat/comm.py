"""``zerotune.comm`` / ``deepspeed.comm``: DeepSpeed's collectives API, with its signatures and defaults.

User scripts call collectives the way DeepSpeed documents them: ``group=None`` is the whole
world, ``src`` / ``dst`` are global ranks, the call returns ``None`` or, with ``async_op=True``,
a handle with ``wait()``. Each call goes through zerotune's one collective layer
(``zerotune.distributed.comm``), so it is counted in ``comm_stats()`` and a failure names the op
and the rank. zerotune's own code uses that layer directly (explicit groups, group-local ranks);
this module is the user-facing face of it. DeepSpeed's per-call profiling arguments (``prof``,
``log_name``, ``debug``) are accepted and have no effect: the comms log (``comms_logger``, switched by
``configure`` or the config's ``comms_logger`` block) times ops by name, its ``prof_ops`` or ``prof_all``.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from zerotune.distributed import comm as _layer
from zerotune.distributed.comm import (  # noqa: F401 - re-exported
    CommError,
    Handle,
    OpStats,
    ReduceOp,
    comm_stats,
    reset_comm_stats,
    total_comm_bytes,
)
from zerotune.distributed.comm_log import COMMS_LOGGER as comms_logger
from zerotune.distributed.env import init_distributed  # noqa: F401 - re-exported (DeepSpeed's signature)

_ignored = object()  # default of DeepSpeed's profiling arguments, which do nothing here

__all__ = [
    "ReduceOp", "CommError", "comm_stats", "reset_comm_stats", "total_comm_bytes", "init_distributed",
    "is_initialized", "is_available", "get_rank", "get_world_size", "get_local_rank", "get_global_rank",
    "get_world_group", "get_all_ranks_from_group", "get_backend", "new_group", "destroy_process_group",
    "initialize_mesh_device",
    "all_reduce", "inference_all_reduce", "all_reduce_coalesced", "broadcast", "all_gather",
    "all_gather_into_tensor", "allgather_fn", "reduce_scatter_tensor", "reduce_scatter_fn", "reduce_scatter",
    "reduce", "all_to_all_single", "all_to_all", "gather", "scatter", "send", "recv", "isend", "irecv",
    "barrier", "monitored_barrier", "has_all_reduce_coalesced", "has_all_gather_into_tensor",
    "has_reduce_scatter_tensor", "configure", "log_summary", "comms_logger",
]


def _world(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise CommError("torch.distributed is not initialized: call zerotune.comm.init_distributed() "
                        "(or zerotune.initialize) before issuing collectives")
    if group is not None:
        return group
    world = dist.group.WORLD
    assert world is not None  # set by init_process_group, checked just above
    return world


def _result(handle: Handle, async_op: bool) -> Handle | None:
    return handle if async_op else None


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _group_rank(group: dist.ProcessGroup, global_rank: int) -> int:
    return dist.get_group_rank(group, global_rank) if group is not dist.group.WORLD else global_rank


# --- who am I ------------------------------------------------------------------------------

def is_initialized() -> bool:
    return dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (the world by default); 0 before initialization, as DeepSpeed."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (the world by default); 1 before initialization."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    """This process's index on its node, from the launcher's ``LOCAL_RANK`` (0 if unset)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: dist.ProcessGroup | None = None, group_rank: int = 0) -> int:
    """The global rank of member ``group_rank`` of ``group``."""
    group = _world(group)
    return group_rank if group is dist.group.WORLD else dist.get_global_rank(group, group_rank)


def get_world_group() -> dist.ProcessGroup:
    return _world(None)


def get_all_ranks_from_group(group: dist.ProcessGroup | None = None) -> list[int]:
    """The global ranks of ``group``'s members, in group order."""
    return dist.get_process_group_ranks(_world(group))


def get_backend(group: dist.ProcessGroup | None = None) -> str:
    return dist.get_backend(_world(group))


def new_group(ranks: list[int]) -> dist.ProcessGroup:
    """A subgroup of the given global ranks (every rank must call it, as with torch)."""
    return dist.new_group(ranks)


def initialize_mesh_device(mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...]) -> Any:
    """torch's ``DeviceMesh`` of ``mesh_shape`` over the world (last dim innermost), on this process's device
    type: DeepSpeed's mesh for its data x sequence / data x tensor groups."""
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if dist.get_backend(_world(None)) == "nccl" else "cpu"
    return init_device_mesh(device_type, tuple(mesh_shape), mesh_dim_names=tuple(mesh_dim_names))


def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_initialized():
        dist.destroy_process_group(group)


# --- collectives (counted, failures named) -------------------------------------------------

def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: dist.ProcessGroup | None = None,
               async_op: bool = False, prof: bool = False, log_name: str = "all_reduce",
               debug: Any = _ignored) -> Handle | None:
    """In-place reduction of ``tensor`` over ``group`` (default: the world)."""
    return _result(_layer.all_reduce(tensor, _world(group), op=op, async_op=async_op), async_op)


def inference_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                         group: dist.ProcessGroup | None = None) -> None:
    """DeepSpeed's inference-path all-reduce; here the same counted all-reduce."""
    all_reduce(tensor, op=op, group=group)


def all_reduce_coalesced(tensors: list[torch.Tensor], op: Any = ReduceOp.SUM,
                         group: dist.ProcessGroup | None = None, async_op: bool = False) -> _Many | None:
    """All-reduce a list of tensors (one call each; gloo has no coalesced all-reduce)."""
    handles = [_layer.all_reduce(t, _world(group), op=op, async_op=True) for t in tensors]
    for handle in handles if not async_op else ():
        handle.wait()
    return _Many(handles) if async_op else None


class _Many:
    """Waits on several handles as one."""

    def __init__(self, handles: list[Handle]) -> None:
        self._handles = handles

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self._handles)

    def wait(self) -> None:
        for handle in self._handles:
            handle.wait()


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False,
              prof: bool = False, log_name: str = "broadcast", debug: Any = _ignored) -> Handle | None:
    """Broadcast ``tensor`` from global rank ``src`` to every member of ``group``."""
    group = _world(group)
    return _result(_layer.broadcast(tensor, _group_rank(group, src), group, async_op=async_op), async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
               async_op: bool = False, prof: bool = False, log_name: str = "all_gather",
               debug: Any = _ignored) -> Handle | None:
    """Every rank's ``tensor`` into ``tensor_list[rank]``."""
    return _result(_layer.all_gather(tensor_list, tensor, _world(group), async_op=async_op), async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor,
                           group: dist.ProcessGroup | None = None, async_op: bool = False,
                           debug: Any = _ignored) -> Handle | None:
    """Every rank's ``tensor`` concatenated (rank order) into the flat ``output_tensor``."""
    return _result(_layer.all_gather_into_tensor(output_tensor, tensor, _world(group), async_op=async_op),
                   async_op)


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                 async_op: bool = False, debug: Any = _ignored) -> Handle | None:
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: dist.ProcessGroup | None = None, async_op: bool = False, prof: bool = False,
                          debug: Any = _ignored) -> Handle | None:
    """Reduce ``tensor`` over ``group`` and keep this rank's chunk in ``output_tensor``."""
    return _result(_layer.reduce_scatter_tensor(output_tensor, tensor, _world(group), op=op, async_op=async_op),
                   async_op)


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                      group: dist.ProcessGroup | None = None, async_op: bool = False, prof: bool = False,
                      debug: Any = _ignored) -> Handle | None:
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM,
                   group: dist.ProcessGroup | None = None, async_op: bool = False, prof: bool = False,
                   log_name: str = "reduce_scatter", debug: Any = _ignored) -> Handle | None:
    return _result(_layer.reduce_scatter(output, input_list, _world(group), op=op, async_op=async_op), async_op)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: dist.ProcessGroup | None = None,
           async_op: bool = False, prof: bool = False, log_name: str = "reduce",
           debug: Any = _ignored) -> Handle | None:
    """Reduce ``tensor`` over ``group`` into global rank ``dst``."""
    group = _world(group)
    return _result(_layer.reduce(tensor, _group_rank(group, dst), group, op=op, async_op=async_op), async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: dist.ProcessGroup | None = None,
                      async_op: bool = False, prof: bool = False, log_name: str = "all_to_all_single",
                      debug: Any = _ignored) -> Handle | None:
    group = _world(group)
    if output_split_sizes is None and input_split_sizes is None:
        return _result(_layer.all_to_all_single(output, tensor, group, async_op=async_op), async_op)
    return _result(_layer.run_collective(
        "all_to_all", group, _nbytes(tensor),
        lambda: dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group,
                                       async_op=async_op), async_op, tensor.dtype), async_op)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: dist.ProcessGroup | None = None, async_op: bool = False, prof: bool = False,
               log_name: str = "all_to_all", debug: Any = _ignored) -> Handle | None:
    group = _world(group)
    return _result(_layer.run_collective(
        "all_to_all", group, sum(_nbytes(t) for t in input_tensor_list),
        lambda: dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op),
        async_op, input_tensor_list[0].dtype if input_tensor_list else None), async_op)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
           group: dist.ProcessGroup | None = None, async_op: bool = False, prof: bool = False,
           log_name: str = "gather", debug: Any = _ignored) -> Handle | None:
    """Every rank's ``tensor`` into ``gather_list`` on global rank ``dst``."""
    group = _world(group)
    return _result(_layer.run_collective(
        "gather", group, _nbytes(tensor),
        lambda: dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op), async_op, tensor.dtype),
        async_op)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
            group: dist.ProcessGroup | None = None, async_op: bool = False, prof: bool = False,
            log_name: str = "scatter", debug: Any = _ignored) -> Handle | None:
    """``scatter_list[r]`` from global rank ``src`` into rank r's ``tensor``."""
    group = _world(group)
    return _result(_layer.run_collective(
        "scatter", group, _nbytes(tensor),
        lambda: dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op), async_op, tensor.dtype),
        async_op)


def isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0,
          prof: bool = False, log_name: str = "isend", debug: Any = _ignored) -> Handle:
    """Asynchronous send to global rank ``dst``; wait on the handle before reusing ``tensor``."""
    group = _world(group)
    return _layer.run_collective("send", group, _nbytes(tensor),
                                 lambda: dist.isend(tensor, dst=dst, group=group, tag=tag), async_op=True,
                                 dtype=tensor.dtype, peer=dst)


def irecv(tensor: torch.Tensor, src: int | None = None, group: dist.ProcessGroup | None = None, tag: int = 0,
          prof: bool = False, log_name: str = "irecv", debug: Any = _ignored) -> Handle:
    """Asynchronous receive from global rank ``src``; not counted (the sender counts)."""
    group = _world(group)
    return _layer.run_collective("recv", group, 0, lambda: dist.irecv(tensor, src=src, group=group, tag=tag),
                                 async_op=True, dtype=tensor.dtype, peer=src)


def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0,
         prof: bool = False, log_name: str = "send", debug: Any = _ignored) -> None:
    isend(tensor, dst, group=group, tag=tag).wait()


def recv(tensor: torch.Tensor, src: int | None = None, group: dist.ProcessGroup | None = None, tag: int = 0,
         prof: bool = False, log_name: str = "recv", debug: Any = _ignored) -> None:
    irecv(tensor, src=src, group=group, tag=tag).wait()


def barrier(group: dist.ProcessGroup | None = None, async_op: bool = False, device_ids: list[int] | None = None,
            prof: bool = False, log_name: str = "barrier", debug: Any = _ignored) -> Handle | None:
    group = _world(group)
    return _result(_layer.run_collective("barrier", group, 0, lambda: dist.barrier(group=group, async_op=async_op),
                                         async_op), async_op)


def monitored_barrier(group: dist.ProcessGroup | None = None, timeout: datetime.timedelta | None = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier that names the ranks that did not arrive within ``timeout`` (gloo only, as torch)."""
    group = _world(group)
    _layer.run_collective("barrier", group, 0, lambda: dist.monitored_barrier(
        group=group, timeout=timeout, wait_all_ranks=wait_all_ranks), async_op=False)


def has_all_reduce_coalesced() -> bool:
    return True


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def configure(deepspeed_config: Any = None, enabled: bool | None = None, prof_all: bool | None = None,
              prof_ops: list[str] | None = None, verbose: bool | None = None, debug: bool | None = None) -> None:
    """DeepSpeed's comms-logger switches (``comms_logger``): the config's block first (a ``DeepSpeedConfig``, a
    resolved zerotune config or a config dict), then each argument given. Calls and bytes are always counted
    (``comm_stats()``); these switch on the per-call latency log (``comms_logger``, ``log_summary``)."""
    if deepspeed_config is not None:
        config = getattr(deepspeed_config, "config", deepspeed_config)  # DeepSpeedConfig holds the resolved one
        block = config.get("comms_logger", {}) if isinstance(config, dict) else getattr(config, "comms_logger", None)
        if block is not None and (block.get("enabled", False) if isinstance(block, dict) else block.enabled):
            comms_logger.configure(block)  # a disabled block leaves the log as it is, as DeepSpeed's configure
    for name, value in (("enabled", enabled), ("prof_all", prof_all), ("verbose", verbose), ("debug", debug)):
        if value is not None:
            setattr(comms_logger, name, bool(value))
    if prof_ops is not None:
        comms_logger.prof_ops = list(prof_ops)


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict | None:
    """The comms log's table (printed on rank 0; ``return_dict``: its dictionary on every rank) after a barrier,
    and the per-op call and byte counts on rank 0. ``show_straggler`` all-reduces each record's latencies, so
    every rank must call it."""
    barrier()
    result = comms_logger.log_all(print_log=get_rank() == 0, show_straggler=show_straggler, return_dict=return_dict)
    if get_rank() == 0:
        from zerotune.monitor.logging import get_logger

        for op, stats in sorted(comm_stats().items()):
            get_logger().info("comm %s: %d calls, %d bytes", op, stats.calls, stats.bytes)
    return result
