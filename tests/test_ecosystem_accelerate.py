"""``accelerate launch`` with a ``distributed_type: DEEPSPEED`` config file (issue 28): on a CPU-only host
accelerate's own state leaves one process under DEEPSPEED, so the launch stops at DeepSpeed's batch check --
with zerotune as with DeepSpeed itself (compared where REAL_DEEPSPEED_PYTHON names a Python with DeepSpeed);
the same script with accelerate's DeepSpeedPlugin under PartialState(cpu=True) trains at ZeRO 2 and 3 on 2 CPU
ranks with the losses of its accelerate DDP run to 1e-5. Runs scripts/ecosystem/accelerate_case.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CASE = ROOT / "scripts" / "ecosystem" / "accelerate_case.py"


def test_the_line_says_whether_zerotune_and_deepspeed_stop_alike() -> None:
    sys.path.insert(0, str(CASE.parent))
    from accelerate_case import line

    ours = ("zerotune.config.errors.BatchSizeError: zerotune config: train_batch_size: train_batch_size 2 != "
            "train_micro_batch_size_per_gpu 2 * gradient_accumulation_steps 1 * data-parallel size 2 = 4")
    real = ("AssertionError: Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
            "gradient_acc_step * world_size 2 != 2 * 1 * 2")
    summary = {"tool": "accelerate", "version": "1.16.0", "methods": ["plugin"], "reference": {"plugin": 3},
               "zero2": "ok", "zero3": "ok", "max_rel": 0.0,
               "launch": {"zerotune": ours + " [File \"/x/zerotune/config/a.py\", line 3, in f] (while: launch)",
                          "deepspeed": real + " [File \"/y/deepspeed/runtime/config.py\", line 9, in g]",
                          "deepspeed_version": "0.19.5"}}
    text = line(summary)
    assert ("accelerate limitation on CPU, same with DeepSpeed 0.19.5: both stop at the batch check train_batch_size 2"
            " != micro 2 * accumulation 1 * world 2 in deepspeed.initialize (zerotune BatchSizeError, DeepSpeed "
            "AssertionError)") in text
    assert text.endswith("ZeRO 2 ok | ZeRO 3 ok | max rel loss diff vs accelerate DDP 0.0e+00 (plugin)")
    summary["launch"]["deepspeed"] = "ValueError: other"
    assert "DIFFERS" in line(summary)


@pytest.mark.slow
def test_accelerate_deepspeed_on_zerotune(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from tests.ecosystem import run_case

    summary = run_case("accelerate", tmp_path, timeout=1300)
    assert summary["zero2"] == "ok" and summary["zero3"] == "ok", summary
    assert summary["max_rel"] <= 1e-5, summary
    if "deepspeed" in summary["launch"]:
        from accelerate_case import cause

        assert cause(summary["launch"]["zerotune"]) == cause(summary["launch"]["deepspeed"]), summary
