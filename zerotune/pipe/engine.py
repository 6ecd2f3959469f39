"""``PipelineEngine``: DeepSpeed's ``train_batch`` / ``eval_batch`` over pipeline stages.

One ``train_batch`` = one optimizer step = ``gradient_accumulation_steps`` micro-batches pushed
through the stages in the configured schedule (``schedule.py``). Around each action:

* forward: the first stage takes a micro-batch from the data iterator (``batch_fn`` splits it into
  the model inputs and the labels); the others receive the previous stage's outputs (``p2p.py``);
  the last stage also reads the micro-batch, for its labels, and computes ``loss_fn``;
* backward: the last stage backpropagates ``loss * loss_scale / GAS``; the others receive the
  gradient of their outputs; every stage but the first sends its inputs' gradient back.

Why not ``torch.distributed.pipelining``'s schedules: they run each micro-batch's backward
themselves and rescale the accumulated gradients afterwards (``scale_grads``), while zerotune's
gradient path needs to act around each backward -- the boundary flag that lets ZeRO's bucketed
all-reduce / reduce-scatter overlap the *last* micro-batch's backward, the fp16 loss scale and the
1/GAS factor applied to the loss (not the gradients), the tied-weight reduction between stages
before ZeRO-1's reduce-scatter -- and its stages need the whole model on one device per stage to
infer shapes with a meta forward, where ours learn shapes from a small header per message.

After the last backward the step is the data-parallel engine's, with the gradient norm summed
over the pipeline (and tensor) ranks. Sends are asynchronous and receives blocking; every stage's
schedule is consistent with its neighbours', so this cannot deadlock. The batch loss is broadcast
from the last stage and averaged over the data-parallel ranks: every rank returns it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import torch
import torch.distributed as dist

from zerotune.distributed import comm
from zerotune.distributed.engine_guards import EngineGuards
from zerotune.engine_batches import check_batch_not_empty, map_tensors
from zerotune.engine_core import EngineCore
from zerotune.engine_offload_states import FORWARD_NEEDS
from zerotune.parallel.activation_checkpointing import checkpoint as activation_checkpoint
from zerotune.parallel.activation_checkpointing import non_reentrant_checkpoint
from zerotune.parallel.tensor.state_dict import iter_full_tensors
from zerotune.pipe.module import PipelineModule
from zerotune.pipe.p2p import ACTIVATION_TAG, GRADIENT_TAG, as_tuple, recv_tensors, send_tensors
from zerotune.pipe.schedule import build_schedule


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
        """One optimizer step over GAS micro-batches; the mean loss on every rank."""
        self._require_on_device("train_batch()")
        comm.guard_point("train_batch", self.global_steps, self.micro_steps)
        self.pipe.train()
        micro_batches = self.gradient_accumulation_steps()
        schedule = build_schedule(self._config.pipeline.schedule, micro_batches, self.num_stages, self.stage_id)
        saved: dict[int, tuple] = {}
        losses: list[torch.Tensor] = []
        sends: list[comm.Handle] = []
        backwards_done = 0
        self.timeline = []
        for action in schedule:
            if action.kind == "forward":
                inputs, labels = self._stage_inputs(data_iter)
                started = time.perf_counter()
                outputs = self.pipe(inputs[0] if len(inputs) == 1 else inputs)
                if self.is_last_stage():
                    outputs = self._loss(outputs, labels)
                    losses.append(outputs.detach().float())
                self.timeline.append(("forward", action.micro_batch, started, time.perf_counter()))
                if not self.is_last_stage():
                    sends += send_tensors(as_tuple(outputs), self._neighbour("next"), ACTIVATION_TAG)
                saved[action.micro_batch] = (inputs, outputs)
            else:
                backwards_done += 1
                self.state.begin_micro_step(backwards_done == micro_batches)
                inputs, outputs = saved.pop(action.micro_batch)
                grads = None if self.is_last_stage() else recv_tensors(self._neighbour("next"), GRADIENT_TAG,
                                                                       self.device)
                started = time.perf_counter()
                self._backward(outputs, grads)
                self.timeline.append(("backward", action.micro_batch, started, time.perf_counter()))
                if not self.is_first_stage():
                    input_grads = tuple(t.grad if t.grad is not None else torch.zeros_like(t)
                                        for t in inputs if t.requires_grad)
                    sends += send_tensors(input_grads, self._neighbour("previous"), GRADIENT_TAG)
        for handle in sends:
            handle.wait()
        mean_loss = self._broadcast_loss(losses, micro_batches)
        self._window_loss = mean_loss * micro_batches  # the step report divides by GAS
        with self.timers("step"):
            ties = [(param, self.tie_groups[key]) for key, param in self.pipe.local_tied_parameters().items()]
            self.state.finish(ties)  # a tied weight's gradient summed over the stages holding it
            self._take_model_step({})
        self.micro_steps += micro_batches
        return mean_loss

    @EngineGuards.method
    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator | None = None, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str = "avg", bcast_loss: bool = True, num_micro_batches: int | None = None
                   ) -> torch.Tensor:
        """Forward-only over GAS micro-batches (or ``num_micro_batches``): the mean loss on every rank."""
        if return_logits or not compute_loss or reduce_output != "avg":
            raise NotImplementedError("eval_batch supports compute_loss=True, reduce_output='avg' and no logits")
        self._require_on_device("eval_batch()", FORWARD_NEEDS)
        comm.guard_point("eval_batch", self.global_steps, self.micro_steps)
        was_training = self.pipe.training
        self.pipe.eval()
        micro_batches = num_micro_batches or self.gradient_accumulation_steps()
        losses, sends = [], []
        for _ in range(micro_batches):
            inputs, labels = self._stage_inputs(data_iter)
            outputs = self.pipe(inputs[0] if len(inputs) == 1 else inputs)
            if self.is_last_stage():
                losses.append(self._loss(outputs, labels).float())
            else:
                sends += send_tensors(as_tuple(outputs), self._neighbour("next"), ACTIVATION_TAG)
        for handle in sends:
            handle.wait()
        self.pipe.train(was_training)
        return self._broadcast_loss(losses, micro_batches)

    @EngineGuards.method
    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Rank 0 writes the whole model, every stage's layers (tensor-parallel shards joined), under the
        Hugging Face model's own names when it was split from one. Every rank must call it."""
        comm.guard_point("save_16bit_model", self.global_steps, self.micro_steps)
        entries = [(key, tensor) for key, tensor in self.pipe.state_dict(keep_vars=True).items()
                   if not (exclude_frozen_parameters and isinstance(tensor, torch.nn.Parameter)
                           and not tensor.requires_grad)]
        names = self.pipe.export_names or {}
        local: dict[str, torch.Tensor] = {}
        for (key, live), (_, full) in zip(entries, iter_full_tensors(entries, self.mesh.group("tp"))):
            for name in names.get(id(live), [key]):
                local[name] = full.detach().to("cpu", copy=True)
        if self.mesh.rank("dp_sp") == 0 and self.mesh.rank("tp") == 0:
            merged: dict[str, torch.Tensor] = {}
            for part in comm.all_gather_object(local, self.mesh.group("pp")):
                merged.update(part)
            if self.global_rank == 0:
                write_state_dict(merged, Path(save_dir) / save_filename)
        comm.barrier()
        return True

    # ---- pieces ----------------------------------------------------------------------------
    def _stage_inputs(self, data_iter: Iterator | None) -> tuple[tuple, Any]:
        """This stage's inputs for the next micro-batch, and the labels on the last stage."""
        labels = None
        if self.is_first_stage() or self.is_last_stage():
            batch = next(data_iter) if data_iter is not None else self._next_default_batch()
            check_batch_not_empty(batch, self.global_steps + 1, self.micro_steps, self.global_rank)
            inputs, labels = self.batch_fn(map_tensors(batch, lambda t: t.to(self.device)))
        if self.is_first_stage():
            if self.policy.mixed:
                inputs = map_tensors(inputs, lambda t: t.to(self.policy.param_dtype) if t.is_floating_point() else t)
            if self._first_inputs_need_grad():  # (detached first: the script's own tensors stay as they are)
                inputs = map_tensors(inputs, lambda t: t.detach().requires_grad_(t.is_floating_point()))
            return as_tuple(inputs), labels
        received = recv_tensors(self._neighbour("previous"), ACTIVATION_TAG, self.device)
        if not torch.is_grad_enabled():
            received = tuple(t.detach() for t in received)
        return received, labels

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


def write_state_dict(state: dict[str, torch.Tensor], path: Path) -> None:
    """``.safetensors`` or ``torch.save`` by the file name, under a temporary name renamed at the end."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.partial")
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(temporary), metadata={"format": "pt"})
    else:
        torch.save(state, temporary)
    os.replace(temporary, path)
