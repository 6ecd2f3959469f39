"""Running a scripts/ecosystem/TOOL_case.py from a test (the tool installed in this environment): its JSON
summary (scripts/ecosystem/common.py ``drive``), the ranks' output of a failed mode under TMP/failures.log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_case(tool: str, workdir: Path, *args: str, timeout: int = 1900) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "ECOSYSTEM_LOG": str(workdir / "failures.log"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    case = ROOT / "scripts" / "ecosystem" / f"{tool}_case.py"
    done = subprocess.run([sys.executable, str(case), "--workdir", str(workdir), "--timeout", "600", *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
