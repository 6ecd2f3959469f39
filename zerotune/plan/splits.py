"""The model-parallel splits the auto layout weighs: tensor parallelism, pipeline stages, and both, each profiled.

A split is (tensor-parallel size, pipeline stages). Tensor parallelism stays inside a node (its all-reduces
run on every block, over the node's fast links), so its size is a power of two up to the ranks per node
that divides the world; pipeline stages are a power of two up to 8 that leaves every stage a layer; a split
uses tp x pp ranks, which must divide the world (the rest is data parallelism).

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
                   ranks_per_node: int) -> tuple[dict[tuple[int, int], ModelProfile], list[str]]:
    """{(tp, pp): profile of one rank} for every split worth weighing, and why the others are left out.
    ``build`` makes a fresh meta model (a trace consumes the one it is given)."""
    skipped: list[str] = []
    profiles: dict[tuple[int, int], ModelProfile] = {}
    for tp in (1, *SIZES):
        if tp > 1 and (tp > ranks_per_node or world % tp):
            continue
        model = build()
        try:
            unstaged = profile_model(model, seq_len, precision, task, tp=tp)  # (after it, ``model`` is split)
        except PlanModelError as error:
            skipped.append(f"tensor parallel {tp}: {error}")
            continue
        profiles[(tp, 1)] = unstaged
        for pp in SIZES:
            if world % (tp * pp):
                continue
            try:
                profiles[(tp, pp)] = dataclasses.replace(unstaged, stages=tuple(stage_shares(model, pp)))
            except (TypeError, ValueError) as error:  # no layers zerotune.pipe can cut, fewer layers than stages
                skipped.append(f"{f'tensor parallel {tp} x ' if tp > 1 else ''}pipeline stages {pp}: "
                               f"{str(error).splitlines()[0]}")
    return profiles, skipped
