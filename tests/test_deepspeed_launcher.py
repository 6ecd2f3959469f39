"""DeepSpeed's ``deepspeed`` command on zerotune (``zerotune.compat.launcher``, written into an environment
by ``zerotune deepspeed-alias install``): one node's options become ``zerotune run --as-deepspeed``, the
``.deepspeed_env`` variables reach the ranks, and multi-node requests are refused saying what to run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import CLIENTS, ROOT, _rank_rows
from zerotune.compat import launcher
from zerotune.compat.launcher import launch_arguments, parse_args


def _translate(*argv: str) -> tuple[list[str], dict[str, str]]:
    return launch_arguments(parse_args([*argv, "train.py", "--deepspeed_config", "ds.json"]))


def _ranks(*argv: str) -> int:
    run_args = _translate(*argv)[0]
    return int(run_args[run_args.index("--nproc_per_node") + 1])


def test_one_node_options_become_torchrun_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "DEEPSPEED_ENVIRONMENT_PATHS", [str(tmp_path)])
    run_args, environment = _translate("--num_gpus", "2", "--master_port", "29600")
    assert run_args == ["--as-deepspeed", "--nproc_per_node", "2", "--master_port", "29600", "train.py",
                        "--deepspeed_config", "ds.json"]
    assert environment == {}
    run_args, _ = _translate("--include", "localhost:0,2", "--no_local_rank", "--module", "--master_addr", "10.0.0.1")
    assert run_args == ["--as-deepspeed", "--no_local_rank", "--nproc_per_node", "2", "--master_port", "29500",
                        "--master_addr", "10.0.0.1", "-m", "train.py", "--deepspeed_config", "ds.json"]
    monkeypatch.setenv("LOCAL_SIZE", "4")  # what the CPU accelerator reports as the device count
    assert _ranks("--exclude", "localhost:1") == 3 and _ranks() == 4


def test_deepspeed_env_files_are_exported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, here = tmp_path / "home", tmp_path / "here"
    home.mkdir(), here.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_DEBUG=INFO\nSHARED=home\n")
    (here / ".deepspeed_env").write_text("# a comment\nSHARED=here\n\nPYTHONPATH=/opt/lib\n")
    monkeypatch.setattr(launcher, "DEEPSPEED_ENVIRONMENT_PATHS", [str(home), str(here)])
    assert _translate("--num_gpus", "1")[1] == {"NCCL_DEBUG": "INFO", "SHARED": "here", "PYTHONPATH": "/opt/lib"}
    (here / ".deepspeed_env").write_text("NOT A PAIR\n")
    with pytest.raises(SystemExit, match=r"\.deepspeed_env line 1: expected KEY=VALUE, got 'NOT A PAIR'"):
        _translate("--num_gpus", "1")


@pytest.mark.parametrize("argv, message", [
    (("--num_nodes", "2"), "--num_nodes is not supported: starting ranks on other hosts is left to torchrun"),
    (("--include", "worker-0@worker-1:0"), "--include is not supported: starting ranks on other hosts"),
    (("--include", "worker-7:0"), "--include is not supported: host 'worker-7' is not this machine"),
    (("--autotuning", "run"), "--autotuning is not supported: autotuning"),
    (("--no_python",), "--no_python is not supported: the ranks start the DeepSpeed alias before the script"),
    (("--include", "localhost:0", "--exclude", "localhost:1"), "--include and --exclude are mutually exclusive"),
    (("--include", "localhost:a"), "slots must be device numbers"),
])
def test_what_only_deepspeeds_process_management_does_is_refused_in_one_line(argv: tuple, message: str) -> None:
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")):
        _translate(*argv)


def test_a_hostfile_with_several_hosts_is_refused(tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=8\nworker-1 slots=8\n")
    with pytest.raises(SystemExit, match="--hostfile is not supported: .* lists 2 hosts"):
        _translate("--hostfile", str(hostfile))
    hostfile.write_text("localhost slots=2\n")
    assert _ranks("--hostfile", str(hostfile), "--num_gpus", "2") == 2


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_deepspeed_command_runs_a_script_on_two_ranks() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "zerotune.compat.launcher", "--num_gpus", "2", "--master_port", str(_free_port()),
               str(CLIENTS / "comm_and_accelerator.py")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = sorted(_rank_rows(done.stdout), key=lambda row: row["rank"])
    assert [row["rank"] for row in rows] == [0, 1]
    assert [row["local_rank_arg"] for row in rows] == [0, 1]  # --local_rank, as DeepSpeed's launcher passes it
    assert all(row["sum"] == [3.0] * 4 and row["backend"] == "gloo" for row in rows)


def test_accelerates_deepspeed_launcher_finds_what_it_imports() -> None:
    from zerotune.compat import install_deepspeed_alias
    from zerotune.compat.alias import uninstall_deepspeed_alias

    install_deepspeed_alias()
    try:
        from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME, main

        assert DEEPSPEED_ENVIRONMENT_NAME == os.getenv("DS_ENV_FILE", ".deepspeed_env") and main is launcher.main
    finally:
        uninstall_deepspeed_alias()
