"""Datasets for the two fine-tuning tasks: local files or a bundled data set -> tokenized rows.

Loading goes through the ``datasets`` library (its CSV / JSON / parquet / text builders), so
large files are memory-mapped Arrow tables and every rank reads the same cached copy. What this
module adds is the part users trip over: each bad input (a missing file, a file that does not
parse, a misspelled column, an empty set, a label set that disagrees with ``num_labels``) becomes
one ``DataError`` line naming the file or column and what would be valid.

Output shapes, so the training loop needs no per-source code:
  classification: columns ``text`` [, ``text_pair``], ``label`` (ClassLabel ids 0..K-1)
  causal LM:      ``text``, ``prompt`` + ``response``, ``messages`` or ``input_ids`` (``formats.py``)
"""

from __future__ import annotations

import difflib
import math
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

import datasets
import yaml

from zerotune.finetune import assets
from zerotune.finetune.data_files import (
    DataError,
    describe_files,
    load_dataset_split,
    load_files,
    load_with_builder,
    one_line,
    quiet_datasets,
)
from zerotune.finetune.formats import to_canonical

__all__ = [
    "BUNDLED_CAUSAL_LM", "BUNDLED_CLASSIFICATION", "DataError", "DataSpec", "check_num_labels",
    "load_causal_lm_data", "load_chatterbot_qa", "load_preference_data", "load_classification_data", "load_files",
]

BUNDLED_CLASSIFICATION = ("rotten_tomatoes",)
BUNDLED_CAUSAL_LM = ("chatterbot_corpus_english",)
ROTTEN_TOMATOES_LABELS = ["rotten", "fresh"]  # rotten -> 0, fresh -> 1 (negative / positive)


@dataclass
class DataSpec:
    """Where the examples come from and which columns hold what.

    Either ``train_files`` (plus optional ``eval_files``) or ``bundled`` (a data set name).
    Without eval files, ``eval_fraction`` of the train rows is split off with ``seed``.
    """

    train_files: list[str] | None = None
    eval_files: list[str] | None = None
    bundled: str | None = None
    text_column: str = "text"
    text_pair_column: str | None = None
    label_column: str = "label"
    eval_fraction: float = 0.1
    seed: int = 0
    max_train_samples: int | None = None
    max_eval_samples: int | None = None
    dataset: str | None = None
    """A Hugging Face data set id or a local data set directory (instead of files or bundled)."""
    dataset_config: str | None = None
    train_split: str = "train"
    eval_split: str | None = None


# ----------------------------------------------------------------------------- public loaders


@quiet_datasets()
def load_classification_data(spec: DataSpec) -> tuple[datasets.Dataset, datasets.Dataset, list[str]]:
    """Train and eval sets with ``text`` [``text_pair``] and ``label`` ids, plus the label names.

    Label names are the sorted distinct values of the label column over train and eval together
    (numbers sorted numerically), so ids are stable across runs and ranks.
    """
    _check_spec(spec, BUNDLED_CLASSIFICATION)
    if spec.bundled:
        full = _load_rotten_tomatoes()
        train, evaluation = _split(full, None, spec)
        label_names = list(ROTTEN_TOMATOES_LABELS)
    else:
        train, evaluation, label_names = _load_local_classification(spec)
    train = _truncate(train, spec.max_train_samples, spec.seed)
    return train, _truncate(evaluation, spec.max_eval_samples, spec.seed), label_names


def _load_local_classification(spec: DataSpec) -> tuple[datasets.Dataset, datasets.Dataset, list[str]]:
    named = {"text": spec.text_column, "text_pair": spec.text_pair_column, "label": spec.label_column}
    columns = {canonical: given for canonical, given in named.items() if given is not None}
    rows, sources = _rows(spec, "train")
    train = _select_columns(rows, columns, sources)
    _check_no_missing(train, [c for c in columns if c != "label"], columns, sources)
    evaluation = None
    if _has_eval(spec):
        rows, sources = _rows(spec, "eval")
        evaluation = _select_columns(rows, columns, sources)
        _check_no_missing(evaluation, [c for c in columns if c != "label"], columns, sources)
    label_names, train, evaluation = _encode_labels(train, evaluation, spec)
    train, evaluation = _split(train, evaluation, spec)
    return train, evaluation, label_names


@quiet_datasets()
def load_causal_lm_data(
    spec: DataSpec, *, prompt_column: str | None = None, response_column: str | None = None, data_format: str = "auto"
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Train and eval sets in one of the shapes of ``formats.py``: ``text``, ``prompt``/``response``,
    ``messages`` or ``input_ids``.

    ``data_format`` "auto" detects the layout from the columns (chat messages, ShareGPT conversations,
    alpaca, prompt/response -- also chosen by giving both column names --, pre-tokenized ids, text); every
    row is checked, and a bad one is one ``DataError`` naming the files, the row and the key.
    """
    _check_spec(spec, BUNDLED_CAUSAL_LM)
    if (prompt_column is None) != (response_column is None):
        raise DataError("give both prompt_column and response_column (for question/answer data), or neither")
    if spec.bundled:
        pairs = load_chatterbot_qa()
        full = datasets.Dataset.from_dict({"prompt": [q for q, _ in pairs], "response": [a for _, a in pairs]})
        train, evaluation = _split(full, None, spec)
    else:
        def canonical(role: str) -> datasets.Dataset:
            rows, sources = _rows(spec, role)
            return to_canonical(rows, data_format, sources, text_column=spec.text_column,
                                prompt_column=prompt_column, response_column=response_column)

        train = canonical("train")
        evaluation = canonical("eval") if _has_eval(spec) else None
        if evaluation is not None and evaluation.column_names != train.column_names:
            raise DataError(f"the eval data ({describe_files(_rows_sources(spec, 'eval'))}) is laid out as "
                            f"{', '.join(evaluation.column_names)} but the train data as "
                            f"{', '.join(train.column_names)}")
        train, evaluation = _split(train, evaluation, spec)
    return _truncate(train, spec.max_train_samples, spec.seed), _truncate(evaluation, spec.max_eval_samples, spec.seed)


@quiet_datasets()
def load_preference_data(spec: DataSpec, *, unpaired: bool = False) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Train and eval sets of preference rows (``preference/pairs.py``): ``prompt`` turns with ``chosen`` and
    ``rejected`` answers, or, ``unpaired`` (KTO), ``completion`` and a desirable ``label``.

    The bundled chat data becomes pairs whose chosen answer is the question's own and whose rejected
    answer belongs to another question (``pairs_from_answers``)."""
    from zerotune.finetune.preference.pairs import pairs_from_answers, to_pairs, to_unpaired

    _check_spec(spec, BUNDLED_CAUSAL_LM)
    if spec.bundled:
        qa = load_chatterbot_qa()
        full = pairs_from_answers([q for q, _ in qa], [a for _, a in qa], spec.seed)
        train, evaluation = _split(full, None, spec)
        train, evaluation = (_truncate(train, spec.max_train_samples, spec.seed),
                             _truncate(evaluation, spec.max_eval_samples, spec.seed))
        if unpaired:
            train, evaluation = to_unpaired(train, ["bundled"]), to_unpaired(evaluation, ["bundled"])
        return train, evaluation
    convert = to_unpaired if unpaired else to_pairs

    def canonical(role: str) -> datasets.Dataset:
        rows, sources = _rows(spec, role)
        return convert(rows, sources)

    train = canonical("train")
    evaluation = canonical("eval") if _has_eval(spec) else None
    train, evaluation = _split(train, evaluation, spec)
    return _truncate(train, spec.max_train_samples, spec.seed), _truncate(evaluation, spec.max_eval_samples, spec.seed)


def load_chatterbot_qa(directory: str | pathlib.Path | None = None, *, fetch: bool = True) -> list[tuple[str, str]]:
    """(question, answer) pairs from the chatterbot YAML files: each consecutive turn pair.

    A conversation ``[q, a, b]`` yields ``(q, a)`` and ``(a, b)``; the English corpus gives 2,393.
    """
    root = (pathlib.Path(directory) if directory is not None
            else assets.asset_path("chatterbot_corpus_english", fetch=fetch))
    files = sorted(root.glob("*.yml"))
    if not files:
        raise DataError(f"no .yml files in {root}; expected the chatterbot corpus YAML files")
    pairs: list[tuple[str, str]] = []
    for path in files:
        try:
            document = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as error:
            raise DataError(f"cannot parse {path} as YAML: {one_line(error)}") from None
        conversations = document.get("conversations") if isinstance(document, dict) else None
        if not isinstance(conversations, list):
            raise DataError(f"{path} has no 'conversations' list; "
                            "expected {'conversations': [[question, answer, ...], ...]}")
        for turns in conversations:
            turns = [str(turn).strip() for turn in turns if turn is not None]
            pairs.extend(zip(turns[:-1], turns[1:]))
    return pairs


# ----------------------------------------------------------------------------- tokenization


@quiet_datasets()
def check_num_labels(label_names: Sequence[str], num_labels: int | None) -> None:
    """The model's classification head must have one output per label found in the data."""
    if num_labels is not None and num_labels != len(label_names):
        shown = ", ".join(map(repr, label_names[:10])) + (", ..." if len(label_names) > 10 else "")
        raise DataError(
            f"num_labels is {num_labels} but the data has {len(label_names)} distinct labels ({shown}); "
            f"set num_labels to {len(label_names)} or check the label column"
        )


# ----------------------------------------------------------------------------- columns, labels, splits


def _has_eval(spec: DataSpec) -> bool:
    return bool(spec.eval_files) or bool(spec.dataset and spec.eval_split)


def _files(spec: DataSpec, role: str) -> list[str]:
    """``role``'s local data files."""
    files = spec.train_files if role == "train" else spec.eval_files
    if files is None:
        raise DataError(f"no {role} data files given")  # (as load_files says)
    return list(files)


def _rows_sources(spec: DataSpec, role: str) -> list[str]:
    """What error messages name for ``role``'s rows: the files, or the data set and its split."""
    if spec.dataset:
        return [f"{spec.dataset} [{spec.train_split if role == 'train' else spec.eval_split}]"]
    return _files(spec, role)


def _rows(spec: DataSpec, role: str) -> tuple[datasets.Dataset, list[str]]:
    """``role``'s raw rows (from the files or the data set) and what messages call them."""
    if spec.dataset:
        split = spec.train_split if role == "train" else spec.eval_split
        if split is None:  # (eval rows are read from a data set only where _has_eval saw its eval_split)
            raise DataError(f"data.dataset {spec.dataset!r} has no eval split: set data.eval_split")
        return load_dataset_split(spec.dataset, spec.dataset_config, split, role), _rows_sources(spec, role)
    files = _files(spec, role)
    return load_files(files, role), files


def _check_spec(spec: DataSpec, bundled_names: tuple[str, ...]) -> None:
    if sum(map(bool, (spec.train_files, spec.bundled, spec.dataset))) != 1:
        raise DataError(
            f"give one of data.train_files (local files), data.dataset (a Hugging Face data set id or directory) "
            f"or data.bundled (one of: {', '.join(bundled_names)})"
        )
    if spec.bundled and spec.bundled not in bundled_names:
        close = difflib.get_close_matches(spec.bundled, bundled_names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise DataError(f"unknown bundled data set {spec.bundled!r} for this task; "
                        f"available: {', '.join(bundled_names)}{hint}")
    if spec.bundled and spec.eval_files:
        raise DataError("bundled data sets bring their own eval split (eval_fraction); drop data.eval_files")
    if spec.eval_files and spec.dataset:
        raise DataError("data.eval_files with data.dataset: name the data set's eval split with data.eval_split")
    if not _has_eval(spec) and not 0.0 < spec.eval_fraction < 1.0:
        raise DataError(f"eval_fraction must be between 0 and 1 (exclusive), got {spec.eval_fraction!r}")
    for name in ("max_train_samples", "max_eval_samples"):
        value = getattr(spec, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise DataError(f"{name} must be a positive integer or null, got {value!r}")


def _select_columns(dataset: datasets.Dataset, columns: dict[str, str], files: Sequence[str]) -> datasets.Dataset:
    """Keep the named columns and rename them to the canonical names (``text``, ``label``...)."""
    if len(set(columns.values())) < len(columns):
        raise DataError(f"the same column is used for two roles: {columns}")
    available = dataset.column_names
    for role, column in columns.items():
        if column not in available:
            close = difflib.get_close_matches(column, available, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise DataError(
                f"{role} column {column!r} not found in {describe_files(files)}; "
                f"available columns: {', '.join(available)}{hint}"
            )
    dataset = dataset.select_columns(list(columns.values()))
    renames = {given: canonical for canonical, given in columns.items() if given != canonical}
    return dataset.rename_columns(renames) if renames else dataset


def _check_no_missing(dataset: datasets.Dataset, canonical: list[str], columns: dict[str, str],
                      files: Sequence[str]) -> None:
    """A null or blank text would crash the tokenizer far from its cause: reject it here."""
    for name in canonical:
        values = dataset[name]
        bad = [i for i, v in enumerate(values) if v is None or (isinstance(v, str) and not v.strip())]
        if bad:
            raise DataError(
                f"{len(bad)} row(s) of {describe_files(files)} have an empty {columns[name]!r} value "
                f"(first at row {bad[0]}); remove or fill them"
            )


def _encode_labels(
    train: datasets.Dataset, evaluation: datasets.Dataset | None, spec: DataSpec
) -> tuple[list[str], datasets.Dataset, datasets.Dataset | None]:
    """Map label values to ids 0..K-1 (sorted values) and cast to ``ClassLabel``."""
    values_by_set = [(train, spec.train_files, _normalized_labels(train, spec.label_column, spec.train_files))]
    if evaluation is not None:
        eval_labels = _normalized_labels(evaluation, spec.label_column, spec.eval_files)
        values_by_set.append((evaluation, spec.eval_files, eval_labels))
    distinct = {v for _, _, values in values_by_set for v in values}
    if len({type(v) for v in distinct}) > 1:
        examples = ", ".join(sorted(map(repr, distinct))[:6])
        raise DataError(f"label column {spec.label_column!r} mixes numbers and strings ({examples}); use one kind")
    ordered = sorted(distinct)
    label_names = [str(v) for v in ordered]
    ids = {value: index for index, value in enumerate(ordered)}
    class_label = datasets.ClassLabel(names=label_names)
    encoded = []
    for dataset, _, values in values_by_set:
        dataset = dataset.remove_columns("label").add_column("label", [ids[v] for v in values])
        encoded.append(dataset.cast_column("label", class_label))
    return label_names, encoded[0], encoded[1] if evaluation is not None else None


def _normalized_labels(dataset: datasets.Dataset, label_column: str, files: Sequence[str] | None) -> list:
    """Label values as ints or strs: a CSV with a gap reads ints as floats (1.0)."""
    values = dataset["label"]
    missing = [i for i, v in enumerate(values) if v is None or (isinstance(v, float) and math.isnan(v))]
    if missing:
        raise DataError(
            f"{len(missing)} row(s) of {describe_files(files)} have no {label_column!r} value "
            f"(first at row {missing[0]}); remove or fill them"
        )
    normalized = []
    for value in values:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        elif isinstance(value, bool):
            value = int(value)
        if not isinstance(value, (int, str)):
            raise DataError(
                f"label column {label_column!r} holds {type(value).__name__} values like {value!r}; "
                "labels must be strings or integers"
            )
        normalized.append(value)
    return normalized


def _split(
    train: datasets.Dataset, evaluation: datasets.Dataset | None, spec: DataSpec
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Use the eval files, or split ``eval_fraction`` off the shuffled train rows (seeded)."""
    if evaluation is not None:
        return train, evaluation
    eval_rows = max(1, round(len(train) * spec.eval_fraction))
    if eval_rows >= len(train):
        raise DataError(
            f"only {len(train)} train row(s): too few to split off eval_fraction={spec.eval_fraction}; "
            "add rows or give eval_files"
        )
    parts = train.train_test_split(test_size=eval_rows, seed=spec.seed, shuffle=True)
    return parts["train"], parts["test"]


def _truncate(dataset: datasets.Dataset, limit: int | None, seed: int) -> datasets.Dataset:
    """A seeded random subset: the first rows of a file are often all one class."""
    if limit is None or limit >= len(dataset):
        return dataset
    return dataset.shuffle(seed=seed).select(range(limit)).flatten_indices()


def _load_rotten_tomatoes() -> datasets.Dataset:
    """Review snippets with fresh (1) / rotten (0) labels; the file's plot summaries are dropped."""
    path = assets.asset_path("rotten_tomatoes")
    dataset = load_with_builder("csv", [path]).select_columns(["text", "category"])
    dataset = dataset.filter(lambda row: row["category"] in ROTTEN_TOMATOES_LABELS, desc="keeping reviews")
    dataset = dataset.map(
        lambda row: {"label": ROTTEN_TOMATOES_LABELS.index(row["category"])},
        remove_columns=["category"],
        desc="labels",
    )
    return dataset.cast_column("label", datasets.ClassLabel(names=ROTTEN_TOMATOES_LABELS))
