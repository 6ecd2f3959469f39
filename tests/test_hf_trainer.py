"""Hugging Face ``Trainer(TrainingArguments(deepspeed=...))`` and accelerate's ``DeepSpeedPlugin`` train on
zerotune (through ``zerotune run --as-deepspeed``, unmodified user scripts in tests/deepspeed_clients) at
ZeRO 0 (the config-optimizer path), 2 and 3 with CPU offload, ZeRO-3 ``from_pretrained`` through ``zero.Init``,
``save_model`` and resume; the losses match a plain DDP run of the same script (accelerate: the script's own
single-process PyTorch loop). ZeRO-1 under the Trainer is covered by the same engine path as 0 and 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.launch import run_client

pytestmark = pytest.mark.slow
REL = 1e-5


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_trainer")


@pytest.fixture(scope="module")
def ddp(workdir: Path) -> dict:
    """The plain DDP Trainer run every DeepSpeed-config run must reproduce."""
    return run_client("hf_trainer.py", "--out", str(workdir / "ddp"), as_deepspeed=False)[0]


@pytest.fixture(scope="module")
def pretrained(workdir: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # the same initial weights as the script's own random model
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    model.save_pretrained(workdir / "pretrained")
    return workdir / "pretrained"


def _assert_same_losses(got: dict, want: dict) -> None:
    assert sorted(got, key=int) == sorted(want, key=int) and len(want) == 6
    for step, loss in want.items():
        assert abs(got[step] - loss) <= REL * abs(loss), (step, got, want)


def _assert_same_weights(directory: Path, reference: Path) -> None:
    """Within 1e-5: six Adam steps of lr 1e-3 turn reduction-order noise (~1e-7 in the gradients of
    near-zero elements) into at most ~2e-6 here; a wrong update would differ by ~1e-3."""
    got, want = load_file(directory / "model.safetensors"), load_file(reference / "model.safetensors")
    for name, tensor in want.items():
        assert torch.allclose(got[name], tensor, rtol=0, atol=1e-5), name


@pytest.mark.parametrize("variant", [
    ("0", ["--config_optimizer"]),  # a config "optimizer" block: HF's DummyOptim path
    ("2", ["--offload"]),
])
def test_trainer_matches_ddp(variant, ddp: dict, workdir: Path) -> None:
    stage, extra = variant
    out = workdir / f"stage{stage}"
    rows = run_client("hf_trainer.py", "--stage", stage, *extra, "--out", str(out))
    for row in rows:
        assert row["deepspeed"] and row["engine"] == "zerotune.engine.Engine"
        _assert_same_losses(row["losses"], ddp["losses"])
    assert rows[0]["checkpoints"] == ["checkpoint-3", "checkpoint-6"]
    assert (out / "checkpoint-3" / "global_step3").is_dir() and (out / "checkpoint-3" / "latest").is_file()
    _assert_same_weights(out / "final", workdir / "ddp" / "final")


def test_trainer_zero3_from_pretrained_with_offload(ddp: dict, workdir: Path, pretrained: Path) -> None:
    out = workdir / "stage3"
    rows = run_client("hf_trainer.py", "--stage", "3", "--offload", "--pretrained", str(pretrained), "--out", str(out))
    for row in rows:
        assert row["zero_init"] and row["deepspeed"]  # partitioned as from_pretrained built it
        _assert_same_losses(row["losses"], ddp["losses"])
    _assert_same_weights(out / "final", workdir / "ddp" / "final")  # save_model gathered the 16-bit weights


def test_trainer_resumes_from_its_checkpoint(ddp: dict, workdir: Path) -> None:
    import shutil

    source = workdir / "stage0"
    if not (source / "checkpoint-3").is_dir():
        run_client("hf_trainer.py", "--stage", "0", "--config_optimizer", "--out", str(source))
    resumed = workdir / "resumed"
    shutil.copytree(source / "checkpoint-3", resumed / "checkpoint-3")
    rows = run_client("hf_trainer.py", "--stage", "0", "--config_optimizer", "--out", str(resumed), "--resume",
                      str(resumed / "checkpoint-3"))
    for row in rows:  # steps 4-6 after the resume are the uninterrupted run's
        _assert_same_losses(row["losses"], ddp["losses"])


def test_accelerate_deepspeed_plugin_matches_plain_pytorch() -> None:
    for row in run_client("accelerate_plugin.py", "--stage", "2"):
        assert row["engine"] == "zerotune.engine.Engine" and row["distributed_type"] == "DistributedType.DEEPSPEED"
        assert len(row["losses"]) == len(row["reference"]) == 8
        assert all(abs(a - b) <= REL * abs(b) for a, b in zip(row["losses"], row["reference"])), row
