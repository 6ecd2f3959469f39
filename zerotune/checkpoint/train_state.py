"""What a checkpoint saves and restores, as one typed object the engine hands over: the train state.

Checkpoint code never sees the engine. The engine builds a ``TrainState`` (``EngineCore.train_state()``) with
the ZeRO stage, optimizer, LR scheduler, loss scaler, counters, the curriculum's position, where this rank sits
in the mesh and the ``checkpoint`` section of the config; saving reads it, loading fills in what it restores
(``counters``, ``curriculum``) and the engine applies those back (``EngineCore.apply_train_state``). Everything
else a load changes -- weights, masters, optimizer and scheduler state, the loss scale, RNG -- is changed in
place through the objects the state holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from zerotune.distributed.compression import TopKCompressor
from zerotune.distributed.mesh import ProcessMesh
from zerotune.precision.loss_scaler import DynamicLossScaler, StaticLossScaler
from zerotune.zero.contracts import ZeroStage


@dataclass
class Counters:
    """The engine's step counters, saved and restored as they are."""

    global_steps: int = 0
    global_samples: int = 0
    micro_steps: int = 0
    skipped_steps: int = 0


@dataclass
class CheckpointSettings:
    """The ``checkpoint`` section's keys that saving and loading act on."""

    tag_validation: str = "Warn"
    keep_last: int | None = None


@dataclass
class TrainState:
    """One rank's training state, as a checkpoint sees it (module docstring)."""

    module: torch.nn.Module
    stage: ZeroStage
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: Any
    loss_scaler: StaticLossScaler | DynamicLossScaler
    param_names: dict[int, str]
    """``id(parameter)`` -> its name in the model (the key every piece is saved under)."""
    mesh: ProcessMesh
    rank: int
    world_size: int
    device: torch.device
    precision: str
    """``fp32`` / ``fp16`` / ``bf16``: the layout record, and whether masters are separate (mixed)."""
    mixed_precision: bool
    zero_stage: int
    """Recorded with the layout (any saved layout loads at any other)."""
    gradient_accumulation_steps: int
    config: dict
    """The run's config, saved beside the weights for reference (``zerotune export`` reads it)."""
    settings: CheckpointSettings
    counters: Counters
    curriculum: dict = field(default_factory=dict)
    compressor: TopKCompressor | None = None
    sparse_tensor_module_names: list[str] = field(default_factory=list)
    """DeepSpeed's record of the embeddings ``sparse_gradients`` covered; a load takes the saved one (as
    DeepSpeed's engine does) -- a report only: zerotune reduces every gradient dense."""

    @property
    def dp_world_size(self) -> int:
        return self.mesh.size("dp")

    @property
    def sharded(self) -> bool:
        """Masters and optimizer state are split over the data-parallel ranks: each rank saves its own."""
        return self.stage.shards_masters

    def group_hyperparameters(self) -> list[dict] | None:
        """Each optimizer group's settings (lr, betas, ...): the same groups exist at every layout."""
        if self.optimizer is None:
            return None
        return [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
