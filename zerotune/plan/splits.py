"""The model-parallel splits the auto layout weighs: tensor parallelism or pipeline stages, each profiled.

A split is (tensor-parallel size, pipeline stages). Tensor parallelism stays inside a node (its all-reduces
run on every block, over the node's fast links), so its size is a power of two up to the ranks per node
that divides the world; pipeline stages are a power of two up to 8 that divides the world and leaves every
stage a layer. The two are weighed apart, not composed (``zerotune plan`` models them apart).

Each tensor-parallel size needs its own trace (zerotune's ``apply_autotp`` splits the meta model, and the
split forward is what is traced), so the model is built once per size; pipeline splits share the unsplit
trace and only cut it into stages. A split the model does not allow (heads that do not divide, no layers
``zerotune.pipe`` can cut) is left out, with the reason.
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
    model = build()
    skipped: list[str] = []
    stages: dict[int, tuple] = {}
    for pp in SIZES:
        if world % pp:
            continue
        try:
            stages[pp] = tuple(stage_shares(model, pp))
        except (TypeError, ValueError) as error:  # no layers zerotune.pipe can cut, fewer layers than stages
            skipped.append(f"pipeline stages {pp}: {str(error).splitlines()[0]}")
    unsplit = profile_model(model, seq_len, precision, task)
    profiles = {(1, 1): unsplit}
    profiles.update({(1, pp): dataclasses.replace(unsplit, stages=shares) for pp, shares in stages.items()})
    for tp in SIZES:
        if tp > ranks_per_node or world % tp:
            continue
        try:
            profiles[(tp, 1)] = profile_model(build(), seq_len, precision, task, tp=tp)
        except PlanModelError as error:
            skipped.append(f"tensor parallel {tp}: {error}")
    return profiles, skipped
