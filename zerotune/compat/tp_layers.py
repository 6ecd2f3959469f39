"""``deepspeed.module_inject.layers``: DeepSpeed's tensor-parallel layer names on zerotune's layers.

There is one tensor-parallel linear in zerotune (``zerotune/parallel/tensor/layers.py``); DeepSpeed's names are
views of it, in two ways at once:

* *construction*: ``LinearLayer(module, mp_group, gather_output=...)`` (column-parallel),
  ``LinearAllreduce(module, mp_group)`` (row-parallel, replicated bias) and ``LmHeadLinearAllreduce(module,
  mp_group)`` (the gathered LM head: weight split over the input features, input sliced, output summed) are thin
  subclasses of ``ColumnParallelLinear`` / ``RowParallelLinear`` with DeepSpeed's constructor. They shard an
  existing ``nn.Linear`` in place, keeping its parameter objects (only ``.data`` becomes the shard, marked with
  its ``TPLayout``), so gradient norms, checkpoints and the consolidated state dict treat them as every other
  zerotune tensor-parallel layer. ``build_tp_layer(module, kind, group)`` is the same construction by kind;
* *isinstance*: the layers the engine's AutoTP builds are plain zerotune layers, yet DeepSpeed code asks
  ``isinstance(layer, LinearLayer)``. The classes' metaclass answers for zerotune's layers by what they are:
  every ``ColumnParallelLinear`` is a ``LinearLayer``, every ``RowParallelLinear`` a ``LinearAllreduce``, and a
  row-parallel layer that slices its own input (``input_is_parallel=False``) an ``LmHeadLinearAllreduce``.

Nothing global decides what is built: ``set_autotp_mode`` only records DeepSpeed's training/inference flag
(``is_autotp_training_mode``), which zerotune's layers do not need -- their backward is always exact.

DeepSpeed's per-parameter ``param.gather_params([param])`` / ``param._tp_partition([param])`` are attached to
the sharded parameters these constructors make: the first all-gathers the full tensor into ``.data`` (through
``zerotune.distributed.comm``), the second cuts it back to this rank's shard by its layout.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from zerotune.compat.refusals import refused_class
from zerotune.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from zerotune.parallel.tensor.layout import TPLayout, mark_tensor_parallel, shard_tensor, tp_layout_of
from zerotune.parallel.tensor.mappings import group_world_size
from zerotune.parallel.tensor.state_dict import gather_full_tensor

__all__ = ["EmbeddingLayer", "LinearAllreduce", "LinearLayer", "LmHeadLinearAllreduce", "Normalize",
           "SubParamLinearAllreduce", "SubParamLinearLayer", "attach_param_hooks", "build_tp_layer",
           "fused_LinearLayer", "is_autotp_training_mode", "set_autotp_mode"]

_training_mode = False
_SHARD_STORAGE = "_zerotune_tp_shard_storage"  # a gathered parameter's shard tensor, until ``_tp_partition``


def set_autotp_mode(training: bool = False) -> None:
    """Record DeepSpeed's AutoTP mode (``initialize`` with ``tensor_parallel.autotp_size`` sets training)."""
    global _training_mode
    _training_mode = bool(training)


def is_autotp_training_mode() -> bool:
    """Whether AutoTP is in training mode (DeepSpeed's flag; zerotune's layers train in either mode)."""
    return _training_mode


class _ShardOps:
    """``param.gather_params`` / ``param._tp_partition`` of one layer: DeepSpeed's per-parameter hooks.

    Holds the layer's group; a deep copy of a parameter shares it (a process group is a handle, not data)."""

    def __init__(self, group: dist.ProcessGroup | None, gather: bool) -> None:
        self.group, self.gather = group, gather

    def __call__(self, params_list: Iterable[torch.Tensor | None]) -> None:
        with torch.no_grad():
            for param in params_list:
                layout = None if param is None else tp_layout_of(param)
                if param is None or layout is None:
                    continue  # a replicated tensor (the row-parallel bias) is already whole everywhere
                dim = layout.dim % param.dim()
                whole = param.shape[dim] == layout.full_size
                if self.gather and not whole:
                    shard = param.data
                    param.data = gather_full_tensor(param, self.group).contiguous()
                    setattr(param, _SHARD_STORAGE, shard)
                elif not self.gather and whole and layout.world > 1:
                    piece = shard_tensor(param.data, layout)
                    storage = getattr(param, _SHARD_STORAGE, None)
                    if storage is not None and storage.shape == piece.shape:
                        # back into the shard's own storage: under ZeRO 1/2 it is a view of the flat buffer
                        storage.copy_(piece)
                        piece = storage
                        delattr(param, _SHARD_STORAGE)
                    param.data = piece

    def __deepcopy__(self, memo: dict) -> _ShardOps:
        return self


def _linear_of(module: nn.Module, what: str) -> tuple[nn.Parameter, nn.Parameter | None]:
    if not isinstance(module, nn.Linear):
        raise TypeError(f"{what} shards an nn.Linear (weight [out, in]), got {type(module).__name__}")
    weight: Any = module.weight  # (nn.Linear declares Tensors; they are a Parameter and a Parameter or None)
    bias: Any = module.bias
    return weight, bias


def _adopt(layer: ColumnParallelLinear | RowParallelLinear, weight: nn.Parameter, bias: nn.Parameter | None
           ) -> None:
    """Give ``layer`` the module's own parameter objects holding the shards it built, with DeepSpeed's hooks."""
    for attribute, original in (("weight", weight), ("bias", bias)):
        built = getattr(layer, attribute)
        if original is None or built is None:
            continue
        layout = tp_layout_of(built)
        original.data = built.data
        if layout is not None:
            mark_tensor_parallel(original, layout)
            _set_hooks(original, layer.tp_group)
        setattr(layer, attribute, original)


def _set_hooks(param: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    hooks: Any = param  # DeepSpeed's per-parameter hooks (attributes torch does not declare)
    hooks.gather_params = _ShardOps(group, gather=True)
    hooks._tp_partition = _ShardOps(group, gather=False)


def attach_param_hooks(model: nn.Module) -> None:
    """DeepSpeed's ``gather_params`` / ``_tp_partition`` on every sharded parameter of ``model``'s tensor-parallel
    linears: the engine's AutoTP builds zerotune's layers, and DeepSpeed's layers carry these hooks."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            for param in (module.weight, module.bias):
                if param is not None and tp_layout_of(param) is not None and not hasattr(param, "gather_params"):
                    _set_hooks(param, module.tp_group)


class _DeepSpeedLayerType(type):
    """Answers ``isinstance`` for zerotune's own layers of the kind a DeepSpeed name stands for."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return type.__instancecheck__(cls, instance) or cls._zerotune_kind(instance)  # type: ignore[attr-defined]


class LinearLayer(ColumnParallelLinear, metaclass=_DeepSpeedLayerType):
    """DeepSpeed's column-parallel ``LinearLayer(module, mp_group, gather_output=False)``: the nn.Linear's output
    features split over ``mp_group``; ``skip_partition=True`` takes ``module`` as this rank's shard already."""

    def __init__(self, module: nn.Module, mp_group: dist.ProcessGroup | None = None, skip_partition: bool = False,
                 gather_output: bool = False, **kwargs: Any) -> None:
        nn.Module.__init__(self)
        weight, bias = _linear_of(module, "LinearLayer")
        out_features = weight.shape[0] * (group_world_size(mp_group) if skip_partition else 1)
        self._configure(weight.shape[1], out_features, mp_group, gather_output, "out_in", 1)
        self.name = kwargs.get("name")
        if skip_partition:
            self.weight = weight
            self.register_parameter("bias", bias)
            self._mark_local()
        else:
            self._adopt_full(weight.detach(), None if bias is None else bias.detach())
        _adopt(self, weight, bias)

    def _mark_local(self) -> None:
        """``skip_partition``: the tensors given are this rank's shards; record where they sit."""
        layout = TPLayout(0, self.tp_world, self.tp_rank, self.out_features)
        for param in (self.weight, self.bias):
            if param is not None:
                mark_tensor_parallel(param, layout)

    @staticmethod
    def _zerotune_kind(instance: Any) -> bool:
        return isinstance(instance, ColumnParallelLinear)


class LinearAllreduce(RowParallelLinear, metaclass=_DeepSpeedLayerType):
    """DeepSpeed's row-parallel ``LinearAllreduce(module, mp_group)``: the input features split, the partial
    outputs summed over ``mp_group``, the bias replicated. The input arrives already split (``input_is_parallel``)."""

    _input_is_parallel = True

    def __init__(self, module: nn.Module, mp_group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        nn.Module.__init__(self)
        weight, bias = _linear_of(module, type(self).__name__)
        self._configure(weight.shape[1], weight.shape[0], mp_group, self._input_is_parallel, "out_in")
        self.name = kwargs.get("name")
        self._adopt_full(weight.detach(), None if bias is None else bias.detach())
        _adopt(self, weight, bias)

    @staticmethod
    def _zerotune_kind(instance: Any) -> bool:
        return isinstance(instance, RowParallelLinear)


class LmHeadLinearAllreduce(LinearAllreduce):
    """DeepSpeed's gathered LM head: the weight split over the INPUT features; each rank multiplies its slice of
    the (replicated) input and the outputs are summed, so every rank gets all the logits. DeepSpeed gives the
    head its own parameters (a tied embedding stays whole); so does this."""

    _input_is_parallel = False

    def __init__(self, module: nn.Module, mp_group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        weight, bias = _linear_of(module, "LmHeadLinearAllreduce")
        module.weight = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
        if bias is not None:
            module.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        super().__init__(module, mp_group, **{"name": "lm_head", **kwargs})

    @staticmethod
    def _zerotune_kind(instance: Any) -> bool:
        return isinstance(instance, RowParallelLinear) and not instance.input_is_parallel


_KINDS: dict[str, type[nn.Module]] = {"column": LinearLayer, "row": LinearAllreduce, "lm_head": LmHeadLinearAllreduce}


def build_tp_layer(module: nn.Module, kind: str, group: dist.ProcessGroup | None, *,
                   gather_output: bool = False, name: str | None = None) -> nn.Module:
    """The tensor-parallel layer of ``kind`` ("column", "row" or "lm_head") over ``group`` sharding ``module``
    (an nn.Linear) in place: DeepSpeed's AutoTP replacement of one layer."""
    if kind not in _KINDS:
        raise ValueError(f"tensor-parallel layer kind must be one of {sorted(_KINDS)}, got {kind!r}")
    if gather_output and kind != "column":
        raise ValueError(f"gather_output applies to column-parallel layers only, not {kind!r}")
    if kind == "column":
        return LinearLayer(module, group, gather_output=gather_output, name=name)
    return _KINDS[kind](module, group, name=name)


SubParamLinearLayer = refused_class("deepspeed.module_inject.layers.SubParamLinearLayer")
SubParamLinearAllreduce = refused_class("deepspeed.module_inject.layers.SubParamLinearAllreduce")
EmbeddingLayer = refused_class("deepspeed.module_inject.layers.EmbeddingLayer")
Normalize = refused_class("deepspeed.module_inject.layers.Normalize")
fused_LinearLayer = refused_class("deepspeed.module_inject.layers.fused_LinearLayer")
