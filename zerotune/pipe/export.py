"""A pipeline's whole model in one file: every stage's weights, joined on rank 0 (``save_16bit_model``).

Each stage holds only its layers, and under tensor parallelism only shards of them; the file is the model a
single process would save, under the Hugging Face model's own names when the pipeline was split from one, so
``from_pretrained`` or a one-stage ``PipelineModule`` reads it back.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from zerotune.distributed import comm
from zerotune.distributed.mesh import ProcessMesh
from zerotune.parallel.tensor.state_dict import iter_full_tensors
from zerotune.pipe.module import PipelineModule


def save_whole_model(pipe: PipelineModule, mesh: ProcessMesh, global_rank: int, path: Path,
                     exclude_frozen_parameters: bool = False) -> None:
    """Rank 0 writes the whole model (tensor-parallel shards joined, the stages' parts merged) to ``path``.
    Every rank must call it: the joins and the gather are collectives."""
    entries = [(key, tensor) for key, tensor in pipe.state_dict(keep_vars=True).items()
               if not (exclude_frozen_parameters and isinstance(tensor, torch.nn.Parameter)
                       and not tensor.requires_grad)]
    names = pipe.export_names or {}
    local: dict[str, torch.Tensor] = {}
    for (key, live), (_, full) in zip(entries, iter_full_tensors(entries, mesh.group("tp"))):
        for name in names.get(id(live), [key]):
            local[name] = full.detach().to("cpu", copy=True)
    if mesh.rank("dp_sp") == 0 and mesh.rank("tp") == 0:
        merged: dict[str, torch.Tensor] = {}
        for part in comm.all_gather_object(local, mesh.group("pp")):
            merged.update(part)
        if global_rank == 0:
            write_state_dict(merged, path)
    comm.barrier()


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
