"""The consolidated (whole-model) state dict of a partitioned model, one unit at a time.

Every rank walks the units in the same order (each gather is a collective); only rank 0 keeps
what it gathers. ``.safetensors`` files are streamed: the header (every tensor's name, dtype,
shape and byte range) is known from the parameters' shapes before any value is gathered, so
rank 0 writes each unit's tensors at their offsets and drops them -- its memory stays bounded by
the largest unit, not the model. Other file names get ``torch.save`` of the assembled dict.
Files are written under a temporary name and renamed, so a crash never leaves a half file.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from zerotune.parallel.tensor.state_dict import full_shape, gather_full_tensor
from zerotune.zero.stage3.gathered import GatheredParameters
from zerotune.zero.stage3.sharded_param import sharded_param_of
from zerotune.zero.stage3.unit import ParamUnit

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def _state_entries(module: torch.nn.Module, exclude_frozen: bool) -> dict[str, torch.Tensor]:
    """State-dict keys -> the live tensors (parameters as objects, so partitioned ones can be found)."""
    entries = module.state_dict(keep_vars=True)
    if exclude_frozen:
        entries = {k: v for k, v in entries.items() if not (isinstance(v, torch.nn.Parameter) and not v.requires_grad)}
    return entries


def iter_consolidated(module: torch.nn.Module, units: Sequence[ParamUnit], *, exclude_frozen: bool = False,
                      tp_group: dist.ProcessGroup | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, whole tensor)`` for every state-dict entry, gathered one unit at a time (a collective:
    call on every rank). The tensors are views valid only until the next item is requested.
    Tensor-parallel shards are joined over ``tp_group``."""
    entries = _state_entries(module, exclude_frozen)
    keys_of: dict[int, list[str]] = {}
    for key, tensor in entries.items():
        keys_of.setdefault(id(tensor), []).append(key)
    done: set[str] = set()
    for unit in units:
        with GatheredParameters(unit.params):
            for param in unit.params:
                for key in keys_of.get(id(param), []):
                    done.add(key)
                    yield key, gather_full_tensor(param, tp_group)
    for key, tensor in entries.items():  # buffers and anything not partitioned
        if key not in done and sharded_param_of(tensor) is None:
            yield key, gather_full_tensor(tensor, tp_group)


def _header(entries: dict[str, torch.Tensor]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    header, ranges, offset = {}, {}, 0
    for key, tensor in entries.items():
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"cannot write {key} ({tensor.dtype}) to safetensors")
        shape = full_shape(tensor)  # a tensor-parallel shard is written whole
        size = shape.numel() * tensor.element_size()
        header[key] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(shape),
                       "data_offsets": [offset, offset + size]}
        ranges[key] = (offset, offset + size)
        offset += size
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(encoded)) + encoded, ranges


def save_consolidated(module: torch.nn.Module, units: Sequence[ParamUnit], path: str | os.PathLike, *,
                      rank: int, exclude_frozen: bool = False, tp_group: dist.ProcessGroup | None = None) -> None:
    """Write the whole state dict to ``path`` from rank 0 (every rank must call: units are gathered)."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.partial")
    entries = _state_entries(module, exclude_frozen)
    streaming = path.suffix == ".safetensors"
    collected: dict[str, torch.Tensor] = {}
    handle = None
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        if streaming:
            prefix, ranges = _header(entries)
            handle = open(temporary, "wb")
            handle.write(prefix)
            data_start = len(prefix)
    try:
        for key, tensor in iter_consolidated(module, units, exclude_frozen=exclude_frozen, tp_group=tp_group):
            if rank != 0:
                continue
            if streaming:
                assert handle is not None  # (rank 0 opened it)
                handle.seek(data_start + ranges[key][0])
                # a copy: sharing the gathered buffer with numpy would pin its storage (no more release); an
                # ndarray is a buffer, which numpy's stubs declare only for Python >= 3.12
                handle.write(tensor.reshape(-1).to("cpu", copy=True).view(torch.uint8).numpy())  # type: ignore[arg-type]
            else:
                collected[key] = tensor.clone().cpu()
    finally:
        if handle is not None:
            handle.close()
    if rank == 0:
        if not streaming:
            torch.save(collected, temporary)
        os.replace(temporary, path)


class EmptyPartitionedEntries:
    """A ``state_dict`` post-hook for a partitioned model: each partitioned entry becomes an empty tensor, as
    DeepSpeed's does (its partitioned ``param.data`` is ``torch.empty(0)``), instead of the stride-0 placeholder
    that would save as plausible-looking weights. Scripts written for DeepSpeed call ``state_dict()`` on one rank
    and then overwrite the file with gathered weights (DeepSpeed-Chat's ``save_hf_format`` +
    ``save_zero_three_model``), so refusing would stop them; an empty entry cannot be mistaken for a weight:
    loading it anywhere fails on its shape. The (one) warning says how to get the values."""

    def __init__(self, units: Sequence[ParamUnit]) -> None:
        self.units = units
        self.warned = False

    def __call__(self, module: torch.nn.Module, state_dict: dict, prefix: str, metadata: Any) -> None:
        placeholders = {sp.placeholder_ptr for u in self.units for s in u.segments for sp in s.sharded}
        emptied = [key for key, value in state_dict.items()
                   if not isinstance(value, torch.nn.Parameter) and value.data_ptr() in placeholders]
        for key in emptied:
            state_dict[key] = torch.empty(0, dtype=state_dict[key].dtype, device=state_dict[key].device)
        if emptied and not self.warned:
            self.warned = True
            warnings.warn(
                f"state_dict(): {len(emptied)} entries (first '{emptied[0]}') are partitioned by ZeRO stage 3 "
                "and hold no values on this rank, so they are returned empty, as DeepSpeed returns them; for the "
                "weights use engine.save_16bit_model(...) / engine._zero3_consolidated_16bit_state_dict(), or "
                "read them inside zerotune.zero.GatheredParameters(...)", stacklevel=3)

