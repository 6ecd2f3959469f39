"""The fine-tuning job end to end on a tiny random BERT and a tiny local CSV (fast), and the real default (slow)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed, shutdown_pools

REPO = Path(__file__).resolve().parents[1]
WORDS = ["good", "great", "fine", "lovely", "bad", "awful", "poor", "dull", "movie", "plot", "the", "was", "a"]


def make_tiny_bert(directory: Path) -> Path:
    """A 2-layer BERT with a word-level vocabulary, saved like a Hugging Face model directory."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab={word: i for i, word in enumerate(vocab)})
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2)
    BertForSequenceClassification(config).save_pretrained(directory)
    return directory


def make_sentiment_csv(path: Path, rows: int = 96) -> Path:
    generator = torch.Generator().manual_seed(1)
    lines = ["review,sentiment"]
    for i in range(rows):
        positive = i % 2 == 0
        pool = WORDS[:4] if positive else WORDS[4:8]
        words = [pool[int(j)] for j in torch.randint(0, 4, (3,), generator=generator)]
        lines.append(f"the movie was {' '.join(words)},{'pos' if positive else 'neg'}")
    path.write_text("\n".join(lines) + "\n")
    return path


def write_recipe(tmp: Path, stage: int, **train) -> Path:
    model = make_tiny_bert(tmp / "tiny-bert")
    data = make_sentiment_csv(tmp / "reviews.csv")
    recipe = {
        "model": {"name_or_path": str(model)},
        "task": "sequence-classification",
        "data": {"train_files": [str(data)], "text_column": "review", "label_column": "sentiment",
                 "eval_fraction": 0.25, "max_length": 16},
        "method": {"type": "full"},
        "train": {"max_steps": 12, "lr": 3e-3, "micro_batch_size": 4, "gradient_accumulation_steps": 2,
                  "seed": 3, "eval_every": 6, "save_every": 6, "log_every": 2, **train},
        "engine": {"zero_stage": stage, "precision": "fp32"},
        "launch": {"nproc_per_node": 2},
    }
    path = tmp / "recipe.json"
    path.write_text(json.dumps(recipe))
    return path


def _run_worker(recipe: str, output: str, resume: bool, overrides: list[str]) -> dict:
    from zerotune.finetune.worker import run

    args = argparse.Namespace(recipe=recipe, output_dir=output, resume=resume, merge=False, overrides=overrides)
    return run(args)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_finetune_tiny_bert_learns_and_saves_a_loadable_model(tmp_path: Path, stage: int) -> None:
    # lr 6e-3 under the default linear decay: 3e-3 was tuned when a schedule without warm-up stayed flat (a bug;
    # it now decays as documented, and 12 decaying steps at 3e-3 leave this tiny BERT at its starting accuracy)
    recipe = write_recipe(tmp_path, stage, lr=6e-3)
    out = tmp_path / "run"
    summary = run_distributed(_run_worker, 2, str(recipe), str(out), False, [], timeout=240)[0]
    assert summary["zero_stage"] == stage and summary["steps"] == 12
    assert summary["after"] > summary["before"]
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["after"] == summary["after"]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines if l["split"] == "eval"] == [0, 6, 12]
    assert [l["step"] for l in lines if l["split"] == "train"] == [2, 4, 6, 8, 10, 12]
    from transformers import AutoModelForSequenceClassification

    reloaded = AutoModelForSequenceClassification.from_pretrained(out / "model")
    assert reloaded.config.id2label == {0: "neg", 1: "pos"}


def test_resume_after_a_checkpoint_ends_with_the_same_metrics(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, 2)
    full = run_distributed(_run_worker, 2, str(recipe), str(tmp_path / "full"), False, [], timeout=240)[0]
    # A run killed right after its step-6 checkpoint leaves exactly this behind: the step-6 tag as 'latest'.
    cut = tmp_path / "cut" / "checkpoints"
    shutil.copytree(tmp_path / "full" / "checkpoints" / "global_step6", cut / "global_step6")
    (cut / "latest").write_text("global_step6")
    shutdown_pools()  # fresh processes, as after a kill
    resumed = run_distributed(_run_worker, 2, str(recipe), str(tmp_path / "cut"), True, [], timeout=240)[0]
    assert resumed["before"] == full["before"] and resumed["steps"] == full["steps"] == 12
    assert resumed["after_eval"] == full["after_eval"]


@pytest.mark.slow
def test_bundled_default_improves_accuracy_within_five_minutes(tmp_path: Path) -> None:
    out = tmp_path / "default"
    done = subprocess.run([sys.executable, "-m", "zerotune.cli.main", "finetune", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["after"] - summary["before"] >= 0.08, summary
    assert summary["wall_seconds"] <= 300
    # The saved model, loaded the usual way, reproduces the reported accuracy on the held-out split.
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from zerotune.finetune.data import load_classification_data
    from zerotune.finetune.tokenization import make_collator, tokenize_classification
    from zerotune.finetune.recipe import load_recipe
    from zerotune.finetune.task_data import data_spec

    recipe = load_recipe(None)
    _, held_out, _ = load_classification_data(data_spec(recipe))
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    model = AutoModelForSequenceClassification.from_pretrained(out / "model").eval()
    loader = torch.utils.data.DataLoader(tokenize_classification(held_out, tokenizer, recipe.data.max_length),
                                         batch_size=64, collate_fn=make_collator(tokenizer))
    correct = total = 0
    with torch.no_grad():
        for batch in loader:
            correct += (model(**batch).logits.argmax(-1) == batch["labels"]).sum().item()
            total += len(batch["labels"])
    assert correct / total == pytest.approx(summary["after"], abs=1e-3)


def _finetune_cli(recipe: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "zerotune.cli.main", "finetune", str(recipe), "--output-dir",
                             str(out), *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_kill_9_after_a_checkpoint_then_resume_ends_with_the_same_metrics(tmp_path: Path) -> None:
    import signal
    import time

    recipe = write_recipe(tmp_path, 2, max_steps=300, save_every=50, eval_every=0, log_every=50)
    full = _finetune_cli(recipe, tmp_path / "full")
    assert full.wait(timeout=300) == 0, full.stderr.read()[-3000:]

    victim = _finetune_cli(recipe, tmp_path / "killed")
    latest = tmp_path / "killed" / "checkpoints" / "latest"
    deadline = time.time() + 240
    while not (latest.is_file() and latest.read_text() != "global_step50") and time.time() < deadline:
        time.sleep(0.05)  # wait for the second checkpoint, so the kill lands mid-run
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=30)
    killed_at = latest.read_text()
    assert killed_at != "global_step300", "the run finished before it could be killed"

    resumed = _finetune_cli(recipe, tmp_path / "killed", "--resume")
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()[-3000:]
    want = json.loads((tmp_path / "full" / "summary.json").read_text())
    got = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert got["steps"] == want["steps"] == 300
    assert got["before_eval"] == want["before_eval"] and got["after_eval"] == want["after_eval"], killed_at
