"""``deepspeed.utils.zero_to_fp32`` on zerotune: a checkpoint saved by 2 ranks at ZeRO 1/2/3 (and DeepSpeed's own
fixtures) becomes one state dict equal to the model's full weights -- tied weights one tensor under both names,
frozen parameters optionally left out, sharded output with its index json, lazy handles read on access."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import zerotune
from tests.harness import run_distributed
from zerotune.checkpoint.atomic import CheckpointError
from zerotune.compat.zero_to_fp32 import (
    LazyTensor,
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    get_model_state_files,
    get_optim_files,
    load_state_dict_from_zero_checkpoint,
    main,
)

DS_FIXTURES = Path(__file__).parent / "data" / "deepspeed_checkpoints"


class TiedNet(nn.Module):
    """A tied pair (``out.weight`` is ``mid.weight``), a frozen layer and a buffer: everything consolidation sorts."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 13)
        self.mid = nn.Linear(13, 13)
        self.frozen = nn.Linear(13, 13)
        self.out = nn.Linear(13, 13)
        self.out.weight = self.mid.weight
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 13))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mid(torch.tanh(self.embed(x)))
        return (self.out(torch.tanh(self.frozen(h))) * self.scale).pow(2).mean()


def _train_and_save(save_dir: str, stage: int, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    model = TiedNet()
    engine, *_ = zerotune.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                     config=config)
    torch.manual_seed(1 + torch.distributed.get_rank())
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 8)))
        engine.step()
    engine.save_checkpoint(save_dir, exclude_frozen_parameters=exclude_frozen)
    with zerotune.zero.GatheredParameters(list(engine.module.parameters())):
        weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    return weights


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("zero_to_fp32")
    return {stage: (root / f"stage{stage}", run_distributed(_train_and_save, 2, str(root / f"stage{stage}"), stage,
                                                           timeout=120)[0])
            for stage in (1, 2, 3)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_consolidated_state_dict_is_the_full_model_exactly(saved, stage: int) -> None:
    directory, weights = saved[stage]
    state = get_fp32_state_dict_from_zero_checkpoint(directory)
    assert set(state) == set(weights) == set(TiedNet().state_dict())
    for name, tensor in weights.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], tensor), name
    assert state["out.weight"] is state["mid.weight"]  # tied, as DeepSpeed's output: one tensor, two names
    model = TiedNet()
    model.load_state_dict(state, strict=True)
    assert model.out.weight is model.mid.weight and torch.equal(model.mid.weight, weights["mid.weight"])


def test_frozen_parameters_excluded_and_a_tag_named(saved) -> None:
    directory, weights = saved[3]
    state = get_fp32_state_dict_from_zero_checkpoint(directory, tag="global_step2", exclude_frozen_parameters=True)
    assert set(state) == set(weights) - {"frozen.weight", "frozen.bias"}
    assert "scale" in state and state["out.weight"] is state["mid.weight"]


def test_lazy_mode_reads_each_tensor_on_access(saved) -> None:
    directory, weights = saved[2]
    lazy = get_fp32_state_dict_from_zero_checkpoint(directory, lazy_mode=True)
    assert all(isinstance(v, LazyTensor) for v in lazy.values()) and lazy["out.weight"] is lazy["mid.weight"]
    assert lazy["embed.weight"].shape == weights["embed.weight"].shape and lazy["embed.weight"].dtype == torch.float32
    assert torch.equal(lazy["embed.weight"].contiguous(), weights["embed.weight"])


@pytest.mark.parametrize("safe", [False, True])
def test_sharded_output_with_its_index(saved, tmp_path: Path, safe: bool) -> None:
    directory, weights = saved[1]
    out = tmp_path / "fp32"
    files = convert_zero_checkpoint_to_fp32_state_dict(directory, out, max_shard_size="800B", safe_serialization=safe)
    stem, ext = ("model", "safetensors") if safe else ("pytorch_model", "bin")
    index = json.loads((out / f"{stem}.{ext}.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"{stem}-00001-of-{len(shards):05d}.{ext}" and set(files) == {
        *shards, f"{stem}.{ext}.index.json"}
    assert set(index["weight_map"]) == set(weights) and index["metadata"]["total_size"] > 0
    merged: dict[str, torch.Tensor] = {}
    for shard in shards:
        if safe:
            from safetensors.torch import load_file
            merged.update(load_file(out / shard))
        else:
            merged.update(torch.load(out / shard, weights_only=True))
    for name, tensor in weights.items():
        assert torch.equal(merged[name], tensor), name
    single = tmp_path / "single"
    assert convert_zero_checkpoint_to_fp32_state_dict(directory, single) == ["pytorch_model.bin"]
    state = torch.load(single / "pytorch_model.bin", weights_only=True)
    assert state["out.weight"] is state["mid.weight"]  # torch.save keeps the tie


def test_load_state_dict_from_zero_checkpoint_and_the_command_line(saved, tmp_path: Path) -> None:
    directory, weights = saved[3]
    model = load_state_dict_from_zero_checkpoint(TiedNet(), directory)
    assert torch.equal(model.embed.weight, weights["embed.weight"])
    assert main([str(directory), str(tmp_path / "out"), "--safe_serialization", "--exclude_frozen_parameters"]) == 0
    from safetensors.torch import load_file
    state = load_file(tmp_path / "out" / "model.safetensors")
    assert "frozen.weight" not in state and torch.equal(state["out.weight"], weights["mid.weight"])


def test_saved_without_frozen_parameters(tmp_path: Path) -> None:
    weights = run_distributed(_train_and_save, 2, str(tmp_path / "ckpt"), 2, True, timeout=120)[0]
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    assert set(state) == set(weights) - {"frozen.weight", "frozen.bias"}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_written_checkpoints(stage: int) -> None:
    from safetensors.torch import load_file

    expected = {k.split("/", 1)[1]: v for k, v in load_file(DS_FIXTURES / "expected.safetensors").items()
                if k.startswith("weight/")}
    state = get_fp32_state_dict_from_zero_checkpoint(DS_FIXTURES / f"stage{stage}")
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    kept = get_fp32_state_dict_from_zero_checkpoint(DS_FIXTURES / f"stage{stage}", exclude_frozen_parameters=True)
    assert set(kept) == set(expected) - {"frozen"}


def test_bad_checkpoint_directories_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="doesn't exist"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="'latest'"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="global_step9"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path, tag="global_step9")
    (tmp_path / "latest").write_text("global_step1")
    (tmp_path / "global_step1").mkdir()
    with pytest.raises(CheckpointError, match="neither a zerotune checkpoint"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert main([str(tmp_path / "missing"), str(tmp_path / "out")]) == 2


def test_file_helpers_glob_deepspeed_names_in_natural_order(tmp_path: Path) -> None:
    for name in ["zero_pp_rank_10_mp_rank_00_optim_states.pt", "zero_pp_rank_2_mp_rank_00_optim_states.pt",
                 "zero_pp_rank_2_mp_rank_00_model_states.pt", "shard_rank0.pt"]:
        (tmp_path / name).write_text("")
    assert [Path(f).name for f in get_optim_files(tmp_path)] == [
        "zero_pp_rank_2_mp_rank_00_optim_states.pt", "zero_pp_rank_10_mp_rank_00_optim_states.pt"]
    assert [Path(f).name for f in get_model_state_files(tmp_path)] == ["zero_pp_rank_2_mp_rank_00_model_states.pt"]
    with pytest.raises(FileNotFoundError, match="_optim_states.pt"):
        get_optim_files(tmp_path / "nowhere")


def _pipeline_save(directory: str) -> dict[str, torch.Tensor]:
    from tests.test_pipeline import _engine, _train

    engine = _engine(2, "1f1b", 0)
    _train(engine, range(2))
    engine.save_checkpoint(directory, tag="t")
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}  # this stage's layers


def test_pipeline_checkpoint_gives_every_stage_s_layers(tmp_path: Path) -> None:
    stages = run_distributed(_pipeline_save, 2, str(tmp_path / "pipe"), timeout=180)
    weights = {**stages[0], **stages[1]}
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "pipe", exclude_frozen_parameters=True)
    assert set(state) == set(weights) and set(stages[0]) != set(stages[1])
    for name, tensor in weights.items():
        assert torch.equal(state[name], tensor), name
