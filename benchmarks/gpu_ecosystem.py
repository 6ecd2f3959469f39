"""gpu_check's ecosystem section: the DeepSpeed paths of PyTorch Lightning and ``accelerate launch`` that
their own code keeps off a CPU-only host (scripts/ecosystem/lightning_case.py, accelerate_case.py say where),
run unchanged on one GPU with zerotune behind ``import deepspeed`` (``zerotune deepspeed-alias install`` in this
environment: both tools look DeepSpeed up before any process starts).

- lightning: ``Trainer(accelerator="cuda", devices=1, strategy=DeepSpeedStrategy(stage=N)).fit`` at ZeRO 2 and
  3 against the same Trainer with ``strategy="ddp"``: per-step losses, fp32 (1e-5), a zerotune engine;
- accelerate: ``accelerate launch --config_file`` a ``distributed_type: DEEPSPEED`` file (ZeRO 2, one process)
  with a plain ``Accelerator()`` script: it runs and trains on a zerotune engine.

Each is skipped (verdict "skipped") where the tool is not importable or ``import deepspeed`` finds nothing.
Runs in subprocesses: gpu_check's own process group stays as it is.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ECOSYSTEM = ROOT / "scripts" / "ecosystem"
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_report import FP32_TOLERANCE, Row, parity_row  # noqa: E402  (the root is on the path now)


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "4", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            "NVIDIA_TF32_OVERRIDE": "0",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _missing(tool: str) -> str:
    if importlib.util.find_spec(tool) is None:
        return f"{tool} not installed"
    if importlib.util.find_spec("deepspeed") is None:
        return "no `import deepspeed` here: run `zerotune deepspeed-alias install`"
    return ""


def _rows(text: str) -> list[dict]:
    sys.path.insert(0, str(ECOSYSTEM))
    from common import rank_rows

    return rank_rows(text)


def lightning_rows(steps: int = 3, timeout: int = 300) -> list[Row]:
    if why := _missing("lightning"):
        return [Row("ecosystem", "lightning DeepSpeedStrategy", "skipped", {"why": why})]
    losses, rows = {}, []
    for mode in ("ddp", "zero2", "zero3"):
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                   str(ECOSYSTEM / "lightning_case.py"), "--worker", "--mode", mode, "--steps", str(steps),
                   "--accelerator", "cuda", "--devices", "1"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_env())
        found = _rows(done.stdout) if done.returncode == 0 else []
        if not found or found[0].get("stop"):
            why = found[0]["stop"] if found else (done.stderr.strip().splitlines() or ["?"])[-1]
            rows.append(Row("ecosystem", f"lightning {mode}", "ERROR", {"error": str(why)[:200]}))
            continue
        losses[mode] = found[0]["losses"]["fit rank 0"]
        if mode != "ddp":
            row = parity_row(f"lightning DeepSpeedStrategy ZeRO {mode[-1]}", losses[mode], losses.get("ddp", []),
                             FP32_TOLERANCE)
            row.section = "ecosystem"
            row.figures["engine"] = found[0]["engines"].get("fit")
            rows.append(row)
    return rows


def accelerate_rows(steps: int = 3, timeout: int = 300) -> list[Row]:
    if why := _missing("accelerate"):
        return [Row("ecosystem", "accelerate launch DEEPSPEED", "skipped", {"why": why})]
    sys.path.insert(0, str(ECOSYSTEM))
    os.environ.update({k: v for k, v in _env().items() if k == "PYTHONPATH"})
    from accelerate_case import launch_unchanged

    with tempfile.TemporaryDirectory() as workdir:
        status, found = launch_unchanged(sys.executable, Path(workdir), steps, 2, timeout, nproc=1, use_cpu=False)
    engine = found[0]["engines"].get("plugin", "") if found else ""
    ok = status == "ran" and engine.startswith("zerotune.")
    return [Row("ecosystem", "accelerate launch DEEPSPEED ZeRO 2", "ran" if ok else "ERROR",
                     {"engine": engine, "losses": found[0]["losses"]["plugin"] if found else None,
                      **({} if ok else {"error": status[:200]})})]


def ecosystem_rows() -> list[Row]:
    """gpu_check's rows for this section; an error in one tool is a row, the rest still runs."""
    rows = []
    for part in (lightning_rows, accelerate_rows):
        try:
            rows += part()
        except Exception as error:  # noqa: BLE001 - reported as a row
            rows.append(Row("ecosystem", "ecosystem", "ERROR", {"error": f"{type(error).__name__}: {error}"[:200]}))
    return rows


if __name__ == "__main__":  # on its own: python benchmarks/gpu_ecosystem.py
    print(json.dumps([vars(row) for row in ecosystem_rows()], indent=1, default=str))
