"""ZeRO stages 1 and 2: fp32 master weights and optimizer state for this rank's slice only.

Each optimizer param group becomes one flat fp32 "master shard" parameter -- this rank's slice
of the group's flat parameters (``flat_params.FlatParamGroup``). The torch optimizer (any of
them: AdamW, SGD, a client one...) runs on these shards with each group's own
hyperparameters, so ``optimizer.param_groups[i]["lr"]`` keeps its meaning. One step:

1. the gradient sync strategy (stage 1 or 2) has left this rank's summed gradient slice;
2. the global norm comes from the slices (one all-reduce of the squared norm), so clipping
   and fp16 overflow decisions are identical on every rank;
3. the optimizer updates the master shards; the slices are rounded into the model's flat
   parameters and all-gathered (``allgather_bucket_size``) so every rank has the full model.

In fp32 the master shard is a view of the model's flat parameters: no second copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist

from zerotune.distributed import comm
from zerotune.offload.master_placement import MasterPlacement
from zerotune.precision.policy import PrecisionPolicy
from zerotune.zero.contracts import ZeroStage
from zerotune.zero.flat_params import FlatParamGroup
from zerotune.zero.fragments import ParamFragments
from zerotune.zero.grad_norm import ModelParallelNorm, global_grad_norm
from zerotune.zero.held import HeldStateDict
from zerotune.zero.partition import FlatLayout, flat_layout
from zerotune.zero.pieces import HeldPiece, layout_pieces

if TYPE_CHECKING:
    from zerotune.zero.stage1_sync import ReduceAtBoundaryGradSync
    from zerotune.zero.stage2_sync import BucketedReduceGradSync


def _own_fp32_slice(params: Sequence[torch.nn.Parameter], layout: FlatLayout, rank: int) -> torch.Tensor:
    """This rank's slice of the group's flat parameters, gathered piecewise from the (fp32) parameters."""
    start, end = layout.owned_range(rank)
    device = params[0].device if params else torch.device("cpu")
    shard = torch.zeros(end - start, dtype=torch.float32, device=device)
    for piece in layout.owned_pieces(rank):
        source = params[piece.param].detach().reshape(-1)[piece.param_offset:piece.param_offset + piece.length]
        shard[piece.flat_offset - start:piece.flat_offset - start + piece.length] = source.float()
    return shard


def _range_writer(shard: torch.Tensor):
    @torch.no_grad()
    def write(lo: int, values: torch.Tensor) -> None:
        shard[lo:lo + values.numel()].copy_(values)
    return write


class ShardedState(HeldStateDict, ParamFragments, ZeroStage):
    """Flat parameters + master shards of every param group, and the step phases that use them."""

    shards_masters = True
    _grad_sync: ReduceAtBoundaryGradSync | BucketedReduceGradSync
    _placement: MasterPlacement

    def __init__(self, group_params: Sequence[Sequence[torch.nn.Parameter]], policy: PrecisionPolicy,
                 group: dist.ProcessGroup | None, *, allgather_bucket_numel: int,
                 make_grad_sync: Callable[[list[FlatParamGroup], Callable | None],
                                           ReduceAtBoundaryGradSync | BucketedReduceGradSync],
                 placement: MasterPlacement | None = None, stage_grads: bool = False,
                 model_parallel_norm: ModelParallelNorm | None = None) -> None:
        """Call while the parameters still hold their fp32 values: masters are taken before rounding.

        ``make_grad_sync(flat_groups, on_final_grad)``: the stage's gradient sync over the flat groups;
        ``stage_grads`` (host offload at stage 2): ``on_final_grad`` copies each gradient part to the host
        as soon as its bucket is reduced, while backward goes on."""
        self.policy = policy
        self._placement = placement or MasterPlacement()
        self.separate = self._placement.separate_masters(policy.mixed)
        self.group = group
        self.rank = 0 if group is None else dist.get_rank(group)
        world = 1 if group is None else dist.get_world_size(group)
        self.allgather_bucket_numel = allgather_bucket_numel
        self.flat_groups: list[FlatParamGroup] = []
        self.masters: list[torch.nn.Parameter] = []
        for params in group_params:
            layout = flat_layout([p.numel() for p in params], world)
            fp32_slice = _own_fp32_slice(params, layout, self.rank) if self.separate else None
            fg = FlatParamGroup(params, world, self.rank, dtype=policy.param_dtype)
            self.flat_groups.append(fg)
            # fp32 without offload: the master shard *is* the model's slice (a view); else a separate fp32 copy.
            master = self._placement.place(fp32_slice) if fp32_slice is not None else fg.owned
            self.masters.append(torch.nn.Parameter(master))
        if self.separate:
            self._placement.adopt(self.masters, [_range_writer(fg.owned) for fg in self.flat_groups])
        on_final_grad = None
        if stage_grads:
            real = [max(0, min(fg.layout.owned_range(fg.rank)[1], fg.layout.total) - fg.layout.owned_range(fg.rank)[0])
                    for fg in self.flat_groups]
            self._placement.enable_staging(self.masters, real)
            on_final_grad = self._placement.stage
        self._grad_sync = make_grad_sync(self.flat_groups, on_final_grad)
        self._model_groups: list[dist.ProcessGroup] = []
        self._norm_skip: list[list[tuple[int, int]]] | None = None
        if model_parallel_norm is not None:  # a part another model-parallel rank counts is skipped here
            self._model_groups = list(model_parallel_norm.groups)
            self._norm_skip = []
            for fg in self.flat_groups:
                start, end = fg.layout.owned_range(fg.rank)
                self._norm_skip.append([(piece.flat_offset - start, piece.flat_offset - start + piece.length)
                                        for piece in fg.layout.pieces_in(start, end)
                                        if not model_parallel_norm.counted_here(fg.params[piece.param])])

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for fg in self.flat_groups for p in fg.params]

    units: list = []
    """No partitioned units below stage 3."""

    def master_pieces(self) -> list[list[HeldPiece]]:
        """Master g is this rank's slice of param group g's flat buffer."""
        return [layout_pieces(fg.params, fg.layout, *fg.layout.owned_range(fg.rank)) for fg in self.flat_groups]

    def weight_pieces(self) -> list:
        return []  # the weights are whole in the module

    def optimizer_groups(self, groups: Sequence[dict]) -> list[dict]:
        """The user's param groups (hyperparameters kept) with their master shard as the only parameter."""
        return [{**{k: v for k, v in group.items() if k != "params"},
                 "params": self._placement.optimizer_params(index, master)}
                for index, (group, master) in enumerate(zip(groups, self.masters))]

    def step_grads(self) -> list[torch.Tensor]:
        """fp32 gradients of the master shards (a transient fp32 copy when training in bf16/fp16; the host
        copies made during backward with host offload at stage 2)."""
        staged = self._placement.staged_grads()
        if staged is not None:
            return staged
        if self._placement.streams_grads:  # converted chunk by chunk in the step
            return self.master_grads()
        return [grad.float() for grad in self.master_grads()]

    def master_grads(self) -> list[torch.Tensor]:
        """Each group's gradient slice, in the parameters' dtype (complete after ``grad_sync.finish``)."""
        return [self._grad_sync.shard_grad(g) for g in range(len(self.flat_groups))]

    def grad_norm(self, grads: Sequence[torch.Tensor]) -> float:
        return global_grad_norm(grads, shard_group=self.group, model_groups=self._model_groups, skip=self._norm_skip)

    def attach(self, grads: Sequence[torch.Tensor], coefficient: float = 1.0) -> None:
        self._placement.attach(self.masters, grads, coefficient)

    @torch.no_grad()
    def update_model(self) -> None:
        """Round the updated master slices into the flat parameters, then all-gather every rank's slice."""
        for fg, master in zip(self.flat_groups, self.masters):
            if self.separate and self._placement.resident:  # (NVMe offload rounded each chunk as it stepped)
                fg.owned.copy_(master, non_blocking=master.is_pinned())  # ordered before the all-gather (same stream)
            fg.all_gather(self.group, self.allgather_bucket_numel)

    @torch.no_grad()
    def reload_from_model(self) -> None:
        """Refresh the master slices from the model (after loading weights into the module only)."""
        if self.separate:
            for index, (fg, master) in enumerate(zip(self.flat_groups, self.masters)):
                if self._placement.resident:
                    master.copy_(fg.owned)
                else:
                    self._placement.refresh(index, fg.owned)

    def first_nonfinite_param(self, names: dict[int, str]) -> str:
        """Name of the first parameter (in model order, over all ranks' slices) with an inf/nan gradient."""
        local = None
        for g, fg in enumerate(self.flat_groups):
            grad = self._grad_sync.shard_grad(g)
            start = fg.layout.owned_range(fg.rank)[0]
            for piece in fg.layout.owned_pieces(fg.rank):
                part = grad[piece.flat_offset - start:piece.flat_offset - start + piece.length]
                if not torch.isfinite(part).all():
                    local = names.get(id(fg.params[piece.param]), "<unnamed>")
                    break
            if local:
                break
        found = [str(name) for name in comm.all_gather_object(local, self.group) if name]
        return found[0] if found else "<none found>"

    def master_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.masters) if self.separate else 0  # 0 when in files

    def partitioned_param_bytes(self) -> int:
        return 0  # parameters are whole on every rank: counted from the module

    def zero_grad(self) -> None:
        self._grad_sync.zero_grad()
        self._placement.clear_staging()
        for master in self.masters:
            master.grad = None
