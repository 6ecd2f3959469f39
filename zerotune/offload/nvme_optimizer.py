"""NVMe offload of the optimizer (ZeRO-Infinity): fp32 masters and optimizer state in swap files.

Each master (this rank's fp32 slice of a param group, or of a unit's group at stage 3) is cut
into chunks of at most ``sub_group_size`` elements. The torch optimizer -- any of them -- holds
one *proxy* parameter per chunk; between steps a proxy holds no data and its state tensors live
in files (only the scalar ``step`` stays in memory). One step walks the chunks:

1. the chunk's master and state are read into pool buffers (the next chunk's read is started
   while this one is stepped, when the pool has room);
2. the optimizer steps this chunk alone (the other proxies have no gradient, which every torch
   optimizer skips), and the updated master is rounded into the model's shard;
3. master and state are written back asynchronously; the buffers return to the pool when the
   writes complete.

Resident memory is a few chunks whatever the model size: ``buffer_count`` buffers of
``sub_group_size`` elements. Chunking changes nothing numerically: the optimizers are elementwise.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import torch

from zerotune.offload.buffers import BufferPool
from zerotune.offload.cpu_step import step_threads
from zerotune.offload.master_placement import MasterPlacement, ShardWriter
from zerotune.offload.swap_files import SwapFileError, SwapHandle, SwapStore

_EMPTY = torch.empty(0, dtype=torch.float32)
_ALIGN = 64


@dataclass
class _Chunk:
    master: int
    lo: int
    hi: int
    proxy: torch.nn.Parameter
    has_state: bool = False
    """Whether its optimizer state exists in files (after its first step)."""

    @property
    def name(self) -> str:
        return f"m{self.master}_{self.lo}"

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def _initial_state(optimizer: torch.optim.Optimizer, proxy: torch.nn.Parameter, key: str) -> torch.Tensor:
    """A chunk's first value of state the optimizer made at construction (Adagrad's ``sum``)."""
    if isinstance(optimizer, torch.optim.Adagrad) and key == "sum":
        group = next(g for g in optimizer.param_groups if any(p is proxy for p in g["params"]))
        return torch.full_like(proxy.data, group["initial_accumulator_value"])
    raise ValueError(f"optimizer.type: {type(optimizer).__name__} creates its per-parameter state '{key}' when it is "
                     "built, which zero_optimization.offload_optimizer.device nvme cannot split into chunks; use "
                     "Adam, AdamW, SGD or Adagrad (they create theirs in the step), or device cpu")


class NvmePlacement(MasterPlacement):
    """Masters and optimizer state in ``store``'s files, stepped chunk by chunk through ``pool``."""

    def __init__(self, store: SwapStore, *, sub_group_size: int, buffer_count: int,
                 step_threads: int | None = None) -> None:
        super().__init__(device=torch.device("cpu"), step_threads=step_threads)
        self.store = store
        # Chunks start at multiples of 64 elements: a vectorized (fused) kernel then splits every chunk
        # into vector body and scalar tail exactly where it splits the whole master -- same bits.
        self.sub_group_size = max(_ALIGN, int(sub_group_size) // _ALIGN * _ALIGN)
        self.buffer_count = buffer_count
        self.pool: BufferPool | None = None
        self.chunks: list[_Chunk] = []
        self.writers: list[ShardWriter] = []
        self.state_keys: list[str] = []  # tensor state per parameter (exp_avg, ...), known after the first step
        self._model_grads: list[torch.Tensor] = []
        self._coefficient = 1.0
        self._allocated: set[str] = set()

    resident = False

    def _allocate(self, name: str, numel: int) -> None:
        self.store.allocate(name, numel, torch.float32)
        self._allocated.add(name)

    def adopt(self, masters: Sequence[torch.Tensor], shard_writers: Sequence[ShardWriter]) -> None:
        """Move the masters' values into swap files; ``shard_writers[i]`` rounds master i into the model.

        May be called several times (one unit at a time at stage 3); masters are numbered in call order.
        """
        for master, writer in zip(masters, shard_writers):
            index = len(self.writers)
            self.writers.append(writer)
            flat = master.detach().reshape(-1)
            for lo in range(0, max(flat.numel(), 1), self.sub_group_size):
                hi = min(lo + self.sub_group_size, flat.numel())
                chunk = _Chunk(index, lo, hi, torch.nn.Parameter(_EMPTY.clone()))
                self._allocate(chunk.name + "_master", chunk.numel)
                self.store.write(chunk.name + "_master", flat[lo:hi].contiguous()).wait()
                self.chunks.append(chunk)
            master.data = _EMPTY  # the values live in the files now

    def optimizer_params(self, master_index: int, master: torch.nn.Parameter) -> list[torch.nn.Parameter]:
        return [c.proxy for c in self.chunks if c.master == master_index]

    streams_grads = True

    def attach(self, masters: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor], coefficient: float) -> None:
        """Keep the gradients (model dtype) and the coefficient: each chunk's fp32 gradient is made in the step
        (the same fp32 copy and multiply as without offload), so no full fp32 gradient is ever held."""
        self._model_grads = [g.reshape(-1) for g in grads]
        self._coefficient = coefficient

    def refresh(self, master_index: int, values: torch.Tensor) -> None:
        """Overwrite master ``master_index`` (e.g. after weights were loaded into the model's shard)."""
        flat = values.detach().reshape(-1).float()
        for chunk in self.chunks:
            if chunk.master == master_index:
                self.store.write(chunk.name + "_master", flat[chunk.lo:chunk.hi].contiguous()).wait()

    # ---- one step ------------------------------------------------------------------------
    def _load(self, chunk: _Chunk) -> tuple[dict[str, torch.Tensor], list[SwapHandle]]:
        buffers, handles = {}, []
        for key in ["master", *(self.state_keys if chunk.has_state else [])]:
            buffers[key] = self._buffer_pool().acquire(chunk.numel)
            handles.append(self.store.read(f"{chunk.name}_{key}", buffers[key]))
        return buffers, handles

    def _buffer_pool(self) -> BufferPool:
        """The buffers chunks are stepped in, made at the first step (each the size of the largest chunk)."""
        if self.pool is None:
            self.pool = BufferPool(self.buffer_count, max((c.numel for c in self.chunks), default=1) or 1)
        return self.pool

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        pool = self._buffer_pool()
        needed = 1 + len(self.state_keys)
        if pool.buffer_count < needed:
            raise SwapFileError(f"offload_optimizer.buffer_count is {pool.buffer_count}; this optimizer keeps "
                                f"{len(self.state_keys)} state tensor(s) per parameter, so at least {needed} are "
                                "needed")
        writes: deque[tuple[list[SwapHandle], list[torch.Tensor], list[torch.Tensor]]] = deque()

        def retire_oldest() -> None:
            handles, pooled, _written = writes.popleft()  # _written: tensors the writes read, alive until now
            for handle in handles:
                handle.wait()
            for buffer in pooled:
                pool.release(buffer)

        def make_room() -> None:
            while writes and pool.free_count < needed:
                retire_oldest()

        make_room()
        upcoming = self._load(self.chunks[0]) if self.chunks else None
        for i, chunk in enumerate(self.chunks):
            assert upcoming is not None  # (read ahead, or after the previous chunk)
            buffers, reads = upcoming
            for handle in reads:
                handle.wait()
            upcoming = None
            if i + 1 < len(self.chunks) and pool.free_count >= 2 * needed:
                upcoming = self._load(self.chunks[i + 1])  # read ahead while this chunk steps
            with step_threads(self.step_threads or torch.get_num_threads()):
                self._step_chunk(optimizer, chunk, buffers)
            writes.append(self._store(chunk, buffers, optimizer))
            while len(writes) > 1:
                retire_oldest()
            if upcoming is None and i + 1 < len(self.chunks):
                make_room()
                upcoming = self._load(self.chunks[i + 1])
        while writes:
            retire_oldest()

    def _step_chunk(self, optimizer: torch.optim.Optimizer, chunk: _Chunk, buffers: dict[str, torch.Tensor]) -> None:
        proxy = chunk.proxy
        proxy.data = buffers["master"]
        grad = self._model_grads[chunk.master][chunk.lo:chunk.hi].float()  # bf16: a copy; fp32: the shard itself
        if self._coefficient != 1.0:
            grad.mul_(self._coefficient)  # the plain path's multiply, on this chunk only
        proxy.grad = grad
        state = optimizer.state[proxy]
        state.update({key: buffers[key] for key in self.state_keys if key in buffers})
        if not chunk.has_state:  # state some optimizers create when built, on the then empty proxy
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != proxy.shape:
                    state[key] = _initial_state(optimizer, proxy, key)
        optimizer.step()
        self.writers[chunk.master](chunk.lo, proxy.data)

    def _store(self, chunk: _Chunk, buffers: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer
               ) -> tuple[list[SwapHandle], list[torch.Tensor], list[torch.Tensor]]:
        """Write master and state back; the proxy keeps only its scalar state."""
        proxy = chunk.proxy
        state = optimizer.state[proxy]
        if not self.state_keys:  # the first step created the state: learn its tensors' names
            self.state_keys = sorted(k for k, v in state.items()
                                     if isinstance(v, torch.Tensor) and v.shape == proxy.shape)
        handles, written = [], []
        for key in ["master", *self.state_keys]:
            tensor = buffers[key] if key in buffers else state[key]
            name = f"{chunk.name}_{key}"
            if name not in self._allocated:
                self._allocate(name, chunk.numel)
            written.append(tensor)
            handles.append(self.store.write(name, tensor))
        for key in self.state_keys:
            state.pop(key, None)
        chunk.has_state = True
        proxy.data = _EMPTY
        proxy.grad = None
        return handles, list(buffers.values()), written

    # ---- checkpoints ---------------------------------------------------------------------
    def read_master(self, index: int, master: torch.nn.Parameter, optimizer: torch.optim.Optimizer
                    ) -> tuple[torch.Tensor, dict]:
        """Master ``index`` and its state, read from its chunks' files (one master in memory at a time)."""
        chunks = [c for c in self.chunks if c.master == index]
        numel = chunks[-1].hi if chunks else 0
        keys = ["master", *(self.state_keys if chunks and chunks[0].has_state else [])]
        read = {key: torch.empty(numel, dtype=torch.float32) for key in keys}
        for chunk in chunks:
            if chunk.numel:
                for key in keys:
                    self.store.read(f"{chunk.name}_{key}", read[key][chunk.lo:chunk.hi]).wait()
        scalars = dict(optimizer.state.get(chunks[0].proxy, {})) if chunks and chunks[0].has_state else {}
        return read.pop("master"), {**scalars, **read}

    def write_master(self, index: int, master: torch.nn.Parameter, optimizer: torch.optim.Optimizer,
                     values: torch.Tensor, state: dict) -> None:
        """Write master ``index`` and its state into its chunks' files; the proxies keep the scalars."""
        tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        if tensors and self.state_keys and sorted(tensors) != self.state_keys:
            raise ValueError(f"optimizer state keys {sorted(tensors)} differ from the swapped ones {self.state_keys}")
        if tensors:
            self.state_keys = sorted(tensors)
        scalars = {k: v for k, v in state.items() if k not in tensors}
        for chunk in (c for c in self.chunks if c.master == index):
            for key, source in [("master", values), *tensors.items()]:
                name = f"{chunk.name}_{key}"
                if name not in self._allocated:
                    self._allocate(name, chunk.numel)
                if chunk.numel:
                    self.store.write(name, source.reshape(-1)[chunk.lo:chunk.hi].float().contiguous()).wait()
            chunk.has_state = bool(tensors)
            if tensors:  # each proxy its own scalars: optimizers count steps in place
                optimizer.state[chunk.proxy] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                                for k, v in scalars.items()}
            else:
                optimizer.state.pop(chunk.proxy, None)

    def grad_bytes(self) -> int:
        return 0
