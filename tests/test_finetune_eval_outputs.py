"""Where a fine-tuning run's evaluations go: every configured writer under the run directory, and generated
samples at each evaluation of a causal-LM run (issue 17 item 4); writer packages checked at load."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import pytest

from tests.harness import run_distributed
from tests.test_finetune_causal_lm import write_recipe
from zerotune.finetune.recipe import RecipeError, load_recipe
from zerotune.finetune.samples import sample_conversations


def _finetune(recipe: str, output: str) -> dict:
    from zerotune.finetune.worker import run

    return run(argparse.Namespace(recipe=recipe, output_dir=output, resume=False, merge=False, overrides=[]))


def _csv_column(path: Path) -> list[tuple[int, float]]:
    rows = list(csv.reader(path.open()))[1:]
    return [(int(step), float(value)) for step, value in rows]


@pytest.mark.slow
def test_evaluations_reach_every_writer_in_the_run_directory_and_samples_are_generated_at_zero_3(tmp_path) -> None:
    path = write_recipe(tmp_path, stage=3)
    recipe = json.loads(path.read_text())
    recipe["train"].update(max_steps=10, eval_every=5, sample_prompts=["what color is the sky", "what color is the coal"],
                           sample_max_new_tokens=6)
    recipe["engine"].update(tensorboard={"enabled": True}, csv_monitor={"enabled": True}, steps_per_print=5)
    path.write_text(json.dumps(recipe))
    run = tmp_path / "run"
    run_distributed(_finetune, 2, str(path), str(run), timeout=300)

    evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["split"] == "eval"]
    assert [e["step"] for e in evals] == [0, 5, 10]
    loss_rows = _csv_column(run / "csv_monitor" / "Eval_loss.csv")
    assert loss_rows == [(e["step"], pytest.approx(e["loss"], rel=1e-6)) for e in evals]
    assert (run / "csv_monitor" / "Eval_perplexity.csv").is_file()
    assert any(p.name.startswith("Train_Samples") for p in (run / "csv_monitor").iterdir())  # the engine's own scalars

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("Eval/loss")] == [0, 5, 10]
    assert not Path("runs").exists() or not any(Path("runs").rglob(f"*{tmp_path.name}*"))

    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["prompt"]) for s in samples] == [
        (step, prompt) for step in (0, 5, 10) for prompt in ("what color is the sky", "what color is the coal")]
    assert all(isinstance(s["answer"], str) for s in samples)
    assert samples[-2]["answer"] != samples[0]["answer"]  # training changed what the model says


def test_sample_prompts_come_from_the_eval_questions_or_the_recipe() -> None:
    import datasets

    pairs = datasets.Dataset.from_list([{"prompt": f"q{i}", "response": f"a{i}"} for i in range(5)])
    assert sample_conversations(pairs, None, 2) == [[{"role": "user", "content": "q0"}],
                                                    [{"role": "user", "content": "q1"}]]
    chats = datasets.Dataset.from_list([{"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "bye"}]}])
    assert sample_conversations(chats, None, 2) == [chats[0]["messages"][:4]]  # cut before the last answer
    assert sample_conversations(datasets.Dataset.from_list([{"text": "t"}]), None, 2) == []
    assert sample_conversations(pairs, ["fixed"], 2) == [[{"role": "user", "content": "fixed"}]]


def test_sample_keys_on_a_classification_recipe_and_a_missing_writer_package_are_refused_at_load(monkeypatch) -> None:
    # the bundled default is a classification recipe
    with pytest.raises(RecipeError, match="train.sample_prompts: only used by task 'causal-lm'"):
        load_recipe(None, ["train.sample_prompts=[hi]"])
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    with pytest.raises(RecipeError, match="engine.tensorboard.enabled: .*the tensorboard package is not installed"):
        load_recipe(None, ["engine.tensorboard.enabled=true"])


def test_switching_method_type_by_override_drops_the_recipes_options_of_the_old_method() -> None:
    recipe = load_recipe("smollm2-lora", ["method.type=prefix"])
    assert recipe.method.type == "prefix" and recipe.method.model_fields_set == {"type"}
    with pytest.raises(RecipeError, match="method.r: a lora / qlora option, but method.type is 'prefix'"):
        load_recipe("smollm2-lora", ["method.type=prefix", "method.r=4"])  # given with the switch: still refused


def test_merge_of_a_prefix_run_is_refused_before_training() -> None:
    from zerotune.finetune.worker import check_merge

    with pytest.raises(RecipeError, match="--merge: prefix tuning learns virtual tokens"):
        check_merge(load_recipe("smollm2-lora", ["method.type=prefix"]), merge=True)
    check_merge(load_recipe("smollm2-lora"), merge=True)


def _merge_run(recipe: str, output: str) -> dict:
    from zerotune.finetune.worker import run

    return run(argparse.Namespace(recipe=recipe, output_dir=output, resume=False, merge=True, overrides=[]))


@pytest.mark.slow
def test_merge_writes_the_merged_model_in_the_training_dtype(tmp_path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    path = write_recipe(tmp_path, stage=2)
    recipe = json.loads(path.read_text())
    recipe["train"].update(max_steps=4, eval_every=0, eval_samples=0)
    recipe["engine"]["precision"] = "bf16"
    path.write_text(json.dumps(recipe))
    run_distributed(_merge_run, 2, str(path), str(tmp_path / "run"), timeout=300)
    merged_dir = tmp_path / "run" / "merged"
    assert json.loads((merged_dir / "config.json").read_text())["dtype"] == "bfloat16"
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype="auto")
    assert {p.dtype for p in merged.parameters()} == {torch.bfloat16}
    assert not any("lora_" in name for name, _ in merged.named_parameters())


def test_library_noise_is_quieted_and_colour_codes_are_stripped_off_a_terminal() -> None:
    import logging
    import warnings

    import transformers

    from zerotune.finetune.console import quiet_libraries

    quiet_libraries(rank=0)
    record = logging.LogRecord("transformers.modeling_utils", logging.WARNING, __file__, 1,
                               "\x1b[1mBertForSequenceClassification LOAD REPORT\x1b[0m from: x", None, None)
    handlers = transformers.utils.logging.get_logger().handlers
    assert handlers and all(h.filter(record) for h in handlers)
    assert record.msg == "BertForSequenceClassification LOAD REPORT from: x"
    assert logging.getLogger("bitsandbytes.backends.cpu.ops").level == logging.ERROR
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        quiet_libraries(rank=0)
        warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
    assert caught == []
