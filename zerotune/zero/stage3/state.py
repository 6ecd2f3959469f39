"""The engine-facing state of ZeRO stage 3: fp32 masters and optimizer groups over the units' shards.

Per unit and optimizer group, one master parameter: this rank's part of that group in the
unit's trainable shard (contiguous, as ``wrap`` orders a unit's parameters by group). In fp32 it
is a view of the shard itself (no second copy); in bf16/fp16 a separate fp32 copy taken before
the model was cast. One step, as for stages 1 and 2: the schedule left each unit's reduced
gradient slice in ``grad_shard``; the global norm comes from the slices (one all-reduce); the
optimizer updates the masters; the masters are rounded into the shards. There is nothing to
all-gather after the step: the next forward gathers each unit as it needs it.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Sequence, cast

import torch
import torch.distributed as dist

from zerotune.distributed import comm
from zerotune.offload.master_placement import MasterPlacement
from zerotune.precision.policy import PrecisionPolicy
from zerotune.zero.contracts import ZeroStage
from zerotune.zero.fragments import ParamFragments
from zerotune.zero.grad_norm import ModelParallelNorm, global_grad_norm
from zerotune.zero.held import HeldStateDict
from zerotune.zero.pieces import HeldPiece, layout_pieces
from zerotune.zero.stage3.schedule import UnitScheduler
from zerotune.zero.stage3.segment import FlatSegment
from zerotune.zero.stage3.sharded_param import sharded_param_of
from zerotune.zero.stage3.unit import ParamUnit


def _group_ranges(unit: ParamUnit, group_of: dict[int, int], n_groups: int) -> list[tuple[int, int]]:
    """Per optimizer group, the ``[lo, hi)`` of this rank's trainable shard that holds it (maybe empty)."""
    segment = unit.trainable_segment()
    start, end = segment.layout.owned_range(segment.rank)
    ranges = []
    for g in range(n_groups):
        spans = [(o, o + p.numel()) for p, o in zip(segment.params, segment.layout.offsets) if group_of[id(p)] == g]
        if not spans:
            ranges.append((0, 0))
            continue
        lo, hi = max(start, spans[0][0]), min(end, spans[-1][1])
        ranges.append((lo - start, hi - start) if lo < hi else (0, 0))
    return ranges


class Stage3State(HeldStateDict, ParamFragments, ZeroStage):
    """Masters, optimizer groups and step phases over partitioned units (the engine's state interface)."""

    partitions_weights = True
    shards_masters = True
    _grad_sync: UnitScheduler  # (set by ``start_schedule``)
    _placement: MasterPlacement

    def __init__(self, trainable_groups: Sequence[Sequence[torch.nn.Parameter]], policy: PrecisionPolicy,
                 group: dist.ProcessGroup | None, placement: MasterPlacement | None = None,
                 model_parallel_norm: ModelParallelNorm | None = None) -> None:
        """Empty; ``add_unit`` each unit as it is built, then ``start_schedule`` (the masters of a unit are taken,
        the unit cast and possibly swapped out before the next is built, so memory holds one at a time).
        ``model_parallel_norm``: with tensor parallelism, how the gradient norm spans the tp ranks."""
        self.units: list[ParamUnit] = []
        self.policy = policy
        self._placement = placement or MasterPlacement()
        self.separate = self._placement.separate_masters(policy.mixed)
        self.group = group
        self._groups = [list(g) for g in trainable_groups]
        self._group_of = {id(p): g for g, params in enumerate(self._groups) for p in params}
        self.master_flats: dict[int, torch.Tensor] = {}
        self._slots: list[tuple[int, ParamUnit | None, int, int]] = []  # (group, unit, lo, hi), one per master
        self.masters: list[torch.nn.Parameter] = []
        self._model_norm = model_parallel_norm
        self._norm_skip: list[list[tuple[int, int]]] = []  # per master: the ranges another tp rank counts

    def add_unit(self, unit: ParamUnit) -> None:
        """Take the unit's masters (its fp32 values, before the cast), then cast it to the model dtype."""
        self.units.append(unit)
        if unit.trainable is not None:
            flat = self._placement.place(unit.trainable.local) if self.separate else unit.trainable.local
            first = len(self._slots)
            for g, (lo, hi) in enumerate(_group_ranges(unit, self._group_of, len(self._groups))):
                if hi > lo:
                    self._slots.append((g, unit, lo, hi))
                    self.masters.append(torch.nn.Parameter(flat[lo:hi]))
                    self._norm_skip.append(self._counted_elsewhere(unit, lo, hi))
            if self.separate:
                slots = range(first, len(self._slots))
                writers = [partial(self._write_shard, i) for i in slots]
                self._placement.adopt(self.masters[first:], writers)
                unit.trainable.on_local_changed.append(partial(self._refresh_masters, unit))
            if self._placement.resident:  # (else the values live in the placement's files)
                self.master_flats[id(unit)] = flat
        unit.cast_(self.policy.param_dtype)

    def start_schedule(self, make_scheduler: Callable[[Callable[[ParamUnit], None]], UnitScheduler]) -> None:
        """Every rank keeps every optimizer group, if only with an empty master; ``make_scheduler(on_final_grad)``
        builds the units' scheduler, whose ``on_final_grad`` copies each unit's final gradient to the host (host
        offload) as soon as its last reduce-scatter is done."""
        for g in range(len(self._groups)):
            if not any(slot[0] == g for slot in self._slots):
                self._slots.append((g, None, 0, 0))
                self.masters.append(torch.nn.Parameter(torch.zeros(0, dtype=torch.float32)))
                self._norm_skip.append([])
        self._placement.enable_staging(self.masters, [hi - lo for _, _, lo, hi in self._slots])
        slots_of: dict[int, list[int]] = {}
        for index, (_, unit, _, _) in enumerate(self._slots):
            if unit is not None:
                slots_of.setdefault(id(unit), []).append(index)

        def stage(unit: ParamUnit) -> None:
            for index in slots_of.get(id(unit), []):
                _, _, lo, hi = self._slots[index]
                self._placement.stage(index, 0, unit.gradient_shard()[lo:hi])
        self._grad_sync = make_scheduler(stage)

    def release_gathered(self) -> None:
        for unit in self.units:
            unit.release()

    def detach_forward_hooks(self) -> None:
        self._grad_sync.detach_forward_hooks()

    def attach_forward_hooks(self) -> None:
        self._grad_sync.attach_forward_hooks()

    def forward_hook_handles(self) -> list:
        return list(self._grad_sync.forward_hooks)

    def _write_shard(self, slot: int, lo: int, values: torch.Tensor) -> None:
        """Round ``values`` into master ``slot``'s part of its unit's shard, at offset ``lo``."""
        _, unit, start, _ = self._slots[slot]
        if unit is not None:
            unit.trainable_segment().write_local_range(start + lo, values)

    @torch.no_grad()
    def _refresh_masters(self, unit: ParamUnit) -> None:
        local = unit.trainable_segment().read_local()
        if self._placement.resident:
            self.master_flats[id(unit)].copy_(local)
            return
        for slot, (_, owner, lo, hi) in enumerate(self._slots):
            if owner is unit:
                self._placement.refresh(slot, local[lo:hi])

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for group in self._groups for p in group]

    def master_pieces(self) -> list[list[HeldPiece]]:
        """Master i is ``[lo, hi)`` of this rank's shard of its unit's trainable segment (or empty)."""
        pieces: list[list[HeldPiece]] = []
        for _, unit, lo, hi in self._slots:
            if unit is None:
                pieces.append([])
                continue
            segment = unit.trainable_segment()
            start = segment.layout.owned_range(segment.rank)[0]
            pieces.append(layout_pieces(segment.params, segment.layout, start + lo, start + hi))
        return pieces

    def weight_pieces(self) -> list[tuple[FlatSegment, list[HeldPiece]]]:
        """Every segment (trainable and frozen) with the parameter parts in this rank's shard of it."""
        return [(segment, layout_pieces(segment.params, segment.layout, *segment.layout.owned_range(segment.rank)))
                for unit in self.units for segment in unit.segments]

    def optimizer_groups(self, groups: Sequence[dict]) -> list[dict]:
        """The user's param groups (hyperparameters kept) with this rank's master slices as parameters."""
        return [{**{k: v for k, v in group.items() if k != "params"},
                 "params": [p for slot, ((g, *_), m) in enumerate(zip(self._slots, self.masters)) if g == index
                            for p in self._placement.optimizer_params(slot, m)]}
                for index, group in enumerate(groups)]

    def step_grads(self) -> list[torch.Tensor]:
        """fp32 gradients of the masters (a transient fp32 copy when training in bf16/fp16; the host copies
        made during backward with host offload)."""
        staged = self._placement.staged_grads()
        if staged is not None:
            return staged
        grads = self.master_grads()
        return grads if self._placement.streams_grads else [g.float() for g in grads]  # (NVMe: chunk by chunk)

    def master_grads(self) -> list[torch.Tensor]:
        """Each master's part of its unit's reduced gradient shard, in the model dtype (complete after backward)."""
        return [unit.gradient_shard()[lo:hi] if unit is not None else master.new_zeros(0)
                for (_, unit, lo, hi), master in zip(self._slots, self.masters)]

    def write_weight(self, param: torch.Tensor, lo: int, values: torch.Tensor) -> None:
        """Round the elements of ``[lo, lo + n)`` that lie in this rank's shard into it (in memory or its swap file);
        a gathered copy is released, to be gathered with the new values when next used."""
        sharded = sharded_param_of(param)
        if sharded is None:
            raise ValueError(f"a parameter of shape {tuple(param.shape)} is not partitioned by ZeRO stage 3: "
                             "its values cannot be written into a shard")
        segment = cast(FlatSegment, sharded.segment)  # (a sharded parameter's segment is the FlatSegment that made it)
        start, end = segment.layout.owned_range(segment.rank)
        first, last = max(start, sharded.offset + lo), min(end, sharded.offset + lo + values.numel())
        if first < last:
            at = sharded.offset + lo
            segment.write_local_range(first - start, values[first - at:last - at])
        if segment.gathered:
            segment.release()

    def _counted_elsewhere(self, unit: ParamUnit, lo: int, hi: int) -> list[tuple[int, int]]:
        """The ranges of the master over ``[lo, hi)`` of ``unit``'s shard that another tp rank counts in the norm
        (a tp-replicated LayerNorm or row bias: the same gradient on every tp rank)."""
        if self._model_norm is None:
            return []
        segment = unit.trainable_segment()
        start = segment.layout.owned_range(segment.rank)[0]
        counted_here = self._model_norm.counted_here
        return [(piece.flat_offset - start - lo, piece.flat_offset - start - lo + piece.length)
                for piece in segment.layout.pieces_in(start + lo, start + hi)
                if not counted_here(segment.params[piece.param])]

    def _norm(self, grads: Sequence[torch.Tensor], skip: Sequence[list[tuple[int, int]]]) -> float:
        model_groups = self._model_norm.groups if self._model_norm is not None else ()
        return global_grad_norm(grads, shard_group=self.group, model_groups=model_groups,
                                skip=skip if self._model_norm is not None else None)

    def grad_norm(self, grads: Sequence[torch.Tensor]) -> float:
        return self._norm(grads, self._norm_skip)

    def group_grad_norms(self) -> list[float]:
        """The L2 norm of each optimizer param group's current gradient (a collective per group): what
        DeepSpeed's ``_get_norm_groups()`` reports, read between backward and step."""
        grads = self.master_grads()
        chosen = [[i for i, (g, *_) in enumerate(self._slots) if g == group] for group in range(len(self._groups))]
        return [self._norm([grads[i] for i in slots], [self._norm_skip[i] for i in slots]) for slots in chosen]

    def attach(self, grads: Sequence[torch.Tensor], coefficient: float = 1.0) -> None:
        self._placement.attach(self.masters, grads, coefficient)

    @torch.no_grad()
    def update_model(self) -> None:
        """Round the masters into the shards; units gather the new values when next used."""
        if self.separate and self._placement.resident:  # (NVMe offload rounded each chunk as it stepped)
            for unit in self.units:
                if unit.trainable is not None:
                    unit.trainable.overwrite_local(self.master_flats[id(unit)], notify=False)
        self._grad_sync.after_step()

    @torch.no_grad()
    def reload_from_model(self) -> None:
        """Refresh the masters from the shards (after weights were loaded into them)."""
        if self.separate:
            for unit in self.units:
                if unit.trainable is not None:
                    self._refresh_masters(unit)
        self._grad_sync.after_step()

    def first_nonfinite_param(self, names: dict[int, str]) -> str:
        """Name of the first parameter (unit order, over all ranks' slices) with an inf/nan gradient."""
        local = None
        for unit in self.units:
            if unit.trainable is None or local:
                continue
            for sharded in unit.trainable.sharded:
                lo, hi, _ = sharded.local_piece()
                start = unit.trainable.layout.owned_range(unit.trainable.rank)[0]
                begin = sharded.offset + lo - start
                if hi > lo and not torch.isfinite(unit.gradient_shard()[begin:begin + hi - lo]).all():
                    local = names.get(id(sharded.param), "<unnamed>")
                    break
        found = [str(name) for name in comm.all_gather_object(local, self.group) if name]
        return found[0] if found else "<none found>"

    def master_bytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.master_flats.values()) if self.separate else 0

    def partitioned_param_bytes(self) -> int:
        """This rank's parameter shards (gathered buffers are counted as communication buffers)."""
        return sum(s.local_bytes() for u in self.units for s in u.segments)

    def zero_grad(self) -> None:
        self._grad_sync.zero_grad()
        self._placement.clear_staging()
        for master in self.masters:
            master.grad = None
