"""Faults end the run in seconds, with a message that says what happened: processes are really stopped
(SIGSTOP), killed (SIGKILL) or fail (an exception), and each test measures how long the other ranks take
to end after the fault and checks what they print."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "fault_scripts" / "train.py"
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path: Path, *args: str) -> list[subprocess.Popen]:
    port = _free_port()
    ranks = []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        log = open(tmp_path / f"rank{rank}.log", "w")
        ranks.append(subprocess.Popen([sys.executable, str(SCRIPT), "--marker", str(tmp_path), *args], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    return ranks


def _wait(process: subprocess.Popen, seconds: float) -> int | None:
    try:
        return process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


def _seconds_after_fault(tmp_path: Path) -> float:
    return time.time() - float((tmp_path / "fault_time").read_text())


def _cleanup(ranks: list[subprocess.Popen]) -> None:
    for process in ranks:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()


def _run_to_the_end(tmp_path: Path, *args: str) -> tuple[list[int | None], float, list[str]]:
    """Every rank's exit status (None: still running after 60 s, then killed), the seconds from the fault to
    the end, and every rank's log."""
    ranks = _launch(tmp_path, *args)
    try:
        statuses = [_wait(process, 60) for process in ranks]
        elapsed = _seconds_after_fault(tmp_path)
    finally:
        _cleanup(ranks)
    return statuses, elapsed, [(tmp_path / f"rank{rank}.log").read_text() for rank in range(WORLD)]


def test_a_stopped_rank_makes_the_others_report_the_pending_collective_and_exit(tmp_path: Path) -> None:
    """Rank 1 is SIGSTOPped mid-run: rank 0's watchdog reports within comm_timeout_s (10 s) + its 1 s tick."""
    ranks = _launch(tmp_path, "--fault", "sigstop", "--comm-timeout", "10")
    try:
        status = _wait(ranks[0], 90)
        elapsed = _seconds_after_fault(tmp_path)
    finally:
        _cleanup(ranks)
    log = (tmp_path / "rank0.log").read_text()
    assert status == 75, log[-3000:]
    assert 10 <= elapsed <= 16, elapsed
    # Rank 0 waits where rank 1 would next meet it: the collective guard's exchange before the backward.
    assert "zerotune watchdog: rank 0: collective guard before backward over 2 ranks" in log, log[-3000:]
    assert "has not completed after" in log, log[-3000:]
    assert "(most recent call first)" in log  # every thread's Python stack
    print(f"rank 0 ended {elapsed:.1f} s after rank 1 stopped (comm_timeout_s 10)")


@pytest.mark.parametrize("fault", ["sigkill", "raise"])
def test_a_dead_rank_ends_the_others_in_seconds_naming_the_failed_collective(tmp_path: Path, fault: str) -> None:
    ranks = _launch(tmp_path, "--fault", fault)
    try:
        statuses = [_wait(process, 60) for process in ranks]
        elapsed = _seconds_after_fault(tmp_path)
    finally:
        _cleanup(ranks)
    log = (tmp_path / "rank0.log").read_text()
    assert statuses[1] == (-signal.SIGKILL if fault == "sigkill" else 1)
    assert statuses[0] not in (0, None), log[-3000:]
    assert "zerotune.distributed.comm.CommError" in log and "failed on global rank 0" in log, log[-3000:]
    assert elapsed <= 15, elapsed
    if fault == "raise":
        assert "injected failure on rank 1" in (tmp_path / "rank1.log").read_text()
    print(f"{fault}: every rank gone {elapsed:.1f} s after the fault")


STALLS = {
    # Rank 1 all-reduces a tensor the others never all-reduce: it waits there for rank 0, which waits at the next
    # collective-guard point for rank 1.
    "extra collective": (("--fault", "extra-collective"),
                         ["rank 0 waits at the collective guard before backward (step 2, micro-step 2)",
                          "rank 1 waits in all_reduce issued at train.py:"]),
    # Where exchanges cost over 1% of the time the guard compares records every few micro-steps: rank 1 saves a
    # checkpoint on a micro-step without an exchange while rank 0 goes on to reduce gradients.
    "save on one rank between exchanges": (("--fault", "save-on-one-rank", "--at-step", "3", "--guard-interval", "2"),
                                           ["rank 1 waits at the collective guard before save_checkpoint (step 3, "
                                            "micro-step 3)", "rank 0 waits in all_reduce issued at zerotune/"]),
    # Every rank averages its loss with a raw torch.distributed.all_reduce, brought under the guard; rank 1 skips
    # it once and goes on to its next backward's guard point, while rank 0 waits in the all-reduce.
    "raw torch.distributed collective skipped on one rank": (
        ("--fault", "skip-raw-collective", "--guard-torch-distributed"),
        ["rank 1 waits at the collective guard before backward (step 3, micro-step 3)",
         "rank 0 waits in torch.distributed.all_reduce issued at train.py:"]),
}


@pytest.mark.parametrize("fault", list(STALLS))
def test_ranks_waiting_for_each_other_in_different_collectives_stop_in_seconds_not_minutes(tmp_path: Path,
                                                                                           fault: str) -> None:
    """Both stalled ranks compare notes after the guard's grace (5 s) and exit with CollectiveMismatch naming
    where each waits -- long before comm_timeout_s (600 s here)."""
    args, expected = STALLS[fault]
    statuses, elapsed, logs = _run_to_the_end(tmp_path, *args)
    assert statuses == [1, 1], (statuses, logs[0][-3000:], logs[1][-3000:])
    for log in logs:
        assert "CollectiveMismatch: ranks issued different collectives" in log, log[-3000:]
        for line in expected:
            assert line in log, log[-3000:]
    assert elapsed <= 12, elapsed
    print(f"{fault}: every rank gone {elapsed:.1f} s after it (comm_timeout_s 600)")


ELASTIC = Path(__file__).parent / "fault_scripts" / "elastic_train.py"


def _zerotune_run(tmp_path: Path, name: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / f"{name}.json"
    done = subprocess.run([sys.executable, "-m", "zerotune.cli.main", "run", "--standalone", "--max-restarts", "1",
                           "--nproc_per_node", "2", str(ELASTIC), "--save-dir", str(tmp_path / name), "--out", str(out),
                           *extra], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    return done, json.loads(out.read_text()) if out.is_file() else {}


def test_a_killed_rank_restarts_the_job_which_resumes_from_its_newest_checkpoint(tmp_path: Path) -> None:
    """SIGKILL of rank 1 after the second checkpoint: the launcher restarts both ranks, auto_resume loads step 4,
    and the run ends with exactly the loss and weights of a run that was never interrupted (fp32)."""
    interrupted, result = _zerotune_run(tmp_path, "killed", "--kill")
    assert interrupted.returncode == 0, interrupted.stderr[-3000:]
    assert "resumed from" in interrupted.stdout + interrupted.stderr
    uninterrupted, expected = _zerotune_run(tmp_path, "whole")
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    assert result["first_step"] == 4 and expected["first_step"] == 0
    assert result["loss"] == expected["loss"] and result["weights_sum"] == expected["weights_sum"], (result, expected)
