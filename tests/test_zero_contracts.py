"""Every ZeRO stage's state, gradient sync and master placement provides the declared contracts
(``zerotune/zero/contracts.py``), and what a state says it holds covers its masters exactly."""

from __future__ import annotations

import pytest

import zerotune
from tests.harness import run_distributed
from tests.models import make_gpt2
from zerotune.offload.master_placement import MasterPlacement as HostPlacement
from zerotune.offload.nvme_optimizer import NvmePlacement
from zerotune.zero.contracts import GradSync, MasterPlacement, ZeroState


def test_placements_provide_the_placement_contract() -> None:
    assert isinstance(HostPlacement(), MasterPlacement)
    for name in ("read_master", "write_master", "optimizer_params", "attach", "step"):
        assert callable(getattr(NvmePlacement, name))


def _contracts(stage: int) -> dict:
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=config)
    state = engine.state
    covered = [sum(piece.length for piece in pieces) for pieces in state.master_pieces()]
    real = [sum(piece.length for pieces in state.master_pieces() for piece in pieces)]
    trainable = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in state.params)
    result = {"state": isinstance(state, ZeroState), "sync": isinstance(state.grad_sync, GradSync),
              "placement": isinstance(state.placement, MasterPlacement),
              "pieces_fit": all(c <= m.numel() for c, m in zip(covered, state.masters)),
              "held": real[0], "trainable": trainable, "units": len(state.units)}
    engine.destroy()
    return result


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_provides_the_contracts_and_its_pieces_cover_the_model(stage: int) -> None:
    ranks = run_distributed(_contracts, 2, stage)
    for result in ranks:
        assert result["state"] and result["sync"] and result["placement"] and result["pieces_fit"]
        assert (result["units"] > 0) == (stage == 3)
    held = [r["held"] for r in ranks]
    # stage 0 replicates (each rank holds everything); stages 1-3 split the trainable elements exactly
    assert held == [ranks[0]["trainable"]] * 2 if stage == 0 else sum(held) == ranks[0]["trainable"]
