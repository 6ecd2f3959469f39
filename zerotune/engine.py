"""The training engine: forward / backward / step, with DeepSpeed's semantics and accessors.

One optimizer step spans ``gradient_accumulation_steps`` micro-steps. Each micro-step the
script calls ``engine(batch)``, ``engine.backward(loss)`` and ``engine.step()``; only the last
one (the accumulation boundary) communicates and updates weights: the gradient sync is finished
(buckets were launched during backward), then the step core (``engine_core.py``) takes the
optimizer step.

The engine is assembled by ``zerotune.initialize``; it never reads the config file itself.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from zerotune.distributed import comm
from zerotune.distributed.engine_guards import EngineGuards
from zerotune.engine_batches import check_batch_not_empty, loss_from_output, map_tensors
from zerotune.engine_compile import EngineCompile
from zerotune.engine_core import EngineCore
from zerotune.engine_flops import EngineFlops
from zerotune.engine_offload_states import BACKWARD_NEEDS, FORWARD_NEEDS
from zerotune.parallel.sequence.batch import sequence_parallel_forward
from zerotune.parallel.tensor.consistency import check_same_inputs


class NoSyncError(RuntimeError, AssertionError):
    """A misuse of ``engine.no_sync()``; also an AssertionError, which DeepSpeed raises (and its tests expect)."""


class Engine(EngineCompile, EngineFlops, EngineCore):
    """Wraps a model for data-parallel training: DeepSpeed's micro-step API over the step core."""

    def __init__(self, **core: Any) -> None:
        super().__init__(**core)
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary
        self._inside_no_sync = False
        # Stage 3 gathers parameters and model parallelism exchanges activations in the forward; otherwise a
        # forward is local (a rank may evaluate alone) and the collective guard leaves it out.
        self._forward_communicates = (self.state.partitions_weights or self.mesh.size("tp") > 1
                                      or self.mesh.size("sp") > 1)
        # Every rank of a tp group must see the same batch: checked at the first forward (tensor/consistency.py)
        self._tp_inputs_unchecked = self.mesh.size("tp") > 1
        self._step_calls = 0  # engine.step() calls: the micro-steps this engine has run (never rewound)
        self._guarded_at = -1  # one collective-guard point per micro-step, before its first collective
        self._flops_setup()  # the config's flops_profiler block (engine_flops.py)

    # ---- one micro-step ------------------------------------------------------------------
    @EngineGuards.method
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._require_on_device("forward()", FORWARD_NEEDS)
        check_batch_not_empty((args, kwargs), self.global_steps + 1, self.micro_steps, self.global_rank)
        if self._tp_inputs_unchecked:
            check_same_inputs(args, kwargs, self.mesh.group("tp"))
            self._tp_inputs_unchecked = False
        args, kwargs = self._curriculum_inputs(args, kwargs)  # curriculum_learning (engine_curriculum.py)
        if self.policy.mixed:
            dtype = self.policy.param_dtype

            def cast(t: torch.Tensor) -> torch.Tensor:
                return t.to(dtype) if t.is_floating_point() else t

            args, kwargs = map_tensors(args, cast), map_tensors(kwargs, cast)
        if self._forward_communicates:
            if torch.is_grad_enabled():
                self._guard_point("forward")
            else:  # an evaluation forward: its own point (it may come between a micro-step's phases)
                comm.guard_point("forward (no grad)", self.global_steps, self.micro_steps)
        if self.training and torch.is_grad_enabled():
            self.tput_timer.start()
        with self.timers("forward"), self._flops_forward():
            if self.mesh.size("sp") > 1:
                return sequence_parallel_forward(self.module, self.mesh.group("sp"), args, kwargs)
            return self.module(*args, **kwargs)

    @EngineGuards.method
    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss / GAS * loss_scale``; gradients accumulate in fp32 buckets.

        Returns the loss as it was differentiated before the loss scale: divided by the
        accumulation steps when ``scale_wrt_gas`` (DeepSpeed's return value)."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"engine.backward expects a scalar loss tensor, got {type(loss).__name__}")
        self._require_on_device("backward()", BACKWARD_NEEDS)
        detached = loss.detach().float()
        if not scale_wrt_gas:  # the caller already divided (HF Trainer): the window mean needs the whole loss
            detached = detached * self.gradient_accumulation_steps()
        self._window_loss = detached if self._window_loss is None else self._window_loss + detached
        gas_divisor = self.gradient_accumulation_steps() if scale_wrt_gas else 1
        communicate = self.is_gradient_accumulation_boundary() and not self._inside_no_sync
        if communicate or self._forward_communicates or self.state.reduces_every_backward:
            self._guard_point("backward")
        self.state.begin_micro_step(communicate)
        with self.timers("backward"), self._flops_phase("backward"):
            (loss.float() * (self.loss_scaler.loss_scale / gas_divisor)).backward(retain_graph=retain_graph)
        return loss / gas_divisor

    @EngineGuards.method
    def step(self, lr_kwargs: dict | None = None) -> None:
        """Act at the accumulation boundary; a no-op (besides counting) on other micro-steps."""
        if self._inside_no_sync:
            raise NoSyncError("It is illegal to call Engine.step() inside no_sync context manager: leave the "
                              "engine.no_sync() block first (the gradients accumulated there are reduced by the next "
                              "backward outside it)")
        self._require_on_device("step()")
        boundary = self.is_gradient_accumulation_boundary()
        if boundary and self.optimizer is None:
            raise RuntimeError("engine.step() needs an optimizer: pass initialize(optimizer=...) or add an "
                               "'optimizer' block to the config")
        if boundary:
            self._guard_point("optimizer step")
            with self.timers("reduce"):
                self.state.finish()
            with self.timers("step"), self._flops_phase("step"):
                self._take_model_step(lr_kwargs or {})
            self._flops_report()  # the step flops_profiler.profile_step measured: its profile (engine_flops.py)
        self.tput_timer.stop(global_step=boundary)
        self.micro_steps += 1
        self._step_calls += 1
        self._boundary_override = None

    def _guard_point(self, phase: str) -> None:
        """The micro-step's first phase that communicates meets the other ranks at a collective-guard point;
        its later phases follow from it (a divergence between them is caught by the stalled ranks' notes,
        ``guard_stall.py``). One point per micro-step, or per few where the exchanges cost more
        than 1% of the time (``CollectiveGuard.adapt``)."""
        if self._guarded_at != self._step_calls:
            self._guarded_at = self._step_calls
            # (the interval is the same on every rank: ``CollectiveGuard.adapt``)
            if self._step_calls % self.guards.guard.interval == 0:
                comm.guard_point(phase, self.global_steps, self.micro_steps)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether this micro-step ends an optimizer step: every GAS-th one, unless the script said
        otherwise with ``set_gradient_accumulation_boundary`` (as HF accelerate does)."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Say whether the coming backward/step ends an optimizer step (DeepSpeed's override; set it
        before each micro-step's backward, True on the last one)."""
        self._boundary_override = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communication (stages 0/1;
        stages 2/3 reduce gradients to their owners as they are produced, so they refuse, as DeepSpeed).
        The next backward outside the block reduces everything accumulated."""
        if self.state.reduces_every_backward:
            raise NoSyncError(f"engine.no_sync(): no_sync context manager is incompatible with ZeRO stage "
                              f"{self.zero_optimization_stage()}, which partitions gradients during backward; use "
                              "stage 0 or 1")
        if self._inside_no_sync:
            raise NoSyncError("no_sync context manager reentry is unsupported: engine.no_sync() blocks cannot be "
                              "nested")
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    # ---- whole batches -------------------------------------------------------------------
    def _run_batch(self, batch: Any) -> Any:
        batch = map_tensors(batch, lambda t: t.to(self.device))
        if isinstance(batch, dict):
            return self(**batch)
        if isinstance(batch, (list, tuple)):
            return self(*batch)
        return self(batch)

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", num_micro_batches: int | None = None) -> Any:
        """Forward ``num_micro_batches`` (default: the accumulation steps) batches without gradients and
        return the loss averaged over them and over the data-parallel ranks (DeepSpeed's ``eval_batch``);
        ``reduce_output=None`` returns the per-micro-batch losses; ``return_logits`` adds the last logits."""
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch(reduce_output={reduce_output!r}): expected 'avg' or None")
        was_training = self.training
        self.eval()
        try:
            outputs = [self._run_batch(next(data_iter))
                       for _ in range(num_micro_batches or self.gradient_accumulation_steps())]
        finally:
            self.train(was_training)
        losses = [loss_from_output(o).detach().float() for o in outputs] if compute_loss else []
        result: Any = losses
        if compute_loss and reduce_output == "avg":
            result = torch.stack(losses).mean()
            comm.all_reduce(result, self.mesh.group("dp"))
            result /= self.dp_world_size
        if return_logits:
            last = outputs[-1]
            logits = last.get("logits") if isinstance(last, dict) else getattr(last, "logits", last)
            return result, logits
        return result

    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """Run one full optimizer step (GAS micro-batches) and return the mean loss."""
        total = torch.zeros((), device=self.device)
        for _ in range(self.gradient_accumulation_steps()):
            batch = next(data_iter) if data_iter is not None else self._next_default_batch()
            loss = loss_from_output(self._run_batch(batch))
            self.backward(loss)
            self.step()
            total += loss.detach().float()
        return total / self.gradient_accumulation_steps()
