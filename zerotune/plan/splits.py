"""The model-parallel splits the auto layout weighs: tensor parallelism, pipeline stages, both, and sequence
parallelism, each profiled.

A split is (tensor-parallel size, pipeline stages, sequence-parallel size). Tensor parallelism stays inside a
node (its all-reduces run on every block, over the node's fast links), so its size is a power of two up to
the ranks per node that divides the world; pipeline stages are a power of two up to 8 that leaves every
stage a layer; a split uses tp x pp ranks, which must divide the world (the rest is data parallelism).
Ulysses sequence parallelism (its all-to-alls also run in every block, inside a node) is weighed on its own,
with data parallelism around it -- zerotune runs it with tensor parallelism too, but not with pipelines,
and tensor parallelism already cuts a block's activations -- at sizes up to the ranks per node that divide
the heads and the sequence (a trace each: a rank runs 1/sp of every sequence).

Each tensor-parallel size needs its own trace (zerotune's ``apply_autotp`` splits the meta model, and the
split forward is what is traced), so the model is built once per size; the pipeline stages of a size cut
that split model (its stages hold their tensor-parallel shards) and share its trace. A split the model does
not allow (heads that do not divide, no layers ``zerotune.pipe`` can cut) is left out, with the reason.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from zerotune.plan.memory import ModelProfile, profile_model
from zerotune.plan.meta_model import PlanModelError
from zerotune.plan.pipeline import stage_shares

SIZES = (2, 4, 8)


def split_profiles(build: Callable[[], torch.nn.Module], seq_len: int, precision: str, task: str, world: int,
                   ranks_per_node: int) -> tuple[dict[tuple[int, int, int], ModelProfile], list[str]]:
    """{(tp, pp, sp): profile of one rank} for every split worth weighing, and why the others are left out.
    ``build`` makes a fresh meta model (a trace consumes the one it is given)."""
    skipped: list[str] = []
    profiles: dict[tuple[int, int, int], ModelProfile] = {}
    for tp in (1, *SIZES):
        if tp > 1 and (tp > ranks_per_node or world % tp):
            continue
        model = build()
        try:
            unstaged = profile_model(model, seq_len, precision, task, tp=tp)  # (after it, ``model`` is split)
        except PlanModelError as error:
            skipped.append(f"tensor parallel {tp}: {error}")
            continue
        profiles[(tp, 1, 1)] = unstaged
        for pp in SIZES:
            if world % (tp * pp):
                continue
            try:
                profiles[(tp, pp, 1)] = dataclasses.replace(unstaged, stages=tuple(stage_shares(model, pp)))
            except (TypeError, ValueError) as error:  # no layers zerotune.pipe can cut, fewer layers than stages
                skipped.append(f"{f'tensor parallel {tp} x ' if tp > 1 else ''}pipeline stages {pp}: "
                               f"{str(error).splitlines()[0]}")
    for sp in SIZES:  # Ulysses over ranks of a node (all-to-alls in every block), data parallel around it
        if sp > ranks_per_node or world % sp:
            continue
        try:
            profiles[(1, 1, sp)] = profile_model(build(), seq_len, precision, task, sp=sp)
        except PlanModelError as error:
            skipped.append(f"sequence parallel {sp}: {error}")
    return profiles, skipped
