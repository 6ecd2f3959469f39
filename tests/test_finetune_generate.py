"""``zerotune generate`` / ``zerotune chat`` answer from what ``zerotune finetune`` wrote: a full model
(freeze tuning), a LoRA adapter over its base, a QLoRA adapter over its 4-bit base."""

from __future__ import annotations

import io
import json

import pytest

from tests.harness import run_distributed
from tests.test_finetune_more_methods import _finetune, _recipe, llama_dir  # noqa: F401 - fixture
from zerotune.cli.main import main


@pytest.mark.parametrize("method", [
    {"type": "freeze", "trainable_layers": 2, "trainable_modules": ["lm_head", "embed_tokens"]},
    {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0},
    {"type": "qlora", "r": 4, "alpha": 8, "dropout": 0.0},
])
def test_generate_and_chat_answer_from_the_run(tmp_path, llama_dir, capsys, monkeypatch, method) -> None:  # noqa: F811
    if method["type"] == "qlora":
        pytest.importorskip("bitsandbytes")
    run = tmp_path / "run"
    summary = run_distributed(_finetune, 2, str(_recipe(tmp_path, llama_dir, method, 2)), str(run), timeout=300)[0]
    assert main(["generate", str(run), "--prompt", "what color is the sky", "--prompt", "what color is the coal",
                 "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "> what color is the sky" in out and "> what color is the coal" in out
    if method["type"] == "freeze":  # trained to a loss near 0: the answers are the data's
        assert "the sky is blue" in out and "the coal is black" in out, out
    monkeypatch.setattr("sys.stdin", io.StringIO("what color is the snow\nwhat color is the sun\n/exit\n"))
    assert main(["chat", str(run), "--max-new-tokens", "6"]) == 0
    answers = capsys.readouterr().out.strip().splitlines()
    assert len(answers) == 2 and all(answers), answers
    print(f"{method['type']}: answer loss {summary['after']:.3f}\n{out}chat: {answers}")


def test_generate_says_what_is_missing(tmp_path, capsys) -> None:
    assert main(["generate", str(tmp_path / "nowhere"), "--prompt", "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", str(tmp_path), "--prompt", "hi"]) == 2
    assert "holds no trained model" in capsys.readouterr().err
    (tmp_path / "summary.json").write_text(json.dumps({"task": "sequence-classification"}))
    assert main(["generate", str(tmp_path), "--prompt", "hi"]) == 2
    assert "is a sequence-classification run; generation needs a causal-lm run" in capsys.readouterr().err
