"""Launcher environment parsing (torchrun / OpenMPI / SLURM) and process-group initialization.

The pure helpers are tested in this process with monkeypatched environment variables; nothing
here initializes a process group in the pytest process (it would outlive the test). The
"plain python, no launcher" world of one runs in a subprocess, and reusing an existing group
runs on the harness's gloo ranks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import run_distributed
from zerotune.distributed import env
from zerotune.distributed.env import DistributedSetupError, first_slurm_host

REPO_ROOT = Path(__file__).resolve().parents[1]

LAUNCHER_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_NODELIST",
    "MASTER_ADDR", "MASTER_PORT",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No launcher variables at all; anything a test sets (or the code under test sets) is undone."""
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ----------------------------------------------------------------------------- _launcher_ranks


def test_no_launcher_variables_means_no_launcher(clean_env):
    assert env._launcher_ranks() is None


def test_torchrun_variables(clean_env):
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "8")
    clean_env.setenv("LOCAL_RANK", "1")
    assert env._launcher_ranks() == (3, 8, 1)


def test_openmpi_variables(clean_env):
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "5")
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "6")
    clean_env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2")
    assert env._launcher_ranks() == (5, 6, 2)


def test_slurm_variables(clean_env):
    clean_env.setenv("SLURM_PROCID", "2")
    clean_env.setenv("SLURM_NTASKS", "4")
    clean_env.setenv("SLURM_LOCALID", "0")
    assert env._launcher_ranks() == (2, 4, 0)


def test_missing_local_rank_defaults_to_global_rank(clean_env):
    clean_env.setenv("SLURM_PROCID", "3")
    clean_env.setenv("SLURM_NTASKS", "4")
    assert env._launcher_ranks() == (3, 4, 3)


def test_torchrun_wins_over_slurm_when_torchrun_runs_inside_an_allocation(clean_env):
    clean_env.setenv("SLURM_PROCID", "0")
    clean_env.setenv("SLURM_NTASKS", "1")
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("LOCAL_RANK", "1")
    assert env._launcher_ranks() == (1, 2, 1)


@pytest.mark.parametrize("rank_var, world_var", [
    ("RANK", "WORLD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
])
@pytest.mark.parametrize("rank", ["4", "7", "-1"])
def test_rank_outside_world_is_an_error(clean_env, rank_var, world_var, rank):
    clean_env.setenv(rank_var, rank)
    clean_env.setenv(world_var, "4")
    with pytest.raises(DistributedSetupError, match=rf"{rank_var}={rank} is outside \[0, {world_var}=4\)"):
        env._launcher_ranks()


@pytest.mark.parametrize("variables, bad", [
    ({"RANK": "zero", "WORLD_SIZE": "2"}, "RANK"),
    ({"RANK": "0", "WORLD_SIZE": "2.0"}, "WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK"),
    ({"OMPI_COMM_WORLD_RANK": "one", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4(x2)"}, "SLURM_NTASKS"),
])
def test_non_integer_variable_is_named(clean_env, variables, bad):
    for name, value in variables.items():
        clean_env.setenv(name, value)
    with pytest.raises(DistributedSetupError) as raised:
        env._launcher_ranks()
    assert f"{bad}={variables[bad]!r} is not an integer" in str(raised.value)


@pytest.mark.parametrize("present, missing", [("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK"),
                                              ("SLURM_PROCID", "SLURM_NTASKS")])
def test_half_a_launcher_is_an_error_naming_the_missing_variable(clean_env, present, missing):
    clean_env.setenv(present, "0" if "RANK" in present or "PROCID" in present else "2")
    with pytest.raises(DistributedSetupError, match=rf"^{missing} is not set"):
        env._launcher_ranks()


def test_empty_variable_counts_as_unset(clean_env):
    clean_env.setenv("RANK", "")
    clean_env.setenv("WORLD_SIZE", "")
    assert env._launcher_ranks() is None


# ----------------------------------------------------------------------------- first_slurm_host


@pytest.mark.parametrize("nodelist, host", [
    ("node[03-05,9],gpu1", "node03"),
    ("node[9,03-05]", "node9"),
    ("gpu1,node[1-2]", "gpu1"),
    ("single-host", "single-host"),
    ("  a[7]  ", "a7"),
    ("n[001-128]", "n001"),
])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["", "   ", "[1-2]", ",node1"])
def test_unparseable_slurm_nodelist_is_named(nodelist):
    with pytest.raises(DistributedSetupError, match="SLURM_NODELIST"):
        first_slurm_host(nodelist)


@pytest.mark.parametrize("nodelist, host", [("cn[1-2]-ib", "cn1-ib"), ("rack[1-2]-n[01-04]", "rack1-n01")])
def test_first_slurm_host_keeps_text_after_the_bracket(nodelist, host):
    assert first_slurm_host(nodelist) == host


# ----------------------------------------------------------------------------- _ensure_rendezvous_address


def test_openmpi_without_master_addr_is_a_clear_error(clean_env):
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "0")
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(DistributedSetupError, match="MASTER_ADDR is not set"):
        env._ensure_rendezvous_address()


def test_slurm_master_addr_comes_from_the_job_nodelist(clean_env):
    clean_env.setenv("SLURM_JOB_NODELIST", "node[03-05,9],gpu1")
    clean_env.setenv("SLURM_NODELIST", "other1")
    env._ensure_rendezvous_address()
    assert os.environ["MASTER_ADDR"] == "node03"
    assert os.environ["MASTER_PORT"] == str(env.DEFAULT_PORT)


def test_slurm_nodelist_is_the_fallback(clean_env):
    clean_env.setenv("SLURM_NODELIST", "gpu[7-8]")
    env._ensure_rendezvous_address()
    assert os.environ["MASTER_ADDR"] == "gpu7"


def test_existing_master_addr_and_port_are_kept(clean_env):
    clean_env.setenv("MASTER_ADDR", "10.0.0.1")
    clean_env.setenv("MASTER_PORT", "12345")
    clean_env.setenv("SLURM_NODELIST", "node1")
    env._ensure_rendezvous_address()
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.1", "12345")


def test_current_env_without_a_process_group_says_what_to_call():
    # Guard: this must stay true in the pytest process (no test may leave a group behind).
    import torch.distributed as dist
    assert not dist.is_initialized()
    with pytest.raises(DistributedSetupError, match="init_distributed"):
        env.current_env()


def test_bad_timeout_variable_is_named(monkeypatch):
    monkeypatch.setenv("ZEROTUNE_DIST_TIMEOUT_S", "half an hour")
    # A private copy of the module, so the real one (and its exception classes) stay untouched.
    spec = importlib.util.spec_from_file_location("_zerotune_env_copy", env.__file__)
    module = importlib.util.module_from_spec(spec)
    with pytest.raises(Exception, match="ZEROTUNE_DIST_TIMEOUT_S"):
        spec.loader.exec_module(module)


# ----------------------------------------------------------------------------- init_distributed


_WORLD_OF_ONE = """
import json, torch, torch.distributed as dist, zerotune
from zerotune.distributed import comm
from zerotune.distributed.mesh import ParallelDims, build_mesh
e = zerotune.init_distributed()
mesh = build_mesh(ParallelDims(dp=1), "cpu")
t = torch.ones(3)
comm.all_reduce(t, mesh.group("dp"))
print(json.dumps({"rank": e.rank, "world": e.world_size, "local": e.local_rank, "backend": e.backend,
                  "device": str(e.device), "pg_world": dist.get_world_size(), "dp_size": mesh.size("dp"),
                  "dp_group_real": mesh.group("dp") is not None, "sum": t.tolist(),
                  "bytes": comm.total_comm_bytes(), "again": zerotune.init_distributed().world_size}))
"""


def test_plain_python_is_a_world_of_one_on_gloo():
    """No launcher: world 1, rank 0, gloo, and still a real group that collectives go through."""
    clean = {k: v for k, v in os.environ.items()
             if k not in LAUNCHER_VARS and not k.startswith(("OMPI_", "SLURM_", "PMI_"))}
    clean.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-c", _WORLD_OF_ONE], env=clean, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"rank": 0, "world": 1, "local": 0, "backend": "gloo", "device": "cpu", "pg_world": 1,
                      "dp_size": 1, "dp_group_real": True, "sum": [1.0, 1.0, 1.0], "bytes": 24, "again": 1}


def _env_on_rank() -> tuple:
    import zerotune
    e = zerotune.init_distributed()
    return e.rank, e.world_size, e.local_rank, e.backend, str(e.device)


def test_init_distributed_reuses_the_launchers_group():
    assert run_distributed(_env_on_rank, 2) == [(0, 2, 0, "gloo", "cpu"), (1, 2, 1, "gloo", "cpu")]


_EXIT_PROBE = """
import atexit, sys, torch.distributed as dist, zerotune
atexit.register(lambda: print("group at exit:", dist.is_initialized(), flush=True))  # runs after zerotune's
zerotune.init_distributed()
if sys.argv[1] == "raise":
    raise RuntimeError("the script failed")
"""


@pytest.mark.parametrize("ending, torn_down", [("return", True), ("raise", False)])
def test_a_clean_exit_tears_the_process_group_down_and_a_failed_one_does_not_wait_for_it(ending, torn_down):
    """A group left to interpreter finalization aborts a finished process now and then (exit -6, a failed
    torchrun job); tearing it down waits for in-flight collectives, which a failing rank must not do."""
    clean = {k: v for k, v in os.environ.items()
             if k not in LAUNCHER_VARS and not k.startswith(("OMPI_", "SLURM_", "PMI_"))}
    clean.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-c", _EXIT_PROBE, ending], env=clean, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == (0 if torn_down else 1), done.stderr
    assert done.stdout.strip().splitlines()[-1] == f"group at exit: {not torn_down}"
    assert ("the script failed" in done.stderr) is not torn_down  # the failure still reaches the user
