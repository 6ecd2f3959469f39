"""The instructions a pipeline stage executes, one list per tick of its schedule (``steps.py``).

``PipelineEngine`` executes exactly these (``engine.py``'s ``_BatchRun``), so a schedule's instructions are a
true account of what a stage does, in order. A buffer is a slot of the stage's in-flight state (a micro-batch's
inputs, outputs and gradients); the schedule reuses slots cyclically, ``num_pipe_buffers()`` of them.

DeepSpeed's names and attributes (``name``, ``kwargs``, each keyword an attribute, ``buffer_id``), so code that
inspects or builds schedules for DeepSpeed's engine reads zerotune's the same way.
"""

from __future__ import annotations

from typing import Any


class PipeInstruction:
    """One operation of a stage; keyword arguments become attributes (as a namedtuple's fields)."""

    def __init__(self, **kwargs: Any) -> None:
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        return f"{self.name}({', '.join(f'{key}={value!r}' for key, value in self.kwargs.items())})"


class OptimizerStep(PipeInstruction):
    """The optimizer step on the reduced gradients (after ``ReduceGrads``), then gradients zeroed; the batch's
    loss is averaged over the pipeline and data-parallel ranks first, for the step report."""


class ReduceGrads(PipeInstruction):
    """Finish the data-parallel gradient reduction of this stage's parameters (the ZeRO stage's grad sync)."""


class ReduceTiedGrads(PipeInstruction):
    """Sum each tied weight's gradient over the stages holding it. zerotune's grad sync does the sum inside
    ``ReduceGrads``, before or after the data-parallel reduction as its sharding requires (ZeRO-1 before its
    reduce-scatter, ZeRO-2 over the slices after): this instruction hands the tied weights to it."""


class BufferOpInstruction(PipeInstruction):
    """An instruction on one buffer."""

    buffer_id: int

    def __init__(self, buffer_id: int, **kwargs: Any) -> None:
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Take the next micro-batch from the data iterator: the inputs on the first stage, the labels on the last."""


class ForwardPass(BufferOpInstruction):
    """The stage's forward on the buffer's inputs (and the loss on the last stage)."""


class BackwardPass(BufferOpInstruction):
    """The backward of the buffer's outputs (the scaled loss on the last stage), accumulating gradients."""


class SendActivation(BufferOpInstruction):
    """Send the buffer's outputs to the next stage (asynchronous: waited on at the end of the batch)."""


class RecvActivation(BufferOpInstruction):
    """Receive the buffer's inputs from the previous stage (blocking)."""


class SendGrad(BufferOpInstruction):
    """Send the gradients of the buffer's inputs to the previous stage (asynchronous)."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradients of the buffer's outputs from the next stage (blocking)."""
