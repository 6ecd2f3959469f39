"""Unmodified DeepSpeed-style client scripts (tests/deepspeed_clients) run through
``zerotune run --as-deepspeed``: the alias is installed in every rank before the script starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import run_client
from zerotune.cli.run import _split_own_flags

CLIENTS = Path(__file__).resolve().parent / "deepspeed_clients"


def _run(script: str, *script_args: str, nproc: int = 2) -> list[dict]:
    return run_client(script, *script_args, nproc=nproc)


def test_own_flags_are_told_apart_from_torchrun_options_and_script_flags() -> None:
    own, rest = _split_own_flags(["--as-deepspeed", "--nproc_per_node", "2", "t.py", "--no_local_rank", "x"])
    assert own == {"--as-deepspeed"} and rest == ["--nproc_per_node", "2", "t.py", "--no_local_rank", "x"]
    own, rest = _split_own_flags(["--nproc_per_node", "2", "--as-deepspeed", "--no_local_rank", "t.py"])
    assert own == {"--as-deepspeed", "--no_local_rank"} and rest == ["--nproc_per_node", "2", "t.py"]


def test_accelerator_and_comm_script() -> None:
    rows = _run("comm_and_accelerator.py")
    assert [row["rank"] for row in rows] == [0, 1]
    for rank, row in enumerate(rows):
        assert row["local_rank_arg"] == rank  # passed like DeepSpeed's launcher
        assert row["sum"] == [3.0] * 4 and row["gathered"] == [0.0, 1.0] and row["dp"] == 2
        assert row["backend"] == "gloo" and row["version"].endswith("+zerotune")


@pytest.mark.slow
def test_cifar_style_training_script_matches_plain_pytorch(tmp_path: Path) -> None:
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"train_batch_size": 8, "gradient_accumulation_steps": 2, "steps_per_print": 100,
                                  "zero_optimization": {"stage": 1}}))
    rows = _run("train_cifar_style.py", "--deepspeed_config", str(config), "--save_dir", str(tmp_path / "ckpt"))
    assert rows[0]["steps"] == 6 and rows[0]["keys"] == ["0.bias", "0.weight"]
    assert len(rows[0]["losses"]) == len(rows[0]["reference"]) == 12
    for got, want in zip(rows[0]["losses"], rows[0]["reference"]):
        assert abs(got - want) <= 1e-5 * abs(want), (rows[0]["losses"], rows[0]["reference"])


@pytest.mark.slow
def test_pipeline_script_with_a_topology() -> None:
    config_rows = _run("pipeline_alexnet_style.py", "--deepspeed_config",
                       str(CLIENTS / "pipeline_config.json"), nproc=2)
    assert all(row["stages"] == 2 for row in config_rows)
    assert config_rows[0]["losses"] == config_rows[1]["losses"] and len(config_rows[0]["losses"]) == 4


@pytest.mark.slow
def test_zero3_init_script(tmp_path: Path) -> None:
    rows = _run("zero3_init.py", "--out", str(tmp_path))
    assert all(row["has_ds"] and row["saved"] and row["stage"] == 3 for row in rows)
    assert (tmp_path / "model.safetensors").exists()


@pytest.mark.slow
def test_gan_style_script_with_two_engines_in_one_process() -> None:
    rows = _run("gan_style.py", "--stage", "2")
    for row in rows:
        assert row["steps"] == [5, 5] and len(row["g"]) == len(row["d"]) == 5
        assert all(loss == loss for loss in row["g"] + row["d"])  # finite, no NaN


@pytest.mark.slow
def test_bert_style_script_with_grouped_parameters_and_client_state(tmp_path: Path) -> None:
    rows = _run("bert_style.py", "--checkpoint_dir", str(tmp_path))
    for row in rows:
        assert row["global_steps"] == 4 and row["groups"] == [0.01, 0.0]
        assert row["client_state"] == {"last_step": 8, "data_position": 64}
        assert row["lr"] == [pytest.approx(1e-3)] * 2  # both groups, warm-up done


@pytest.mark.slow
def test_api_surface_script() -> None:
    rows = _run("api_surface.py")
    for row in rows:
        assert row["ds_config"] == [8, 3] and row["leaves"] == 1 and row["groups"] == [2, 1]
        assert row["members"] == ["adamw", False, 1.0, True, True, 2]
        assert row["backward_returns"] and row["steps"] == 2 and row["hooked"] == [1, 2]
        assert row["samples_per_sec"] and row["gas"] == 4 and row["eval"]
        assert row["no_sync"] == "engine.no_sync(): no_sync context manager is incompatible with ZeRO stage 3"
        assert row["refused"] == ("deepspeed.DeepSpeedTransformerLayer: the fused transformer kernel "
                                  "(DeepSpeedTransformerLayer) is a DeepSpeed feature zerotune does not support")


@pytest.mark.slow
def test_rlhf_style_script_with_offloaded_states_matches_the_plain_loop() -> None:
    rows = _run("rlhf_style.py")
    for row in rows:
        assert row["equal"], (row["plain"], row["offloaded"])  # bit-identical with the states moved and back
        assert len(row["plain"]["losses"]) == 4 and all(norm > 0 for norm in row["plain"]["grad_norms"])
    assert [row["rank"] for row in rows] == [0, 1]
