"""DeepSpeed's spellings on zerotune's engine classes and on the engines they build.

``DeepSpeedEngine.initialize(model=..., config_params=...)`` and ``PipelineEngine(model, config=...)`` both mean
``zerotune.initialize``. The engine classes do not import ``initialize`` (it builds them), so the spellings are
attached here, by the package facade (``zerotune/__init__.py``) when zerotune is imported. Likewise every
stage-3 engine's optimizer gets DeepSpeed's ``parameter_offload`` (``parameter_offload.py``), through which TRL
drops and re-adds the module hooks around generation, and every engine's optimizer the loss scaler.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import torch

from zerotune.compat.fp16 import LossScaleConfig
from zerotune.compat.parameter_offload import DeepSpeedZeRoOffload
from zerotune.compat.paths import DeepSpeedFeatureNotSupported
from zerotune.engine import Engine
from zerotune.engine_core import EngineCore, register_engine_extension
from zerotune.initialize import initialize
from zerotune.pipe.engine import set_model_builder
from zerotune.precision.loss_scaler import DynamicLossScaler


def _initialize(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
    """``DeepSpeedEngine.initialize(...)`` is ``zerotune.initialize(...)``."""
    return initialize(*args, **kwargs)


def _engine_from_model(model: torch.nn.Module, **kwargs: Any) -> Any:
    return initialize(model=model, **kwargs)[0]


def _get_optimizer_ckpt_name(self: EngineCore, checkpoints_path: str, tag: str, expp_rank: int) -> str:
    """DeepSpeed's engine names an expert-parallel rank's optimizer-state file with this (only for MoE models; other
    optimizer state is in the ZeRO files). zerotune has no MoE layers, so it is refused by name; a checkpoint's
    optimizer state is in its ``shard_rank{r}.pt`` files (``checkpoint/logical.py``)."""
    raise DeepSpeedFeatureNotSupported("engine._get_optimizer_ckpt_name",
                                       "Mixture-of-Experts layers' expert-parallel optimizer files (deepspeed.moe)")


def _attach_parameter_offload(engine: EngineCore) -> None:
    """DeepSpeed's ``engine.optimizer.parameter_offload`` where the stage partitions the weights."""
    if engine.state.partitions_weights and engine.optimizer is not None:
        # DeepSpeed hangs it on its ZeRO optimizer; here the attribute is added to the torch optimizer itself
        engine.optimizer.parameter_offload = DeepSpeedZeRoOffload(engine.module, engine.state)  # type: ignore[attr-defined]


def _attach_loss_scaler(engine: EngineCore) -> None:
    """DeepSpeed's fp16 / ZeRO optimizers carry the loss scaler (``optimizer.loss_scaler.cur_scale``,
    ``optimizer.dynamic_loss_scale``, 0.19's ``optimizer.loss_scale_config``), which clients and DeepSpeed's tests
    read off what ``initialize`` returned: the engine's own scaler object, so it follows every step."""
    if engine.optimizer is not None:
        engine.optimizer.loss_scaler = engine.loss_scaler  # type: ignore[attr-defined]
        engine.optimizer.dynamic_loss_scale = isinstance(engine.loss_scaler, DynamicLossScaler)  # type: ignore[attr-defined]
        engine.optimizer.loss_scale_config = LossScaleConfig(engine.loss_scaler)  # type: ignore[attr-defined]


def _attach_base_optimizer(engine: EngineCore) -> None:
    """DeepSpeed's ZeRO and fp16 / bf16 optimizers wrap a torch optimizer over the fp32 master weights and expose it
    as ``optimizer.optimizer`` (clients and DeepSpeed's tests read its ``state``). zerotune does not wrap: what
    ``initialize`` returns already is that torch optimizer over the masters, so the attribute names the same object.
    Set only where DeepSpeed wraps (ZeRO stage >= 1 or mixed precision): its plain fp32 optimizer has none."""
    if engine.optimizer is not None and (engine.zero_optimization_stage() > 0 or engine.policy.mixed):
        engine.optimizer.optimizer = engine.optimizer  # type: ignore[attr-defined]


def _attach_zero_optimizer_members(engine: EngineCore) -> None:
    """What DeepSpeed's ZeRO optimizers answer, on the optimizer a ZeRO engine returned: the stage mark behind
    ``isinstance(optimizer, DeepSpeedZeroOptimizer[_Stage3])`` (``pt.py``), ``_global_grad_norm`` (the last
    step's gradient norm) and, at stage 3, ``_get_norm_groups()`` (each param group's gradient norm, read
    between backward and step -- custom clipping through ``safe_set_local_grad`` shows in it); at stages 1 and 2,
    ``bit16_groups_flat`` (_FlatBuffers). The rank's fp32 masters, under DeepSpeed's names: at stages 1 and 2
    ``single_partition_of_fp32_groups`` (one flat fp32 slice per param group), at stage 3
    ``fp32_partitioned_groups_flat`` (one per sub-group: zerotune's are the (unit, param group) slots)."""
    optimizer: Any = engine.optimizer  # (DeepSpeed's members are added to the torch optimizer)
    stage = engine.zero_optimization_stage()
    if optimizer is None or stage == 0:
        return
    optimizer._zerotune_zero_stage = stage
    optimizer._global_grad_norm = None

    def record_norm(stepped: EngineCore) -> None:
        optimizer._global_grad_norm = stepped.get_global_grad_norm()

    engine.register_post_step_hook(record_norm)
    state = engine.state
    if stage == 3 and hasattr(state, "group_grad_norms"):
        optimizer._get_norm_groups = lambda: [torch.tensor(norm) for norm in state.group_grad_norms()]
    if stage in (1, 2) and hasattr(state, "flat_groups"):
        optimizer.bit16_groups_flat = _FlatBuffers(state)
    if hasattr(state, "masters"):  # read live: the stage owns the list
        setattr(optimizer, "fp32_partitioned_groups_flat" if stage == 3 else "single_partition_of_fp32_groups",
                _Masters(state))


class _FlatBuffers(Sequence[torch.Tensor]):
    """DeepSpeed's ``bit16_groups_flat`` at stages 1 and 2: each param group's parameters as one flat buffer, which
    the parameters are views of -- zerotune's ``FlatParamGroup.buffer``, in the training dtype, built where the
    parameters are and outside autograd. Read live, so a buffer moved by ``offload_states`` is the one seen."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def __len__(self) -> int:
        return len(self._state.flat_groups)

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[torch.Tensor]: ...

    def __getitem__(self, index: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        if isinstance(index, slice):
            return [group.buffer for group in self._state.flat_groups[index]]
        return self._state.flat_groups[index].buffer


class _Masters(Sequence[torch.nn.Parameter]):
    """The stage's fp32 master parameters (this rank's flat slices), read live off the stage."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def __len__(self) -> int:
        return len(self._state.masters)

    @overload
    def __getitem__(self, index: int) -> torch.nn.Parameter: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[torch.nn.Parameter]: ...

    def __getitem__(self, index: int | slice) -> torch.nn.Parameter | Sequence[torch.nn.Parameter]:
        return self._state.masters[index]


def install_spellings() -> None:
    """Idempotent."""
    Engine.initialize = staticmethod(_initialize)  # type: ignore[attr-defined]
    EngineCore._get_optimizer_ckpt_name = _get_optimizer_ckpt_name  # type: ignore[attr-defined]
    set_model_builder(_engine_from_model)
    register_engine_extension(_attach_parameter_offload)
    register_engine_extension(_attach_loss_scaler)
    register_engine_extension(_attach_zero_optimizer_members)
    register_engine_extension(_attach_base_optimizer)


__all__ = ["install_spellings"]
