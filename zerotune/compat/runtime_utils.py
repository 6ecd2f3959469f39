"""``deepspeed.runtime.utils``: DeepSpeed's helpers for scripts that clip, check overflow and partition outside
the engine.

The arithmetic is zerotune's own: the global gradient norm and clipping are ``zero/grad_norm.py``'s (the
engine's), partitioning is the pipeline's ``pipe/partition.py``. What is DeepSpeed's here is how a call names
its groups: a Megatron ``mpu`` for model parallelism (a parameter replicated there is counted on model-parallel
rank 0 only, unless marked ``model_parallel`` / ``tensor_model_parallel`` or split by zerotune's tensor
parallelism), ``deepspeed.utils.groups`` for the data-parallel and expert groups, and DeepSpeed's conventions
(a weight norm of -1 means "not finite").

Only the L2 norm is computed (``norm_type=2``, DeepSpeed's default and the one its engine uses); another is
refused by name rather than answered with the L2 norm.
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Any, Iterable, Sequence, cast

import torch
import torch.distributed as dist

from zerotune.compat import groups
from zerotune.compat.accelerator import get_accelerator
from zerotune.compat.moe import is_moe_param
from zerotune.compat.utils import set_random_seed
from zerotune.distributed import comm
from zerotune.monitor.logging import get_logger
from zerotune.parallel.tensor.layout import tp_layout_of
from zerotune.pipe.partition import PartitionError, balanced_boundaries
from zerotune.zero.grad_norm import ModelParallelNorm, clip_grads_to_norm_, global_grad_norm

__all__ = ["call_to_str", "prefix_sum_inc", "partition_uniform", "partition_balanced", "is_model_parallel_parameter",
           "clip_grad_norm_", "get_weight_norm", "CheckOverflow", "check_internal_apis_for_count_used_parameters",
           "count_used_parameters_in_backward", "set_random_seed", "see_memory_usage"]

Parameters = torch.Tensor | Iterable[torch.Tensor]


def call_to_str(base: str, *args: Any, **kwargs: Any) -> str:
    """``base(arg, ..., key=value)`` with each value's ``repr``: how a logged object was built."""
    return f"{base}({', '.join([*map(repr, args), *(f'{key}={value!r}' for key, value in kwargs.items())])})"


# ---- partitioning (pipe/partition.py) ------------------------------------------------------------
def prefix_sum_inc(weights: Iterable[float]) -> list[float]:
    """Inclusive prefix sums: ``[3, 4, 5] -> [3, 7, 12]``."""
    return list(accumulate(weights))


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` contiguous parts of ``num_items`` items, sizes differing by at most one (the
    larger ones first). With fewer items than parts, the first parts hold one item each and the rest none."""
    if num_parts < 1:
        raise PartitionError(f"partition_uniform: num_parts must be >= 1, got {num_parts}")
    if num_items <= num_parts:
        return [min(part, num_items) for part in range(num_parts + 1)]
    return balanced_boundaries([1] * num_items, num_parts)


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` contiguous parts of ``weights``: the heaviest part as light as possible, then
    the lightest as heavy as possible (the pipeline's split). With no more items than parts, as
    ``partition_uniform``: DeepSpeed lets parts be empty there, where a pipeline stage may not."""
    weights = list(weights)
    if len(weights) <= num_parts:
        return partition_uniform(len(weights), num_parts)
    return balanced_boundaries(weights, num_parts)


# ---- norms, clipping, overflow (zero/grad_norm.py) -----------------------------------------------------
def is_model_parallel_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` is split over the model-parallel ranks (each holds a different part), so every one of
    them counts its part: Megatron's marks, or zerotune's tensor-parallel layout."""
    return bool(getattr(param, "model_parallel", False) or getattr(param, "tensor_model_parallel", False)
                or tp_layout_of(param) is not None)


def _model_parallel(mpu: Any) -> tuple[dist.ProcessGroup | None, int]:
    """(model-parallel group, this rank in it) of a Megatron ``mpu``; (None, 0) without one."""
    if mpu is None:
        return None, 0
    if hasattr(mpu, "get_tensor_model_parallel_rank"):
        return mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_rank()
    return mpu.get_model_parallel_group(), mpu.get_model_parallel_rank()


def _mp_group(mpu: Any) -> dist.ProcessGroup:
    group, _ = _model_parallel(mpu)
    if group is None:
        raise ValueError("deepspeed.runtime.utils: the mpu has no model-parallel group")
    return group


def _l2_only(norm_type: float, caller: str) -> None:
    if float(norm_type) != 2.0:
        raise ValueError(f"deepspeed.runtime.utils.{caller}: norm_type={norm_type!r}; zerotune computes the L2 norm "
                         "only (norm_type=2)")


def _as_list(parameters: Parameters) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def clip_grad_norm_(parameters: Parameters, max_norm: float, norm_type: float = 2, mpu: Any = None
                    ) -> torch.Tensor:
    """Clip the gradients of ``parameters`` in place to a global L2 norm of ``max_norm``; returns the norm before
    clipping (a float32 tensor).

    The norm sums over ``mpu``'s model-parallel group, and the data-parallel ranks share one (the root mean
    square of theirs: ranks holding expert parameters, or unreduced gradients, differ and must still clip alike),
    so every rank clips by the same factor. DeepSpeed shares the mean of the ranks' norms instead; the two agree
    when the ranks' gradients do.
    """
    _l2_only(norm_type, "clip_grad_norm_")
    group, mp_rank = _model_parallel(mpu)
    model_norm = None if group is None else ModelParallelNorm(
        (group,), lambda param: mp_rank == 0 or is_model_parallel_parameter(param))
    rank_group = groups._get_data_parallel_group() if dist.is_initialized() else None
    params = cast(list[torch.nn.Parameter], _as_list(parameters))  # (any tensor with a .grad)
    return clip_grads_to_norm_(params, max_norm, model_norm=model_norm, rank_group=rank_group)


def get_weight_norm(parameters: Parameters, norm_type: float = 2, mpu: Any = None) -> float:
    """The L2 norm of the tensors themselves (weights, or flattened gradients) over ``mpu``'s model-parallel
    group; -1 when it is not finite (DeepSpeed's mark, which ``CheckOverflow.check_using_norm`` reads).

    A tensor marked ``ds_pipe_replicated`` is counted by another pipeline stage, and one replicated over the
    model-parallel ranks on their rank 0 only."""
    _l2_only(norm_type, "get_weight_norm")
    group, mp_rank = _model_parallel(mpu)
    counted = [t.detach() for t in _as_list(parameters) if not getattr(t, "ds_pipe_replicated", False)
               and (mp_rank == 0 or is_model_parallel_parameter(t))]
    norm = global_grad_norm(counted, model_groups=() if group is None else (group,))
    return norm if math.isfinite(norm) else -1


def _backward_allreduce_off(engine: Any) -> bool:
    """Whether DeepSpeed's engine was told not to reduce gradients in backward (each data-parallel rank then
    holds its own, and an overflow on one must stop all)."""
    if hasattr(engine, "pipeline_enable_backward_allreduce"):
        return engine.pipeline_enable_backward_allreduce is False
    return getattr(engine, "enable_backward_allreduce", True) is False


class CheckOverflow:
    """Whether any rank that must skip a step with this one holds a gradient that is not finite.

    Which ranks agree is DeepSpeed's choice: the largest expert group when expert parameters (``allreduce =
    False``) are checked, and then the whole world under ``zero_reduce_scatter``, else ``mpu``'s model-parallel
    group (and its data-parallel group when ``deepspeed``'s backward leaves gradients unreduced), else the world
    when ``deepspeed`` leaves them unreduced. The check is the engine's: the global norm is not finite.
    """

    def __init__(self, param_groups: Sequence[Sequence[torch.Tensor]] | None = None, mpu: Any = None,
                 zero_reduce_scatter: bool = False, deepspeed: Any = None) -> None:
        self.mpu, self.zero_reduce_scatter, self.deepspeed = mpu, zero_reduce_scatter, deepspeed
        self.params = [p for group in param_groups for p in group] if param_groups else None
        self.has_moe_params = any(is_moe_param(p) for p in self.params or ())

    def check(self, param_groups: Sequence[Sequence[torch.Tensor]] | None = None) -> bool:
        """The overflow of the parameters given here, else of those given at construction."""
        if param_groups is None:
            if self.params is None:
                raise ValueError("CheckOverflow.check(): no parameters, neither here nor at construction")
            return self.has_overflow(self.params, self.has_moe_params)
        params = [p for group in param_groups for p in group]
        return self.has_overflow(params, any(is_moe_param(p) for p in params))

    def has_overflow_serial(self, params: Iterable[torch.Tensor]) -> bool:
        """This rank's answer alone."""
        return any(p.grad is not None and not bool(torch.isfinite(p.grad).all()) for p in params)

    def has_overflow(self, params: Iterable[torch.Tensor], has_moe_params: bool | None = None) -> bool:
        moe = self.has_moe_params if has_moe_params is None else has_moe_params
        agreeing = [groups._get_max_expert_parallel_group()] if moe else []
        if self.zero_reduce_scatter:
            agreeing.append(groups._world())
        elif self.mpu is not None:
            if self.deepspeed is not None and _backward_allreduce_off(self.deepspeed):
                agreeing.append(self.mpu.get_data_parallel_group())
            agreeing.append(_mp_group(self.mpu))
        elif self.deepspeed is not None and _backward_allreduce_off(self.deepspeed):
            agreeing.append(groups._world())
        grads = [p.grad for p in params if p.grad is not None]
        return not math.isfinite(global_grad_norm(grads, model_groups=agreeing))

    def check_using_norm(self, norm_group: Sequence[float | torch.Tensor], reduce_overflow: bool = True) -> bool:
        """Overflow from norms already computed (-1, as ``get_weight_norm`` returns, or not finite), agreed over
        the largest expert group with expert parameters, then ``mpu``'s model-parallel group, else (with
        ``reduce_overflow``) the world."""
        local = any(float(norm) == -1 or not math.isfinite(float(norm)) for norm in norm_group)
        flag = torch.tensor([float(local)], device=get_accelerator().current_device_name())
        agreeing = [groups._get_max_expert_parallel_group()] if self.has_moe_params else []
        if self.mpu is not None:
            agreeing.append(_mp_group(self.mpu))
        elif reduce_overflow:
            agreeing.append(groups._world())
        for group in agreeing:
            comm.all_reduce(flag, group, op=comm.ReduceOp.MAX)
        return bool(flag.item())


# ---- autograd ---------------------------------------------------------------------------------
def check_internal_apis_for_count_used_parameters() -> bool:
    """Whether this torch has the autograd internals ``count_used_parameters_in_backward`` reads."""
    return (hasattr(torch.autograd.graph, "_get_grad_fn_or_grad_acc")
            and hasattr(torch._C, "_current_graph_task_id") and hasattr(torch._C, "_will_engine_execute_node"))


def count_used_parameters_in_backward(parameters: Iterable[torch.Tensor]) -> int:
    """How many of ``parameters`` the backward now running will give a gradient; call it from a backward hook.

    A parameter counts when autograd will execute its gradient node (its accumulate-grad node, or the node
    that produced it); parameters sharing a node count once, frozen ones not at all."""
    if not check_internal_apis_for_count_used_parameters():
        raise RuntimeError("count_used_parameters_in_backward needs torch's autograd internals "
                           "(_get_grad_fn_or_grad_acc, _will_engine_execute_node), which this torch lacks")
    if torch._C._current_graph_task_id() == -1:
        raise RuntimeError("count_used_parameters_in_backward must be called during backward (from a hook)")
    nodes = set()
    # Backward hooks run with grad mode off, and torch <= 2.4 finds a leaf's accumulate-grad node only with it
    # on. Looked up on the module at each call (not imported), so a patched torch is the one used.
    with torch.enable_grad():
        for param in parameters:
            if isinstance(param, torch.Tensor) and param.requires_grad:
                node = torch.autograd.graph._get_grad_fn_or_grad_acc(param)
                if node is not None:
                    nodes.add(node)
    return sum(bool(torch._C._will_engine_execute_node(node)) for node in nodes)


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log this process's memory (DeepSpeed's helper); only when ``force`` is true, as DeepSpeed."""
    if not force:
        return
    accelerator = get_accelerator()
    get_logger().info("%s | allocated %.2f GB | max allocated %.2f GB", message,
                      accelerator.memory_allocated() / 2**30, accelerator.max_memory_allocated() / 2**30)


def move_to_device(item: Any, device: Any, criterion_func: Any = None) -> Any:
    """DeepSpeed's ``move_to_device``: ``item`` (a tensor, or lists / tuples / dicts nesting them) on ``device``.
    With ``criterion_func``, a tensor it accepts is moved in place (its ``.data`` replaced, the same object
    returned); the others, and everything without one, are returned as ``.to(device)`` copies."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    if not isinstance(item, torch.Tensor):
        raise TypeError(f"move_to_device: expected tensors in lists, tuples and dicts, got a {type(item).__name__}")
    return item.to(device)
