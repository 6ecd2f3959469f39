"""Preference training in ``zerotune finetune``: data layouts and their errors, recipe checks, parity of
every preference objective with single-process PyTorch at ZeRO 0-3 (LoRA: adapter-disabled reference;
full: precomputed reference), and end-to-end runs that move the reward margin."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import datasets
import pytest
import torch

from tests.harness import run_distributed
from tests.test_finetune_causal_lm import COLORS, make_tiny_llama
from zerotune.finetune.data_files import DataError
from zerotune.finetune.models import apply_method, load_model, load_tokenizer
from zerotune.finetune.preference.batches import paired_collator, tokenize_pairs, tokenize_unpaired, unpaired_collator
from zerotune.finetune.preference.objective import PreferenceObjective, sequence_logps
from zerotune.finetune.preference.pairs import pairs_from_answers, to_pairs, to_unpaired
from zerotune.finetune.recipe import RecipeError, load_recipe
from zerotune.finetune.recipe_sections import MethodSection


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


# --- data layouts ------------------------------------------------------------------------------

USER = [{"role": "user", "content": "what color is the sky"}]


@pytest.mark.parametrize("row", [
    {"prompt": "what color is the sky", "chosen": "blue", "rejected": "green"},
    {"prompt": USER, "chosen": [{"role": "assistant", "content": "blue"}],
     "rejected": [{"role": "assistant", "content": "green"}]},
    {"chosen": USER + [{"role": "assistant", "content": "blue"}],
     "rejected": USER + [{"role": "assistant", "content": "green"}]},
    {"conversations": [{"from": "human", "value": "what color is the sky"}], "chosen": {"from": "gpt", "value": "blue"},
     "rejected": {"from": "gpt", "value": "green"}},
    {"messages": USER, "chosen": "blue", "rejected": {"role": "assistant", "content": "green"}},
    {"question": "what color is the sky", "chosen": "blue", "rejected": "green"},
    {"instruction": "what color is the sky", "input": "", "chosen": "blue", "rejected": "green"},
], ids=["trl-standard", "trl-conversational", "implicit-prompt", "llamafactory-sharegpt", "messages", "question",
        "alpaca"])
def test_each_documented_pair_layout_becomes_prompt_chosen_rejected(row) -> None:
    pairs = to_pairs(datasets.Dataset.from_list([row]), ["pairs.jsonl"])
    assert pairs[0] == {"prompt": USER, "chosen": "blue", "rejected": "green"}


def test_unpaired_layouts_and_paired_data_unpaired_for_kto() -> None:
    rows = datasets.Dataset.from_list([{"prompt": "q1", "completion": "good", "label": True},
                                       {"prompt": "q2", "completion": "bad", "label": False}])
    assert to_unpaired(rows, ["kto.jsonl"])["label"] == [True, False]
    tagged = datasets.Dataset.from_list([
        {"messages": USER + [{"role": "assistant", "content": "blue"}], "kto_tag": True},
        {"messages": USER + [{"role": "assistant", "content": "green"}], "kto_tag": False}])
    assert to_unpaired(tagged, ["kto.jsonl"])["completion"] == ["blue", "green"]
    paired = datasets.Dataset.from_list([{"prompt": "q", "chosen": "yes", "rejected": "no"}])
    unpaired = to_unpaired(paired, ["pairs.jsonl"])
    assert unpaired["completion"] == ["yes", "no"] and unpaired["label"] == [True, False]


@pytest.mark.parametrize(("rows", "message"), [
    ([{"text": "hello"}], "needs 'chosen' and 'rejected' columns; 'pairs.jsonl' has text"),
    ([{"prompt": "q", "chosen": "", "rejected": "no"}], "row 0: 'chosen' is ''"),
    ([{"prompt": "q", "chosen": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}],
       "rejected": "no"}], "'chosen' must be one assistant turn"),
    ([{"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
       "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "b"}]}],
     "share their opening turns"),
    ([{"prompt": [{"role": "robot", "content": "q"}], "chosen": "a", "rejected": "b"}], "has role 'robot'"),
])
def test_a_wrong_pair_shape_is_one_line_naming_the_row_and_key(rows, message) -> None:
    with pytest.raises(DataError, match=re.escape(message)):
        to_pairs(datasets.Dataset.from_list(rows), ["pairs.jsonl"])


def test_kto_data_needs_both_labels_and_boolean_labels() -> None:
    with pytest.raises(DataError, match="every row of 'kto.jsonl' is desirable"):
        to_unpaired(datasets.Dataset.from_list([{"prompt": "q", "completion": "a", "label": True}]), ["kto.jsonl"])
    with pytest.raises(DataError, match="row 0: the label is 'yes'"):
        to_unpaired(datasets.Dataset.from_list([{"prompt": "q", "completion": "a", "label": "yes"}]), ["kto.jsonl"])
    with pytest.raises(DataError, match="KTO data: 'kto.jsonl' has columns text"):
        to_unpaired(datasets.Dataset.from_list([{"text": "a"}]), ["kto.jsonl"])


def test_pairs_from_answers_never_rejects_a_questions_own_answer() -> None:
    questions = [f"q{i}" for i in range(50)]
    answers = [f"a{i}" for i in range(50)]
    pairs = pairs_from_answers(questions, answers, seed=3)
    assert len(pairs) == 50
    for prompt, chosen, rejected in zip(pairs["prompt"], pairs["chosen"], pairs["rejected"]):
        assert chosen == "a" + prompt[0]["content"][1:] and rejected != chosen


def test_tokenized_pairs_mark_only_the_answer_tokens(llama_dir) -> None:
    tokenizer = load_tokenizer(llama_dir)
    rows = datasets.Dataset.from_list([{"prompt": USER, "chosen": "the sky is blue", "rejected": "the sky is red"}])
    tokens = tokenize_pairs(rows, tokenizer, 64)
    batch = paired_collator(tokenizer.pad_token_id)([tokens[0]])
    prompt = tokens[0]["prompt_ids"]
    assert batch["input_ids"].shape[0] == 2 and batch["completion_mask"][:, :len(prompt)].sum() == 0
    answer = tokenizer.decode(batch["input_ids"][0][batch["completion_mask"][0].bool()])
    assert "blue" in answer and answer.endswith("<|im_end|>")
    with pytest.raises(DataError, match="raise data.max_length"):
        tokenize_pairs(rows, tokenizer, 3)


# --- recipe checks -------------------------------------------------------------------------------


def _pair_rows(rows: int) -> list[dict]:
    """Questions whose right answer is chosen and another color's answer rejected."""
    things = list(COLORS)
    out = []
    for i in range(rows):
        thing, other = things[i % len(things)], things[(i + 1) % len(things)]
        out.append({"prompt": f"what color is the {thing}", "chosen": f"the {thing} is {COLORS[thing]}",
                    "rejected": f"the {thing} is {COLORS[other]}"})
    return out


def _pairs_file(path: Path, rows: int = 64) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in _pair_rows(rows)))
    return path


def _recipe(tmp: Path, llama: Path, objective: dict, method: dict | None = None, stage: int = 2, **train) -> Path:
    recipe = {"model": {"name_or_path": str(llama)}, "task": "causal-lm", "objective": objective,
              "data": {"train_files": [str(_pairs_file(tmp / "pairs.jsonl"))], "eval_fraction": 0.25,
                       "max_length": 32},
              "method": method or {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0},
              "train": {"max_steps": 12, "lr": 2e-2, "micro_batch_size": 4, "seed": 3, "eval_samples": 0, **train},
              "engine": {"zero_stage": stage}}
    path = tmp / "recipe.json"
    path.write_text(json.dumps(recipe))
    return path


def test_objective_options_and_combinations_are_checked_at_load(tmp_path, llama_dir) -> None:
    with pytest.raises(RecipeError, match="objective.gamma: a simpo option, but objective.type is 'dpo'"):
        load_recipe(str(_recipe(tmp_path, llama_dir, {"type": "dpo", "gamma": 1.0})))
    with pytest.raises(RecipeError, match="objective.loss: a dpo option, but objective.type is 'kto'"):
        load_recipe(str(_recipe(tmp_path, llama_dir, {"type": "kto", "loss": "ipo"})))
    with pytest.raises(RecipeError, match="data.packing: not with objective.type orpo"):
        load_recipe(str(_recipe(tmp_path, llama_dir, {"type": "orpo"})), ["data.packing=true"])
    with pytest.raises(RecipeError, match="train.metric_for_best_model: 'perplexity' is not an eval metric of "
                                          "objective.type 'dpo'"):
        load_recipe(str(_recipe(tmp_path, llama_dir, {"type": "dpo"})),
                    ["train.metric_for_best_model=perplexity", "train.eval_every=4",
                     "train.load_best_model_at_end=true"])
    with pytest.raises(RecipeError, match="objective.type: invalid value \"ppo\": expected 'sft', 'dpo'"):
        load_recipe(str(_recipe(tmp_path, llama_dir, {"type": "ppo"})))
    recipe = load_recipe(str(_recipe(tmp_path, llama_dir, {"type": "simpo"})))
    assert recipe.objective.effective_beta() == 2.0 and recipe.objective.gamma == 0.5


# --- parity with single-process PyTorch at every ZeRO stage --------------------------------------

ROWS, STEPS = 8, 4
CASES = [("dpo", "lora"), ("dpo", "full"), ("kto", "lora"), ("orpo", "full"), ("simpo", "lora"), ("dpo-ipo", "full")]


def _batches(llama: str, kind: str) -> list[dict]:
    tokenizer = load_tokenizer(Path(llama))
    rows = datasets.Dataset.from_list(_pair_rows(ROWS))
    pairs = to_pairs(rows, ["p"])
    if kind == "kto":
        tokens = tokenize_unpaired(to_unpaired(rows, ["p"]), tokenizer, 32)
        return [unpaired_collator(tokenizer.pad_token_id)(list(tokens))]
    tokens = tokenize_pairs(pairs, tokenizer, 32)
    return [paired_collator(tokenizer.pad_token_id)(list(tokens))]


def _objective(kind: str, model) -> PreferenceObjective:
    loss = "ipo" if kind == "dpo-ipo" else "sigmoid"
    return PreferenceObjective(kind=kind.split("-")[0], beta=0.1 if kind != "simpo" else 2.0, dpo_loss=loss,
                               adapter_reference=hasattr(model, "peft_config"))


def _model(llama: str, method: str):
    torch.manual_seed(0)
    options = {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0} if method == "lora" else {"type": "full"}
    return apply_method(load_model(Path(llama), "causal-lm"), "causal-lm", MethodSection(**options))


def _rank_part(batch: dict, rank: int, world: int, paired: bool) -> dict:
    """This rank's rows of a full batch (a paired batch keeps its chosen / rejected halves together)."""
    if not paired:
        return {key: value[rank::world] for key, value in batch.items()}
    rows = batch["input_ids"].shape[0] // 2
    part = {}
    for key, value in batch.items():
        if key.startswith("ref_"):
            part[key] = value[rank::world]
        else:
            part[key] = torch.cat([value[:rows][rank::world], value[rows:][rank::world]])
    return part


def _with_reference(objective: PreferenceObjective, forward, batch: dict) -> dict:
    """Full fine-tuning: the step-0 model's log-probs, as ``precompute_reference`` attaches them."""
    if not objective.precomputes_reference:
        return batch
    with torch.no_grad():
        if objective.kind == "kto":
            first, _ = sequence_logps(forward, batch)
            second, _ = sequence_logps(forward, {k[3:]: v for k, v in batch.items() if k.startswith("kl_")})
            return {**batch, "ref_logps": first, "ref_kl_logps": second}
        chosen, rejected = sequence_logps(forward, batch)[0].chunk(2)
        return {**batch, "ref_chosen_logps": chosen, "ref_rejected_logps": rejected}


class _Direct:
    def __init__(self, model) -> None:
        from types import SimpleNamespace

        self.module = model
        self.mesh = SimpleNamespace(size=lambda axis: 1, rank=lambda axis: 0, group=lambda axis: None)

    def __call__(self, **batch):
        return self.module(**batch)


def _single_process(llama: str, kind: str, method: str) -> list[float]:
    model = _model(llama, method)
    forward = _Direct(model)
    objective = _objective(kind, model)
    batch = _with_reference(objective, forward, _batches(llama, kind)[0])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        loss, _ = objective.loss(forward, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _on_ranks(llama: str, kind: str, method: str, stages: list[int]) -> dict[int, list[float]]:
    import torch.distributed as dist

    import zerotune

    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for stage in stages:
        model = _model(llama, method)
        engine, *_ = zerotune.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config={"train_micro_batch_size_per_gpu": ROWS // world, "zero_optimization": {"stage": stage},
                    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
                    "steps_per_print": 1000})
        objective = _objective(kind, model)
        batch = _with_reference(objective, engine, _batches(llama, kind)[0])
        part = _rank_part(batch, rank, world, paired=kind != "kto")
        losses = []
        for _ in range(STEPS):
            loss, _ = objective.loss(engine, part)
            engine.backward(loss)
            engine.step()
            total = loss.detach().clone().reshape(1)
            dist.all_reduce(total)
            losses.append(total.item() / world)
        engine.destroy()
        results[stage] = losses
    return results


@pytest.mark.parametrize(("kind", "method"), CASES, ids=[f"{k}-{m}" for k, m in CASES])
def test_preference_training_matches_single_process_pytorch_at_every_zero_stage(llama_dir, kind, method) -> None:
    """Two ranks, each with half the pairs, at ZeRO 0-3: every step's loss equals one process training on all
    pairs with torch.optim.AdamW (fp32, 1e-5 relative). KTO's even rows split desirable / undesirable evenly."""
    expected = _single_process(str(llama_dir), kind, method)
    assert expected[-1] < expected[0]
    results = run_distributed(_on_ranks, 2, str(llama_dir), kind, method, [0, 1, 2, 3], timeout=400)[0]
    for stage, losses in results.items():
        assert losses == pytest.approx(expected, rel=1e-5), (kind, method, stage, losses, expected)


# --- end to end -----------------------------------------------------------------------------------


def _finetune(recipe: str, output: str, overrides: list[str]) -> dict:
    from zerotune.finetune.worker import run

    return run(argparse.Namespace(recipe=recipe, output_dir=output, resume=False, merge=False, overrides=overrides))


@pytest.mark.slow
@pytest.mark.parametrize(("objective", "method", "stage"), [
    ({"type": "dpo"}, {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0}, 3),
    ({"type": "dpo"}, {"type": "full"}, 2),
    ({"type": "kto"}, {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0}, 1),
    ({"type": "orpo", "beta": 1.0}, {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0}, 0),
    ({"type": "reward"}, {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0}, 2),
    ({"type": "dpo", "loss": "ipo"}, {"type": "qlora", "bits": 4, "r": 4, "alpha": 8, "dropout": 0.0}, 2),
    ({"type": "simpo"}, {"type": "full"}, 3),
], ids=["dpo-lora-z3", "dpo-full-z2", "kto-lora-z1", "orpo-lora-z0", "reward-lora-z2", "ipo-qlora-z2",
        "simpo-full-z3"])
def test_finetune_moves_the_reward_margin_on_two_ranks(tmp_path, llama_dir, objective, method, stage) -> None:
    if method["type"] == "qlora":
        pytest.importorskip("bitsandbytes")
    recipe = _recipe(tmp_path, llama_dir, objective, method, stage)
    summary = run_distributed(_finetune, 2, str(recipe), str(tmp_path / "run"), [], timeout=400)[0]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if r["split"] == "eval"][-1]
    if objective["type"] == "reward":
        assert summary["metric"] == "reward_accuracy" and summary["after"] >= 0.9, summary
    else:
        assert summary["metric"] == "reward_margin" and summary["after"] > summary["before"] + 0.05, summary
    if objective["type"] in ("dpo", "orpo"):
        assert final["reward_accuracy"] >= 0.75, final
    assert (tmp_path / "run" / ("model" if method["type"] == "full" else "adapter")).is_dir()


@pytest.mark.slow
def test_compare_methods_compares_dpo_orpo_and_simpo_on_the_same_pairs(tmp_path, llama_dir) -> None:
    import os
    import subprocess
    import sys

    recipe = _recipe(tmp_path, llama_dir, {"type": "dpo"}, stage=2)
    out = tmp_path / "compare"
    done = subprocess.run([sys.executable, "-m", "zerotune.cli.main", "compare-methods", str(recipe), "--objectives",
                           "dpo,orpo,simpo", "--output-dir", str(out), "--set", "train.max_steps=8",
                           "--set", "launch.nproc_per_node=1"], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "compare.json").read_text())
    rows = {row["method"]: row for row in result["rows"]}
    assert set(rows) == {"dpo", "orpo", "simpo"} and result["metric"] == "reward_accuracy"
    assert result["compared"] == "objective.type" and rows["dpo"]["model_state_pct_of_full"] == 100.0
    assert all(0.0 <= row["final_metric"] <= 1.0 for row in rows.values())
    assert "| objective | model state / rank MiB (% of dpo)" in done.stdout
    for name in rows:
        summary = json.loads((out / name / "summary.json").read_text())
        assert summary["objective"] == name
