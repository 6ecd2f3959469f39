"""What each file of an engine checkpoint holds, and how each part is taken from and put back into an engine.

Layout of ``<save_dir>/<tag>/`` (written through ``checkpoint.atomic``):
* ``model_states.pt``   (rank 0) module state dict by parameter name (tensor-parallel shards joined
                        into full tensors, so it loads at any tp size), counters, loss scaler,
                        LR scheduler, client state, the config and the layout it was saved on;
* ``optim_states.pt``   (rank 0, ZeRO stage 0) optimizer state and fp32 master weights keyed by
                        parameter *name* (not by position), so a reader can match them to any layout;
                        with tensor parallelism one ``optim_states_tp_rank{t}.pt`` per tp rank;
* ``optim_states_rank{r}.pt`` (every rank, ZeRO stages 1-2) that rank's optimizer shard, with
                        the parameter ranges it holds: per group, the (name, numel, offset) of
                        every parameter in the flat layout and the rank's [start, end) slice;
* ``param_shards_rank{r}.pt`` (every rank, ZeRO stage 3) that rank's parameter shards per unit
                        (``model_states.pt`` then holds only what is not partitioned: buffers);
* ``compression_rank{r}.pt`` (every rank, with ``gradient_compression`` or OneBitAdam) the error-feedback
                        state: Top-K residuals, OneBitAdam's worker / server errors and step count;
* ``rng_state_rank{r}.pt`` (every rank) torch / CUDA / Python / NumPy generators, so dropout
                        and sampling continue as if never interrupted.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from zerotune.checkpoint.atomic import CheckpointError
from zerotune.parallel.tensor.state_dict import iter_full_tensors
from zerotune.zero.stage3.sharded_param import sharded_param_of

if TYPE_CHECKING:
    from zerotune.engine import Engine

MODEL_FILE = "model_states.pt"
OPTIM_FILE = "optim_states.pt"


def stage_part(engine: Engine) -> str:
    return "" if engine.mesh.size("pp") == 1 else f"_stage{engine.mesh.rank('pp')}"


def model_file(engine: Engine) -> str:
    """One module file, or one per pipeline stage (each holds its own layers)."""
    return f"model_states{stage_part(engine)}.pt"


def optim_file(engine: Engine) -> str:
    """Stage 0: one optimizer file, or one per pipeline stage and tensor-parallel rank (different parameters)."""
    tp = "" if engine.mesh.size("tp") == 1 else f"_tp_rank{engine.mesh.rank('tp')}"
    return f"optim_states{stage_part(engine)}{tp}.pt"


def compression_file(rank: int) -> str:
    return f"compression_rank{rank}.pt"


def compression_state(engine: Engine) -> dict:
    """This rank's error-feedback state: Top-K residuals and OneBitAdam's worker / server errors."""
    state = {}
    if engine.compressor is not None:
        state["topk"] = engine.compressor.state_dict()
    if hasattr(engine.optimizer, "error_state_dict"):
        state["onebit"] = engine.optimizer.error_state_dict()
    return state


def load_compression_state(engine: Engine, saved: dict) -> None:
    if engine.compressor is not None and "topk" in saved:
        engine.compressor.load_state_dict(saved["topk"], engine.device)
    if hasattr(engine.optimizer, "load_error_state_dict") and "onebit" in saved:
        engine.optimizer.load_error_state_dict(saved["onebit"], engine.device)
        engine.grad_sync.local_only = engine.optimizer.takes_local_gradients


def rng_file(rank: int) -> str:
    return f"rng_state_rank{rank}.pt"


def rng_state() -> dict:
    """Every generator, as tensors, numbers and tuples only (so it loads with ``weights_only``)."""
    name, keys, position, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached))}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def optim_shard_file(rank: int) -> str:
    return f"optim_states_rank{rank}.pt"


def position_names(engine: Engine) -> list[str]:
    """Parameter names in the order of the optimizer's (master) parameters."""
    weights = engine.state.weights
    name_of_master = {id(weights.master_of(p)): engine.param_names[id(p)] for p in engine.state.params}
    return [name_of_master[id(m)] for group in engine.optimizer.param_groups for m in group["params"]]


def optimizer_state_by_name(engine: Engine) -> dict:
    """Stage 0: the optimizer's state dict with parameter positions replaced by parameter names."""
    order = position_names(engine)
    raw = engine.optimizer.state_dict()
    state = {order[index]: value for index, value in raw["state"].items()}
    groups = [{**group, "params": [order[i] for i in group["params"]]} for group in raw["param_groups"]]
    masters = ({engine.param_names[id(p)]: engine.state.weights.master_of(p).detach().clone()
                for p in engine.state.params} if engine.policy.mixed else {})
    return {"state": state, "param_groups": groups, "fp32_masters": masters}


def load_optimizer_state_by_name(engine: Engine, saved: dict, module_state: dict) -> None:
    """Stage 0 (names checked by ``_read_and_check``). The fp32 masters come from the checkpoint's masters,
    or, for a checkpoint saved in fp32, from its weights (exact): an fp32 checkpoint resumes in bf16/fp16."""
    order = position_names(engine)
    index_of = {name: i for i, name in enumerate(order)}
    groups = [{**group, "params": [index_of[n] for n in group["params"]]} for group in saved["param_groups"]]
    state = {index_of[name]: value for name, value in saved["state"].items()}
    engine.optimizer.load_state_dict({"state": state, "param_groups": groups})
    masters = saved["fp32_masters"] or (module_state if engine.policy.mixed else {})
    with torch.no_grad():
        for p in engine.state.params:
            name = engine.param_names[id(p)]
            if name in masters:
                engine.state.weights.master_of(p).copy_(masters[name])


def param_shard_file(rank: int) -> str:
    return f"param_shards_rank{rank}.pt"


def units(engine: Engine) -> list | None:
    """The stage-3 units (None below stage 3)."""
    return getattr(engine.state, "units", None)


def shard_layout(engine: Engine) -> list[dict]:
    """What a rank's optimizer shard covers: enough to check (and later reshape) it on load."""
    if units(engine) is not None:
        return [{"unit": unit.name,
                 "segments": [{"params": [(engine.param_names.get(id(p), "<unnamed>"), p.numel(), offset)
                                          for p, offset in zip(s.params, s.layout.offsets)],
                               "shard": s.layout.shard, "owned_range": s.layout.owned_range(s.rank)}
                              for s in unit.segments]}
                for unit in units(engine)]
    return [{"params": [(engine.param_names[id(p)], p.numel(), offset)
                        for p, offset in zip(fg.params, fg.layout.offsets)],
             "shard": fg.layout.shard, "owned_range": fg.layout.owned_range(fg.rank)}
            for fg in engine.state.flat_groups]


def swap_dir(rank: int) -> str:
    return f"optimizer_swap_rank{rank}"


def sharded_optimizer_state(engine: Engine) -> dict:
    return {"optimizer": engine.optimizer.state_dict(), "dp_world_size": engine.dp_world_size,
            "swapped_state_keys": list(getattr(engine.state.placement, "state_keys", [])),
            "layout": shard_layout(engine),
            "fp32_master_shards": [m.detach().clone() for m in engine.state.masters] if engine.state.separate else []}


def module_state(engine: Engine) -> dict:
    """The module's state dict without ZeRO-3-partitioned parameters (their shards are saved per rank);
    tensor-parallel shards joined into full tensors (a collective over the tp group)."""
    items = [(key, value) for key, value in engine.module.state_dict(keep_vars=True).items()
             if sharded_param_of(value) is None]
    return dict(iter_full_tensors(items, engine.mesh.group("tp")))


def frozen_names(engine: Engine) -> list[str]:
    return [name for name, param in engine.module.named_parameters() if not param.requires_grad]


def frozen_fingerprint(engine: Engine, module_state: dict) -> dict:
    """Names, shapes, dtypes and one SHA-256 of the frozen parameters' full values: what a checkpoint
    saved without the frozen base records, so a resume can tell it is the same base."""
    digest, shapes = hashlib.sha256(), {}
    for name in frozen_names(engine):
        tensor = module_state[name].detach().contiguous().cpu()
        shapes[name] = [list(tensor.shape), str(tensor.dtype)]
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return {"shapes": shapes, "sha256": digest.hexdigest()}


def check_frozen_base(engine: Engine, saved: dict, path: Path) -> None:
    live = frozen_fingerprint(engine, module_state(engine))
    recorded = saved["frozen_fingerprint"]
    for name in sorted(set(live["shapes"]) | set(recorded["shapes"])):
        if live["shapes"].get(name) != recorded["shapes"].get(name):
            raise CheckpointError(f"{path} was saved without its frozen base, which does not match this model's: "
                                  f"'{name}' is {recorded['shapes'].get(name)} there and {live['shapes'].get(name)} here")
    if live["sha256"] != recorded["sha256"]:
        raise CheckpointError(f"{path} was saved without its frozen base, and this model's frozen weights are not the "
                              "ones it was trained on (their SHA-256 differs): load the same base model")


def param_shards(engine: Engine) -> dict:
    return {"layout": shard_layout(engine),
            "shards": [[s.read_local() for s in unit.segments] for unit in units(engine)]}


@torch.no_grad()
def load_sharded_optimizer_state(engine: Engine, saved: dict, path: Path, module_state: dict) -> None:
    engine.optimizer.load_state_dict(saved["optimizer"])
    placement = engine.state.placement
    if not placement.resident:  # NVMe offload: masters and state are the swap files saved beside
        placement.copy_files_from(path.parent / swap_dir(engine.global_rank), saved["swapped_state_keys"])
        return
    if engine.state.separate:
        # an fp32 checkpoint has no separate masters: its weights are the exact fp32 values
        shards = saved["fp32_master_shards"] or master_shards_from_weights(engine, module_state)
        with torch.no_grad():
            for master, shard in zip(engine.state.masters, shards):
                master.copy_(shard)


def master_shards_from_weights(engine: Engine, module_state: dict) -> list[torch.Tensor]:
    """This rank's fp32 master slice of every flat group, cut from whole (fp32) weights by name."""
    shards = []
    for fg in engine.state.flat_groups:
        start, end = fg.layout.owned_range(fg.rank)
        shard = torch.zeros(end - start, dtype=torch.float32)
        for piece in fg.layout.owned_pieces(fg.rank):
            weight = module_state[engine.param_names[id(fg.params[piece.param])]].reshape(-1)
            shard[piece.flat_offset - start:piece.flat_offset - start + piece.length] = \
                weight[piece.param_offset:piece.param_offset + piece.length].float()
        shards.append(shard)
    return shards


