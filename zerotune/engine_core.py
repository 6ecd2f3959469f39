"""The step core every engine is built from: one optimizer step, counters, checkpoints, reports.

``EngineCore`` holds what an optimizer step needs -- the ZeRO state (``zero/contracts.py``), the
optimizer, LR scheduler and loss scaler, the counters -- and performs the step at an accumulation
boundary (``_take_model_step``):

1. one global norm of the fp32 gradients -> fp16 overflow check, unscale and clip in one pass;
2. optimizer step on the fp32 masters (skipped on overflow), masters rounded into the model;
3. loss scale, LR schedule, counters, post-step hooks and the step report advance.

How micro-batches reach that step is the engines' own business: ``Engine`` (``engine.py``) exposes
DeepSpeed's forward / backward / step; ``PipelineEngine`` (``pipe/engine.py``) runs a pipeline
schedule in ``train_batch``. Neither has the other's methods.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from zerotune.checkpoint.engine_state import load_engine_checkpoint, load_newest_checkpoint, save_engine_checkpoint
from zerotune.checkpoint.train_state import CheckpointSettings, Counters, TrainState
from zerotune.config import resolved
from zerotune.distributed import comm
from zerotune.distributed.comm_log import COMMS_LOGGER
from zerotune.distributed.compression import CompressionStats, TopKCompressor
from zerotune.distributed.engine_guards import EngineGuards
from zerotune.distributed.env import DistEnv
from zerotune.distributed.mesh import ProcessMesh
from zerotune.distributed.streams import phase
from zerotune.engine_curriculum import EngineCurriculum
from zerotune.engine_data import EngineDataLoader
from zerotune.engine_offload_states import FORWARD_NEEDS, StateOffloading
from zerotune.engine_queries import EngineQueries
from zerotune.monitor.logging import log_rank0
from zerotune.monitor.logging import set_level as set_log_level
from zerotune.monitor.step_report import StepReporter
from zerotune.monitor.throughput import ThroughputTimer
from zerotune.monitor.timers import WallClockTimers
from zerotune.monitor.writers import ScalarWriters
from zerotune.offload.pinned import TRACKER as PINNED
from zerotune.precision.loss_scaler import DynamicLossScaler, LossScaleError, NonFiniteError, StaticLossScaler
from zerotune.precision.policy import PrecisionPolicy
from zerotune.zero.contracts import ZeroStage
from zerotune.zero.fragments import register_owner
from zerotune.zero.stage3.saving import iter_consolidated, save_consolidated

_ENGINE_EXTENSIONS: list[Callable[["EngineCore"], None]] = []


def register_engine_extension(extend: Callable[["EngineCore"], None]) -> None:
    """Call ``extend(engine)`` at the end of every engine's construction (idempotent).

    How a front end adds its own names to the engines it receives without the core knowing it: the
    DeepSpeed face (``compat/spellings.py``) hangs DeepSpeed's ``optimizer.parameter_offload`` here."""
    if extend not in _ENGINE_EXTENSIONS:
        _ENGINE_EXTENSIONS.append(extend)


class EngineCore(EngineQueries, StateOffloading, EngineCurriculum, torch.nn.Module):
    """What every engine has: the step, the counters, checkpoints and reports (see the module docstring)."""

    def __init__(self, *, module: torch.nn.Module, config: Any, env: DistEnv, mesh: ProcessMesh,
                 policy: PrecisionPolicy, state: ZeroStage,
                 optimizer: torch.optim.Optimizer | None, lr_scheduler: Any,
                 loss_scaler: StaticLossScaler | DynamicLossScaler, param_names: dict[int, str],
                 training_dataloader: EngineDataLoader | None = None, compressor: TopKCompressor | None = None,
                 client_optimizer: Any = None, guards: EngineGuards | None = None) -> None:
        super().__init__()
        self.guards = guards if guards is not None else EngineGuards.off()
        """This engine's collective guard, watchdog timeout and checkpointing policy; its methods that communicate
        run inside them (``EngineGuards.method``), ``destroy()`` closes them."""
        self.module = module
        self._config = config
        if config.log_level is not None:  # DeepSpeed's key: the logger's level from initialize on
            set_log_level(config.log_level)
        self.env = env
        self.mesh = mesh
        self.policy = policy
        self.state = state
        self.optimizer = optimizer
        register_owner(module.parameters(), self)  # how deepspeed.utils.safe_get_full_grad(param) & co. find us
        if optimizer is not None:  # DeepSpeed's fp16/ZeRO optimizers' flag, read by DeepSpeed-Chat: the last step
            optimizer.overflow = False  # type: ignore[attr-defined]  # overflowed and was skipped (see _model_step)
        self.client_optimizer = client_optimizer
        self.lr_scheduler = lr_scheduler
        self.loss_scaler = loss_scaler
        self.param_names = param_names
        self.training_dataloader = training_dataloader
        self.compressor = compressor
        self.timers = WallClockTimers(config.wall_clock_breakdown,
                                      torch.cuda.synchronize if env.device.type == "cuda" else None)
        self.monitor = ScalarWriters.from_config(config.tensorboard, config.csv_monitor, config.wandb, rank=env.rank)
        if config.comms_logger.enabled:  # the process's collectives log, as DeepSpeed's engine configures it
            COMMS_LOGGER.configure(config.comms_logger)
        if PINNED.allocations:  # offload pinned host buffers while the state was built: say how much (memlock)
            PINNED.log_summary("engine built")
        self.reporter = StepReporter(config.steps_per_print, env.rank, self.monitor, self.timers)
        self.tput_timer = ThroughputTimer(config.train_batch_size,
                                          synchronize=torch.cuda.synchronize if env.device.type == "cuda" else None)
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._consecutive_skips = 0
        self._step_applied = False
        self._last_grad_norm: float | None = None
        self._window_loss: torch.Tensor | None = None
        self._data_iterator: Iterator | None = None
        self._epoch = 0
        self._post_step_hooks: list[Callable[["EngineCore"], None]] = []
        self._offloaded = {}  # offload_states: kind -> its move (typed in engine_offload_states.py)
        self._pinned_host = {}  # kind -> page-locked host buffers kept for the next offload_states
        for extend in _ENGINE_EXTENSIONS:
            extend(self)

    def register_post_step_hook(self, hook: Callable[["EngineCore"], None]) -> Callable[[], None]:
        """Call ``hook(engine)`` after every optimizer step; returns a function that removes it."""
        self._post_step_hooks.append(hook)
        return lambda: self._post_step_hooks.remove(hook)

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch size by changing the accumulation steps (the micro-batch size stays),
        as DeepSpeed's method; call it between optimizer steps."""
        per_step = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if not isinstance(train_batch_size, int) or train_batch_size < per_step or train_batch_size % per_step:
            raise ValueError(f"set_train_batch_size({train_batch_size!r}): must be a positive multiple of "
                             f"train_micro_batch_size_per_gpu x data-parallel size = {per_step}")
        if self.micro_steps % self.gradient_accumulation_steps():
            raise RuntimeError("set_train_batch_size() in the middle of an optimizer step; call it after engine.step() "
                               "at an accumulation boundary")
        gas = train_batch_size // per_step
        self._config = self._config.model_copy(update={"train_batch_size": train_batch_size,
                                                       "gradient_accumulation_steps": gas})
        self.micro_steps = self.global_steps * gas
        self.tput_timer.batch_size = train_batch_size

    def _take_model_step(self, lr_kwargs: dict) -> None:
        self._require_on_device("step()")
        with phase("step"):  # a profiler range over the whole optimizer step
            self._model_step(lr_kwargs)

    def _model_step(self, lr_kwargs: dict) -> None:
        grads = self.state.step_grads()
        # The lr this step trains with, read before the scheduler moves on: the step report (console line,
        # TensorBoard / CSV / W&B) shows it against this step (DeepSpeed logs get_lr() after the scheduler
        # step, i.e. the next step's lr, which hides the warm-up's first value).
        applied_lrs = self.get_lr()
        scale = self.loss_scaler.loss_scale
        scaled_norm = self.state.grad_norm(grads)
        # the global norm: every rank decides alike; bf16.check_grad_overflow false applies even a non-finite step
        overflow = not math.isfinite(scaled_norm) and not self._applies_non_finite_steps()
        if overflow:
            self._last_grad_norm = scaled_norm
            self._skip_non_finite_step(scaled_norm, scale)
        else:
            self._consecutive_skips = 0
            norm = scaled_norm / scale
            self._last_grad_norm = norm
            coefficient = 1.0 / scale
            clip = resolved(self._config.gradient_clipping, "gradient_clipping")
            if clip > 0:
                coefficient *= min(1.0, clip / (norm + 1e-6))
            self.state.step(self._stepping_optimizer(), grads, coefficient)
            if getattr(self.optimizer, "takes_local_gradients", False):  # OneBitAdam after its warm-up
                self.state.use_local_gradients(True)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**lr_kwargs)
        scale_before = self.loss_scaler.loss_scale
        self.loss_scaler.update_scale(overflow)
        self._step_applied = not overflow
        if self.optimizer is not None:
            self.optimizer.overflow = overflow  # type: ignore[attr-defined]  # DeepSpeed's flag (see __init__)
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        if self.compressor is not None:
            self._advance_compression(self.compressor, overflow, scale_before)
        self._report(overflow, applied_lrs[0] if applied_lrs else 0.0)
        self.zero_grad()
        for hook in self._post_step_hooks:
            hook(self)

    def _applies_non_finite_steps(self) -> bool:
        bf16 = self._config.bf16
        return bf16.enabled is True and resolved(bf16.check_grad_overflow, "bf16.check_grad_overflow") is False

    def _stepping_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError("an optimizer step needs an optimizer: pass initialize(optimizer=...) or add an "
                               "'optimizer' block to the config")
        return self.optimizer

    def _skip_non_finite_step(self, norm: float, scale: float) -> None:
        """A non-finite gradient norm skips the step, in every precision. An fp16 overflow is routine while the
        dynamic loss scale settles (the step report counts them); in bf16 / fp32 no scale will fix it, so each
        skip is a warning naming the first non-finite parameter. ``max_consecutive_skipped_steps`` in a row, or
        an overflow at the minimum loss scale, stops the run."""
        self.skipped_steps += 1
        self._consecutive_skips += 1
        limit = resolved(self._config.max_consecutive_skipped_steps, "max_consecutive_skipped_steps")
        at_minimum = isinstance(self.loss_scaler, DynamicLossScaler) and self.loss_scaler.at_minimum
        routine = self.fp16_enabled() and self.loss_scaler.dynamic
        if routine and not at_minimum and self._consecutive_skips < limit:
            return
        name = self.state.first_nonfinite_param(self.param_names)  # (a collective: every rank is here)
        loss = self._window_loss.item() if self._window_loss is not None else None
        cause = (f"the gradient norm is {norm} in {self.policy.name}; the first parameter with a non-finite gradient "
                 f"is '{name}'" + (f", and this rank's loss is {loss}" if loss is not None and not math.isfinite(loss)
                                   else ""))
        if at_minimum:
            raise LossScaleError(f"fp16 gradient overflow at the minimum loss scale {scale:g}: {cause}. Lower the "
                                 "learning rate, use bf16, or lower fp16.min_loss_scale")
        if self._consecutive_skips >= limit:
            first = self.global_steps - self._consecutive_skips + 2
            raise NonFiniteError(f"{self._consecutive_skips} optimizer steps in a row (steps {first}-"
                                 f"{self.global_steps + 1}) were skipped: {cause}. Check the data and the learning "
                                 "rate (max_consecutive_skipped_steps sets how many skips in a row stop the run)")
        log_rank0("step %d skipped: %s", self.global_steps + 1, cause, rank=self.global_rank, level=logging.WARNING)

    def _advance_compression(self, compressor: TopKCompressor, overflow: bool, scale_before: float) -> None:
        """Residuals follow the loss scale (they hold scaled gradients) and are dropped after an overflow;
        the achieved compression is logged with the step report."""
        if overflow:
            compressor.drop_residuals()
        elif self.loss_scaler.loss_scale != scale_before:
            compressor.rescale_residuals(self.loss_scaler.loss_scale / scale_before)
        compressor.step = self.global_steps
        if self.global_steps % self.steps_per_print() == 0 and compressor.stats.dense_bytes:
            stats = compressor.stats
            log_rank0("gradient compression: sent %s of %s gradient bytes (%.2f%%) over the last %d step(s)",
                      f"{stats.sent_bytes:,}", f"{stats.dense_bytes:,}", 100 * stats.ratio, self.steps_per_print(),
                      rank=self.global_rank)
            compressor.stats = CompressionStats()

    def _report(self, overflow: bool, lr: float) -> None:
        """Record the finished step with ``lr``, the learning rate it trained with."""
        loss = None
        if self._window_loss is not None:
            loss = self._window_loss.item() / self.gradient_accumulation_steps()
            self._window_loss = None
        self.reporter.record(step=self.global_steps, loss=loss, lr=lr,
                             grad_norm=self._last_grad_norm, skipped=overflow,
                             loss_scale=self.loss_scaler.loss_scale if self.fp16_enabled() else None,
                             samples=self.train_batch_size())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients (the fp32 buckets and any ``.grad`` left on parameters or masters)."""
        del set_to_none
        self.state.zero_grad()

    # ---- data ----------------------------------------------------------------------------
    def _next_default_batch(self) -> Any:
        if self.training_dataloader is None:
            raise ValueError("train_batch() without data_iter needs initialize(training_data=...)")
        while True:
            if self._data_iterator is None:
                sampler = self.training_dataloader.sampler
                if hasattr(sampler, "set_epoch"):
                    sampler.set_epoch(self._epoch)
                self._data_iterator = iter(self.training_dataloader)
            try:
                return next(self._data_iterator)
            except StopIteration:
                self._data_iterator = None
                self._epoch += 1

    def set_data_post_process_func(self, post_process_func: Callable[[Any, dict], Any] | None) -> None:
        """Apply ``post_process_func(batch, sampler_state)`` to every batch of the engine's data loader."""
        if self.training_dataloader is not None:
            self.training_dataloader.post_process_func = post_process_func

    # ---- checkpoints ---------------------------------------------------------------------
    def train_state(self) -> TrainState:
        """What a checkpoint saves and restores (``checkpoint/train_state.py``); ``apply_train_state`` takes back
        what a load restored."""
        return TrainState(
            module=self.module, stage=self.state, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
            loss_scaler=self.loss_scaler, param_names=self.param_names, mesh=self.mesh, rank=self.global_rank,
            world_size=self.world_size, device=self.device, precision=self.policy.name,
            mixed_precision=self.policy.mixed, zero_stage=self.zero_optimization_stage(),
            gradient_accumulation_steps=self.gradient_accumulation_steps(), config=self.config,
            settings=self._checkpoint_settings(),
            counters=Counters(self.global_steps, self.global_samples, self.micro_steps, self.skipped_steps),
            curriculum=self.curriculum_state(), compressor=self.compressor,
            sparse_tensor_module_names=sorted(self.sparse_tensor_module_names))

    def _checkpoint_settings(self) -> CheckpointSettings:
        section = self._config.checkpoint
        keep_last = None if section.keep_last is None else resolved(section.keep_last, "checkpoint.keep_last")
        return CheckpointSettings(tag_validation=section.tag_validation, keep_last=keep_last)

    def apply_train_state(self, train: TrainState) -> None:
        """Take the counters and the curriculum's position a load restored."""
        counters = train.counters
        self.global_steps, self.global_samples = counters.global_steps, counters.global_samples
        self.micro_steps, self.skipped_steps = counters.micro_steps, counters.skipped_steps
        self.load_curriculum_state(train.curriculum)
        self.sparse_tensor_module_names = set(train.sparse_tensor_module_names)

    def _checkpoint_dir(self, given: str | None, method: str) -> str:
        if given is not None and str(given) != "":
            return str(given)
        if self._config.checkpoint.save_dir:
            return self._config.checkpoint.save_dir
        raise ValueError(f"engine.{method}() needs a directory: pass one, or set checkpoint.save_dir in the config")

    @EngineGuards.method
    def save_checkpoint(self, save_dir: str | None = None, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """``save_dir`` defaults to ``checkpoint.save_dir``. ``exclude_frozen_parameters`` (LoRA / prefix tuning):
        save the trainable weights and a fingerprint of the frozen base instead of the base; loading checks it."""
        self._require_on_device("save_checkpoint()")
        comm.guard_point("save_checkpoint", self.global_steps, self.micro_steps)
        save_engine_checkpoint(self.train_state(), self._checkpoint_dir(save_dir, "save_checkpoint"), tag,
                               client_state or {}, save_latest, exclude_frozen_parameters)
        return True

    @EngineGuards.method
    def load_checkpoint(self, load_dir: str | None = None, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, dict | None]:
        """``load_dir`` defaults to ``checkpoint.save_dir``; any saved layout loads at this one."""
        load_dir = self._checkpoint_dir(load_dir, "load_checkpoint")
        self._require_on_device("load_checkpoint()")
        comm.guard_point("load_checkpoint", self.global_steps, self.micro_steps)
        train = self.train_state()
        loaded = load_engine_checkpoint(train, load_dir, tag, load_module_strict=load_module_strict,
                                        load_optimizer_states=load_optimizer_states,
                                        load_lr_scheduler_states=load_lr_scheduler_states,
                                        load_module_only=load_module_only)
        self.apply_train_state(train)
        return loaded

    @EngineGuards.method
    def resume_newest_checkpoint(self, save_dir: str | None = None) -> tuple[str | None, dict | None]:
        """Load the newest complete, verified checkpoint in ``save_dir`` (default ``checkpoint.save_dir``),
        falling back to older ones; ``(None, None)`` when there is none (``checkpoint.auto_resume``)."""
        save_dir = self._checkpoint_dir(save_dir, "resume_newest_checkpoint")
        self._require_on_device("resume_newest_checkpoint()")
        comm.guard_point("resume_newest_checkpoint", self.global_steps, self.micro_steps)
        train = self.train_state()
        loaded = load_newest_checkpoint(train, save_dir)
        self.apply_train_state(train)
        return loaded

    @EngineGuards.method
    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Rank 0 writes the whole model's weights in the training dtype (DeepSpeed's method).

        At stage 3 the units are gathered one at a time; a ``.safetensors`` file name streams them
        to disk, so rank 0 never holds more than the largest unit (other names are ``torch.save``d).
        """
        self._require_on_device("save_16bit_model()", FORWARD_NEEDS)
        comm.guard_point("save_16bit_model", self.global_steps, self.micro_steps)
        units = self.state.units
        gather = self._config.zero_optimization.stage3_gather_16bit_weights_on_model_save
        if self.state.partitions_weights and not gather:
            log_rank0("save_16bit_model: nothing saved: ZeRO stage 3 keeps the parameters partitioned; set "
                      "zero_optimization.stage3_gather_16bit_weights_on_model_save to true to gather them "
                      "(save_checkpoint saves the shards)", rank=self.global_rank)
            return False
        save_consolidated(self.module, units, Path(save_dir) / save_filename, rank=self.global_rank,
                          exclude_frozen=exclude_frozen_parameters, tp_group=self.mesh.group("tp"))
        comm.barrier()
        return True

    @EngineGuards.method
    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """The whole state dict on rank 0 (empty on the others); every rank must call it."""
        self._require_on_device("_zero3_consolidated_16bit_state_dict()", FORWARD_NEEDS)
        items = iter_consolidated(self.module, self.state.units,
                                  exclude_frozen=exclude_frozen_parameters, tp_group=self.mesh.group("tp"))
        gathered = {key: tensor.clone().cpu() for key, tensor in items}
        return gathered if self.global_rank == 0 else {}

    def destroy(self) -> None:
        """Release hooks, writers and guards (DeepSpeed's ``engine.destroy()``); the collective guard's last
        exchange is checked here rather than left in flight at exit."""
        self.guards.close()
        self.state.remove_hooks()
        self.monitor.close()
