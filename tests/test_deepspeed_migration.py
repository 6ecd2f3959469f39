"""A DeepSpeed user's running job moves to zerotune: ``engine.load_checkpoint`` and ``zerotune export`` read a
checkpoint written by DeepSpeed itself (ZeRO 1/2/3, ``tests/data/deepspeed_checkpoints``), at any zerotune layout.

Resuming continues the run: the next 3 steps' losses match a plain PyTorch run of the same model, data and
AdamW that never stopped (the fixtures were trained 2 steps by DeepSpeed 0.18.0 on 2 gloo ranks)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import zerotune
from tests.data.deepspeed_checkpoints.make_fixtures import LR, STEPS, WD
from tests.data.deepspeed_checkpoints.tiny_model import batch, make_model
from tests.harness import run_distributed
from zerotune.cli.main import main

FIXTURES = Path(__file__).parent / "data" / "deepspeed_checkpoints"
MORE, SAVED_RANKS = 3, 2


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [batch(step, rank) for rank in range(SAVED_RANKS)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _reference() -> list[float]:
    model = make_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    losses = []
    for step in range(STEPS + MORE):
        loss = model(*_global_batch(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses[STEPS:]


def _resume(directory: str, stage: int) -> dict:
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    config = {"train_micro_batch_size_per_gpu": 2 * SAVED_RANKS // world, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}, "steps_per_print": 1000}
    model = make_model()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)  # other weights: the checkpoint must replace every one
    engine, *_ = zerotune.initialize(model=model, config=config)
    engine.load_checkpoint(directory)
    steps = engine.global_steps
    losses = []
    for step in range(STEPS, STEPS + MORE):
        ids, target = _global_batch(step)
        rows = ids.shape[0] // world
        loss = engine(ids[rank * rows:(rank + 1) * rows], target[rank * rows:(rank + 1) * rows])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    engine.destroy()
    return {"losses": losses, "steps": steps}


@pytest.mark.parametrize("saved_stage, stage, world", [(1, 0, 1), (2, 2, 2), (3, 3, 2), (3, 1, 2)])
def test_a_deepspeed_checkpoint_resumes_at_any_zerotune_layout(saved_stage: int, stage: int, world: int) -> None:
    expected = _reference()
    result = run_distributed(_resume, world, str(FIXTURES / f"stage{saved_stage}"), stage)[0]
    assert result["steps"] == STEPS
    for got, want in zip(result["losses"], expected):
        assert abs(got - want) <= 1e-5 * abs(want), (result["losses"], expected)


def test_export_reads_a_deepspeed_checkpoint(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    expected = load_file(FIXTURES / "expected.safetensors")
    assert main(["export", str(FIXTURES / "stage3"), str(tmp_path / "hf")]) == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    for key, tensor in expected.items():
        if key.startswith("weight/"):
            torch.testing.assert_close(exported[key[len("weight/"):]], tensor, rtol=1e-5, atol=1e-6)


def test_a_damaged_deepspeed_checkpoint_is_one_error_on_every_rank(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES / "stage2", tmp_path / "stage2")
    tag = (tmp_path / "stage2" / "latest").read_text().strip()
    (tmp_path / "stage2" / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    messages = run_distributed(_resume_or_error, 2, str(tmp_path / "stage2"))
    assert all("zero_pp_rank_1_mp_rank_00_optim_states.pt is missing" in m for m in messages), messages


def _resume_or_error(directory: str) -> str:
    try:
        _resume(directory, 2)
        return "loaded"
    except zerotune.checkpoint.atomic.CheckpointError as error:
        return str(error)
