"""DeepSpeed's checkpoint module surface on zerotune: ``get_model_ckpt_name_for_rank`` (the file holding a
model-parallel rank's module state, in either layout), ``checkpoint.constants`` (the DeepSpeed keys and files zerotune
reads, checked against checkpoints real DeepSpeed wrote), ``ds_to_universal`` (check, then publish a copy that loads
at another layout), ``TorchCheckpointEngine`` (atomic writes, ``weights_only`` loads), the ZeRO optimizer's fp32
master names and base ``optimizer.optimizer``, ``engine._get_optimizer_ckpt_name`` refused (MoE files),
``pipeline_loading_checkpoint``, counter-only optimizer state and a custom ``state_dict`` with frozen weights left
out."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import zerotune
from tests.harness import run_distributed
from zerotune.checkpoint.atomic import CheckpointError
from zerotune.checkpoint.deepspeed_format import _load, read_deepspeed_checkpoint
from zerotune.compat import checkpoint_constants as C
from zerotune.compat.checkpoint import get_model_ckpt_name_for_rank
from zerotune.compat.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine, TorchCheckpointEngine
from zerotune.compat.ds_to_universal import main as to_universal
from zerotune.compat.ds_to_universal import parse_arguments
from zerotune.compat.paths import DeepSpeedFeatureNotSupported
from zerotune.compat.zero_config import DeepSpeedZeroConfig

DATA = Path(__file__).parent / "data" / "deepspeed_checkpoints"
TAG = "global_step2"


def _args(source: Path, target: Path) -> SimpleNamespace:
    return SimpleNamespace(input_folder=str(source), output_folder=str(target), num_extract_workers=1,
                           num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False)


def test_model_file_name_in_both_layouts(tmp_path: Path) -> None:
    deepspeed_tag = DATA / "stage1" / TAG
    assert get_model_ckpt_name_for_rank(str(deepspeed_tag), "00") == str(deepspeed_tag / "mp_rank_00_model_states.pt")
    assert get_model_ckpt_name_for_rank(str(tmp_path), "00") == str(tmp_path / "model_states.pt")
    assert get_model_ckpt_name_for_rank(str(tmp_path), "01") == str(tmp_path / "model_states.pt")  # tp joined
    with pytest.raises(ValueError, match="mp_rank_str"):
        get_model_ckpt_name_for_rank(str(tmp_path), "x")


@pytest.mark.parametrize("stage", [1, 3])
def test_constants_name_what_deepspeed_wrote(stage: int) -> None:
    tag = DATA / f"stage{stage}" / TAG
    model_name = (C.ZERO_FILE_PREFIX + "0_" if stage == 3 else "") + C.MODEL_FILE_PREFIX + "00" + C.MODEL_FILE_SUFFIX
    model = _load(tag / model_name)
    assert {C.PARAM_SHAPES, C.BUFFER_NAMES, C.DS_VERSION} <= set(model)
    optim = _load(tag / f"{C.ZERO_FILE_PREFIX}1_{C.MODEL_FILE_PREFIX}00{C.OPTIM_FILE_SUFFIX}")
    state = optim[C.OPTIMIZER_STATE_DICT]
    assert state[C.ZERO_STAGE] == stage and state[C.PARTITION_COUNT] in (2, [2])
    if stage == 3:  # the torch optimizer's own state dict, laid out like the flat groups
        assert C.FP32_FLAT_GROUPS in state and C.PARAM_GROUPS in state[C.OPTIMIZER_STATE_DICT]
    else:
        assert {C.BASE_OPTIMIZER_STATE, C.SINGLE_PARTITION_OF_FP32_GROUPS, C.GROUP_PADDINGS} <= set(state)


def test_universal_copy_of_a_deepspeed_checkpoint_reads_the_same(tmp_path: Path) -> None:
    source = tmp_path / "run" / TAG
    shutil.copytree(DATA / "stage2" / TAG, source)
    target = tmp_path / "run" / f"{TAG}_universal"
    to_universal(_args(source, target))
    before, after = read_deepspeed_checkpoint(source), read_deepspeed_checkpoint(target)
    assert before.weights.keys() == after.weights.keys()
    assert all(torch.equal(before.weights[k], after.weights[k]) for k in before.weights)
    assert not any(p.name.endswith(".partial") for p in target.parent.iterdir())
    with pytest.raises(CheckpointError, match="already exists"):
        to_universal(_args(source, target))


def test_universal_refuses_a_damaged_input(tmp_path: Path) -> None:
    source = tmp_path / TAG
    shutil.copytree(DATA / "stage1" / TAG, source)
    (source / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match="zero_pp_rank_1"):
        to_universal(_args(source, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_universal_command_line() -> None:
    args = parse_arguments(["--input_folder", "a", "--output_folder", "b", "--no_strict"])
    assert (args.input_folder, args.output_folder, args.strict) == ("a", "b", False)


def test_torch_checkpoint_engine_writes_atomically_and_loads_weights_only(tmp_path: Path) -> None:
    engine = TorchCheckpointEngine()
    info = CheckpointCommitInfo(tag="t", save_dir=str(tmp_path), save_latest=True)
    engine.create(info)
    engine.makedirs(str(tmp_path / "t"), exist_ok=True)
    engine.save({"w": torch.arange(3.0)}, str(tmp_path / "t" / "a.pt"))
    assert engine.commit(info) is True
    assert [p.name for p in (tmp_path / "t").iterdir()] == ["a.pt"]  # no temporary file left
    assert torch.equal(engine.load(str(tmp_path / "t" / "a.pt"))["w"], torch.arange(3.0))
    torch.save({"code": SimpleNamespace(x=1)}, tmp_path / "t" / "b.pt")
    with pytest.raises(CheckpointError, match="b.pt"):
        engine.load(str(tmp_path / "t" / "b.pt"))
    assert engine.name == "TorchCheckpointEngine" and engine.is_data_parallel_writer(0)
    assert not engine.is_decoupled() and engine.get_commit_info() is None
    with pytest.raises(TypeError):
        CheckpointEngine()  # type: ignore[abstract]


def test_pipeline_loading_checkpoint_is_accepted() -> None:
    assert DeepSpeedZeroConfig(stage=3, pipeline_loading_checkpoint=True).pipeline_loading_checkpoint is True
    assert DeepSpeedZeroConfig().pipeline_loading_checkpoint is False


@pytest.mark.parametrize("stage", [1, 3])
def test_fp32_masters_under_deepspeed_names_and_universal_reload(stage: int, tmp_path: Path) -> None:
    run_distributed(_save_convert_load, 2, stage, str(tmp_path), timeout=120)


def _engine(stage: int, seed: int) -> zerotune.Engine:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 2))
    config = {"train_batch_size": 2, "zero_optimization": {"stage": stage}, "bf16": {"enabled": True},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "checkpoint": {"load_universal": True}}
    return zerotune.initialize(model=model, config=config)[0]


def _save_convert_load(stage: int, tmp: str) -> None:
    engine = _engine(stage, 0)
    for _ in range(2):
        engine.backward(engine(torch.randn(1, 6)).square().mean())
        engine.step()
    name = "fp32_partitioned_groups_flat" if stage == 3 else "single_partition_of_fp32_groups"
    masters = getattr(engine.optimizer, name)
    assert len(masters) >= 1 and all(m.dtype == torch.float32 for m in masters)
    assert len(masters) == len(engine.state.masters) and masters[0] is engine.state.masters[0]
    assert engine.optimizer.optimizer is engine.optimizer  # DeepSpeed's base optimizer: zerotune's is not wrapped
    with pytest.raises(DeepSpeedFeatureNotSupported, match="Mixture-of-Experts"):
        engine._get_optimizer_ckpt_name(tmp, "t", 0)
    engine.save_checkpoint(tmp, tag="t")
    if torch.distributed.get_rank() == 0:
        to_universal(_args(Path(tmp) / "t", Path(tmp) / "t_universal"))
    torch.distributed.barrier()
    loaded = _engine(1 if stage == 3 else 3, 1)  # another stage: the copy loads at any layout
    loaded.load_checkpoint(tmp, tag="t_universal")
    assert loaded.global_steps == engine.global_steps == 2
    params = [*engine.module.parameters(), *loaded.module.parameters()]
    with zerotune.zero.GatheredParameters(params):
        for a, b in zip(engine.module.parameters(), loaded.module.parameters()):
            assert a.numel() > 0 and torch.equal(a, b)
    engine.destroy()
    loaded.destroy()


class _CountingSGD(torch.optim.Optimizer):
    """Plain SGD keeping only per-parameter counters, one a Python int and one a one-element tensor (the state
    DeepSpeed's HybridStateOptimizer test keeps): no per-element state at all."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["integer_step"], state["tensor_step"] = 0, torch.zeros(1, device=p.device)
                p.add_(p.grad, alpha=-group["lr"])
                state["integer_step"] += 1
                state["tensor_step"] += 1


@pytest.mark.parametrize("stage", [1, 2])
def test_counter_only_optimizer_state_round_trips(stage: int, tmp_path: Path) -> None:
    run_distributed(_counters_round_trip, 2, stage, str(tmp_path), timeout=120)


def _counters_round_trip(stage: int, tmp: str) -> None:
    config = {"train_batch_size": 2, "zero_optimization": {"stage": stage, "elastic_checkpoint": True},
              "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True}
    engines = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = nn.Linear(6, 5)
        engines.append(zerotune.initialize(model=model, optimizer=_CountingSGD(model.parameters()), config=config)[0])
    saved, loaded = engines
    for _ in range(3):
        saved.backward(saved(torch.randn(1, 6)).float().square().mean())
        saved.step()
    saved.save_checkpoint(tmp, tag="t")
    loaded.load_checkpoint(tmp, tag="t")
    states = [list(engine.optimizer.state.values()) for engine in engines]
    assert len(states[0]) == len(states[1]) == 1
    assert states[1][0]["integer_step"] == states[0][0]["integer_step"] == 3
    assert torch.equal(states[1][0]["tensor_step"], torch.tensor([3.0]))
    loaded.backward(loaded(torch.randn(1, 6)).float().square().mean())
    loaded.step()  # the restored counters keep counting
    assert states[1][0]["integer_step"] == 4 and torch.equal(states[1][0]["tensor_step"], torch.tensor([4.0]))


class _PartlyFrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen, self.hidden, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.frozen.requires_grad_(False)
        self.hidden.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(self.frozen(x)))

    def without_hidden_weight(self, *args, **kwargs) -> dict:
        """A module's own state_dict that leaves out one frozen parameter (DeepSpeed's custom_state_dict case)."""
        return {k: v for k, v in nn.Module.state_dict(self, *args, **kwargs).items() if k != "hidden.weight"}


def test_exclude_frozen_with_a_custom_state_dict(tmp_path: Path) -> None:
    run_distributed(_custom_state_dict_saved, 1, str(tmp_path), timeout=120)


def _custom_state_dict_saved(tmp: str) -> None:
    model = _PartlyFrozen()
    engine = zerotune.initialize(model=model, config={"train_batch_size": 1, "zero_optimization": {"stage": 1},
                                                      "optimizer": {"type": "Adam"}})[0]
    model.state_dict = model.without_hidden_weight  # type: ignore[method-assign]
    engine.save_checkpoint(tmp, tag="t", exclude_frozen_parameters=True)
    saved = torch.load(get_model_ckpt_name_for_rank(str(Path(tmp) / "t"), "00"), weights_only=True)["module"]
    assert set(saved) == {"hidden.bias", "head.weight", "head.bias"}  # (the custom dict's trainable entries)
    engine.load_checkpoint(tmp, tag="t")  # the frozen base it recorded is this model's
    engine.destroy()


def test_zero3_elastic_checkpoint_warns_as_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    from zerotune.monitor.logging import get_logger

    messages: list[str] = []
    monkeypatch.setattr(get_logger(), "warning", lambda message, *args, **kwargs: messages.append(message))
    DeepSpeedZeroConfig(stage=2, elastic_checkpoint=True)
    assert messages == []
    DeepSpeedZeroConfig(stage=3, elastic_checkpoint=True)
    assert len(messages) == 1 and "elastic checkpointing is deprecated" in messages[0] and "no effect" in messages[0]
