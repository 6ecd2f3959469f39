"""Chat format control for causal-LM fine-tuning: data.template (the named formats as Jinja chat templates on
the tokenizer), which tokens carry the loss (train_on_prompt, train_on, roles_to_train), EOS on text rows
(add_eos), and ``zerotune finetune RECIPE --preview [N]`` -- which must not load the model's weights."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import datasets
import pytest

from tests.logs import recorded_messages
from zerotune.finetune.chat_templates import TEMPLATES, end_of_turn, use_template
from zerotune.finetune.data_files import DataError
from zerotune.finetune.preview import print_preview, render_plain
from zerotune.finetune.recipe import RecipeError, load_recipe
from zerotune.finetune.tokenization import IGNORE_INDEX, LossPolicy, tokenize_causal_lm

SMOL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    from zerotune.finetune.models import resolve_model_path

    return resolve_model_path(SMOL)


@pytest.fixture
def tokenizer(smol_dir):
    """A fresh copy per test: use_template sets the template on the tokenizer object."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


SKY = [{"role": "user", "content": "what color is the sky"}, {"role": "assistant", "content": "blue"}]
NEXT = [{"role": "user", "content": "and the snow"}]

# SmolLM2's own bos / eos tokens are <|im_start|> / <|im_end|>: mistral, gemma and alpaca write the tokenizer's.
RENDERED = {
    "chatml": ("<|im_start|>user\nwhat color is the sky<|im_end|>\n<|im_start|>assistant\nblue<|im_end|>\n",
               "<|im_start|>user\nand the snow<|im_end|>\n<|im_start|>assistant\n"),
    "qwen": ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
             "<|im_start|>user\nwhat color is the sky<|im_end|>\n<|im_start|>assistant\nblue<|im_end|>\n",
             "<|im_start|>user\nand the snow<|im_end|>\n<|im_start|>assistant\n"),
    "llama3": ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nwhat color is the sky<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\nblue<|eot_id|>",
               "<|start_header_id|>user<|end_header_id|>\n\nand the snow<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "mistral": ("<|im_start|>[INST] what color is the sky [/INST] blue<|im_end|>",
                "[INST] and the snow [/INST]"),
    "gemma": ("<|im_start|><start_of_turn>user\nwhat color is the sky<end_of_turn>\n"
              "<start_of_turn>model\nblue<end_of_turn>\n",
              "<start_of_turn>user\nand the snow<end_of_turn>\n<start_of_turn>model\n"),
    "alpaca": ("### Instruction:\nwhat color is the sky\n\n### Response:\nblue<|im_end|>",
               "\n\n### Instruction:\nand the snow\n\n### Response:\n"),
}


def test_every_named_template_is_tested() -> None:
    assert sorted(RENDERED) == sorted(TEMPLATES)


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_named_template_renders_a_two_turn_conversation_and_a_generation_prompt(tokenizer, name) -> None:
    assert use_template(tokenizer, name) is True
    conversation, prompt = RENDERED[name]
    assert tokenizer.apply_chat_template(SKY, tokenize=False) == conversation
    with_prompt = tokenizer.apply_chat_template(SKY + NEXT, tokenize=False, add_generation_prompt=True)
    assert with_prompt == conversation + prompt


@pytest.mark.parametrize("name, rendered", [
    ("qwen", "<|im_start|>system\nsay the color<|im_end|>\n<|im_start|>user\nwhat color is the sky<|im_end|>\n"),
    ("llama3", "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nsay the color<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nwhat color is the sky<|eot_id|>"),
    ("mistral", "<|im_start|>[INST] say the color\n\nwhat color is the sky [/INST]"),
    ("gemma", "<|im_start|><start_of_turn>user\nsay the color\n\nwhat color is the sky<end_of_turn>\n"),
    ("alpaca", "say the color\n\n### Instruction:\nwhat color is the sky\n\n"),
])
def test_a_system_turn_replaces_the_default_or_goes_before_the_first_user_message(tokenizer, name, rendered) -> None:
    use_template(tokenizer, name)
    assert tokenizer.apply_chat_template([{"role": "system", "content": "say the color"}, SKY[0]],
                                         tokenize=False) == rendered


def test_auto_keeps_the_tokenizers_template_and_none_removes_it(tokenizer) -> None:
    own = tokenizer.chat_template
    assert use_template(tokenizer, "auto") is True and tokenizer.chat_template == own
    assert use_template(tokenizer, "none") is False and tokenizer.chat_template is None
    assert use_template(tokenizer, "auto") is False  # a tokenizer without a template renders plain text


def test_markers_the_tokenizer_lacks_work_as_text_and_the_log_says_so_once(tokenizer) -> None:
    with recorded_messages() as messages:
        use_template(tokenizer, "chatml")  # SmolLM2 holds <|im_start|> / <|im_end|> as single tokens: nothing to say
        assert messages == []
        use_template(tokenizer, "llama3")
    warnings = [message for message in messages if "no single token" in message]
    assert len(warnings) == 1 and "<|eot_id|>" in warnings[0] and "data.template llama3" in warnings[0]
    row = tokenize_causal_lm(datasets.Dataset.from_dict({"messages": [SKY]}), tokenizer, 128)[0]
    assert render_plain(tokenizer, row["input_ids"], row["labels"]).endswith("[[blue<|eot_id|>]]")


CONVERSATION = [{"role": "system", "content": "say the color"},
                {"role": "user", "content": "what color is the sky"}, {"role": "assistant", "content": "blue"},
                {"role": "user", "content": "and the snow"}, {"role": "assistant", "content": "white"}]
S = "<|im_start|>system\nsay the color<|im_end|>\n"
U1, A1 = "<|im_start|>user\nwhat color is the sky<|im_end|>\n", "blue<|im_end|>\n"
U2, A2 = "<|im_start|>user\nand the snow<|im_end|>\n", "white<|im_end|>\n"
H = "<|im_start|>assistant\n"


@pytest.mark.parametrize("policy, marked", [
    (LossPolicy(), f"{S}{U1}{H}[[{A1}]]{U2}{H}[[{A2}]]"),
    (LossPolicy(last_only=True), f"{S}{U1}{H}{A1}{U2}{H}[[{A2}]]"),
    (LossPolicy(roles=("assistant",)), f"{S}{U1}{H}[[{A1}]]{U2}{H}[[{A2}]]"),
    (LossPolicy(roles=("user", "assistant")), f"{S}[[{U1}]]{H}[[{A1}{U2}]]{H}[[{A2}]]"),
    (LossPolicy(roles=("user",)), f"{S}[[{U1}]]{H}{A1}[[{U2}]]{H}{A2}"),
    (LossPolicy(train_on_prompt=True), f"[[{S}{U1}{H}{A1}{U2}{H}{A2}]]"),
], ids=["all_assistant", "last_assistant", "roles_assistant", "roles_user_assistant", "roles_user",
        "train_on_prompt"])
def test_the_loss_mask_of_a_known_conversation(tokenizer, policy, marked) -> None:
    use_template(tokenizer, "chatml")
    row = tokenize_causal_lm(datasets.Dataset.from_dict({"messages": [CONVERSATION]}), tokenizer, 256, policy)[0]
    assert render_plain(tokenizer, row["input_ids"], row["labels"]) == marked
    assert len(row["labels"]) == len(row["input_ids"])


class _SlowTokenizer:
    """The SmolLM2 tokenizer as a slow one looks to tokenization: no character offsets."""

    def __init__(self, fast) -> None:
        self._fast = fast

    def __getattr__(self, name):
        return getattr(self._fast, name)

    def __call__(self, text, **kwargs):
        if kwargs.get("return_offsets_mapping"):
            raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")
        return self._fast(text, **kwargs)


@pytest.mark.parametrize("policy", [LossPolicy(), LossPolicy(roles=("user", "assistant")), LossPolicy(last_only=True)])
def test_a_tokenizer_without_offsets_marks_the_same_tokens(tokenizer, policy) -> None:
    use_template(tokenizer, "chatml")
    rows = datasets.Dataset.from_dict({"messages": [CONVERSATION]})
    assert tokenize_causal_lm(rows, _SlowTokenizer(tokenizer), 256, policy)[0] == \
        tokenize_causal_lm(rows, tokenizer, 256, policy)[0]


@pytest.mark.parametrize("policy, marked", [
    (LossPolicy(), "what color is the sky[[ blue<|im_end|>]]"),
    (LossPolicy(last_only=True), "what color is the sky[[ blue<|im_end|>]]"),
    (LossPolicy(train_on_prompt=True), "[[what color is the sky blue<|im_end|>]]"),
    (LossPolicy(roles=("user", "assistant")), "[[what color is the sky blue<|im_end|>]]"),
])
def test_prompt_response_without_a_template_ends_with_eos_and_honours_the_policy(tokenizer, policy, marked) -> None:
    use_template(tokenizer, "none")
    pairs = datasets.Dataset.from_dict({"prompt": ["what color is the sky"], "response": [" blue"]})
    row = tokenize_causal_lm(pairs, tokenizer, 64, policy)[0]
    assert row["input_ids"][-1] == tokenizer.eos_token_id
    assert render_plain(tokenizer, row["input_ids"], row["labels"]) == marked


@pytest.mark.parametrize("name", ["auto", *sorted(TEMPLATES)])
def test_templated_pairs_train_on_the_answer_through_the_end_of_turn_token(tokenizer, name) -> None:
    use_template(tokenizer, name)
    pairs = datasets.Dataset.from_dict({"prompt": ["what color is the sky"], "response": ["blue"]})
    row = tokenize_causal_lm(pairs, tokenizer, 128)[0]
    trained = tokenizer.decode([i for i, label in zip(row["input_ids"], row["labels"]) if label != IGNORE_INDEX])
    # the answer is trained through the token a model stops at (chatml and gemma write a newline after it)
    assert trained.strip().rstrip("\n") == "blue" + end_of_turn("chatml" if name == "auto" else name, tokenizer)
    assert row["labels"][0] == IGNORE_INDEX


def test_text_rows_end_with_a_trained_eos_within_max_length_unless_add_eos_is_off(tokenizer) -> None:
    text = datasets.Dataset.from_dict({"text": ["the sky is blue and the snow is white"]})
    plain = tokenizer("the sky is blue and the snow is white")["input_ids"]
    row = tokenize_causal_lm(text, tokenizer, 64)[0]
    assert row["input_ids"] == plain + [tokenizer.eos_token_id] and row["labels"] == row["input_ids"]
    cut = tokenize_causal_lm(text, tokenizer, 4)[0]  # truncation keeps room for the EOS
    assert cut["input_ids"] == plain[:3] + [tokenizer.eos_token_id] and cut["labels"] == cut["input_ids"]
    off = tokenize_causal_lm(text, tokenizer, 64, LossPolicy(add_eos=False))[0]
    assert off["input_ids"] == plain and off["labels"] == plain
    assert tokenize_causal_lm(text, tokenizer, 4, LossPolicy(add_eos=False))[0]["input_ids"] == plain[:4]


def test_messages_without_a_template_is_an_error_naming_data_template(tokenizer) -> None:
    use_template(tokenizer, "none")
    with pytest.raises(DataError, match="set data.template to one of chatml, .*alpaca"):
        tokenize_causal_lm(datasets.Dataset.from_dict({"messages": [SKY]}), tokenizer, 64)


# ============================================================================ recipe keys


def _recipe(tmp_path: Path, data: dict, task: str = "causal-lm", model: str = "x") -> str:
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps({"model": {"name_or_path": model}, "task": task,
                                "data": {"train_files": ["a.jsonl"], **data}}))
    return str(path)


def test_recipe_defaults_keep_todays_behaviour_except_eos_on_text(tmp_path) -> None:
    from zerotune.finetune.task_data import loss_policy

    recipe = load_recipe(_recipe(tmp_path, {}))
    assert recipe.data.template == "auto" and loss_policy(recipe) == LossPolicy(add_eos=True)
    recipe = load_recipe(_recipe(tmp_path, {"train_on": "last_assistant", "add_eos": False}))
    assert loss_policy(recipe) == LossPolicy(last_only=True, add_eos=False)
    recipe = load_recipe(_recipe(tmp_path, {"roles_to_train": ["user", "assistant"], "train_on_prompt": False}))
    assert loss_policy(recipe).roles == ("user", "assistant")


@pytest.mark.parametrize("data, key, message", [
    ({"template": "vicuna"}, "data.template", "chatml"),
    ({"roles_to_train": ["robot"]}, "data.roles_to_train", "assistant"),
    ({"roles_to_train": []}, "data.roles_to_train", ""),
    ({"train_on": "first_assistant"}, "data.train_on", "last_assistant"),
    ({"add_eos": "yes"}, "data.add_eos", ""),
    ({"train_on": "last_assistant", "roles_to_train": ["assistant"]}, "data.roles_to_train",
     "conflicts with data.train_on: last_assistant"),
    ({"train_on": "all_assistant", "roles_to_train": ["user", "assistant"]}, "data.roles_to_train",
     "conflicts with data.train_on: all_assistant"),
    ({"train_on_prompt": True, "train_on": "last_assistant"}, "data.train_on",
     "conflicts with data.train_on_prompt"),
    ({"train_on_prompt": True, "roles_to_train": ["user"]}, "data.roles_to_train",
     "conflicts with data.train_on_prompt"),
    ({"template": "none", "format": "messages"}, "data.template", "need a chat template"),
])
def test_bad_or_conflicting_chat_keys_are_one_line_naming_the_key(tmp_path, data, key, message) -> None:
    with pytest.raises(RecipeError) as error:
        load_recipe(_recipe(tmp_path, data))
    text = str(error.value)
    assert key in text and message in text and "\n" not in text, text


def test_agreeing_keys_are_accepted(tmp_path) -> None:
    for data in ({"train_on": "all_assistant", "roles_to_train": ["assistant"]},
                 {"train_on_prompt": True, "train_on": "all_assistant"}):
        load_recipe(_recipe(tmp_path, data))


@pytest.mark.parametrize("key, value", [("template", "chatml"), ("train_on_prompt", True),
                                        ("train_on", "last_assistant"), ("roles_to_train", ["assistant"]),
                                        ("add_eos", False)])
def test_chat_keys_are_causal_lm_only(tmp_path, key, value) -> None:
    with pytest.raises(RecipeError, match=f"data.{key}: only used by task 'causal-lm'"):
        load_recipe(_recipe(tmp_path, {key: value}, task="sequence-classification"))


def test_template_none_on_detected_chat_messages_fails_before_any_rank_naming_data_template(tmp_path) -> None:
    from tests.test_finetune_causal_lm import make_tiny_llama
    from zerotune.finetune.task_data import check_recipe_inputs

    model = make_tiny_llama(tmp_path / "llama")
    rows = "".join(json.dumps({"messages": SKY}) + "\n" for _ in range(10))
    (tmp_path / "a.jsonl").write_text(rows)
    recipe = load_recipe(_recipe(tmp_path, {"template": "none"}, model=str(model)))  # format auto: detected later
    with pytest.raises(RecipeError, match="data.template: none, but the data holds chat messages"):
        check_recipe_inputs(recipe)


# ============================================================================ --preview


def _forbid_weight_loading(monkeypatch) -> list[str]:
    """Every way this code base loads model weights raises, and is recorded."""
    import transformers

    from zerotune.finetune import gguf_models, models

    calls: list[str] = []

    def forbidden(name: str):
        def refuse(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"--preview called {name}")
        return refuse

    monkeypatch.setattr(models, "load_model", forbidden("load_model"))
    monkeypatch.setattr(gguf_models, "load_gguf", forbidden("load_gguf"))
    for auto in ("AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification"):
        monkeypatch.setattr(getattr(transformers, auto), "from_pretrained", forbidden(f"{auto}.from_pretrained"))
    return calls


def _smol_recipe(tmp_path: Path, model: str = SMOL, **data) -> str:
    path = tmp_path / "smol.json"
    path.write_text(json.dumps({"model": {"name_or_path": model}, "task": "causal-lm",
                                "data": {"bundled": "chatterbot_corpus_english", "max_length": 96, **data}}))
    return str(path)


def test_preview_prints_examples_with_trained_tokens_marked_and_counts_without_loading_weights(
        tmp_path, monkeypatch, capsys, smol_dir) -> None:
    from zerotune.cli.main import main

    calls = _forbid_weight_loading(monkeypatch)
    assert main(["finetune", _smol_recipe(tmp_path), "--preview"]) == 0
    out = capsys.readouterr().out
    assert calls == []
    assert out.startswith("zerotune finetune --preview: 3 training example(s), data.template auto; trained tokens "
                          "between [[ and ]]")
    examples = out.split("\n--- example ")[1:]
    assert len(examples) == 3
    for number, example in enumerate(examples, 1):
        head, body = example.split("\n", 1)
        tokens, trained = head.split(": ")[1].split(", ")
        assert head.startswith(f"{number}: ") and tokens.endswith(" tokens") and trained.endswith(" trained")
        assert body.startswith("<|im_start|>system\n") and "<|im_start|>assistant\n[[" in body
        assert body.rstrip("\n").endswith("<|im_end|>\n]]") and body.count("[[") == 1
        assert 0 < int(trained.split()[0]) < int(tokens.split()[0])
    assert main(["finetune", _smol_recipe(tmp_path, train_on_prompt=True, template="alpaca"), "--preview", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 training example(s), data.template alpaca" in out and out.count("\n--- example") == 1
    head, body = out.split("\n--- example 1: ")[1].split("\n", 1)
    assert body.startswith("[[### Instruction:\n") and body.rstrip("\n").endswith("<|im_end|>]]")
    assert head.split(", ")[0].split()[0] == head.split(", ")[1].split()[0]  # every token trained
    assert calls == []


def test_preview_reads_only_the_tokenizer_from_a_model_directory_with_unreadable_weights(
        tmp_path, monkeypatch, capsys, smol_dir) -> None:
    """The weights file is garbage: anything that opened it as weights would fail."""
    from zerotune.cli.main import main

    model = tmp_path / "model"
    shutil.copytree(smol_dir, model)
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    _forbid_weight_loading(monkeypatch)
    assert main(["finetune", _smol_recipe(tmp_path, model=str(model), template="llama3"), "--preview", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n--- example") == 2 and "<|start_header_id|>assistant<|end_header_id|>\n\n[[" in out


def test_preview_on_a_terminal_colours_the_trained_tokens(tokenizer) -> None:
    use_template(tokenizer, "chatml")
    rows = tokenize_causal_lm(datasets.Dataset.from_dict({"messages": [SKY]}), tokenizer, 64)
    stream = io.StringIO()
    print_preview(rows, tokenizer, template="chatml", stream=stream, color=True)
    out = stream.getvalue()
    assert "trained tokens in bold green" in out and "[[" not in out and "\x1b[" in out and "blue" in out


def test_preview_refuses_a_classification_recipe_and_a_count_below_one(tmp_path, capsys) -> None:
    from zerotune.cli.main import main

    assert main(["finetune", _smol_recipe(tmp_path), "--preview", "0"]) == 2
    assert "--preview: 0 examples; give a number >= 1" in capsys.readouterr().err
    classification = _recipe(tmp_path, {"text_column": "sentence"}, task="sequence-classification")
    assert main(["finetune", classification, "--preview"]) == 2
    assert "--preview: shows chat-formatted causal-LM examples; task is 'sequence-classification'" in \
        capsys.readouterr().err


def test_preview_of_a_never_converted_gguf_model_reads_its_tokenizer_without_dequantizing(
        tmp_path, monkeypatch, capsys, smol_dir) -> None:
    """A fresh cache holding only the bundled GGUF file: --preview must not convert (load) the weights."""
    from zerotune.cli.main import main
    from zerotune.finetune import assets

    cache = tmp_path / "cache"
    cache.mkdir()
    for name in (SMOL, "chatterbot_corpus_english"):
        (cache / name).symlink_to(assets.cache_dir() / name)
    monkeypatch.setenv(assets.CACHE_ENV_VAR, str(cache))
    calls = _forbid_weight_loading(monkeypatch)
    assert main(["finetune", _smol_recipe(tmp_path), "--preview", "1"]) == 0
    out = capsys.readouterr().out
    assert calls == [] and not (cache / f"{SMOL}-hf").exists()
    assert "<|im_start|>assistant\n[[" in out and out.count("\n--- example") == 1


def test_a_worker_started_with_preview_previews_instead_of_training(tmp_path, monkeypatch, capsys, smol_dir) -> None:
    from zerotune.finetune import worker

    monkeypatch.delenv("RANK", raising=False)
    calls = _forbid_weight_loading(monkeypatch)
    monkeypatch.setattr(worker, "run", lambda args: pytest.fail("the worker trained instead of previewing"))
    assert worker.main([_smol_recipe(tmp_path), "--preview", "1"]) == 0
    assert calls == [] and capsys.readouterr().out.count("\n--- example") == 1
