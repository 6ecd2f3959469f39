"""Causal-LM fine-tuning end to end: a tiny random Llama with a chat template on tiny local Q/A data
(fast), and the bundled SmolLM2 LoRA recipe on the chatterbot corpus (slow)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_RECIPE = REPO / "zerotune" / "finetune" / "recipes" / "smollm2_lora.yaml"
SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
# A ChatML-like template: the rendered prompt is a prefix of the rendered prompt + answer, as
# answer-only loss masking requires.
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }} {{ message['content'] }}<|im_end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
COLORS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "blood": "red", "sun": "yellow"}
WORDS = ["user", "assistant", "what", "color", "is", "the", "it", "says"] + list(COLORS) + list(COLORS.values())


def make_tiny_llama(directory: Path) -> Path:
    """A 2-layer Llama (hidden 32) with a word-level tokenizer that carries a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>",
                                        bos_token="<|im_start|>", eos_token="<|im_end|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=vocab["<pad>"], bos_token_id=vocab["<|im_start|>"],
                         eos_token_id=vocab["<|im_end|>"], tie_word_embeddings=False,
                         initializer_range=0.2)  # a frozen head of std 0.02 could barely move the logits
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def make_qa_jsonl(path: Path, rows: int = 96) -> Path:
    """Question/answer rows whose answer is a deterministic function of the question."""
    things = list(COLORS)
    lines = []
    for i in range(rows):
        thing = things[i % len(things)]
        lines.append(json.dumps({"question": f"what color is the {thing}", "answer": f"the {thing} is {COLORS[thing]}"}))
    path.write_text("\n".join(lines) + "\n")
    return path


def write_recipe(tmp: Path, stage: int = 2) -> Path:
    recipe = {
        "model": {"name_or_path": str(make_tiny_llama(tmp / "tiny-llama"))},
        "task": "causal-lm",
        "data": {"train_files": [str(make_qa_jsonl(tmp / "qa.jsonl"))], "prompt_column": "question",
                 "response_column": "answer", "eval_fraction": 0.25, "max_length": 32},
        "method": {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0},
        "train": {"max_steps": 30, "lr": 2e-2, "micro_batch_size": 4, "seed": 3, "eval_every": 15, "log_every": 5},
        "engine": {"zero_stage": stage, "precision": "fp32"},
        "launch": {"nproc_per_node": 2},
    }
    path = tmp / "recipe.json"
    path.write_text(json.dumps(recipe))
    return path


def _run_worker(recipe: str, output: str, merge: bool) -> dict:
    from zerotune.finetune.worker import run

    args = argparse.Namespace(recipe=recipe, output_dir=output, resume=False, merge=merge, overrides=[])
    return run(args)


def _generate(model_dir: Path, question: str, max_new_tokens: int) -> tuple[int, str]:
    """(number of new tokens, their text) from greedy decoding of ``question`` with the chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    new = out[0, prompt["input_ids"].shape[1]:]
    return len(new), tokenizer.decode(new, skip_special_tokens=True)


@pytest.mark.parametrize("stage", [0, 3])
def test_lora_causal_lm_lowers_answer_loss_and_merged_model_generates(tmp_path: Path, stage: int) -> None:
    recipe = write_recipe(tmp_path, stage)
    out = tmp_path / "run"
    summary = run_distributed(_run_worker, 2, str(recipe), str(out), True, timeout=240)[0]
    assert summary["metric"] == "eval_loss" and summary["task"] == "causal-lm" and summary["steps"] == 30
    assert summary["after"] < 0.5 * summary["before"], summary
    assert summary["after_eval"]["perplexity"] == pytest.approx(torch.tensor(summary["after"]).exp().item(), rel=1e-6)
    assert json.loads((out / "summary.json").read_text())["after"] == summary["after"]
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in evals if line["split"] == "eval"] == [0, 15, 30]
    assert (out / "adapter" / "adapter_config.json").is_file()
    generated, _ = _generate(out / "merged", "what color is the sky", max_new_tokens=5)
    assert generated > 0


def test_answer_only_loss_masks_the_prompt(tmp_path: Path) -> None:
    """Labels are -100 over the rendered prompt and equal the ids over the answer (and its end token)."""
    from transformers import AutoTokenizer

    from zerotune.finetune.data import load_causal_lm_data
    from zerotune.finetune.tokenization import IGNORE_INDEX, tokenize_causal_lm
    from zerotune.finetune.recipe import load_recipe
    from zerotune.finetune.task_data import data_spec

    recipe = load_recipe(str(write_recipe(tmp_path)))
    tokenizer = AutoTokenizer.from_pretrained(recipe.model.name_or_path)
    train, _ = load_causal_lm_data(data_spec(recipe), prompt_column="question", response_column="answer")
    row = tokenize_causal_lm(train, tokenizer, 32)[0]
    answer = [i for i, label in zip(row["input_ids"], row["labels"]) if label != IGNORE_INDEX]
    assert tokenizer.convert_ids_to_tokens(answer) == train[0]["response"].split() + ["<|im_end|>"]
    assert row["labels"][: len(row["labels"]) - len(answer)] == [IGNORE_INDEX] * (len(row["labels"]) - len(answer))


def test_unknown_prompt_column_is_one_clear_error(tmp_path: Path) -> None:
    from zerotune.finetune.data import DataError
    from zerotune.finetune.recipe import load_recipe
    from zerotune.finetune.task_data import check_recipe_inputs

    recipe = load_recipe(str(write_recipe(tmp_path)), ["data.prompt_column=questoin"])
    with pytest.raises(DataError, match="prompt column 'questoin' not found.*did you mean 'question'"):
        check_recipe_inputs(recipe)


@pytest.mark.slow
def test_bundled_smollm2_lora_recipe_lowers_answer_loss_and_merges(tmp_path: Path) -> None:
    """The bundled recipe, shortened to 20 of its 30 steps and 50 of its 100 held-out pairs to keep the suite
    under 20 minutes (2 min instead of 4; 2.743 -> 1.666 when measured): the loss still falls by a quarter."""
    out = tmp_path / "smollm2"
    done = subprocess.run([sys.executable, "-m", "zerotune.cli.main", "finetune", str(SMOLLM2_RECIPE),
                           "--output-dir", str(out), "--merge", "--set", "train.max_steps=20",
                           "--set", "data.max_eval_samples=50"], capture_output=True, text=True, timeout=900,
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metric"] == "eval_loss"
    assert summary["after"] <= 0.75 * summary["before"], summary
    generated, text = _generate(out / "merged", "What is artificial intelligence?", max_new_tokens=24)
    assert generated > 0 and text.strip(), text
    print(f"answer loss {summary['before']:.3f} -> {summary['after']:.3f}, {summary['wall_seconds']:.0f} s of training; "
          f"merged model says: {text!r}")


def test_bundled_gguf_model_is_dequantized_once_into_an_atomic_cache_dir(tmp_path: Path, monkeypatch) -> None:
    """The conversion itself is stubbed (a tiny Llama stands in for the GGUF): what is tested is the
    caching -- written once, atomically, found by ``resolve_model_path`` -- and that a failed
    conversion leaves nothing behind."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zerotune.finetune import assets, gguf_models
    from zerotune.finetune.models import resolve_model_path

    name = "SmolLM2-135M-Instruct"
    monkeypatch.setenv(assets.CACHE_ENV_VAR, str(tmp_path / "cache"))
    gguf_file = tmp_path / "cache" / name / Path(assets.ASSETS[name].member).name
    gguf_file.parent.mkdir(parents=True)
    gguf_file.write_bytes(b"GGUF")  # present, so asset_path does not fetch
    tiny = make_tiny_llama(tmp_path / "tiny-llama")
    calls = []

    def broken(path: Path):
        raise RuntimeError("conversion killed")

    monkeypatch.setattr(gguf_models, "load_gguf", broken)
    with pytest.raises(RuntimeError, match="conversion killed"):
        resolve_model_path(name)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [".lock", name]  # no half-written dir

    def fake_load(path: Path):
        calls.append(path)
        return AutoTokenizer.from_pretrained(tiny), AutoModelForCausalLM.from_pretrained(tiny)

    monkeypatch.setattr(gguf_models, "load_gguf", fake_load)
    first = resolve_model_path(name)
    assert first == tmp_path / "cache" / f"{name}-hf" and calls == [gguf_file]
    assert resolve_model_path(name) == first and len(calls) == 1  # cached: not converted again
    assert (first / "config.json").is_file() and (first / "model.safetensors").is_file()
    assert AutoTokenizer.from_pretrained(first).chat_template == CHAT_TEMPLATE
    assert not list((tmp_path / "cache").glob(".dequantize-*"))


def test_drop_quantizer_detaches_the_loading_quantizer() -> None:
    from zerotune.finetune.gguf_models import drop_quantizer

    class Quantizer:
        def remove_quantization_config(self, model) -> None:
            model.hf_quantizer = None
            model.removed = True

    model = argparse.Namespace(hf_quantizer=Quantizer(), removed=False)
    assert drop_quantizer(model).removed and model.hf_quantizer is None
    plain = argparse.Namespace()
    assert drop_quantizer(plain) is plain


def _run_prefix_worker(recipe: str, output: str) -> dict:
    from zerotune.finetune.worker import run

    return run(argparse.Namespace(recipe=recipe, output_dir=output, resume=False, merge=False, overrides=[]))


@pytest.mark.parametrize("stage", [1, 2])
def test_prefix_tuning_causal_lm_trains_only_the_prefix_and_saves_the_adapter(tmp_path: Path, stage: int) -> None:
    recipe = write_recipe(tmp_path, stage)
    content = json.loads(recipe.read_text())
    content["method"] = {"type": "prefix", "num_virtual_tokens": 4}
    recipe.write_text(json.dumps(content))
    out = tmp_path / "run"
    summary = run_distributed(_run_prefix_worker, 2, str(recipe), str(out), timeout=240)[0]
    assert summary["method"] == "prefix" and summary["steps"] == 30
    assert summary["after"] < summary["before"], summary
    from peft import PeftConfig

    assert PeftConfig.from_pretrained(out / "adapter").peft_type.value == "PREFIX_TUNING"
