"""The launcher's faults: ranks die with a killed launcher (and the last published checkpoint still loads), a
failed rank ends ``zerotune run`` with a short summary instead of torchrun's traceback wall, and Ctrl-C ends
``zerotune finetune`` with one line saying how to resume. Real processes, killed and interrupted for real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from zerotune.cli.failures import summary_lines
from zerotune.distributed.launcher_link import LAUNCHER_PID_ENV, is_alive

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "fault_scripts"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
DIE_WITHIN_S = 10.0


def _zerotune(*args: str, log: Path, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "zerotune.cli.main", *args], cwd=REPO, env=ENV,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True, **popen)


def _wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _seconds_until_gone(pids: list[int], limit: float) -> float:
    started = time.time()
    while any(is_alive(pid) for pid in pids) and time.time() - started < limit:
        time.sleep(0.05)
    return time.time() - started


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        if is_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_ranks_die_within_seconds_of_a_killed_launcher_and_the_last_published_checkpoint_loads(tmp_path: Path) -> None:
    """``kill -9`` of ``zerotune run`` while both ranks loop saving checkpoints: both ranks are gone within
    seconds (the kernel's parent-death signal), and the checkpoint ``latest`` names loads in a fresh process."""
    save_dir, pid_dir = tmp_path / "checkpoints", tmp_path / "pids"
    launcher = _zerotune("run", "--standalone", "--nproc_per_node", "2", str(SCRIPTS / "save_loop.py"),
                         "--save-dir", str(save_dir), "--pid-dir", str(pid_dir), log=tmp_path / "launcher.log")
    ranks: list[int] = []
    try:
        _wait_for(lambda: len(list(pid_dir.glob("rank*"))) == 2 and (save_dir / "latest").is_file(), 240,
                  "both ranks and a first checkpoint")
        ranks = [int(path.read_text()) for path in sorted(pid_dir.glob("rank*"))]
        _wait_for(lambda: (save_dir / "latest").read_text() != "global_step1", 60, "a second checkpoint")
        time.sleep(0.3)  # mid-loop: most of a step's time is the save
        assert all(is_alive(pid) for pid in ranks)
        launcher.send_signal(signal.SIGKILL)
        elapsed = _seconds_until_gone(ranks, 3 * DIE_WITHIN_S)
        launcher.wait(timeout=60)
    finally:
        _kill_all(ranks)
        if launcher.poll() is None:
            launcher.kill()
    assert elapsed <= DIE_WITHIN_S, (elapsed, (tmp_path / "launcher.log").read_text()[-3000:])
    latest = (save_dir / "latest").read_text().strip()
    loaded = subprocess.run([sys.executable, str(SCRIPTS / "save_loop.py"), "--save-dir", str(save_dir), "--load"],
                            capture_output=True, text=True, timeout=180, env={
                                k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    result = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert result == {"tag": latest, "step": int(latest.removeprefix("global_step"))}, result
    print(f"both ranks gone {elapsed:.2f} s after kill -9 of the launcher; {latest} loads")


def test_a_rank_whose_launcher_is_not_its_parent_watches_for_it(tmp_path: Path) -> None:
    """launcher -> agent -> rank: the rank's parent lives on, so the kernel's parent-death signal cannot help; the
    rank's watch thread notices the launcher is gone (once a second) and the rank leaves."""
    rank = ("import os, sys, time; from zerotune.distributed.launcher_link import bind_to_launcher; "
            "bind_to_launcher(); open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)")
    agent = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {rank!r}, sys.argv[1]]); "
             "time.sleep(600)")
    launcher = (f"import os, subprocess, sys, time; os.environ[{LAUNCHER_PID_ENV!r}] = str(os.getpid()); "
                f"subprocess.Popen([sys.executable, '-c', {agent!r}, sys.argv[1]]); time.sleep(600)")
    pid_file = tmp_path / "rank.pid"
    process = subprocess.Popen([sys.executable, "-c", launcher, str(pid_file)], cwd=REPO, env=ENV,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    rank_pid = None
    try:
        _wait_for(lambda: pid_file.is_file() and pid_file.read_text(), 120, "the rank")
        rank_pid = int(pid_file.read_text())
        process.send_signal(signal.SIGKILL)
        elapsed = _seconds_until_gone([rank_pid], 20)
        process.wait(timeout=30)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the agent, which outlives the launcher by design here
        if rank_pid is not None:
            _kill_all([rank_pid])
    assert elapsed <= 5.0, elapsed  # one watch interval (1 s), on a busy machine
    print(f"the rank left {elapsed:.2f} s after its grandparent launcher was killed")


def test_a_failed_rank_ends_zerotune_run_with_a_short_summary(tmp_path: Path) -> None:
    """Rank 1 raises: the last lines name it, its one-line error and the report file; torchrun's
    ``ChildFailedError`` wall is in that file, not on the terminal."""
    log = tmp_path / "out.log"
    run = _zerotune("run", "--standalone", "--nproc_per_node", "2", "--log-dir", str(tmp_path / "logs"),
                    str(SCRIPTS / "train.py"), "--fault", "raise", "--marker", str(tmp_path), log=log)
    assert run.wait(timeout=240) == 1, log.read_text()[-3000:]
    output = log.read_text()
    tail = output.strip().splitlines()[-3:]
    assert tail[0].startswith("zerotune run: rank 1 failed first (pid "), output[-3000:]
    assert tail[0].endswith("RuntimeError: injected failure on rank 1 at step 2"), output[-3000:]
    assert tail[1].startswith("zerotune run: then rank 0: "), output[-3000:]
    report = tmp_path / "logs" / "failure.txt"
    assert tail[2] == f"zerotune run: every failed rank's traceback and torchrun's report: {report}", output[-3000:]
    assert "ChildFailedError" not in output and "Root Cause" not in output, output[-3000:]
    text = report.read_text()
    assert "Root Cause" in text and 'raise RuntimeError(f"injected failure' in text, text
    print("\n".join(tail))


def _failure(tmp_path: Path, rank: int, exitcode: int, message: str | None, at: float | None) -> ProcessFailure:
    error_file = tmp_path / f"error{rank}.json"
    if message is not None:
        error_file.write_text(json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": "Traceback ...", "timestamp": str(int(at)), "time": at}}}))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(error_file))


def test_the_summary_puts_the_cause_first_not_the_ranks_it_took_down(tmp_path: Path) -> None:
    """Rank 0's collective failed because rank 2 left, and the agent SIGTERMed rank 1, all in one second: the
    summary starts with rank 2, whose error came first and caused the others."""
    now = time.time()
    failures = {0: _failure(tmp_path, 0, 1, "CommError: all_reduce failed on global rank 0", now - 0.5),
                1: _failure(tmp_path, 1, -signal.SIGTERM, None, None),
                2: _failure(tmp_path, 2, 1, "ValueError: bad batch\nsecond line", now)}
    lines = summary_lines("zerotune run", failures, tmp_path / "failure.txt")
    assert lines[0] == "zerotune run: rank 2 failed first (pid 102): ValueError: bad batch\nsecond line"
    assert lines[1] == ("zerotune run: then rank 0: CommError: all_reduce failed on global rank 0; rank 1: was "
                        "killed by SIGTERM")


@pytest.mark.slow
def test_ctrl_c_ends_zerotune_finetune_with_one_line_saying_how_to_resume(tmp_path: Path) -> None:
    """SIGINT to the whole process group (a terminal's Ctrl-C) after the first checkpoint: exit status 130, no
    traceback from any rank, and the last line names the newest checkpoint and the exact resume command."""
    from tests.test_finetune_run import write_recipe

    recipe = write_recipe(tmp_path, 1, max_steps=400, save_every=20, eval_every=0, log_every=50)
    out, log = tmp_path / "run", tmp_path / "out.log"
    finetune = _zerotune("finetune", str(recipe), "--output-dir", str(out), "--set", "train.lr=0.002", log=log)
    latest = out / "checkpoints" / "latest"
    try:
        _wait_for(lambda: latest.is_file(), 300, "the first checkpoint")
        os.killpg(finetune.pid, signal.SIGINT)
        status = finetune.wait(timeout=60)
    finally:
        if finetune.poll() is None:
            os.killpg(finetune.pid, signal.SIGKILL)
    output = log.read_text()
    assert status == 130, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"zerotune finetune: interrupted (SIGINT); the newest checkpoint is {out / 'checkpoints'}/"
                           "global_step"), last
    assert last.endswith(f"; resume with: zerotune finetune {recipe} --output-dir {out} --resume --set "
                         "train.lr=0.002"), last
    print(last)
