"""ZeRO stage 0 (data parallel): every rank holds all master weights and optimizer state.

The counterpart of ``sharded_state.ShardedState`` with the same methods, so the engine runs one
step recipe for every stage. Gradients come from ``AllReduceGradSync`` (fp32, already averaged
and identical on all ranks), so the global norm needs no communication.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from zerotune.offload.master_placement import MasterPlacement
from zerotune.precision.policy import MasterWeights
from zerotune.zero.allreduce_sync import AllReduceGradSync
from zerotune.zero.contracts import ZeroStage
from zerotune.zero.fragments import ParamFragments
from zerotune.zero.grad_norm import ModelParallelNorm, global_grad_norm
from zerotune.zero.held import HeldStateDict
from zerotune.zero.pieces import HeldPiece


class ReplicatedState(HeldStateDict, ParamFragments, ZeroStage):
    """Full fp32 masters (or the parameters themselves in fp32) and the all-reduce gradient sync."""

    _grad_sync: AllReduceGradSync
    _placement: MasterPlacement

    def __init__(self, weights: MasterWeights, grad_sync: AllReduceGradSync,
                 model_parallel_norm: ModelParallelNorm | None = None) -> None:
        """``weights``: the masters, taken while the parameters still held their fp32 values (before the cast);
        ``model_parallel_norm``: with tensor / pipeline parallelism, how the norm spans the model-parallel ranks."""
        self.policy = policy = weights.policy
        self.weights = weights
        self.separate = policy.mixed
        self._placement = MasterPlacement()  # stage 0 keeps masters with the parameters
        self._grad_sync = grad_sync
        self._model_groups: list[dist.ProcessGroup] = []
        self._norm_skip: list[list[tuple[int, int]]] | None = None
        if model_parallel_norm is not None:
            self._model_groups = list(model_parallel_norm.groups)
            self._norm_skip = [[(0, p.numel())] if not model_parallel_norm.counted_here(p) else [] for p in self.params]

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.weights.params

    @property  # read-only here: the masters are ``weights``' (ZeroStage declares the attribute the others set)
    def masters(self) -> list[torch.nn.Parameter]:  # type: ignore[override]
        return self.weights.masters

    shards_masters = False  # every rank holds every master whole

    def use_local_gradients(self, enabled: bool) -> None:
        """OneBitAdam after its warm-up steps on each rank's own gradient: the all-reduce is skipped."""
        self._grad_sync.use_local_gradients(enabled)

    def master_pieces(self) -> list[list[HeldPiece]]:
        """Master i is the whole of trainable parameter i."""
        return [[HeldPiece(p, 0, 0, p.numel())] for p in self.params]

    def weight_pieces(self) -> list:
        return []  # the weights are whole in the module

    def optimizer_groups(self, groups: Sequence[dict]) -> list[dict]:
        """The user's param groups with each trainable parameter replaced by its master."""
        trainable = {id(p) for p in self.params}
        return [{**group, "params": [self.weights.master_of(p) for p in group["params"] if id(p) in trainable]}
                for group in groups]

    def master_grads(self) -> list[torch.Tensor]:
        """Each parameter's fp32 gradient (a view of its bucket)."""
        return [self._grad_sync.grad_of(p) for p in self.params]

    def step_grads(self) -> list[torch.Tensor]:
        return self.master_grads()

    def grad_norm(self, grads: Sequence[torch.Tensor]) -> float:
        if self._grad_sync.local_only:  # per-rank gradients: the root mean square of the ranks' norms, the same
            group = self._grad_sync.group  # on every rank, so clipping and overflow skips stay in step
            world = 1 if group is None else dist.get_world_size(group)
            return global_grad_norm(grads, shard_group=group, model_groups=self._model_groups,
                                    skip=self._norm_skip) / math.sqrt(world)
        if self._model_groups:
            return global_grad_norm(grads, model_groups=self._model_groups, skip=self._norm_skip)
        return torch.nn.utils.get_total_norm(grads, 2.0, foreach=True).item() if grads else 0.0

    def attach(self, grads: Sequence[torch.Tensor], coefficient: float = 1.0) -> None:
        self._placement.attach(self.masters, grads, coefficient)

    def update_model(self) -> None:
        self.weights.copy_to_model()

    def reload_from_model(self) -> None:
        self.weights.copy_from_model()

    def first_nonfinite_param(self, names: dict[int, str]) -> str:
        for param in self.params:
            if not torch.isfinite(self._grad_sync.grad_of(param)).all():
                return names.get(id(param), "<unnamed>")
        return "<none found>"

    def master_bytes(self) -> int:
        return self.weights.master_bytes()

    def partitioned_param_bytes(self) -> int:
        return 0  # parameters are whole on every rank: counted from the module

    def zero_grad(self) -> None:
        self._grad_sync.zero_grad()
        for master in self.masters:
            master.grad = None
