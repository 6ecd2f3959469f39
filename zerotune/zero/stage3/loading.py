"""Loading pretrained safetensors weights into a ZeRO-3 partitioned model, each rank reading only its slices.

Why not ``model.load_state_dict``: a partitioned parameter holds no values (its ``.data`` is a
placeholder) and gathering every parameter just to overwrite it would need the whole model on
every rank -- exactly what stage 3 exists to avoid. Instead each rank asks every partitioned
parameter which flattened range ``[lo, hi)`` it holds (``ShardedParam.local_piece``) and reads
only the rows of the stored tensor that cover that range (safetensors maps the file and
``get_slice`` copies just the requested rows). Ordinary (unpartitioned) parameters and
persistent buffers are read whole and copied in place.

Key matching follows Hugging Face: a model name is looked up as is, then without the model's
``base_model_prefix`` (loading a ``GPT2LMHeadModel`` from ``GPT2Model`` weights is the reverse
case: ``transformer.h.0...`` stored as ``h.0...``), then with it. A parameter shared under two
names (tied embeddings) is loaded once, from whichever name the files contain.

    rows of the stored tensor:   | r0 | r1 | r2 | r3 | r4 |
    this rank's flat range:           [lo ........ hi)
    rows read:                        | r1 | r2 | r3 |      -> flattened, trimmed to [lo, hi)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from zerotune.zero.stage3.sharded_param import sharded_param_of

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class WeightLoadingError(ValueError):
    """Pretrained weights that cannot be loaded: a missing/unreadable file, key, or a wrong shape."""


def read_flat_range(handle: Any, key: str, lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the row-major flattened tensor ``key``, as a 1-D tensor.

    Only the rows (slices along dim 0) covering the range are read, so a rank holding a small
    piece of a large embedding never materializes the whole matrix. ``handle`` is a
    ``safetensors.safe_open(..., framework="pt")`` handle.
    """
    view = handle.get_slice(key)
    shape = list(view.get_shape())
    numel = math.prod(shape)
    if not 0 <= lo <= hi <= numel:
        raise WeightLoadingError(
            f"flat range [{lo}, {hi}) of {key!r} is outside its {numel} elements (shape {shape}); "
            f"need 0 <= lo <= hi <= {numel}")
    if not shape:  # 0-d: one element, nothing to slice (safetensors refuses slices of a scalar)
        return view[...].reshape(1)[lo:hi]
    row = math.prod(shape[1:])  # elements per row (slice along dim 0)
    if lo == hi or row == 0:
        return view[0:0].reshape(-1)
    row_lo, row_hi = lo // row, -(-hi // row)
    rows = view[row_lo:row_hi].reshape(-1)
    start = lo - row_lo * row
    return rows[start:start + (hi - lo)]


def weight_files(path: str | os.PathLike) -> dict[str, Path]:
    """Which file holds each stored key: from an index json, a directory, or one ``.safetensors`` file."""
    path = Path(path)
    if path.is_dir():
        if (path / INDEX_FILE).is_file():
            return _keys_from_index(path / INDEX_FILE)
        if (path / SINGLE_FILE).is_file():
            return _keys_from_file(path / SINGLE_FILE)
        present = sorted(p.name for p in path.iterdir())[:20]
        raise WeightLoadingError(
            f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE} (it holds: {present}); "
            f"pass a directory written by save_pretrained(safe_serialization=True) or a .safetensors file")
    if path.name.endswith(".index.json") and path.is_file():
        return _keys_from_index(path)
    if path.suffix == ".safetensors" and path.is_file():
        return _keys_from_file(path)
    raise WeightLoadingError(
        f"no weights at {path}: expected a directory with {SINGLE_FILE} or {INDEX_FILE}, "
        f"a .safetensors file, or a .index.json file")


def _keys_from_file(file: Path) -> dict[str, Path]:
    with _open(file) as handle:
        return {key: file for key in handle.keys()}


def _keys_from_index(index: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise WeightLoadingError(f"cannot read the weight map of {index}: {error!r}; "
                                 f"expected JSON with a 'weight_map' object of key -> shard file") from error
    if not isinstance(weight_map, dict):
        raise WeightLoadingError(f"'weight_map' in {index} is a {type(weight_map).__name__}, expected an object")
    files = {}
    for key, name in weight_map.items():
        file = index.parent / str(name)
        if not file.is_file():
            raise WeightLoadingError(f"shard {file} listed in {index} for key {key!r} does not exist")
        files[key] = file
    return files


def _open(file: Path):
    """``safe_open`` whose failures (truncated header or data, not a safetensors file) name the file."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as error:  # safetensors raises its own SafetensorError, or OSError
        raise WeightLoadingError(f"cannot read safetensors file {file}: {error} "
                                 f"(truncated, corrupted, or not a safetensors file?)") from error


def _model_tensors(model: torch.nn.Module) -> Iterator[tuple[list[str], torch.Tensor]]:
    """Each parameter and persistent buffer once, with every name it has (tied weights have several)."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        tensors[id(param)] = param
    for module_name, module in model.named_modules(remove_duplicate=False):
        for buffer_name, buffer in module._buffers.items():
            if buffer is None or buffer_name in module._non_persistent_buffers_set:
                continue
            name = f"{module_name}.{buffer_name}" if module_name else buffer_name
            names.setdefault(id(buffer), []).append(name)
            tensors[id(buffer)] = buffer
    for ident, tensor in tensors.items():
        yield names[ident], tensor


def _candidate_keys(name: str, prefix: str) -> list[str]:
    """``name`` as stored: as is, without the base-model prefix, with it (the order transformers tries)."""
    if not prefix:
        return [name]
    if name.startswith(prefix + "."):
        return [name, name[len(prefix) + 1:]]
    return [name, f"{prefix}.{name}"]


def _find_key(names: list[str], prefix: str, files: dict[str, Path]) -> str | None:
    for name in names:
        for key in _candidate_keys(name, prefix):
            if key in files:
                return key
    return None


def _stored_shape(handle: Any, key: str, file: Path) -> list[int]:
    try:
        return list(handle.get_slice(key).get_shape())
    except Exception as error:
        raise WeightLoadingError(f"cannot read key {key!r} in {file}: {error}") from error


def _load_one(tensor: torch.Tensor, names: list[str], key: str, handle: Any, file: Path) -> None:
    """Copy the stored ``key`` into ``tensor`` (only the local piece if it is partitioned)."""
    sharded = sharded_param_of(tensor) if isinstance(tensor, torch.nn.Parameter) else None
    expected = list(sharded.shape if sharded is not None else tensor.shape)
    stored = _stored_shape(handle, key, file)
    if stored != expected:
        raise WeightLoadingError(f"shape mismatch for {names[0]!r}: key {key!r} in {file} has shape {stored}, "
                                 f"the model expects {expected}")
    try:
        if sharded is not None:
            lo, hi, view = sharded.local_piece()
            if view.numel() != hi - lo:
                raise WeightLoadingError(f"local piece of {names[0]!r} is [{lo}, {hi}) but its view has "
                                         f"{view.numel()} elements")
            view.copy_(read_flat_range(handle, key, lo, hi))
        else:
            tensor.data.copy_(handle.get_tensor(key))
    except WeightLoadingError:
        raise
    except Exception as error:  # e.g. data past the end of a file truncated after opening
        raise WeightLoadingError(f"cannot read key {key!r} from {file} into {names[0]!r}: {error}") from error


@torch.no_grad()
def load_partitioned_weights(model: torch.nn.Module, path: str | os.PathLike, *, strict: bool = True) -> dict:
    """Load pretrained weights into ``model`` in place; partitioned parameters read only this rank's range.

    ``path``: a directory holding ``model.safetensors`` or ``model.safetensors.index.json`` with its
    shards, a single ``.safetensors`` file, or an index json. With ``strict``, a model tensor found
    under none of its names raises ``WeightLoadingError``; stored keys the model lacks are only
    reported (Hugging Face checkpoints routinely carry some, e.g. old GPT-2 attention masks).

    Returns ``{"loaded": [stored keys read], "missing": [model names not found],
    "unexpected": [stored keys not used]}``.
    """
    files = weight_files(path)
    prefix = getattr(model, "base_model_prefix", "") or ""
    loaded: list[str] = []
    missing: list[str] = []
    used: set[str] = set()
    touched: dict[int, Any] = {}
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}
        for names, tensor in _model_tensors(model):
            key = _find_key(names, prefix, files)
            if key is None:
                missing.append(names[0])
                continue
            file = files[key]
            if file not in handles:
                handles[file] = stack.enter_context(_open(file))
            _load_one(tensor, names, key, handles[file], file)
            loaded.append(key)
            sharded = sharded_param_of(tensor)
            if sharded is not None:
                touched[id(sharded.segment)] = sharded.segment
            # A tied weight's other names count as used: the file may hold both copies.
            used.update(k for name in names for k in _candidate_keys(name, prefix))
    for segment in touched.values():  # a gathered copy is stale now; fp32 masters (if any) follow the shard
        segment.release()
        segment.notify_local_changed()
    if strict and missing:
        raise WeightLoadingError(
            f"{len(missing)} model tensor(s) not found in the weights at {path}: {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''} (looked up as stored, and with/without the "
            f"base-model prefix {prefix!r}); pass strict=False to keep their current values")
    unexpected = sorted(key for key in files if key not in used)
    return {"loaded": loaded, "missing": missing, "unexpected": unexpected}
