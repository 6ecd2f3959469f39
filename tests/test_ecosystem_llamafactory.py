"""LLaMA-Factory's DeepSpeed path on zerotune (issue 28): ``llamafactory-cli train`` LoRA SFT and DPO with its
shipped ds_z2 / ds_z3 configs on 2 CPU ranks log the same losses as its non-DeepSpeed run (1e-5 relative).
Runs scripts/ecosystem/llamafactory_case.py where LLaMA-Factory is installed; skipped elsewhere. With CPU torch
2.13 it stops at llamafactory/data/mm_plugin.py:30's torchaudio import (no torchaudio for torch 2.13; see
scripts/ecosystem_check.sh llamafactory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ecosystem import run_case

pytest.importorskip("llamafactory")
pytest.importorskip("torchaudio")  # llamafactory/data/mm_plugin.py imports it on every stage's path
pytestmark = pytest.mark.slow


def test_llamafactory_sft_and_dpo_on_zerotune_match_its_non_deepspeed_run(tmp_path: Path) -> None:
    summary = run_case("llamafactory", tmp_path)
    assert summary["reference"] == {"sft": 3, "dpo": 3}, summary
    assert summary["zero2"] == "ok" and summary["zero3"] == "ok", summary
    assert summary["max_rel"] <= 1e-5, summary
