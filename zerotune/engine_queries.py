"""The read-only answers a training script asks an engine (DeepSpeed's accessor methods).

They are plain queries of the engine's config, mesh and precision policy, kept apart from the
step logic in ``engine.py`` so that file reads as one step's phases.
"""

from __future__ import annotations

from typing import Any

import torch

from zerotune.distributed.mpu import ModelParallelUnit


class EngineQueries(torch.nn.Module):
    """Mixed into ``EngineCore``, a ``torch.nn.Module`` (hence the base, which leaves the engines' MRO as it was:
    ``__getattr__`` falls back to torch's); relies on its ``env``, ``mesh``, ``policy``, ``state``, ``optimizer``,
    ``client_optimizer``, ``loss_scaler``, ``module`` and ``_config`` attributes."""

    def __getattr__(self, name: str) -> Any:
        """DeepSpeed's pass-through: a name the engine does not have is looked up on the wrapped model, so
        ``engine.model`` (an HF model's backbone), ``engine.forward_value(...)`` or
        ``engine.gradient_checkpointing_enable()`` reach the module (DeepSpeed-Chat relies on it)."""
        try:
            return super().__getattr__(name)  # torch's: parameters, buffers, submodules
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}', nor has its "
                                 f"module ({type(module).__name__})") from None

    @property
    def sparse_tensor_module_names(self) -> set[str]:
        """DeepSpeed's names of the embedding weights ``sparse_gradients: true`` covers (every ``nn.Embedding`` /
        ``nn.EmbeddingBag`` weight); zerotune reduces their gradients dense, in the buckets (the same values).
        A checkpoint load replaces it with the saved engine's record, as DeepSpeed's load does."""
        loaded = getattr(self, "_loaded_sparse_names", None)
        if loaded is not None:
            return set(loaded)
        if self._config.sparse_gradients is not True:
            return set()
        return {f"{name}.weight" if name else "weight" for name, module in self.module.named_modules()
                if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag))}

    @sparse_tensor_module_names.setter
    def sparse_tensor_module_names(self, names: set[str]) -> None:
        self._loaded_sparse_names = set(names)

    @property
    def device(self) -> torch.device:
        return self.env.device

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def global_rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def dp_world_size(self) -> int:
        return self.mesh.size("dp")

    @property
    def mpu(self) -> ModelParallelUnit:
        """Megatron-style rank and group queries (``get_data_parallel_rank()``, ...), as DeepSpeed's ``engine.mpu``."""
        return ModelParallelUnit(self.mesh)

    @property
    def config(self) -> dict:
        return self._config.to_dict()

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    @property
    def trainable_params(self) -> list[torch.nn.Parameter]:
        return self.state.params

    @property
    def sharded(self) -> bool:
        """Whether optimizer state and masters are partitioned over the data-parallel ranks (ZeRO >= 1)."""
        return self.state.shards_masters

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def zero_optimization_stage(self) -> int:
        return self._config.zero_optimization.stage

    def fp16_enabled(self) -> bool:
        return self.policy.param_dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        return self.policy.param_dtype == torch.bfloat16

    bf16_enabled = bfloat16_enabled

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def log_level(self) -> str | None:
        """The config's ``log_level`` as given (None: initialize left the logger's level alone)."""
        return self._config.log_level

    def steps_per_print(self) -> int:
        return self._config.steps_per_print

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups] if self.optimizer else []

    def get_global_grad_norm(self) -> float | None:
        """Global L2 norm of the (unscaled) gradients before clipping, at the last boundary."""
        return self._last_grad_norm

    def was_step_applied(self) -> bool:
        """False when the last boundary's step was skipped for an fp16 overflow."""
        return self._step_applied

    def optimizer_name(self) -> str | None:
        """The client optimizer's class name, else the config's optimizer type (lower-cased, as DeepSpeed)."""
        if self.client_optimizer is not None:
            return type(self.client_optimizer).__name__
        optimizer = self._config.optimizer
        return optimizer.type.lower() if optimizer is not None else None

    def wall_clock_breakdown(self) -> bool:
        return self._config.wall_clock_breakdown

    def get_loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    def get_data_parallel_group(self) -> Any:
        """The data-parallel process group (the world's group when every rank is data parallel)."""
        return self.mesh.group("dp") or torch.distributed.group.WORLD

    def autotp_size(self) -> int:
        """The config's ``tensor_parallel.autotp_size`` (0 or 1: no tensor parallelism)."""
        return int(self._config.tensor_parallel.autotp_size)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """DeepSpeed's whole-model state dict on rank 0 where the weights are partitioned (ZeRO-3: as
        ``_zero3_consolidated_16bit_state_dict``; tensor parallelism: shards joined, None on other ranks)."""
        if self.state.partitions_weights:
            return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.mesh.size("tp") > 1:
            gathered = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
            return gathered if self.global_rank == 0 else None
        raise ValueError("_consolidated_16bit_state_dict needs partitioned weights (ZeRO stage 3 or "
                         "tensor_parallel.autotp_size > 1); use module.state_dict() otherwise")

    def zero_optimization_partition_gradients(self) -> bool:
        return self.state.reduces_every_backward

    def zero_optimization_partition_weights(self) -> bool:
        return self.state.partitions_weights

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(self._config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def zero_cpu_offload(self) -> bool:
        return self._config.zero_optimization.offload_optimizer.device == "cpu"

    def get_mom(self) -> list:
        """Each group's momentum: Adam's beta1 pair, or SGD's momentum."""
        if self.optimizer is None:
            return []
        return [group.get("betas", group.get("momentum")) for group in self.optimizer.param_groups]

    def memory_breakdown(self) -> dict[str, int]:
        """This rank's bytes of model state, by kind (the ZeRO paper's accounting).

        ``params``: the model's parameters (trainable and frozen; at stage 3 this rank's shards,
        gathered units counted in ``comm_buffers``); ``grads``: gradient storage
        (fp32 buckets at stage 0, full flat buffers at stage 1, this rank's slice at stage 2);
        ``master_weights``: separate fp32 masters (none in fp32 training); ``optimizer_state``;
        ``comm_buffers``: communication staging beyond the gradients (stage-2 buckets in flight).
        """
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in self.module.parameters()}
        optimizer_bytes = 0
        if self.optimizer is not None:
            optimizer_bytes = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                                  for t in s.values() if isinstance(t, torch.Tensor))
        return {"params": sum(storages.values()) + self.state.partitioned_param_bytes(),
                "grads": self.state.grad_bytes(),
                "master_weights": self.state.master_bytes(), "optimizer_state": optimizer_bytes,
                "comm_buffers": self.state.buffer_bytes()}
