"""What each file of an engine checkpoint holds, and how each part is taken from and put back into a train state
(``train_state.py``).

Layout of ``<save_dir>/<tag>/`` (written through ``checkpoint.atomic``):
* ``model_states.pt``   (rank 0; ``model_states_stage{s}.pt`` per pipeline stage) module state dict by
                        parameter name (tensor-parallel shards joined into full tensors; without the
                        ZeRO-3-partitioned weights), counters, loss scaler, LR scheduler, the optimizer
                        groups' settings, client state, the config and the layout it was saved on;
* ``shard_rank{r}.pt``  (``checkpoint/logical.py``) the parameter pieces rank r holds, by name: fp32
                        masters and optimizer state (stage 0: the first replica only), stage-3 weights;
* ``compression_rank{r}.pt`` (every rank, with ``gradient_compression`` or OneBitAdam) the error-feedback
                        state: Top-K residuals, OneBitAdam's worker / server errors and step count;
* ``rng_state_rank{r}.pt`` (every rank) torch / CUDA / Python / NumPy generators, so dropout
                        and sampling continue as if never interrupted.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path
from typing import Iterable, Protocol, runtime_checkable

import numpy as np
import torch

from zerotune.checkpoint.atomic import CheckpointError
from zerotune.checkpoint.train_state import TrainState
from zerotune.parallel.tensor.state_dict import iter_full_tensors
from zerotune.zero.stage3.sharded_param import sharded_param_of

MODEL_FILE_PATTERN = re.compile(r"model_states(_stage\d+)?\.pt")


@runtime_checkable
class ErrorFeedbackOptimizer(Protocol):
    """An optimizer with per-rank error-feedback state (OneBitAdam): saved in ``compression_rank{r}.pt``."""

    @property
    def takes_local_gradients(self) -> bool: ...

    def error_state_dict(self) -> dict: ...

    def load_error_state_dict(self, state: dict, device: torch.device) -> None: ...


def model_file(train: TrainState) -> str:
    """One module file, or one per pipeline stage (each holds its own layers)."""
    return model_file_name(train.mesh.rank("pp") if train.mesh.size("pp") > 1 else None)


def model_file_name(pipeline_stage: int | None = None) -> str:
    """The module file's name: ``model_states.pt``, or ``model_states_stage{s}.pt`` for pipeline stage ``s``."""
    return "model_states.pt" if pipeline_stage is None else f"model_states_stage{pipeline_stage}.pt"


def compression_file(rank: int) -> str:
    return f"compression_rank{rank}.pt"


def compression_state(train: TrainState) -> dict:
    """This rank's error-feedback state: Top-K residuals and OneBitAdam's worker / server errors."""
    state = {}
    if train.compressor is not None:
        state["topk"] = train.compressor.state_dict()
    if isinstance(train.optimizer, ErrorFeedbackOptimizer):
        state["onebit"] = train.optimizer.error_state_dict()
    return state


def load_compression_state(train: TrainState, saved: dict) -> None:
    if train.compressor is not None and "topk" in saved:
        train.compressor.load_state_dict(saved["topk"], train.device)
    if isinstance(train.optimizer, ErrorFeedbackOptimizer) and "onebit" in saved:
        train.optimizer.load_error_state_dict(saved["onebit"], train.device)
        train.stage.use_local_gradients(train.optimizer.takes_local_gradients)


def rng_file(rank: int) -> str:
    return f"rng_state_rank{rank}.pt"


def rng_state() -> dict:
    """Every generator, as tensors, numbers and tuples only (so it loads with ``weights_only``)."""
    name, keys, position, has_gauss, cached = _numpy_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached))}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _numpy_state() -> tuple[str, np.ndarray, int, int, float]:
    """NumPy's global generator state as its legacy tuple (the global generator is always MT19937, which has one)."""
    state = np.random.get_state(legacy=True)
    if isinstance(state, dict):
        raise CheckpointError(f"NumPy's global generator is {state.get('bit_generator')}, not MT19937: its state "
                              "cannot be saved as the legacy tuple")
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def module_state(train: TrainState) -> dict:
    """The module's state dict without ZeRO-3-partitioned parameters (their shards are saved per rank);
    tensor-parallel shards joined into full tensors (a collective over the tp group)."""
    items = [(key, value) for key, value in train.module.state_dict(keep_vars=True).items()
             if sharded_param_of(value) is None]
    return dict(iter_full_tensors(items, train.mesh.group("tp")))


def frozen_names(train: TrainState) -> list[str]:
    return [name for name, param in train.module.named_parameters() if not param.requires_grad]


def frozen_fingerprint(train: TrainState, module_state: dict) -> dict:
    """Names, shapes, dtypes and one SHA-256 of the frozen parameters' full values: what a checkpoint
    saved without the frozen base records, so a resume can tell it is the same base. Only the frozen parameters
    ``module_state`` holds count: a module whose own ``state_dict`` leaves one out never saves it either."""
    digest, shapes = hashlib.sha256(), {}
    for name in frozen_names(train):
        if name not in module_state:
            continue
        tensor = module_state[name].detach().contiguous().cpu()
        shapes[name] = [list(tensor.shape), str(tensor.dtype)]
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return {"shapes": shapes, "sha256": digest.hexdigest()}


def check_frozen_base(train: TrainState, saved: dict, path: Path) -> None:
    live = frozen_fingerprint(train, module_state(train))
    recorded = saved["frozen_fingerprint"]
    for name in sorted(set(live["shapes"]) | set(recorded["shapes"])):
        if live["shapes"].get(name) != recorded["shapes"].get(name):
            raise CheckpointError(f"{path} was saved without its frozen base, which does not match this model's: "
                                  f"'{name}' is {recorded['shapes'].get(name)} there and "
                                  f"{live['shapes'].get(name)} here")
    if live["sha256"] != recorded["sha256"]:
        raise CheckpointError(f"{path} was saved without its frozen base, and this model's frozen weights are not the "
                              "ones it was trained on (their SHA-256 differs): load the same base model")


def model_description(module: torch.nn.Module) -> dict:
    """JSON text of the Hugging Face model config and the PEFT adapter configs (when the module has them), so
    ``zerotune export`` can write ``config.json`` / ``adapter_config.json`` from the checkpoint alone."""
    description = {}
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        description["hf_config"] = config.to_json_string(use_diff=False)
    peft = getattr(module, "peft_config", None)
    if isinstance(peft, dict):
        description["peft_config"] = {name: json.dumps(c.to_dict(), default=_jsonable) for name, c in peft.items()}
    return description


def _jsonable(value: object) -> object:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)


def loaded_sparse_names(current: Iterable[str], saved: Iterable[str], current_params: Iterable[str],
                        saved_params: Iterable[str], *, strict: bool) -> list[str]:
    """The ``sparse_tensor_module_names`` after a load, by DeepSpeed's rule: a strict load takes the saved record;
    a non-strict one keeps this engine's names except those the checkpoint had as dense parameters, and adds the
    checkpoint's sparse names that are parameters here."""
    saved = set(saved)
    if strict:
        return sorted(saved)
    saved_params, current_params = set(saved_params), set(current_params)
    kept = {name for name in current if name not in saved_params or name in saved}
    return sorted(kept | (saved & current_params))

