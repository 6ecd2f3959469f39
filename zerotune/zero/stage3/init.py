"""``zerotune.zero.Init``: build a model already partitioned, so no rank ever holds all of it.

DeepSpeed's ``zero.Init`` patches torch's tensor constructors and every module class's
``__init__``. This one uses torch's public module-registration hook instead: when a module is
assigned into its parent (``self.attn = Attention(...)``), its ``__init__`` -- parameter
creation and initialization included -- has just finished, and its parameters are partitioned
at once (broadcast from rank 0, this rank's slice kept, the whole tensor dropped). So at most
one module's parameters are whole at any time, initialization code runs unchanged and in the
same order as without the context (the same seed gives the same weights), and parameters
registered directly on the top-level module are partitioned when the context exits.

Hugging Face models: partitioned modules are marked initialized, so ``post_init`` does not try
to rewrite weights that are no longer whole; the weights are each module's own initialization
(``reset_parameters``), and pretrained weights are loaded per slice with
``zerotune.zero.load_partitioned_weights``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from zerotune.distributed import comm
from zerotune.zero.stage3.segment import FlatSegment
from zerotune.zero.stage3.sharded_param import sharded_param_of


def _default_group() -> dist.ProcessGroup | None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def contradicting_single_rank_group(dp_world_size: int, explicit_process_group: Any,
                                    env: Mapping[str, str | None] | None = None) -> str | None:
    """Why partitioning over a one-rank group would be wrong here, or None when it is not.

    A launcher that says ``WORLD_SIZE`` > 1 while the group resolved by default holds one rank (the process group
    was not set up yet, or a one-rank one was, e.g. by ``from_pretrained`` before ``init_distributed``) means every
    rank would build the whole model unpartitioned and run out of memory looking like a "model too big" failure.
    An explicitly given group of one rank is intentional; a missing or malformed ``WORLD_SIZE`` says nothing.
    """
    if dp_world_size != 1 or explicit_process_group is not None:
        return None
    raw = (os.environ if env is None else env).get("WORLD_SIZE")
    try:
        launcher_world = int(raw or 0)
    except (TypeError, ValueError):
        return None
    if launcher_world <= 1:
        return None
    return (f"zero.Init would partition over one rank, but the launcher set WORLD_SIZE={launcher_world}: call "
            "init_distributed() (zerotune.init_distributed / deepspeed.init_distributed) before building the model "
            "under zero.Init, or pass data_parallel_group explicitly if a one-rank group is intended")


class Init:
    """``with zerotune.zero.Init(): model = build()`` -- see the module docstring.

    ``config_dict_or_path`` is validated like ``initialize``'s config. ``dtype``: cast the shards
    to it (default: keep the dtype the module created, normally fp32, so ``initialize`` takes exact
    fp32 masters). ``data_parallel_group``: the group to partition over (default: the world).
    """

    def __init__(self, config_dict_or_path: Any = None, data_parallel_group: dist.ProcessGroup | None = None,
                 dtype: torch.dtype | None = None, enabled: bool = True, remote_device: str | None = None,
                 pin_memory: bool = False, mpu: Any = None, module: torch.nn.Module | None = None,
                 config: Any = None, **_ignored: Any) -> None:
        del pin_memory, mpu
        source = config_dict_or_path if config_dict_or_path is not None else config
        self._store = None
        if source is not None:
            from zerotune.config import load_config

            loaded = load_config(source)  # bad configs fail here, naming the key, not deep inside training
            offload = loaded.zero_optimization.offload_param
            if remote_device == "nvme" or (remote_device is None and offload.device == "nvme"):
                self._store = self._swap_store(offload.nvme_path, loaded.aio)
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"zero.Init(dtype=...) must be a torch.dtype, got {dtype!r}")
        self.enabled = enabled
        self.dtype = dtype
        self.group = data_parallel_group if data_parallel_group is not None else _default_group()
        contradiction = contradicting_single_rank_group(1 if self.group is None else dist.get_world_size(self.group),
                                                        data_parallel_group) if enabled else None
        if contradiction is not None:
            raise RuntimeError(contradiction)
        self._handles: list[Any] = []
        self._registered: dict[int, torch.nn.Module] = {}
        self._count = 0
        if module is not None and enabled:  # DeepSpeed: partition an already-built module
            self.partition(module)

    def _swap_store(self, nvme_path: str | None, aio: Any) -> Any:
        """``offload_param: {device: nvme}``: each module's shard goes to a file as soon as it is built."""
        from zerotune.offload.swap_files import AioSettings, SwapStore

        if not nvme_path:
            raise ValueError("zero.Init(remote_device='nvme') needs zero_optimization.offload_param.nvme_path")
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return SwapStore(Path(nvme_path) / f"zerotune_init_rank{rank}", AioSettings.from_config(aio))

    def __enter__(self) -> "Init":
        if self.enabled:
            self._handles = [register_module_module_registration_hook(self._on_child_registered),
                             register_module_parameter_registration_hook(self._on_param_registered)]
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if exc_info[0] is None:
            for module in self._registered.values():  # e.g. the top-level module's own parameters
                self.partition(module)
        self._registered = {}

    def _on_child_registered(self, parent: torch.nn.Module, name: str, child: torch.nn.Module | None) -> None:
        if child is not None:
            self.partition(child)

    def _on_param_registered(self, module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None:
            self._registered[id(module)] = module

    @torch.no_grad()
    def partition(self, module: torch.nn.Module) -> None:
        """Partition every parameter of ``module`` not partitioned yet, one submodule at a time."""
        for submodule in module.modules():
            params = list({id(p): p for p in submodule.parameters(recurse=False)
                           if sharded_param_of(p) is None}.values())
            if not params:
                continue
            for param in params:  # every rank starts from rank 0's values (init may differ across ranks)
                comm.broadcast(param.data, 0, self.group)
            segment = FlatSegment(params, self.group)
            if self.dtype is not None:
                segment.cast_(self.dtype)
            if self._store is not None:
                self._count += 1
                segment.swap_out_to(self._store, f"module{self._count}")
            initialized: list[Any] = [submodule, *params]  # (transformers' marker: no type declares it)
            for done in initialized:
                done._is_hf_initialized = True

