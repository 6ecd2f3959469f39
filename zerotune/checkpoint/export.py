"""``zerotune export``: a checkpoint (zerotune's, at any layout, or DeepSpeed's) as a Hugging Face model directory.

Streaming: tensors are assembled one at a time (``PieceReader``: mmap'd files, the pieces of one
tensor) and appended to the current output shard; a full shard is written and dropped before the next
begins. Peak memory is one output shard plus the largest tensor, whatever the model size. Shards are
``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json`` (HF's layout; one shard is
plain ``model.safetensors``); ``config.json`` comes from the HF config the checkpoint recorded.

PEFT runs: by default the adapter (``adapter_model.safetensors`` + ``adapter_config.json``, PEFT's key
names); ``merge=True`` folds LoRA into the base weights (``W + scale * B @ A``) and writes a plain model.
The directory is written under a temporary name and renamed: a failed export leaves nothing behind.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Iterator

import torch

from zerotune.checkpoint.atomic import (
    CheckpointError,
    read_file,
    read_manifest,
    resolve_tag,
    tag_directory,
    verify_files,
)
from zerotune.checkpoint.deepspeed_format import is_deepspeed_checkpoint, read_deepspeed_checkpoint
from zerotune.checkpoint.engine_parts import MODEL_FILE_PATTERN
from zerotune.checkpoint.logical import MASTER, SHARD_FILE_PATTERN, WEIGHT, PieceReader

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_LORA = re.compile(r"(.*)\.lora_(A|B)\.([^.]+)\.weight")


class ExportError(CheckpointError):
    """The checkpoint cannot be exported as asked; the message says why and what would work."""


def open_checkpoint(path: Path) -> tuple[PieceReader, dict, list[str]]:
    """A zerotune checkpoint (a save dir with ``latest``, or a tag directory), verified against its manifest:
    the reader, the model-states metadata, and the weight names in saving order."""
    directory = path
    if not (path / "manifest.json").is_file():
        tag = resolve_tag(path, None)
        if tag is None:
            raise ExportError(f"{path} is neither a checkpoint tag directory (no manifest.json) nor a save directory "
                              "(no 'latest' file)")
        directory = tag_directory(path, tag)
    manifest = read_manifest(directory)
    verify_files(directory, sorted(manifest), manifest)
    models = {n: read_file(directory / n, "model states", mmap=True) for n in sorted(manifest)
              if MODEL_FILE_PATTERN.fullmatch(n)}
    if not models:
        raise ExportError(f"{directory} has no model_states*.pt file")
    pieces = {n: read_file(directory / n, "parameter pieces", mmap=True) for n in sorted(manifest)
              if SHARD_FILE_PATTERN.fullmatch(n)}
    whole = {k: v for content in models.values() for k, v in content["module"].items()}
    reader = PieceReader(directory, whole, pieces)
    order = list(dict.fromkeys([*whole, *(e["name"] for c in pieces.values() for e in c["entries"]
                                          if e["kind"] in (WEIGHT, MASTER))]))
    first = models.get("model_states.pt") or next(iter(models.values()))
    return reader, first, order


class ShardWriter:
    """Shards of at most ``max_shard_bytes`` (a larger tensor gets a shard of its own), named as Hugging Face names
    them: ``{stem}.{extension}``, or ``{stem}-0000i-of-0000N.{extension}`` with ``{stem}.{extension}.index.json``.

    ``extension`` ``safetensors`` (``save_file``) or ``bin`` (``torch.save``, DeepSpeed's ``zero_to_fp32`` default).
    A tensor added under a second name (tied weights) costs no bytes: ``torch.save`` keeps one storage for both
    names, as DeepSpeed's output does; safetensors cannot hold two names of one storage, so there it is a copy."""

    def __init__(self, directory: Path, max_shard_bytes: int | float, stem: str = "model",
                 extension: str = "safetensors") -> None:
        if extension not in ("safetensors", "bin"):
            raise ExportError(f"shard format {extension!r} is not 'safetensors' or 'bin'")
        self.directory, self.max_shard_bytes, self.stem, self.extension = directory, max_shard_bytes, stem, extension
        self.current: dict[str, torch.Tensor] = {}
        self.current_storages: set[tuple] = set()  # _identity of each tensor in the current shard
        self.current_bytes = 0
        self.written: list[tuple[str, list[str]]] = []  # (temporary file, names)
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.contiguous()
        identity = _identity(tensor)
        if identity in self.current_storages and tensor.numel():
            if self.extension == "bin":  # a second name of a tensor already in this shard
                self.current[name] = tensor
                return
            tensor = tensor.clone()
        size = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + size > self.max_shard_bytes:
            self.flush()
        self.current[name] = tensor
        self.current_storages.add(_identity(tensor))
        self.current_bytes += size
        self.total += size

    def flush(self) -> None:
        if not self.current:
            return
        # named per process: ranks that all convert into one directory (as DeepSpeed's tests do) do not collide
        temporary = self.directory / f".shard{len(self.written)}.{os.getpid()}.{self.extension}"
        if self.extension == "safetensors":
            from safetensors.torch import save_file

            save_file(self.current, str(temporary), metadata={"format": "pt"})
        else:
            torch.save(self.current, temporary)
        self.written.append((temporary.name, list(self.current)))
        self.current, self.current_storages, self.current_bytes = {}, set(), 0

    def finish(self) -> list[str]:
        """Give the shards their final names and write the index; the files written."""
        self.flush()
        count = len(self.written)
        if count == 1:
            final = f"{self.stem}.{self.extension}"
            os.replace(self.directory / self.written[0][0], self.directory / final)
            return [final]
        weight_map, files = {}, []
        for index, (temporary, names) in enumerate(self.written, start=1):
            final = f"{self.stem}-{index:05d}-of-{count:05d}.{self.extension}"
            os.replace(self.directory / temporary, self.directory / final)
            weight_map.update({name: final for name in names})
            files.append(final)
        index_name = f"{self.stem}.{self.extension}.index.json"
        table = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.directory / index_name).write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
        return [*files, index_name]


def _identity(tensor: torch.Tensor) -> tuple:
    """Equal for two names of one tensor (tied weights), different for distinct views of one flat buffer."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)


def _lora_scale(peft: dict) -> float:
    rank, alpha = peft.get("r", 8), peft.get("lora_alpha", 8)
    return alpha / math.sqrt(rank) if peft.get("use_rslora") else alpha / rank


def _merged_items(reader: PieceReader, order: list[str], peft: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's tensors under HF names with each LoRA pair folded into its weight."""
    if peft.get("peft_type") != "LORA" or peft.get("use_dora"):
        raise ExportError(f"--merge folds LoRA adapters into the base weights; this checkpoint's adapter is "
                          f"{peft.get('peft_type')}{' (DoRA)' if peft.get('use_dora') else ''}: export the adapter "
                          "without --merge")
    adapters: dict[str, dict[str, str]] = {}  # the adapted module -> {'A': name, 'B': name}
    for name in order:
        match = _LORA.fullmatch(name)
        if match:
            adapters.setdefault(match.group(1), {})[match.group(2)] = name
    scale, transposed = _lora_scale(peft), bool(peft.get("fan_in_fan_out"))
    for name in order:
        if _LORA.fullmatch(name) or ".lora_" in name:
            continue
        tensor = reader.full(name)
        module, _, leaf = name.rpartition(".")
        if module.endswith(".base_layer"):
            owner = module[:-len(".base_layer")]
            if leaf == "weight" and owner in adapters:
                a = reader.full(adapters[owner]["A"]).float()
                b = reader.full(adapters[owner]["B"]).float()
                delta = (b @ a) * scale
                tensor = (tensor.float() + (delta.T if transposed else delta)).to(tensor.dtype)
            name = f"{owner}.{leaf}"
        yield name.removeprefix("base_model.model."), tensor


def _adapter_items(reader: PieceReader, order: list[str], trainable: list[str], adapter: str, peft: dict
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter's tensors under PEFT's saved names (the adapter name dropped from the keys)."""
    if peft.get("peft_type") == "PREFIX_TUNING":
        if peft.get("prefix_projection"):
            raise ExportError("prefix tuning with prefix_projection: the saved prompt embeddings are computed by the "
                              "projection; export from the fine-tuning job (zerotune finetune writes the adapter)")
        yield "prompt_embeddings", reader.full(f"prompt_encoder.{adapter}.embedding.weight")
        return
    for name in trainable:
        yield name.replace(f".{adapter}.", "."), reader.full(name)


def export_checkpoint(source: Path, out_dir: Path, *, dtype: str | None = None, merge: bool = False,
                      max_shard_bytes: int = 2 << 30) -> list[str]:
    """Write ``out_dir`` (must not exist or be empty) from the checkpoint at ``source``; the files written."""
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"output directory {out_dir} exists and is not empty: choose a new directory")
    saved: dict  # the model-states metadata (a DeepSpeed checkpoint has none zerotune reads)
    if is_deepspeed_checkpoint(source):
        loaded = read_deepspeed_checkpoint(source)
        reader, saved, order = PieceReader(source, loaded.weights, {}), {}, list(loaded.weights)
    else:
        reader, saved, order = open_checkpoint(source)
    description = saved.get("model_description", {})
    peft = {name: json.loads(text) for name, text in description.get("peft_config", {}).items()}
    if merge and not peft:
        raise ExportError(f"--merge: {source} is not a LoRA / prefix-tuning checkpoint (no adapter config recorded)")
    if not peft and "frozen_fingerprint" in saved:
        raise ExportError(f"{source} was saved without its frozen parameters (exclude_frozen_parameters): it cannot "
                          "be exported as a whole model")
    if peft and "frozen_fingerprint" in saved and merge:
        raise ExportError(f"--merge: {source} was saved without its frozen base (exclude_frozen_parameters): it holds "
                          "the adapter only; export the adapter, then merge it into the base with PEFT")
    staging = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        if peft and not merge:
            adapter, config = next(iter(peft.items()))
            trainable = saved.get("trainable_names", [n for n in order if f".{adapter}." in n])
            items, stem = _adapter_items(reader, order, trainable, adapter, config), "adapter_model"
            (staging / "adapter_config.json").write_text(json.dumps(config, indent=2))
        else:
            items = _merged_items(reader, order, next(iter(peft.values()))) if merge else \
                ((name, reader.full(name)) for name in order)
            stem = "model"
        writer = ShardWriter(staging, max_shard_bytes, stem)
        for name, tensor in items:
            writer.add(name, tensor.to(DTYPES[dtype]) if dtype else tensor.clone())
        files = writer.finish()
        if "hf_config" in description and stem == "model":
            config = json.loads(description["hf_config"])
            if dtype:
                config["torch_dtype"] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
            (staging / "config.json").write_text(json.dumps(config, indent=2))
            files.append("config.json")
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return sorted(p.name for p in out_dir.iterdir())
