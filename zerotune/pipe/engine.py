"""``PipelineEngine``: DeepSpeed's ``train_batch`` / ``eval_batch`` over pipeline stages.

One ``train_batch`` = one optimizer step = ``gradient_accumulation_steps`` micro-batches: the engine
executes the configured schedule's instructions (``steps.py``; ``_BatchRun`` below), in order. The
first stage loads the inputs, the last the labels (``batch_fn`` splits a micro-batch) and computes
``loss_fn``; the others receive the previous stage's outputs (``p2p.py``). The last stage's backward
is of ``loss * loss_scale / GAS``; the others receive their outputs' gradient, and all but the first
send their inputs' gradient back. ``eval_batch`` runs an ``InferenceSchedule`` the same way.

Why not ``torch.distributed.pipelining``'s schedules: they run each micro-batch's backward
themselves and rescale the accumulated gradients afterwards (``scale_grads``), while zerotune's
gradient path needs to act around each backward -- the boundary flag that lets ZeRO's bucketed
all-reduce / reduce-scatter overlap the *last* micro-batch's backward, the fp16 loss scale and the
1/GAS factor applied to the loss (not the gradients), the tied-weight reduction between stages
before ZeRO-1's reduce-scatter -- and its stages need the whole model on one device per stage to
infer shapes with a meta forward, where ours learn shapes from a small header per message.

After the last backward the step is the data-parallel engine's, with the gradient norm summed
over the pipeline (and tensor) ranks. Sends are asynchronous and receives blocking; every stage's
instructions are laid out on one clock (``schedule.py``), so this cannot deadlock. The batch loss is broadcast
from the last stage and averaged over the data-parallel ranks: every rank returns it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

import torch
import torch.distributed as dist

from zerotune.distributed import comm
from zerotune.distributed.engine_guards import EngineGuards
from zerotune.engine_batches import check_batch_not_empty, map_tensors
from zerotune.engine_core import EngineCore
from zerotune.engine_offload_states import FORWARD_NEEDS
from zerotune.parallel.activation_checkpointing import checkpoint as activation_checkpoint
from zerotune.parallel.activation_checkpointing import non_reentrant_checkpoint
from zerotune.pipe.export import save_whole_model
from zerotune.pipe.instructions import (
    BackwardPass,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)
from zerotune.pipe.module import PipelineModule
from zerotune.pipe.p2p import ACTIVATION_TAG, GRADIENT_TAG, as_tuple, recv_tensors, send_tensors
from zerotune.pipe.steps import InferenceSchedule, PipeSchedule, train_schedule
from zerotune.zero.contracts import TiedWeight


def _schedule_only(method: str) -> str:
    return (f"engine.{method}() is not available with pipeline parallelism: use engine.train_batch(data_iter) / "
            "engine.eval_batch(data_iter) (the pipeline schedule runs forward, backward and step)")


def default_batch_fn(batch: Any) -> tuple[Any, Any]:
    """DeepSpeed's batch format for pipelines: ``(inputs, labels)``."""
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError("a pipeline batch must be a pair (inputs, labels) (DeepSpeed's format); set "
                    f"engine.set_batch_fn(fn) to convert your batches, got {type(batch).__name__}")


ModelBuilder = Callable[..., Any]
"""``builder(model, **kwargs) -> engine``: what ``PipelineEngine(model, **kwargs)`` calls (``set_model_builder``)."""
_model_builder: ModelBuilder | None = None


def set_model_builder(builder: ModelBuilder) -> None:
    """Let ``PipelineEngine(model, **kwargs)`` build an engine from a model: the DeepSpeed spelling, installed by
    ``zerotune/compat/spellings.py`` over ``zerotune.initialize`` (the core does not import ``initialize``)."""
    global _model_builder
    _model_builder = builder


class _BuiltFromAModel(type(EngineCore)):  # type: ignore[misc]
    """A call with a model as its first argument goes to the registered builder; the engine's own construction
    (``initialize``'s) passes keyword arguments only."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], torch.nn.Module):
            if _model_builder is None:
                raise TypeError("PipelineEngine(model, ...) builds through zerotune.initialize: import zerotune first")
            if len(args) > 1:
                raise TypeError("PipelineEngine(model, config=...): pass everything but the model by keyword")
            engine = _model_builder(args[0], **kwargs)
            if not isinstance(engine, cls):
                raise ValueError("PipelineEngine(model, config=...) needs a pipelined model: a PipelineModule, or a "
                                 "Hugging Face model with \"pipeline\": {\"stages\": N} (N > 1) in the config")
            return engine
        return super().__call__(*args, **kwargs)


class PipelineEngine(EngineCore, metaclass=_BuiltFromAModel):
    """The engine of a ``PipelineModule``: the step core (``engine_core.py``) driven by a pipeline schedule; it has
    no micro-step API (forward / backward / step), as DeepSpeed's."""

    def __init__(self, *, module: PipelineModule, tie_groups: dict[str, dist.ProcessGroup],
                 batch_fn: Callable | None = None, **kwargs: Any) -> None:
        super().__init__(module=module, **kwargs)
        self.pipe = module
        self.tie_groups = tie_groups
        self.batch_fn = batch_fn or default_batch_fn
        self.stage_id = self.mesh.rank("pp")
        self.num_stages = self.mesh.size("pp")
        ranks = dist.get_process_group_ranks(self.mesh.group("pp")) if self.num_stages > 1 else [dist.get_rank()]
        self._prev = ranks[self.stage_id - 1] if self.stage_id > 0 else None
        self._next = ranks[self.stage_id + 1] if self.stage_id < self.num_stages - 1 else None
        # (kind, micro-batch, start, end) of each action's computation in the last train_batch (perf_counter: one
        # clock for all processes of a machine), excluding waits for the neighbours -- the bubble benchmark reads it
        self.timeline: list[tuple[str, int, float, float]] = []
        self.data_iterator: Iterator | None = None  # set_dataiterator's

    def _neighbour(self, which: Literal["previous", "next"]) -> int:
        """The global rank of the previous or next stage (the first / last stage has none)."""
        rank = self._prev if which == "previous" else self._next
        if rank is None:
            raise RuntimeError(f"pipeline stage {self.stage_id} of {self.num_stages} has no {which} stage")
        return rank

    # ---- DeepSpeed's pipeline accessors --------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_batch_fn(self, fn: Callable) -> None:
        self.batch_fn = fn

    def set_dataiterator(self, iterator: Iterator) -> None:
        """The iterator ``train_batch()`` / ``eval_batch()`` read when given none (DeepSpeed's; it takes the place
        of the loader of ``initialize(training_data=...)``). Only the first and last stages read data."""
        self.data_iterator = iterator

    def set_dataloader(self, loader: Iterable) -> None:
        """Read ``loader`` (one pass, as DeepSpeed's) in ``train_batch()`` / ``eval_batch()`` given no iterator."""
        self.set_dataiterator(iter(loader))

    def _reentrant_activation_checkpointing(self) -> bool:
        """DeepSpeed's question: does the stage checkpoint with a function other than ``non_reentrant_checkpoint``
        (DeepSpeed's reentrant ``checkpoint``, or a script's own)? Asked of the module, whose interval and function
        forward reads, so ``set_checkpoint_interval`` after ``initialize`` is seen."""
        return (self.pipe.activation_checkpoint_interval > 0
                and self.pipe.activation_checkpoint_func is not non_reentrant_checkpoint)

    def _first_inputs_need_grad(self) -> bool:
        """A reentrant checkpoint cuts its first block off from autograd unless the block's inputs require grad.
        zerotune's ``checkpoint`` is non-reentrant under DeepSpeed's reentrant name, so only a script's own
        function needs them marked (marking for zerotune's would compute input gradients nobody reads)."""
        return (self._reentrant_activation_checkpointing() and torch.is_grad_enabled()
                and self.pipe.activation_checkpoint_func is not activation_checkpoint)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(_schedule_only("forward"))

    def __getattr__(self, name: str) -> Any:
        if name in ("backward", "step"):  # a DeepSpeed script written for the data-parallel engine
            raise AttributeError(_schedule_only(name))
        return super().__getattr__(name)

    # ---- one batch -------------------------------------------------------------------------
    @EngineGuards.method
    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One optimizer step over GAS micro-batches: the configured schedule's instructions (``steps.py``),
        run in order; the mean loss on every rank."""
        self._require_on_device("train_batch()")
        comm.guard_point("train_batch", self.global_steps, self.micro_steps)
        self.pipe.train()
        micro_batches = self.gradient_accumulation_steps()
        self.timeline = []
        run = _BatchRun(self, data_iter, micro_batches)
        run.execute(train_schedule(self._config.pipeline.schedule, micro_batches, self.num_stages, self.stage_id))
        self.micro_steps += micro_batches
        if run.mean_loss is None:
            raise RuntimeError("the pipeline schedule ended without an OptimizerStep")
        return run.mean_loss

    @EngineGuards.method
    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator | None = None, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str = "avg", bcast_loss: bool = True, num_micro_batches: int | None = None
                   ) -> torch.Tensor:
        """Forward-only over GAS micro-batches (or ``num_micro_batches``), an ``InferenceSchedule``'s
        instructions: the mean loss on every rank."""
        if return_logits or not compute_loss or reduce_output != "avg":
            raise NotImplementedError("eval_batch supports compute_loss=True, reduce_output='avg' and no logits")
        self._require_on_device("eval_batch()", FORWARD_NEEDS)
        comm.guard_point("eval_batch", self.global_steps, self.micro_steps)
        was_training = self.pipe.training
        self.pipe.eval()
        micro_batches = num_micro_batches or self.gradient_accumulation_steps()
        run = _BatchRun(self, data_iter, micro_batches, training=False)
        run.execute(InferenceSchedule(micro_batches, self.num_stages, self.stage_id))
        run.wait_for_sends()
        self.pipe.train(was_training)
        return self._broadcast_loss(run.losses, micro_batches)

    @EngineGuards.method
    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Rank 0 writes the whole model, every stage's layers (tensor-parallel shards joined), under the
        Hugging Face model's own names when it was split from one. Every rank must call it."""
        comm.guard_point("save_16bit_model", self.global_steps, self.micro_steps)
        save_whole_model(self.pipe, self.mesh, self.global_rank, Path(save_dir) / save_filename,
                         exclude_frozen_parameters)
        return True

    # ---- pieces ----------------------------------------------------------------------------
    def _loss(self, outputs: Any, labels: Any) -> torch.Tensor:
        if self.pipe.loss_fn is None:
            if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
                return outputs
            raise ValueError("PipelineModule(loss_fn=...) is needed: the last stage's output is not a scalar loss")
        return self.pipe.loss_fn(outputs, labels)

    def _backward(self, outputs: Any, grads: tuple[torch.Tensor, ...] | None) -> None:
        """The loss's backward on the last stage; elsewhere the outputs' backward with the received gradients."""
        if grads is None:
            scale = self.loss_scaler.loss_scale / self.gradient_accumulation_steps()
            (outputs.float() * scale).backward()
            return
        needing = [t for t in as_tuple(outputs) if t.requires_grad]
        if len(needing) != len(grads):
            raise RuntimeError(f"pipeline stage {self.stage_id}: {len(grads)} gradient(s) received for "
                               f"{len(needing)} output(s) that need one")
        torch.autograd.backward(needing, grads)

    def _broadcast_loss(self, losses: list[torch.Tensor], micro_batches: int) -> torch.Tensor:
        """The batch's mean loss, averaged over the data-parallel ranks (as DeepSpeed's), on every rank."""
        total = torch.stack(losses).sum() / micro_batches if losses else torch.zeros((), device=self.device)
        total = total.to(self.device, torch.float32)
        comm.broadcast(total, self.num_stages - 1, self.mesh.group("pp"))
        comm.all_reduce(total, self.mesh.group("dp"))
        return total / self.mesh.size("dp")


class _BatchRun:
    """One batch's instructions on this stage, and what they leave between each other: the buffers' contents
    (slots keyed by ``buffer_id``; a schedule that reuses a busy one fails, naming it), the losses, the
    pending sends and the tied weights handed to the reduction."""

    def __init__(self, engine: PipelineEngine, data_iter: Iterator | None, micro_batches: int,
                 training: bool = True) -> None:
        self.engine, self.micro_batches, self.training = engine, micro_batches, training
        self.data_iter = data_iter if data_iter is not None else engine.data_iterator
        self.inputs: dict[int, tuple] = {}
        self.labels: dict[int, Any] = {}
        self.outputs: dict[int, Any] = {}
        self.output_grads: dict[int, tuple] = {}
        self.input_grads: dict[int, tuple] = {}
        self.micro_batch: dict[int, int] = {}  # the micro-batch in each buffer (the engine's timeline names it)
        self.forwards = self.backwards = 0
        self.losses: list[torch.Tensor] = []
        self.sends: list[comm.Handle] = []
        self.ties: list[TiedWeight] = []
        self.reduced = False
        self.mean_loss: torch.Tensor | None = None
        self._handlers: dict[type, Callable[[Any], None]] = {
            LoadMicroBatch: self.load, RecvActivation: self.recv_activation, ForwardPass: self.forward,
            SendActivation: self.send_activation, RecvGrad: self.recv_grad, BackwardPass: self.backward,
            SendGrad: self.send_grad, ReduceTiedGrads: self.reduce_tied_grads, ReduceGrads: self.reduce_grads,
            OptimizerStep: self.optimizer_step}

    def execute(self, schedule: PipeSchedule) -> None:
        for step in schedule:
            for instruction in step:
                handler = next((self._handlers[k] for k in type(instruction).__mro__ if k in self._handlers), None)
                if handler is None:
                    raise TypeError(f"the pipeline engine has no implementation of {instruction!r}")
                handler(instruction)

    def wait_for_sends(self) -> None:
        for handle in self.sends:
            handle.wait()
        self.sends = []

    def _put(self, slots: dict[int, Any], buffer: int, value: Any, what: str) -> None:
        if buffer in slots:
            raise RuntimeError(f"pipeline stage {self.engine.stage_id}: buffer {buffer} still holds {what} of an "
                               "earlier micro-batch; the schedule reuses it too early")
        slots[buffer] = value

    def _take(self, slots: dict[int, Any], buffer: int, what: str, instruction: PipeInstruction) -> Any:
        if buffer not in slots:
            raise RuntimeError(f"pipeline stage {self.engine.stage_id}: {instruction!r} finds no {what} in buffer "
                               f"{buffer}; the schedule misses the instruction that provides it")
        return slots.pop(buffer)

    # ---- the instructions ------------------------------------------------------------------
    def load(self, instruction: LoadMicroBatch) -> None:
        """The next micro-batch: the inputs on the first stage, the labels on the last."""
        engine, buffer = self.engine, instruction.buffer_id
        if not (engine.is_first_stage() or engine.is_last_stage()):
            return  # (nothing of a micro-batch is read between the ends, as DeepSpeed's)
        batch = next(self.data_iter) if self.data_iter is not None else engine._next_default_batch()
        check_batch_not_empty(batch, engine.global_steps + 1, engine.micro_steps, engine.global_rank)
        inputs, labels = engine.batch_fn(map_tensors(batch, lambda t: t.to(engine.device)))
        if engine.is_first_stage():
            if engine.policy.mixed:
                inputs = map_tensors(inputs, lambda t: t.to(engine.policy.param_dtype) if t.is_floating_point() else t)
            if engine._first_inputs_need_grad():  # (detached first: the script's own tensors stay as they are)
                inputs = map_tensors(inputs, lambda t: t.detach().requires_grad_(t.is_floating_point()))
            self._put(self.inputs, buffer, as_tuple(inputs), "the inputs")
        if engine.is_last_stage():
            self._put(self.labels, buffer, labels, "the labels")

    def recv_activation(self, instruction: RecvActivation) -> None:
        received = recv_tensors(self.engine._neighbour("previous"), ACTIVATION_TAG, self.engine.device)
        if not self.training:
            received = tuple(t.detach() for t in received)
        self._put(self.inputs, instruction.buffer_id, received, "the inputs")

    def forward(self, instruction: ForwardPass) -> None:
        engine, buffer = self.engine, instruction.buffer_id
        inputs = self._take(self.inputs, buffer, "inputs", instruction)
        if self.training:  # (kept for the backward, which sends their gradients)
            self.inputs[buffer] = inputs
        started = time.perf_counter()
        outputs = engine.pipe(inputs[0] if len(inputs) == 1 else inputs)
        if engine.is_last_stage():
            outputs = engine._loss(outputs, self._take(self.labels, buffer, "labels", instruction))
            self.losses.append(outputs.detach().float())
        if self.training:
            engine.timeline.append(("forward", self.forwards, started, time.perf_counter()))
            self.micro_batch[buffer] = self.forwards
        self.forwards += 1
        if self.training or not engine.is_last_stage():
            self._put(self.outputs, buffer, outputs, "the outputs")

    def send_activation(self, instruction: SendActivation) -> None:
        outputs = self._take(self.outputs, instruction.buffer_id, "outputs", instruction)
        if self.training:  # (kept for the backward)
            self.outputs[instruction.buffer_id] = outputs
        self.sends += send_tensors(as_tuple(outputs), self.engine._neighbour("next"), ACTIVATION_TAG)

    def recv_grad(self, instruction: RecvGrad) -> None:
        grads = recv_tensors(self.engine._neighbour("next"), GRADIENT_TAG, self.engine.device)
        self._put(self.output_grads, instruction.buffer_id, grads, "the outputs' gradients")

    def backward(self, instruction: BackwardPass) -> None:
        engine, buffer = self.engine, instruction.buffer_id
        self.backwards += 1
        engine.state.begin_micro_step(self.backwards == self.micro_batches)
        inputs = self._take(self.inputs, buffer, "inputs", instruction)
        outputs = self._take(self.outputs, buffer, "outputs", instruction)
        grads = None if engine.is_last_stage() else self._take(self.output_grads, buffer, "gradients", instruction)
        started = time.perf_counter()
        engine._backward(outputs, grads)
        engine.timeline.append(("backward", self.micro_batch.pop(buffer), started, time.perf_counter()))
        if not engine.is_first_stage():
            self._put(self.input_grads, buffer, tuple(t.grad if t.grad is not None else torch.zeros_like(t)
                                                      for t in inputs if t.requires_grad), "the inputs' gradients")

    def send_grad(self, instruction: SendGrad) -> None:
        grads = self._take(self.input_grads, instruction.buffer_id, "input gradients", instruction)
        self.sends += send_tensors(grads, self.engine._neighbour("previous"), GRADIENT_TAG)

    def reduce_tied_grads(self, instruction: ReduceTiedGrads) -> None:
        """The tied weights of this stage and their groups, summed by ``ReduceGrads``'s grad sync."""
        engine = self.engine
        self.ties = [(param, engine.tie_groups[key]) for key, param in engine.pipe.local_tied_parameters().items()]

    def reduce_grads(self, instruction: ReduceGrads) -> None:
        self.wait_for_sends()
        with self.engine.timers("step"):
            self.engine.state.finish(self.ties)
        self.reduced = True

    def optimizer_step(self, instruction: OptimizerStep) -> None:
        engine = self.engine
        if not self.reduced:
            raise RuntimeError(f"pipeline stage {engine.stage_id}: OptimizerStep before ReduceGrads")
        self.wait_for_sends()
        self.mean_loss = engine._broadcast_loss(self.losses, self.micro_batches)
        engine._window_loss = self.mean_loss * self.micro_batches  # the step report divides by GAS
        with engine.timers("step"):
            engine._take_model_step({})
