"""Ray Train's DeepSpeed path on zerotune (issue 28): a ``TorchTrainer`` whose ``train_loop_per_worker`` calls
``deepspeed.initialize`` trains on 2 CPU Ray workers at ZeRO 2 and ZeRO 3, each worker on a zerotune engine
(``import deepspeed`` in Ray's own worker processes), and every step's loss equals the same loop with plain
DDP (``ray.train.torch.prepare_model``) to 1e-5 relative. Runs scripts/ecosystem/ray_case.py (what
scripts/ecosystem_check.sh ray runs in a venv with the alias installed) where Ray is installed and ``import
deepspeed`` resolves (``zerotune deepspeed-alias install``); skipped elsewhere."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.ecosystem import run_case

pytest.importorskip("ray.train.torch")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="Ray's workers need the persistent alias: zerotune deepspeed-alias install")]


def test_ray_train_deepspeed_loop_on_zerotune_matches_its_ddp_loop(tmp_path: Path) -> None:
    summary = run_case("ray", tmp_path)
    assert summary["reference"] == {"train": 3}, summary
    assert summary["zero2"] == "ok" and summary["zero3"] == "ok", summary
    assert summary["zero2_engines"] == summary["zero3_engines"] == {"train": "zerotune.engine.Engine"}, summary
    assert summary["max_rel"] <= 1e-5, summary
