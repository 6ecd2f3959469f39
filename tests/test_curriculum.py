"""Curriculum learning (``curriculum_learning`` and ``data_efficiency``): the schedules' difficulties against
hand-computed values, the config's checks, and the engine applying a seqlen curriculum -- cut batches that
reproduce a single-process run on the same cut data, ``curriculum_seqlen`` for a model that takes it, and
checkpoints that resume at the difficulty reached."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import zerotune
from tests.harness import run_distributed
from tests.launch import run_client
from tests.models import assert_close_traces, engine_run, gpt2_batch, make_gpt2, reference_run
from zerotune.config import ConfigError, NotSupportedError, load_config
from zerotune.curriculum import CurriculumScheduler
from zerotune.curriculum.seqlen import cut_batch, cut_sequences

STEPS, GAS = 5, 2


def _schedule(kind: str, low: int, high: int, **schedule_config: object) -> CurriculumScheduler:
    return CurriculumScheduler({"min_difficulty": low, "max_difficulty": high, "schedule_type": kind,
                                "schedule_config": schedule_config})


def _walk(scheduler: CurriculumScheduler, steps: int) -> list[int]:
    return [scheduler.update_difficulty(step) for step in range(1, steps + 1)]


# ---- the schedules ---------------------------------------------------------------------------------------
def test_fixed_linear_steps_by_difficulty_step_up_to_max() -> None:
    # min 2 + 8 * step / 8, floored to a multiple of 2 (DeepSpeed's own test of this schedule: the same values)
    assert _walk(_schedule("fixed_linear", 2, 10, total_curriculum_step=8, difficulty_step=2), 10) == \
        [2, 4, 4, 6, 6, 8, 8, 10, 10, 10]


def test_fixed_root_grows_as_the_root_of_the_step() -> None:
    # 8 + 56 * sqrt(step / 16), floored to a multiple of 8: step 1 -> 22 -> 16, 2 -> 27.8 -> 24, 4 -> 36 -> 32,
    # 9 -> 50 -> 48, 16 -> 64; past total_curriculum_step the difficulty stays at max
    scheduler = _schedule("fixed_root", 8, 64, total_curriculum_step=16, difficulty_step=8, root_degree=2)
    assert [scheduler.get_difficulty(step) for step in (1, 2, 4, 9, 16, 20)] == [16, 24, 32, 48, 64, 64]


def test_a_floored_difficulty_never_drops_below_the_first_multiple_of_the_step() -> None:
    # 5 + 15 * 1/10 = 6.5 -> 6 -> 0 by the multiple of 8: raised to 8 (the first multiple >= min 5), not 0 tokens
    assert _schedule("fixed_linear", 5, 20, total_curriculum_step=10, difficulty_step=8).get_difficulty(1) == 8


def test_fixed_discrete_holds_each_difficulty_through_its_max_step() -> None:
    scheduler = _schedule("fixed_discrete", 1, 5, difficulty=[1, 2, 3, 4, 5], max_step=[2, 4, 6, 8])
    assert _walk(scheduler, 10) == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]


def test_custom_schedule_and_the_stop_at_max_rule() -> None:
    scheduler = _schedule("custom", 4, 16)
    with pytest.raises(RuntimeError, match="set_custom_curriculum_learning_schedule"):
        scheduler.update_difficulty(1)
    scheduler.set_custom_get_difficulty(lambda step: 16 if step == 3 else 4 * step)
    # step 3 reaches max; DeepSpeed's rule: from then on the difficulty no longer changes
    assert _walk(scheduler, 5) == [4, 8, 16, 16, 16]
    state = scheduler.get_state()
    assert state["current_difficulty"] == 16 and state["schedule_type"] == "custom"
    scheduler.set_current_difficulty(8)
    assert scheduler.get_current_difficulty() == 8 and scheduler.update_difficulty(4) == 16


# ---- cutting a call ----------------------------------------------------------------------------------------
def test_cut_sequences_cuts_every_tensor_as_long_as_input_ids() -> None:
    ids = torch.arange(12).view(2, 6)
    mask4d = torch.ones(2, 1, 6, 6)
    args, kwargs = cut_sequences((), {"input_ids": ids, "attention_mask": torch.ones(2, 6), "labels": ids,
                                      "position_ids": torch.arange(6)[None], "mask": mask4d,
                                      "pixel": torch.ones(2, 3), "n": 7}, 4)
    assert kwargs["input_ids"].tolist() == [[0, 1, 2, 3], [6, 7, 8, 9]] and kwargs["labels"].shape == (2, 4)
    assert kwargs["attention_mask"].shape == (2, 4) and kwargs["position_ids"].shape == (1, 4)
    assert kwargs["mask"].shape == (2, 1, 4, 4) and kwargs["pixel"].shape == (2, 3) and kwargs["n"] == 7
    assert cut_sequences((), {"input_ids": ids}, 9)[1]["input_ids"] is ids  # longer than the rows: unchanged
    assert cut_batch((ids, ids[:, 0]), 2)[0].shape == (2, 2) and cut_batch(ids, 3).shape == (2, 3)
    with pytest.raises(ValueError, match="no sequence tensor to cut"):
        cut_sequences((torch.ones(3),), {}, 2)


# ---- the config ------------------------------------------------------------------------------------------
LEGACY = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 4, "max_difficulty": 16,
          "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 4}}


def _legacy(**changes: object) -> dict:
    return {"train_batch_size": 4, "curriculum_learning": {**LEGACY, **changes}}


@pytest.mark.parametrize("block, path, message", [
    ({"schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [4, 8], "max_step": [2, 3]}},
     "curriculum_learning.schedule_config", "one value more than max_step"),
    ({"schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [4, 8, 16], "max_step": [3, 2]}},
     "curriculum_learning.schedule_config", "increase strictly"),
    ({"schedule_type": "fixed_root"}, "curriculum_learning.schedule_config.root_degree", "required key is missing"),
    ({"schedule_config": {"difficulty_step": 4}}, "curriculum_learning.schedule_config.total_curriculum_step",
     "required key is missing"),
    ({"min_difficulty": 32}, "curriculum_learning.max_difficulty", "at least min_difficulty"),
    ({"min_difficulty": 0}, "curriculum_learning.min_difficulty", "1 token or more"),
    ({"schedule_type": "fixed_cosine"}, "curriculum_learning.schedule_type", "fixed_linear"),
    ({"schedule_config": {"total_curriculum_step": 4, "difficulty_step": 4, "difficuly": [1]}},
     "curriculum_learning.schedule_config.difficuly", "did you mean 'difficulty'"),
])
def test_bad_curriculum_blocks_name_their_key(block: dict, path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(_legacy(**block))
    assert caught.value.path == path and "\n" not in str(caught.value)


def test_config_refusals_name_the_unsupported_key() -> None:
    with pytest.raises(NotSupportedError) as caught:
        load_config(_legacy(curriculum_type="vocabularyrarity"))
    assert caught.value.path == "curriculum_learning.curriculum_type" and "'seqlen' only" in str(caught.value)
    missing = {k: v for k, v in LEGACY.items() if k != "min_difficulty"}
    with pytest.raises(ConfigError, match="required key is missing") as caught:
        load_config({"curriculum_learning": missing})
    assert caught.value.path == "curriculum_learning.min_difficulty"
    # switched off, the block needs nothing and refuses nothing
    assert not load_config({"curriculum_learning": {"enabled": False, "curriculum_type": "voc"}}).curriculum_learning.enabled


def test_keys_the_schedule_does_not_read_are_reported() -> None:
    cfg = load_config(_legacy(schedule_config={"total_curriculum_step": 4, "difficulty_step": 4, "root_degree": 2}))
    assert ("curriculum_learning.schedule_config.root_degree",
            "no effect here: schedule_type fixed_linear does not read it") in cfg.notes
    assert cfg.curriculum_learning.schedule_config.root_degree is None


def _efficiency(metric: dict | None = None, **sampling: object) -> dict:
    metric = {"difficulty_type": "value", "clustering_type": "single_cluster", "min_difficulty": 4,
              "max_difficulty": 16, "schedule_type": "fixed_linear",
              "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 4}, **(metric or {})}
    return {"train_batch_size": 4, "data_efficiency": {"enabled": True, "seed": 1234, "data_sampling": {
        "enabled": True, "num_workers": 0, **sampling,
        "curriculum_learning": {"enabled": True, "data_cluster_path": "/tmp", "curriculum_metrics": {"seqlen": metric}}}}}


def test_data_efficiency_config_accepts_the_analyzer_free_curriculum() -> None:
    cfg = load_config(_efficiency({"index_to_sample_path": "dummy", "index_to_metric_path": "dummy"}))
    metric = cfg.data_efficiency.data_sampling.curriculum_learning.curriculum_metrics["seqlen"]
    assert metric.schedule_type == "fixed_linear" and metric.max_difficulty == 16
    noted = dict(cfg.notes)
    prefix = "data_efficiency.data_sampling.curriculum_learning"
    assert "single_cluster" in noted[f"{prefix}.curriculum_metrics.seqlen.index_to_sample_path"]
    assert f"{prefix}.data_cluster_path" in noted and "data_efficiency.seed" in noted


@pytest.mark.parametrize("config, path", [
    (_efficiency({"clustering_type": "schedule_based"}),
     "data_efficiency.data_sampling.curriculum_learning.curriculum_metrics.seqlen.clustering_type"),
    ({"data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {"enabled": True}}}},
     "data_efficiency.data_routing.random_ltd"),
    (_efficiency(dynamic_batching={"enabled": True, "max_tokens": 100}), "data_efficiency.data_sampling.dynamic_batching"),
])
def test_analyzer_features_and_random_ltd_are_refused_by_name(config: dict, path: str) -> None:
    with pytest.raises(NotSupportedError) as caught:
        load_config(config)
    assert caught.value.path == path and "not supported" in str(caught.value)


def test_data_efficiency_switches_must_agree() -> None:
    config = _efficiency()
    config["data_efficiency"]["enabled"] = False
    with pytest.raises(ConfigError, match="must be true") as caught:
        load_config(config)
    assert caught.value.path == "data_efficiency.enabled"
    with pytest.raises(ConfigError, match="did you mean 'max_difficulty'") as caught:
        load_config(_efficiency({"max_dificulty": 3}))
    assert caught.value.path.endswith("curriculum_metrics.seqlen.max_dificulty")
    # routing without random-LTD and a disabled block change nothing
    assert load_config({"data_efficiency": {"enabled": False, "data_routing": {"enabled": True}}}).notes


# ---- the engine: 2 ranks, a Hugging Face GPT-2 -------------------------------------------------------------
def _config(**extra: object) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}, **extra}


def _masked_batch(step: int, micro: int, rows: int) -> dict:
    batch = gpt2_batch(step, micro, rows)
    return {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}


def _gpt2_parity() -> dict:
    world = torch.distributed.get_world_size()
    lengths = _walk(CurriculumScheduler(LEGACY), STEPS)  # [4, 8, 12, 16, 16]

    def cut(step: int, micro: int, rows: int) -> dict:
        return cut_batch(_masked_batch(step, micro, rows), lengths[step])

    reference_model = make_gpt2()
    reference = reference_run(reference_model, torch.optim.AdamW(reference_model.parameters(), lr=0.01,
                                                                 weight_decay=0.0),
                              cut, steps=STEPS, gas=GAS, global_rows=2 * world, clip=0.0)
    model = make_gpt2()
    seen: list[tuple] = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append((kw["input_ids"].shape[1],
                                                                 kw["attention_mask"].shape[1],
                                                                 kw["labels"].shape[1])), with_kwargs=True)
    engine, *_ = zerotune.initialize(model=model, config=_config(curriculum_learning=LEGACY))
    trace = engine_run(engine, _masked_batch, steps=STEPS, gas=GAS, global_rows=2 * world)
    engine.eval()
    with torch.no_grad():
        engine(**_masked_batch(0, 0, 2))  # an evaluation forward: full length
    return {"trace": trace, "reference": reference, "seen": seen, "lengths": lengths,
            "params": engine.curriculum_params_legacy(), "enabled": engine.curriculum_enabled_legacy()}


def test_a_gpt2_trains_on_the_scheduled_lengths_like_pytorch_on_cut_batches() -> None:
    result = run_distributed(_gpt2_parity, 2, timeout=180)[0]
    assert result["lengths"] == [4, 8, 12, 16, 16]
    assert result["seen"] == [(n, n, n) for n in result["lengths"] for _ in range(GAS)] + [(16, 16, 16)]
    assert_close_traces(result["trace"], result["reference"], rel=1e-5)
    assert result["enabled"] and result["params"]["curriculum_type"] == "seqlen" and "enabled" not in result["params"]


class MegatronStyle(nn.Module):
    """A model that cuts its own sequences, as Megatron's GPT does with ``curriculum_seqlen``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(96, 16), nn.Linear(16, 96)
        self.received: list[int | None] = []

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, curriculum_seqlen: int | None = None) -> torch.Tensor:
        self.received.append(curriculum_seqlen)
        assert tokens.shape[1] == 16  # the engine leaves the cut to the model
        if curriculum_seqlen is not None:
            tokens, labels = tokens[:, :curriculum_seqlen], labels[:, :curriculum_seqlen]
        return nn.functional.cross_entropy(self.head(self.embed(tokens)).flatten(0, 1), labels.flatten())


def _megatron_style() -> dict:
    model = MegatronStyle()
    custom = {**LEGACY, "schedule_type": "custom", "schedule_config": {}}
    engine, *_ = zerotune.initialize(model=model, config=_config(curriculum_learning=custom))
    engine.set_custom_curriculum_learning_schedule(lambda step: min(4 * step + 4, 16))
    for step in range(3 * GAS):
        batch = gpt2_batch(step, 0, 2)
        engine.backward(engine(batch["input_ids"], batch["labels"]))
        engine.step()
    engine.eval()
    engine(batch["input_ids"], batch["labels"])
    return {"received": model.received, "difficulty": engine.curriculum_scheduler_legacy.get_current_difficulty()}


def test_a_model_taking_curriculum_seqlen_receives_it() -> None:
    result = run_distributed(_megatron_style, 2, timeout=120)[0]
    assert result["received"] == [8, 8, 12, 12, 16, 16, None] and result["difficulty"] == 16


def _resume(directory: str) -> dict:
    config = _config(curriculum_learning={**LEGACY, "schedule_config": {"total_curriculum_step": 8,
                                                                         "difficulty_step": 4}})
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=config)
    engine_run(engine, gpt2_batch, steps=3, gas=GAS, global_rows=4)
    reached = engine.curriculum_scheduler_legacy.get_current_difficulty()
    engine.save_checkpoint(directory, tag="t")
    later = lambda step, micro, rows: gpt2_batch(step + 3, micro, rows)  # noqa: E731
    first = engine_run(engine, later, steps=3, gas=GAS, global_rows=4)
    resumed, *_ = zerotune.initialize(model=make_gpt2(seed=3), config=config)
    resumed.load_checkpoint(directory, tag="t")
    loaded = resumed.curriculum_scheduler_legacy.get_current_difficulty()
    second = engine_run(resumed, later, steps=3, gas=GAS, global_rows=4)
    return {"reached": reached, "loaded": loaded, "first": first, "second": second,
            "saved": torch.load(Path(directory) / "t" / "model_states.pt", weights_only=True)["curriculum"]}


def test_a_resumed_run_continues_at_the_difficulty_it_reached(tmp_path: Path) -> None:
    result = run_distributed(_resume, 2, str(tmp_path), timeout=180)[0]
    # 4 + 12 * 3/8 = 8.5 -> 8 after step 3; the fresh engine starts at min_difficulty 4 until it loads
    assert result["reached"] == result["loaded"] == 8 and result["saved"]["legacy"]["current_difficulty"] == 8
    assert result["first"] == result["second"]


# ---- data_efficiency: the engine's data loader ---------------------------------------------------------------
class _Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 96, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _data_efficiency(directory: str) -> dict:
    config = _config(**_efficiency())
    del config["train_batch_size"]
    engine, _, loader, _ = zerotune.initialize(model=make_gpt2(), config=config, training_data=_Rows())
    batches = iter(loader)
    cut = [next(batches)["input_ids"].shape[1] for _ in range(3 * GAS)]
    states: list[dict] = []
    engine.set_data_post_process_func(lambda batch, state: states.append(state) or batch)
    handed = [next(batches)["input_ids"].shape[1] for _ in range(GAS)]
    handed_states = list(states)
    loss = engine(**next(iter(loader)))  # a training step through the engine still works
    engine.backward(loss.loss)
    engine.step()
    engine.save_checkpoint(directory, tag="d")
    fresh, _, fresh_loader, _ = zerotune.initialize(model=make_gpt2(), config=config, training_data=_Rows())
    fresh.load_checkpoint(directory, tag="d")
    return {"cut": cut, "handed": handed, "difficulties": [s["current_difficulties"] for s in handed_states],
            "steps": [s["curriculum_step"] for s in handed_states], "resumed": fresh_loader.curriculum.state_dict(),
            "saved": loader.curriculum.state_dict()}


def test_the_data_efficiency_seqlen_metric_cuts_the_loaders_batches(tmp_path: Path) -> None:
    result = run_distributed(_data_efficiency, 2, str(tmp_path), timeout=180)[0]
    assert result["cut"] == [4, 4, 8, 8, 12, 12]  # one schedule step per global batch (GAS micro-batches)
    # with a post-process function the batch is its business (DeepSpeed's contract): full rows, the difficulty
    assert result["handed"] == [16, 16] and result["difficulties"] == [{"seqlen": 16}] * 2
    assert result["steps"] == [4, 4]
    assert result["resumed"] == result["saved"]


# ---- a DeepSpeed script --------------------------------------------------------------------------------------
@pytest.mark.slow  # a torchrun launch of 2 fresh processes: ~30 s here
def test_a_deepspeed_script_with_a_curriculum_block(tmp_path: Path) -> None:
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"train_batch_size": 8, "gradient_accumulation_steps": 2, "steps_per_print": 100,
                                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                                  "zero_optimization": {"stage": 1},
                                  "curriculum_learning": {"enabled": True, "curriculum_type": "seqlen",
                                                          "min_difficulty": 4, "max_difficulty": 16,
                                                          "schedule_type": "fixed_linear", "schedule_config": {
                                                              "total_curriculum_step": 4, "difficulty_step": 4}}}))
    rows = run_client("curriculum_seqlen.py", "--deepspeed_config", str(config), "--save_dir", str(tmp_path / "ckpt"))
    for row in rows:
        assert row["enabled"] and row["type"] == "seqlen" and row["finite"]
        assert row["seen"] == row["expected"] == [4, 4, 8, 8, 12, 12, 16, 16, 16, 16]
        assert row["reached"] == row["resumed"] == 16


def test_initialize_reports_a_curriculum_it_does_not_apply() -> None:
    from zerotune.engine_curriculum import curriculum_notes

    config = _efficiency()
    config["curriculum_learning"] = LEGACY
    notes = curriculum_notes(load_config(config), pipelined=True, has_training_data=False)
    assert len(notes) == 2 and "pipeline engine does not apply it" in notes[0] and "no training_data" in notes[1]
    assert curriculum_notes(load_config(config), pipelined=False, has_training_data=True) == []
