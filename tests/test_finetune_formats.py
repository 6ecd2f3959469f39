"""Causal-LM data in the layouts people bring: chat messages, ShareGPT, alpaca, prompt/response, text and
pre-tokenized ids -- detected from the columns, checked row by row (an error names the files, the row and
the key), trained on the assistant turns / answers only -- and a LoRA run on chat messages."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import datasets
import pytest

from tests.harness import run_distributed
from tests.test_finetune_causal_lm import COLORS, make_tiny_llama
from zerotune.finetune.data import DataSpec, load_causal_lm_data
from zerotune.finetune.data_files import DataError
from zerotune.finetune.formats import detect_format
from zerotune.finetune.recipe import RecipeError, load_recipe
from zerotune.finetune.tokenization import IGNORE_INDEX, tokenize_causal_lm


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama"))


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _load(path: str, **kwargs) -> datasets.Dataset:
    return load_causal_lm_data(DataSpec([path], [path], None), **kwargs)[0]


def _trained_tokens(tokenizer, row: dict) -> list[str]:
    return tokenizer.convert_ids_to_tokens([i for i, label in zip(row["input_ids"], row["labels"]) if label != IGNORE_INDEX])


CONVERSATION = [{"role": "system", "content": "it says the color"},
                {"role": "user", "content": "what color is the sky"}, {"role": "assistant", "content": "blue"},
                {"role": "user", "content": "what color is the snow"}, {"role": "assistant", "content": "white"}]


def test_the_layout_is_detected_from_the_columns() -> None:
    assert detect_format(["messages"], None) == "messages"
    assert detect_format(["conversations", "id"], None) == "sharegpt"
    assert detect_format(["instruction", "input", "output"], None) == "alpaca"
    assert detect_format(["prompt", "response"], None) == "prompt_response"
    assert detect_format(["question", "answer"], "question") == "prompt_response"
    assert detect_format(["input_ids", "labels"], None) == "tokens"
    assert detect_format(["text"], None) == "text"


def test_multi_turn_chat_messages_train_on_every_assistant_turn_only(tmp_path, tokenizer) -> None:
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    row = tokenize_causal_lm(_load(path), tokenizer, 64)[0]
    assert _trained_tokens(tokenizer, row) == ["blue", "<|im_end|>", "white", "<|im_end|>"]
    rendered = tokenizer.convert_ids_to_tokens(row["input_ids"])
    assert rendered[2:4] == ["it", "says"] and rendered.count("<|im_start|>") == 5  # the system prompt comes first


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_sharegpt_conversations_equal_the_same_chat_as_messages(tmp_path, tokenizer, suffix) -> None:
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    shared = [{"from": names[turn["role"]], "value": turn["content"]} for turn in CONVERSATION]
    if suffix == "jsonl":
        path = _jsonl(tmp_path / "share.jsonl", [{"conversations": shared, "id": "a"}])
    else:
        path = str(tmp_path / "share.parquet")
        datasets.Dataset.from_dict({"conversations": [shared], "id": ["a"]}).to_parquet(path)
    messages = _jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    assert tokenize_causal_lm(_load(path), tokenizer, 64)[0] == tokenize_causal_lm(_load(messages), tokenizer, 64)[0]


def test_alpaca_keeps_the_input_and_trains_on_the_output(tmp_path, tokenizer) -> None:
    path = _jsonl(tmp_path / "alpaca.jsonl", [
        {"instruction": "what color is the", "input": "sky", "output": "blue"},
        {"instruction": "what color is the grass", "input": "", "output": "green"}])
    rows = _load(path)
    assert rows["prompt"] == ["what color is the\n\nsky", "what color is the grass"]
    encoded = tokenize_causal_lm(rows, tokenizer, 64)
    assert [_trained_tokens(tokenizer, row) for row in encoded] == [["blue", "<|im_end|>"], ["green", "<|im_end|>"]]
    assert "sky" in tokenizer.convert_ids_to_tokens(encoded[0]["input_ids"])  # the input is in the prompt


def test_csv_prompt_response_and_pre_tokenized_ids(tmp_path, tokenizer) -> None:
    csv = tmp_path / "pairs.csv"
    csv.write_text("prompt,response\nwhat color is the sun,yellow\n")
    assert _trained_tokens(tokenizer, tokenize_causal_lm(_load(str(csv)), tokenizer, 64)[0]) == ["yellow", "<|im_end|>"]
    ids = _jsonl(tmp_path / "ids.jsonl", [{"input_ids": [4, 5, 6, 7]},
                                          {"input_ids": [4, 5, 6], "labels": [IGNORE_INDEX, 5, 6]}])
    with pytest.raises(DataError, match="'labels' must be a list as long as 'input_ids'"):
        _load(ids)  # the first row has no labels while the second has: JSON lines give it null
    plain = _jsonl(tmp_path / "plain_ids.jsonl", [{"input_ids": [4, 5, 6, 7]}, {"input_ids": [8, 9]}])
    encoded = tokenize_causal_lm(_load(plain), tokenizer, 3)
    assert encoded["input_ids"] == [[4, 5, 6], [8, 9]] and encoded["labels"] == [[4, 5, 6], [8, 9]]


@pytest.mark.parametrize("rows, message", [
    ([{"messages": CONVERSATION}, {"messages": [{"role": "robot", "content": "hi"}]}],
     "row 1: messages[0].role is 'robot'; expected one of system, user, assistant"),
    ([{"messages": [{"role": "user", "content": "what color is the sky"}]}],
     "row 0: 'messages' has no non-empty assistant turn to train on"),
    ([{"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "blue"}]}],
     "row 0: messages[0].content is None; it must be text"),
    ([{"conversations": [{"from": "bot", "value": "hi"}]}],
     "row 0: conversations[0].from is 'bot'; expected one of system, human, user, gpt, assistant"),
    ([{"instruction": "what color is the sky", "output": "blue"}, {"instruction": "what color is coal", "output": ""}],
     "row 1: 'output' is ''; it must be non-empty text"),
    ([{"input_ids": [1, -2]}], "row 0: 'input_ids' is [1, -2]; it must be a non-empty list of token ids"),
    ([{"question": "a", "answr": "b"}], "text column 'text' not found in"),
])
def test_every_bad_row_is_one_line_naming_the_file_the_row_and_the_key(tmp_path, rows, message) -> None:
    path = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as error:
        _load(path)
    assert message in str(error.value) and path in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_chat_data_needs_a_chat_template_and_a_max_length_that_leaves_an_answer(tmp_path, tokenizer) -> None:
    chat = _load(_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}]))
    plain = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, pad_token="<pad>", eos_token="<|im_end|>")
    with pytest.raises(DataError, match="the model's tokenizer has no chat template"):
        tokenize_causal_lm(chat, plain, 64)
    pairs = _load(_jsonl(tmp_path / "qa.jsonl", [{"prompt": "what color is the sky", "response": "blue"}]))
    with pytest.raises(DataError, match=r"every one of the 1 examples has its answer beyond data.max_length = 6 tokens "
                                        r"\(the prompts are 10 to 10 tokens\), so none is left to train on; raise "):
        tokenize_causal_lm(pairs, tokenizer, 6)


def test_recipe_refuses_a_format_that_contradicts_the_prompt_columns(tmp_path) -> None:
    recipe = {"model": {"name_or_path": "x"}, "task": "causal-lm",
              "data": {"train_files": ["a.jsonl"], "prompt_column": "q", "response_column": "a", "format": "messages"}}
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    with pytest.raises(RecipeError, match="data.format"):
        load_recipe(str(path))
    recipe = {"model": {"name_or_path": "x"}, "task": "sequence-classification",
              "data": {"train_files": ["a.csv"], "format": "alpaca"}}
    path.write_text(json.dumps(recipe))
    with pytest.raises(RecipeError, match="data.format.*only used by task 'causal-lm'"):
        load_recipe(str(path))


def _finetune(recipe: str, output: str) -> dict:
    from zerotune.finetune.worker import run

    return run(argparse.Namespace(recipe=recipe, output_dir=output, resume=False, merge=False, overrides=[]))


@pytest.mark.slow
def test_lora_on_chat_messages_lowers_the_assistant_loss(tmp_path: Path) -> None:
    rows = []
    for i in range(96):
        thing = list(COLORS)[i % len(COLORS)]
        rows.append({"messages": [{"role": "system", "content": "it says the color"},
                                  {"role": "user", "content": f"what color is the {thing}"},
                                  {"role": "assistant", "content": f"the {thing} is {COLORS[thing]}"}]})
    recipe = {"model": {"name_or_path": str(make_tiny_llama(tmp_path / "tiny-llama"))}, "task": "causal-lm",
              "data": {"train_files": [_jsonl(tmp_path / "chat.jsonl", rows)], "eval_fraction": 0.25, "max_length": 32},
              "method": {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0},
              "train": {"max_steps": 30, "lr": 2e-2, "micro_batch_size": 4, "seed": 3, "eval_every": 15},
              "engine": {"zero_stage": 2, "precision": "fp32"}}
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    summary = run_distributed(_finetune, 2, str(path), str(tmp_path / "run"), timeout=240)[0]
    assert summary["after"] < 0.5 * summary["before"], summary
    print(f"chat messages, LoRA, 30 steps: assistant-token loss {summary['before']:.3f} -> {summary['after']:.3f}")


def test_a_data_set_directory_with_splits_or_a_folder_of_files(tmp_path, tokenizer) -> None:
    splits = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"messages": [CONVERSATION] * 6}),
        "test": datasets.Dataset.from_dict({"messages": [CONVERSATION[:3]] * 2})})
    splits.save_to_disk(str(tmp_path / "saved"))
    train, evaluation = load_causal_lm_data(DataSpec(None, None, None, dataset=str(tmp_path / "saved"), eval_split="test"))
    assert (len(train), len(evaluation)) == (6, 2)
    assert _trained_tokens(tokenizer, tokenize_causal_lm(evaluation, tokenizer, 64)[0]) == ["blue", "<|im_end|>"]
    with pytest.raises(DataError, match=r"eval split 'validation' is not in .*saved; its splits: train, test"):
        load_causal_lm_data(DataSpec(None, None, None, dataset=str(tmp_path / "saved"), eval_split="validation"))
    (tmp_path / "folder").mkdir()
    _jsonl(tmp_path / "folder" / "part.jsonl", [{"instruction": f"what color is the {t}", "output": c} for t, c in COLORS.items()])
    train, evaluation = load_causal_lm_data(DataSpec(None, None, None, dataset=str(tmp_path / "folder"), eval_fraction=0.5))
    assert train.column_names == ["prompt", "response"] and len(train) + len(evaluation) == len(COLORS)


def test_a_hub_data_set_id_offline_and_not_cached_is_one_line_saying_how_to_fetch_it() -> None:
    with pytest.raises(DataError) as error:
        load_causal_lm_data(DataSpec(None, None, None, dataset="nobody/not-cached-anywhere"))
    message = str(error.value)
    assert "'nobody/not-cached-anywhere'" in message and "HF_HUB_OFFLINE=1" in message and "\n" not in message
    assert "datasets.load_dataset('nobody/not-cached-anywhere')" in message


def test_recipe_takes_exactly_one_data_source(tmp_path) -> None:
    path = tmp_path / "recipe.json"
    for data, key, message in [
        ({"train_files": ["a.jsonl"], "dataset": "org/set"}, "data.dataset", "data.train_files and data.dataset are both set"),
        ({"train_files": ["a.jsonl"], "eval_split": "test"}, "data.eval_split", "only used with data.dataset"),
        ({"dataset": "org/set", "eval_files": ["b.jsonl"]}, "data.eval_files", "name its eval split in data.eval_split"),
    ]:
        path.write_text(json.dumps({"model": {"name_or_path": "x"}, "task": "causal-lm", "data": data}))
        with pytest.raises(RecipeError, match=f"{key}.*{message}"):
            load_recipe(str(path))
