"""Tests of the multi-rank harness itself: results, pool reuse, failures, hangs, cleanup."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests import harness
from tests.harness import DistributedTestError, run_distributed, shutdown_pools, worker_pids


# Module-level so workers can import them by name.


def all_reduce_rank_plus_one(scale: float = 1.0) -> list[float]:
    tensor = torch.tensor([float(dist.get_rank() + 1) * scale, 1.0])
    dist.all_reduce(tensor)
    return tensor.tolist()


def describe_rank() -> dict:
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "env": {name: os.environ[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")},
        "master": (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]),
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }


def raise_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank one")
    dist.all_reduce(torch.ones(1))  # rank 0 blocks here with the failed rank
    return dist.get_rank()


def skip_collective_on_rank_one() -> int:
    if dist.get_rank() != 1:
        dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def sleep_on_rank_one_forever() -> int:
    if dist.get_rank() == 1:
        time.sleep(3600)
    return dist.get_rank()


def exit_abruptly_on_rank_zero() -> None:
    if dist.get_rank() == 0:
        os._exit(7)
    dist.barrier()


def return_unpicklable() -> object:
    return lambda: None


def count_process_groups_after_new_group() -> tuple[int, int]:
    before = len(dist.distributed_c10d._world.pg_map)
    group = dist.new_group(ranks=[0, 1])
    dist.all_reduce(torch.ones(1), group=group)
    return before, len(dist.distributed_c10d._world.pg_map)


def count_process_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_returns_every_rank_result_in_rank_order(world_size):
    results = run_distributed(all_reduce_rank_plus_one, world_size, 2.0)
    expected_sum = 2.0 * world_size * (world_size + 1) / 2
    assert results == [[expected_sum, float(world_size)]] * world_size


def test_workers_see_consistent_rank_environment():
    infos = run_distributed(describe_rank, 2)
    assert [info["rank"] for info in infos] == [0, 1]
    for rank, info in enumerate(infos):
        assert info["world_size"] == 2
        assert info["env"] == {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}
        assert info["master"] == infos[0]["master"]
        assert info["threads"] == 1


def test_pool_is_reused_across_calls():
    first = [info["pid"] for info in run_distributed(describe_rank, 2)]
    second = [info["pid"] for info in run_distributed(describe_rank, 2)]
    assert first == second == worker_pids(2)


def test_keyword_arguments_reach_fn():
    assert run_distributed(all_reduce_rank_plus_one, 2, scale=0.5) == [[1.5, 2.0]] * 2


def test_exception_on_one_rank_reports_its_traceback_and_recycles_pool():
    pids_before = [info["pid"] for info in run_distributed(describe_rank, 2)]
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(raise_on_rank_one, 2, timeout=30)
    message = str(caught.value)
    assert caught.value.first_failed_rank == 1
    assert "----- rank 1: failed (first to fail)" in message
    assert "ValueError: deliberate failure on rank one" in message
    assert "in raise_on_rank_one" in message
    assert "----- rank 0:" in message  # rank 0 is reported too, whatever happened to it
    assert worker_pids(2) == []  # the broken pool was discarded

    infos = run_distributed(describe_rank, 2)
    assert [info["rank"] for info in infos] == [0, 1]
    assert set(info["pid"] for info in infos).isdisjoint(pids_before)


def test_rank_skipping_a_collective_fails_within_the_timeout_with_a_stack():
    started = time.monotonic()
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(skip_collective_on_rank_one, 2, timeout=3)
    elapsed = time.monotonic() - started
    assert elapsed < 10, f"a hang took {elapsed:.1f} s to fail"
    message = str(caught.value)
    assert caught.value.hung_ranks == [0]
    assert "did not finish within the 3 s timeout" in message
    assert "----- rank 0: did not finish; its Python stack:" in message
    assert "skip_collective_on_rank_one" in message  # the stack shows where rank 0 is stuck
    assert run_distributed(all_reduce_rank_plus_one, 2) == [[3.0, 2.0]] * 2


def test_sleeping_rank_is_named_with_its_stack():
    started = time.monotonic()
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(sleep_on_rank_one_forever, 2, timeout=3)
    assert time.monotonic() - started < 10
    assert caught.value.hung_ranks == [1]
    message = str(caught.value)
    assert "----- rank 0: finished" in message
    section = message.split("----- rank 1:")[1]
    assert "time.sleep" in section or "sleep_on_rank_one_forever" in section


def test_worker_that_dies_is_reported_with_its_exit_code():
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(exit_abruptly_on_rank_zero, 2, timeout=30)
    assert 0 in caught.value.failed_ranks
    assert "exit code 7" in str(caught.value)
    assert run_distributed(all_reduce_rank_plus_one, 2) == [[3.0, 2.0]] * 2


def test_unpicklable_return_value_is_an_error_naming_the_problem():
    with pytest.raises(DistributedTestError, match="return value could not be pickled"):
        run_distributed(return_unpicklable, 2, timeout=30)


def test_local_function_is_rejected_before_anything_runs():
    def local_fn():
        return 1

    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(local_fn, 2)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_invalid_world_size_is_rejected(bad):
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(describe_rank, bad)


def test_subgroups_created_by_a_task_are_destroyed_afterwards():
    baseline = run_distributed(count_process_groups, 2)
    before, during = run_distributed(count_process_groups_after_new_group, 2)[0]
    assert during == before + 1
    assert run_distributed(count_process_groups, 2) == baseline


def test_first_call_timeout_does_not_include_pool_start():
    shutdown_pools()  # the next call pays the pool start-up, which must not count against timeout
    assert run_distributed(all_reduce_rank_plus_one, 2, timeout=0.5) == [[3.0, 2.0]] * 2


def test_pool_that_cannot_start_in_time_is_an_error_not_a_hang(monkeypatch):
    """Workers told to rendezvous at a port where nothing listens can never join the group.

    (A tiny start timeout alone is not a reliable hang: a warm forkserver can start and join a
    2-rank group within 10 ms, which made this test flaky on a fast machine.)
    """
    shutdown_pools()
    start_workers = harness._start_workers

    def start_workers_at_a_dead_rendezvous(context, pool):
        real_store = pool.store
        pool.store = SimpleNamespace(port=dead_port.getsockname()[1])
        try:
            start_workers(context, pool)
        finally:
            pool.store = real_store

    with socket.socket() as dead_port:  # bound, never listening: connections are refused
        dead_port.bind(("127.0.0.1", 0))
        monkeypatch.setattr("tests.harness._start_workers", start_workers_at_a_dead_rendezvous)
        monkeypatch.setattr("tests.harness.POOL_START_TIMEOUT_S", 1.0)
        with pytest.raises(DistributedTestError, match="starting a pool of 2 gloo workers") as caught:
            run_distributed(describe_rank, 2)
    assert caught.value.hung_ranks == [0, 1]
    assert worker_pids(2) == []
    monkeypatch.undo()
    assert run_distributed(all_reduce_rank_plus_one, 2) == [[3.0, 2.0]] * 2


def test_eight_rank_pool_runs_a_collective():
    assert run_distributed(all_reduce_rank_plus_one, 8) == [[36.0, 8.0]] * 8


def test_world_size_one_is_a_real_group():
    assert run_distributed(all_reduce_rank_plus_one, 1) == [[1.0, 1.0]]


def test_shutdown_stops_every_worker():
    run_distributed(describe_rank, 2)
    pids = worker_pids(2)
    shutdown_pools()
    assert worker_pids(2) == []
    for pid in pids:
        assert not _process_is_running(pid)
    assert run_distributed(all_reduce_rank_plus_one, 2) == [[3.0, 2.0]] * 2  # starts again on demand


# A parent that starts a 2-rank pool, prints the worker pids and waits to be killed.
# It skips the transformers preload: this test is about process lifetime, not imports.
_DOOMED_PARENT = textwrap.dedent(
    """
    import sys, time
    import tests.harness as harness
    from tests.test_harness import describe_rank
    if __name__ == "__main__":
        harness._TRANSFORMERS_PRELOAD = []
        harness.run_distributed(describe_rank, 2)
        print(*harness.worker_pids(2), flush=True)
        time.sleep(600)
    """
)


@pytest.mark.slow  # a fresh interpreter plus forkserver: a few seconds
def test_workers_exit_when_the_parent_is_killed(tmp_path):
    script = tmp_path / "doomed_parent.py"
    script.write_text(_DOOMED_PARENT)
    repo_root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env, cwd=repo_root)
    try:
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == 2, "the parent did not start its pool"
        assert all(_process_is_running(pid) for pid in pids)
    finally:
        parent.send_signal(signal.SIGKILL)  # no atexit, no cleanup: only the lifeline is left
        parent.wait()
    deadline = time.monotonic() + 10
    while any(_process_is_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_process_is_running(pid) for pid in pids)


def _process_is_running(pid: int) -> bool:
    """True for a live, non-zombie process (workers are children of the forkserver, not of us)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
