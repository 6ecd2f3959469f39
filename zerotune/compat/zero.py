"""``deepspeed.zero`` / ``deepspeed.runtime.zero.partition_parameters``: zerotune's ZeRO-3 contexts
plus ``register_external_parameter``, and ``ZeroParamStatus``, the type of a partitioned parameter's
``ds_status`` (``zero/stage3/ds_markers.py`` lists the ``ds_*`` attributes and what each holds)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from zerotune.compat.accelerator import get_accelerator
from zerotune.compat.parameter_offload import DeepSpeedZeRoOffload
from zerotune.compat.paths import DeepSpeedFeatureNotSupported
from zerotune.compat.refusals import refused_class, refused_function
from zerotune.zero import GatheredParameters, Init, WeightLoadingError, load_partitioned_weights
from zerotune.zero.stage3.ds_markers import ZeroParamStatus
from zerotune.zero.stage3.init import contradicting_single_rank_group
from zerotune.zero.stage3.wrap import EXTERNAL_PARAMS

# transformers' ZeRO-3 loading swaps these two in and out around ``zero.Init`` (it patches DeepSpeed's
# constructor wrapping to keep ``torch.arange`` integer). zerotune's Init wraps no constructors, so the
# wrapper is never installed; the names exist so that code runs unchanged.
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype: torch.dtype):  # noqa: ANN001, ANN201
    """DeepSpeed's constructor wrapper: floating-point results in ``target_fp_dtype`` on this accelerator."""
    def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        kwargs.setdefault("device", get_accelerator().current_device_name())
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped

class _NoPartitionedShape:
    """DeepSpeed's ``partitioned_param_data_shape`` (``[0]``: its partitioned parameters hold an empty ``.data``).
    zerotune's keep their full shape over one element of storage (``stage3/sharded_param.py``: code reading a
    sharded weight's shape keeps working), so no constant is true here; any use of the value refuses in one line."""

    _FEATURE = ("a fixed .data shape for partitioned parameters (zerotune's show their full shape over one element "
                "of storage; ds_status says whether they are gathered, ds_tensor holds this rank's piece)")

    def _refuse(self, *args: Any) -> Any:
        raise DeepSpeedFeatureNotSupported("deepspeed.runtime.zero.partition_parameters.partitioned_param_data_shape",
                                           self._FEATURE)

    __iter__ = __len__ = __getitem__ = __eq__ = __index__ = _refuse
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return "<partitioned_param_data_shape: refused in zerotune>"


partitioned_param_data_shape = _NoPartitionedShape()

# DeepSpeed's spelling of zerotune's check (stage3/init.py): zero.Init refuses a one-rank group under a
# multi-rank launcher rather than silently building the whole model on every rank.
_contradicting_single_rank_pg_error = contradicting_single_rank_group

MiCS_Init = refused_class("deepspeed.zero.MiCS_Init")
# DeepSpeed's Init base class (it patches every module class's __init__) and its F.linear replacement: zerotune's
# Init hooks module registration instead and never swaps F.linear (memory_efficient_linear changes nothing).
InsertPostInitMethodToModuleSubClasses = refused_class(
    "deepspeed.runtime.zero.partition_parameters.InsertPostInitMethodToModuleSubClasses")
zero3_linear_wrap = refused_function("deepspeed.runtime.zero.partition_parameters.zero3_linear_wrap")


class MultipleAllGatherHandles:
    """Several pending gathers waited on as one: ``wait(handle_dependency=...)`` waits on each in order.

    DeepSpeed's combinator over its all-gather handles; the flag goes by keyword, so handles whose ``wait`` takes
    it keyword-only or as ``**kwargs`` work too. zerotune's own gathers are waited through their unit
    (stage3/unit.py) and never need it; it is here for code that combines handles it holds itself."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def wait(self, handle_dependency: bool = True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)


__all__ = ["Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter",
           "ZeroParamStatus", "DeepSpeedZeRoOffload", "load_partitioned_weights", "WeightLoadingError",
           "get_accelerator", "zero_wrapper_for_fp_tensor_constructor", "unwrap_model_for_generation",
           "partitioned_param_data_shape", "MultipleAllGatherHandles", "MiCS_Init",
           "InsertPostInitMethodToModuleSubClasses", "zero3_linear_wrap"]


@contextlib.contextmanager
def unwrap_model_for_generation(engine: Any) -> Iterator[Any]:
    """DeepSpeed's ``deepspeed.runtime.zero.unwrap_model_for_generation(engine)``: the whole weights, gathered
    once, and no ZeRO-3 forward hooks while the block runs, so ``generate()``'s many forwards do not gather and
    release per module; the hooks come back (and the schedule restarts) when it ends, also on an exception.

    Below stage 3 (no ``optimizer.parameter_offload``) the weights are whole already and nothing changes."""
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    with GatheredParameters(list(engine.parameters())):
        if offload is None:
            yield engine
            return
        for hook in offload.forward_hooks:
            hook.remove()
        offload.forward_hooks = []
        try:
            yield engine
        finally:
            offload._register_deepspeed_module(offload.module)


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter``, which another module owns.

    At stage 3 such a parameter is then gathered for both modules (it joins the root unit, as
    shared weights do). Call it before ``initialize``, which lays out the units.
    """
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(f"register_external_parameter needs an nn.Parameter, got {type(parameter).__name__}")
    external = getattr(module, EXTERNAL_PARAMS, None)
    if external is None:
        external = []
        setattr(module, EXTERNAL_PARAMS, external)
    if all(p is not parameter for p in external):
        external.append(parameter)


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    external = getattr(module, EXTERNAL_PARAMS, [])
    if all(p is not parameter for p in external):
        raise ValueError("unregister_external_parameter: the parameter was not registered on this module")
    external[:] = [p for p in external if p is not parameter]
