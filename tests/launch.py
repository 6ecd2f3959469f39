"""Run a client script under ``zerotune run`` (torchrun) and collect the JSON line each rank prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = ROOT / "tests" / "deepspeed_clients"


def run_client(script: str, *script_args: str, nproc: int = 2, as_deepspeed: bool = True,
               timeout: int = 300) -> list[dict]:
    """Rank-ordered JSON rows of ``tests/deepspeed_clients/<script>``; a failed launch shows its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "zerotune.cli.main", "run", *(["--as-deepspeed"] if as_deepspeed else []),
               "--nproc_per_node", str(nproc), str(CLIENTS / script), *script_args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = _rank_rows(done.stdout)
    assert len(rows) == nproc, done.stdout[-3000:]
    return sorted(rows, key=lambda row: row["rank"])


def _rank_rows(text: str) -> list[dict]:
    """Every ``{"rank": ...}`` object in the ranks' merged output. Each rank prints its row with one
    write (atomic on a pipe), but the newline is a second write, so two rows can share a line."""
    decoder, rows = json.JSONDecoder(), []
    start = text.find('{"rank"')
    while start != -1:
        row, end = decoder.raw_decode(text, start)
        rows.append(row)
        start = text.find('{"rank"', end)
    return rows
