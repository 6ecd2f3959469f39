"""TRL's DeepSpeed path on zerotune (issue 28): SFTTrainer, DPOTrainer (its reference model through TRL's
``prepare_deepspeed``) and GRPOTrainer (generation under ZeRO 3's gathered parameters, a KL reference
model) train with ``deepspeed=`` ZeRO 2 and ZeRO 3 configs on 2 CPU ranks, and every logged loss equals
TRL's own non-DeepSpeed DDP run to 1e-5 relative. Runs scripts/ecosystem/trl_case.py (what
scripts/ecosystem_check.sh trl runs in a venv of its own) where TRL is installed; skipped elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CASE = ROOT / "scripts" / "ecosystem" / "trl_case.py"


def test_trl_trainers_on_zerotune_match_their_non_deepspeed_run(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "ECOSYSTEM_LOG": str(tmp_path / "failures.log"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(CASE), "--workdir", str(tmp_path), "--timeout", "600"],
                          capture_output=True, text=True, timeout=1900, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["reference"] == {"sft": 3, "dpo": 3, "grpo": 3, "grpo reward": 3}, summary
    assert summary["zero2"] == "ok" and summary["zero3"] == "ok", summary
    assert summary["max_rel"] <= 1e-5, summary
