"""Move tensors' storage to host memory and back, keeping every view of it valid.

``engine.offload_states`` (``zerotune/engine_offload_states.py``) frees device memory between training phases
and must bring it back so that training continues *bit-identically*. The unit of a move is a storage, not a
tensor: ZeRO's flat buffers are viewed by parameters, their gradients, fp32 masters, and by slices the stages
and autograd keep. Resizing the storage to 0 bytes frees its device memory while the storage object -- and so
every view of it, known or not -- survives; resizing it back and copying the bytes in restores every view at
once, with the same bits. Nothing needs re-linking, which is where moving ``.data`` tensor by tensor (DeepSpeed's
way) can leave a forgotten view on a stale copy.

While moved, a view of the freed storage must not be read. So every tensor the caller names (parameters, their
gradients, masters, optimizer state, the states' own buffers) is re-pointed at its place in the host copy:
reading it gives its values, on the host; writing it changes what comes back. Views nobody named (a stage's
internal slices) are left pointing at the empty storage; the engine refuses the phases that would use them
until ``restore``.

On a CPU-only machine the host is the device and the same steps run: the bytes go to a separate host buffer and
the original storage is freed, so the CPU tests exercise this code path; on CUDA the host buffers are
page-locked when asked (``pin_memory``), and benchmarks/gpu_check.py checks that device memory drops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

from zerotune.offload.pinned import track_pinned


@dataclass
class _MovedStorage:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor
    """A 1-D uint8 host tensor holding the storage's bytes while it is moved."""


@dataclass
class MovedStorages:
    """One move: the storages freed, their host copies, and the tensors re-pointed at those copies."""

    storages: list[_MovedStorage] = field(default_factory=list)
    rebound: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """``(tensor, original)``: ``original`` is the tensor's own ``.data`` before the move (same storage, same view)."""

    @property
    def nbytes(self) -> int:
        return sum(moved.nbytes for moved in self.storages)

    @property
    def host_buffers(self) -> list[torch.Tensor]:
        return [moved.host for moved in self.storages]


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a 1-D uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _host_view(host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The place of ``like`` (same dtype, shape, strides, offset) in the host copy of its storage."""
    return torch.as_strided(host.view(like.dtype), like.size(), like.stride(), like.storage_offset())


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor`` lives on ``device`` (``cuda`` without an index means any CUDA device)."""
    return tensor.device.type == device.type and device.index in (None, tensor.device.index)


def move_to_host(tensors: Iterable[torch.Tensor], device: torch.device, *, pin_memory: bool, non_blocking: bool,
                 reuse: list[torch.Tensor] | None = None, keep: Iterable[torch.Tensor] = ()) -> MovedStorages:
    """Copy the storages of ``tensors`` that live on ``device`` to host memory, re-point the tensors at the copies,
    then free the storages. Empty storages (already moved, or never filled) are skipped.

    ``pin_memory``: page-locked host buffers (with CUDA only); ``reuse``: host buffers of an earlier move, taken
    again where the sizes match (pinning is slow, and a training loop offloads the same states every phase);
    ``keep``: host buffers of moves not yet restored -- a tensor already pointing into one is not moved again
    (on a CPU-only machine it would otherwise look like device memory)."""
    pin = pin_memory and device.type == "cuda"
    spare = {id(buffer): buffer for buffer in reuse or []}
    result = MovedStorages()
    by_pointer: dict[int, _MovedStorage] = {}
    held = {buffer.untyped_storage().data_ptr() for buffer in keep}
    named: dict[int, tuple[torch.Tensor, _MovedStorage]] = {}
    for tensor in tensors:
        if not _on(tensor, device) or id(tensor) in named:
            continue
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0 or storage.data_ptr() in held:
            continue
        moved = by_pointer.get(storage.data_ptr())
        if moved is None:
            host = next((b for b in spare.values() if b.numel() == nbytes and b.is_pinned() == pin), None)
            if host is None:
                host = track_pinned(torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin))
            else:
                del spare[id(host)]
            host.copy_(_bytes_of(storage), non_blocking=non_blocking and pin)
            moved = by_pointer[storage.data_ptr()] = _MovedStorage(storage, nbytes, host)
            result.storages.append(moved)
        named[id(tensor)] = (tensor, moved)
    for tensor, moved in named.values():
        result.rebound.append((tensor, tensor.data))
        tensor.data = _host_view(moved.host, tensor)
    for moved in result.storages:
        if moved.storage.resizable():  # (a CPU storage that is not, e.g. a memory-mapped file, is host memory already)
            moved.storage.resize_(0)
    return result


def restore(moved: MovedStorages, *, non_blocking: bool) -> None:
    """Give each storage its bytes back (reallocated on its device) and point the tensors at it again: every view of
    it, named or not, sees the values it had before ``move_to_host``, including what was written to the host copies."""
    for entry in moved.storages:
        if entry.storage.nbytes() != entry.nbytes:
            entry.storage.resize_(entry.nbytes)
        _bytes_of(entry.storage).copy_(entry.host, non_blocking=non_blocking and entry.host.is_pinned())
    for tensor, original in moved.rebound:
        tensor.data = original
    moved.rebound.clear()
