"""axolotl's DeepSpeed path on zerotune (issue 28): ``axolotl train`` LoRA SFT with ZeRO 2 / ZeRO 3 configs on
2 CPU ranks logs the same losses as its non-DeepSpeed run (1e-5 relative). Runs
scripts/ecosystem/axolotl_case.py where axolotl and triton are installed (scripts/ecosystem_check.sh axolotl installs
triton as import-only: axolotl/monkeypatch/trainer/utils.py:17 imports it on the trainer's path); skipped
elsewhere. axolotl 0.19.0 stops on CPU at its multi-rank device map (axolotl/utils/config/__init__.py:230) or, with
a ZeRO-3 config, at its TrainingArguments without use_cpu; the case records the stop and runs past both."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ecosystem import run_case

pytest.importorskip("axolotl")
pytest.importorskip("triton")  # axolotl/monkeypatch/trainer/utils.py imports it on the trainer's path
pytestmark = pytest.mark.slow


def test_axolotl_lora_sft_on_zerotune_matches_its_non_deepspeed_run(tmp_path: Path) -> None:
    summary = run_case("axolotl", tmp_path)
    assert summary["reference"] == {"sft": 3}, summary
    assert summary["zero2"] == "ok" and summary["zero3"] == "ok", summary
    assert summary["max_rel"] <= 1e-5, summary
