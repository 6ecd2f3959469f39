"""Sending a stage's activations (a tensor or a tuple of tensors) to the next stage, and gradients back.

The receiver does not know shapes in advance (they depend on the batch: sequence length, padding),
so each message is a fixed-size int64 header -- count, then per tensor its dtype, whether it needs
a gradient, and its shape -- followed by the tensors. Messages between two ranks are matched in
order per tag; forward activations and backward gradients use different tags so a stage's
in-flight sends in both directions never match the wrong receive.
"""

from __future__ import annotations

import torch

from zerotune.distributed import comm

ACTIVATION_TAG, GRADIENT_TAG = 1, 2
MAX_TENSORS, MAX_DIMS = 8, 6
_SLOT = 3 + MAX_DIMS  # dtype code, requires_grad, ndim, dims
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16)


def as_tuple(value: torch.Tensor | tuple) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def _header(tensors: tuple[torch.Tensor, ...], device: torch.device) -> torch.Tensor:
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"a pipeline stage passes {len(tensors)} tensors to the next; at most {MAX_TENSORS}")
    header = torch.zeros(1 + MAX_TENSORS * _SLOT, dtype=torch.int64)
    header[0] = len(tensors)
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"pipeline layers must pass tensors between stages; output {index} is "
                            f"{type(tensor).__name__}")
        if tensor.dim() > MAX_DIMS or tensor.dtype not in _DTYPES:
            raise ValueError(f"cannot send a {tensor.dtype} tensor of {tensor.dim()} dims between stages")
        base = 1 + index * _SLOT
        header[base] = _DTYPES.index(tensor.dtype)
        header[base + 1] = int(tensor.requires_grad)
        header[base + 2] = tensor.dim()
        header[base + 3:base + 3 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header.to(device)


def send_tensors(tensors: tuple[torch.Tensor, ...], dst: int, tag: int) -> list[comm.Handle]:
    """Start sending ``tensors`` to global rank ``dst``; wait on the handles before freeing them."""
    device = tensors[0].device if tensors else torch.device("cpu")
    header = _header(tensors, device)
    payload = [t.detach().contiguous() for t in tensors]
    return [comm.send(header, dst, tag)] + [comm.send(t, dst, tag) for t in payload] + [_Keep(header, payload)]


class _Keep(comm.Handle):
    """Holds the sent buffers alive until the sends are waited on."""

    def __init__(self, *buffers: object) -> None:
        super().__init__("send", None, None)
        self._buffers = buffers


def recv_tensors(src: int, tag: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Receive what ``send_tensors`` sent from global rank ``src`` (floating tensors that needed a gradient
    there are marked ``requires_grad`` here, so backward can produce the gradient to send back)."""
    received = torch.empty(1 + MAX_TENSORS * _SLOT, dtype=torch.int64, device=device)
    comm.recv(received, src, tag)
    header: list[int] = received.cpu().tolist()
    tensors = []
    for index in range(header[0]):
        base = 1 + index * _SLOT
        dtype, needs_grad, ndim = _DTYPES[header[base]], bool(header[base + 1]), header[base + 2]
        tensor = torch.empty(header[base + 3:base + 3 + ndim], dtype=dtype, device=device)
        comm.recv(tensor, src, tag)
        tensors.append(tensor.requires_grad_() if needs_grad else tensor)
    return tuple(tensors)
