"""zerotune reads checkpoints written by real DeepSpeed (ZeRO 1, 2, 3) without DeepSpeed and without
unrestricted pickle: full fp32 weights and Adam state match an independent single-process PyTorch run,
a file that would run code is refused before anything runs, and a missing rank file is named.

The fixtures under tests/data/deepspeed_checkpoints were written by DeepSpeed 0.18.0 itself
(make_fixtures.py there; 2 ranks, 2 AdamW steps, fp32)."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch

from zerotune.checkpoint.atomic import CheckpointError
from zerotune.checkpoint.deepspeed_format import is_deepspeed_checkpoint, read_deepspeed_checkpoint

safetensors_torch = pytest.importorskip("safetensors.torch")

DATA = Path(__file__).parent / "data" / "deepspeed_checkpoints"
TAG = "global_step2"
STAGES = [1, 2, 3]


def _tiny_model():
    spec = importlib.util.spec_from_file_location("ds_fixture_tiny_model", DATA / "tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def expected() -> dict[str, torch.Tensor]:
    return safetensors_torch.load_file(str(DATA / "expected.safetensors"))


def _copy(stage: int, tmp_path: Path) -> Path:
    target = tmp_path / f"stage{stage}"
    shutil.copytree(DATA / f"stage{stage}", target)
    return target


@pytest.mark.parametrize("stage", STAGES)
def test_full_weights_and_adam_state_match_single_process_reference(stage: int, expected) -> None:
    ckpt = read_deepspeed_checkpoint(DATA / f"stage{stage}")
    assert (ckpt.zero_stage, ckpt.dp_world_size, ckpt.step, ckpt.global_steps) == (stage, 2, 2, 2)
    assert ckpt.global_samples == 8 and ckpt.skipped_steps == 0 and ckpt.lr_scheduler is None
    assert ckpt.param_groups and ckpt.param_groups[0]["lr"] == 1e-2 and ckpt.param_groups[0]["weight_decay"] == 0.01
    assert "params" not in ckpt.param_groups[0]
    names = {key.split("/", 1)[1] for key in expected if key.startswith("weight/")}
    assert set(ckpt.weights) == names  # parameters, the frozen one and the buffer
    assert set(ckpt.optimizer_state) == {key.split("/", 1)[1] for key in expected if key.startswith("exp_avg/")}
    for key, want in expected.items():
        kind, name = key.split("/", 1)
        got = ckpt.weights[name] if kind == "weight" else ckpt.optimizer_state[name][kind]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"stage {stage} {key}: {m}")


@pytest.mark.parametrize("stage", STAGES)
def test_weights_load_into_the_rebuilt_model(stage: int) -> None:
    tiny = _tiny_model()
    model = tiny.make_model()
    model.load_state_dict(read_deepspeed_checkpoint(DATA / f"stage{stage}", tag=TAG).weights, strict=True)
    assert torch.isfinite(model(*tiny.batch(0, 0))).all()


def test_detects_save_and_tag_directories(tmp_path: Path) -> None:
    for stage in STAGES:
        assert is_deepspeed_checkpoint(DATA / f"stage{stage}")
        assert is_deepspeed_checkpoint(DATA / f"stage{stage}" / TAG)
    assert not is_deepspeed_checkpoint(DATA)
    assert not is_deepspeed_checkpoint(tmp_path)
    (tmp_path / "latest").write_text("../stage1")  # must not escape the save directory
    assert not is_deepspeed_checkpoint(tmp_path)


class _RunsCode:
    """Unpickling this calls os.system: what a malicious checkpoint file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("stage,victim", [(1, "mp_rank_00_model_states.pt"),
                                          (2, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                                          (3, "zero_pp_rank_1_mp_rank_00_model_states.pt")])
def test_tampered_file_is_refused_and_runs_nothing(stage: int, victim: str, tmp_path: Path) -> None:
    save_dir = _copy(stage, tmp_path)
    marker = tmp_path / "code_ran"
    torch.save({"optimizer_state_dict": _RunsCode(marker), "module": _RunsCode(marker)}, save_dir / TAG / victim)
    with pytest.raises(CheckpointError, match=victim) as info:
        read_deepspeed_checkpoint(save_dir)
    assert "\n" not in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("stage,victim", [(1, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                                          (2, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                                          (3, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                                          (3, "zero_pp_rank_1_mp_rank_00_model_states.pt")])
def test_missing_rank_file_is_named(stage: int, victim: str, tmp_path: Path) -> None:
    save_dir = _copy(stage, tmp_path)
    (save_dir / TAG / victim).unlink()
    with pytest.raises(CheckpointError, match=victim):
        read_deepspeed_checkpoint(save_dir)
