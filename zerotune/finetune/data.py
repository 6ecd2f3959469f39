"""Datasets for the two fine-tuning tasks: local files or a bundled data set -> tokenized rows.

Loading goes through the ``datasets`` library (its CSV / JSON / parquet / text builders), so
large files are memory-mapped Arrow tables and every rank reads the same cached copy. What this
module adds is the part users trip over: each bad input (a missing file, a file that does not
parse, a misspelled column, an empty set, a label set that disagrees with ``num_labels``) becomes
one ``DataError`` line naming the file or column and what would be valid.

Output shapes, so the training loop needs no per-source code:
  classification: columns ``text`` [, ``text_pair``], ``label`` (ClassLabel ids 0..K-1)
  causal LM:      column ``text``, or columns ``prompt`` and ``response``
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math
import pathlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import datasets
import yaml

from zerotune.finetune import assets

_BUILDER_BY_SUFFIX = {".csv": "csv", ".tsv": "tsv", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
_COMPRESSION_SUFFIXES = {".bz2", ".gz", ".xz"}
BUNDLED_CLASSIFICATION = ("rotten_tomatoes",)
BUNDLED_CAUSAL_LM = ("chatterbot_corpus_english",)
ROTTEN_TOMATOES_LABELS = ["rotten", "fresh"]  # rotten -> 0, fresh -> 1 (negative / positive)


class DataError(ValueError):
    """Bad training data or data settings; the message is one line meant for the user."""


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """No per-call progress bars: with several ranks they only interleave into noise."""
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


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


# ----------------------------------------------------------------------------- public loaders


@_quiet_datasets()
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
    columns = {"text": spec.text_column, "text_pair": spec.text_pair_column, "label": spec.label_column}
    columns = {canonical: given for canonical, given in columns.items() if given is not None}
    train = _select_columns(load_files(spec.train_files, "train"), columns, spec.train_files)
    evaluation = _select_columns(load_files(spec.eval_files, "eval"), columns, spec.eval_files) if spec.eval_files else None
    for dataset, files in ((train, spec.train_files), (evaluation, spec.eval_files)):
        if dataset is not None:
            _check_no_missing(dataset, [c for c in columns if c != "label"], columns, files)
    label_names, train, evaluation = _encode_labels(train, evaluation, spec)
    train, evaluation = _split(train, evaluation, spec)
    return train, evaluation, label_names


@_quiet_datasets()
def load_causal_lm_data(
    spec: DataSpec, *, prompt_column: str | None = None, response_column: str | None = None
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Train and eval sets with a ``text`` column, or ``prompt`` and ``response`` columns.

    Prompt/response mode is chosen by giving both column names (or the bundled chatterbot corpus);
    only the response tokens are then trained on (see ``tokenize_causal_lm``).
    """
    _check_spec(spec, BUNDLED_CAUSAL_LM)
    if (prompt_column is None) != (response_column is None):
        raise DataError("give both prompt_column and response_column (for question/answer data), or neither")
    if spec.bundled:
        pairs = load_chatterbot_qa()
        full = datasets.Dataset.from_dict({"prompt": [q for q, _ in pairs], "response": [a for _, a in pairs]})
        train, evaluation = _split(full, None, spec)
    else:
        columns = {"prompt": prompt_column, "response": response_column} if prompt_column else {"text": spec.text_column}
        train = _select_columns(load_files(spec.train_files, "train"), columns, spec.train_files)
        _check_no_missing(train, list(columns), columns, spec.train_files)
        evaluation = None
        if spec.eval_files:
            evaluation = _select_columns(load_files(spec.eval_files, "eval"), columns, spec.eval_files)
            _check_no_missing(evaluation, list(columns), columns, spec.eval_files)
        train, evaluation = _split(train, evaluation, spec)
    return _truncate(train, spec.max_train_samples, spec.seed), _truncate(evaluation, spec.max_eval_samples, spec.seed)


def load_chatterbot_qa(directory: str | pathlib.Path | None = None, *, fetch: bool = True) -> list[tuple[str, str]]:
    """(question, answer) pairs from the chatterbot YAML files: each consecutive turn pair.

    A conversation ``[q, a, b]`` yields ``(q, a)`` and ``(a, b)``; the English corpus gives 2,393.
    """
    root = pathlib.Path(directory) if directory is not None else assets.asset_path("chatterbot_corpus_english", fetch=fetch)
    files = sorted(root.glob("*.yml"))
    if not files:
        raise DataError(f"no .yml files in {root}; expected the chatterbot corpus YAML files")
    pairs: list[tuple[str, str]] = []
    for path in files:
        try:
            document = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as error:
            raise DataError(f"cannot parse {path} as YAML: {_one_line(error)}") from None
        conversations = document.get("conversations") if isinstance(document, dict) else None
        if not isinstance(conversations, list):
            raise DataError(f"{path} has no 'conversations' list; expected {{'conversations': [[question, answer, ...], ...]}}")
        for turns in conversations:
            turns = [str(turn).strip() for turn in turns if turn is not None]
            pairs.extend(zip(turns[:-1], turns[1:]))
    return pairs


# ----------------------------------------------------------------------------- tokenization


@_quiet_datasets()
def check_num_labels(label_names: Sequence[str], num_labels: int | None) -> None:
    """The model's classification head must have one output per label found in the data."""
    if num_labels is not None and num_labels != len(label_names):
        shown = ", ".join(map(repr, label_names[:10])) + (", ..." if len(label_names) > 10 else "")
        raise DataError(
            f"num_labels is {num_labels} but the data has {len(label_names)} distinct labels ({shown}); "
            f"set num_labels to {len(label_names)} or check the label column"
        )


# ----------------------------------------------------------------------------- file loading


@_quiet_datasets()
def load_files(files: Sequence[str] | None, role: str = "train") -> datasets.Dataset:
    """One ``Dataset`` from local files of one format (CSV, TSV, JSON, JSONL, parquet, text).

    Text files give one example per non-blank line in a ``text`` column. A ``.json`` file may
    hold JSON lines, a list of records, or one object of equal-length column lists.
    """
    if not files:
        raise DataError(f"no {role} data files given")
    paths = [pathlib.Path(f) for f in files]
    for path in paths:
        if not path.is_file():
            problem = "is not a file" if path.exists() else "does not exist"
            raise DataError(f"{role} data file {str(path)!r} {problem}")
    builders = {_builder_for(path) for path in paths}
    if len(builders) > 1:
        raise DataError(f"{role} data files mix formats ({', '.join(sorted(builders))}); give files of one format")
    builder = builders.pop()
    if builder == "json" and any(_is_json_columns_object(p) for p in paths):
        return _concatenate([_load_json_columns_object(p) for p in paths], role, paths)
    try:
        dataset = _load_with_builder(builder, paths)
    except DataError:
        raise
    except Exception as error:  # noqa: BLE001 -- re-raised as one line naming the culprit file
        raise _parse_error(builder, paths, error) from None
    if builder == "text":
        dataset = dataset.filter(lambda row: bool(row["text"].strip()), desc="dropping blank lines")
    if len(dataset) == 0:
        raise DataError(f"{role} data ({_describe(paths)}) has no rows")
    return dataset


def _builder_for(path: pathlib.Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSION_SUFFIXES:
        suffixes = suffixes[:-1]
    suffix = suffixes[-1] if suffixes else ""
    if suffix not in _BUILDER_BY_SUFFIX:
        supported = ", ".join(sorted(_BUILDER_BY_SUFFIX))
        raise DataError(
            f"data file {str(path)!r} has an unsupported type {suffix or '(no suffix)'!r}; "
            f"supported: {supported} (optionally .bz2/.gz/.xz)"
        )
    return _BUILDER_BY_SUFFIX[suffix]


def _load_with_builder(builder: str, paths: list[pathlib.Path]) -> datasets.Dataset:
    options = {"delimiter": "\t"} if builder == "tsv" else {}
    name = "csv" if builder == "tsv" else builder
    return datasets.load_dataset(name, data_files=[str(p) for p in paths], split="train", **options)


def _parse_error(builder: str, paths: list[pathlib.Path], error: Exception) -> DataError:
    """Name the file that failed: with several files, load them one by one to find it."""
    culprit, cause = paths[0], error
    if len(paths) > 1:
        for path in paths:
            try:
                _load_with_builder(builder, [path])
            except Exception as single_error:  # noqa: BLE001
                culprit, cause = path, single_error
                break
        else:  # each file parses alone: they disagree with each other (columns or types)
            return DataError(f"data files {_describe(paths)} do not combine (different columns or types?): {_one_line(error)}")
    root_cause = cause.__cause__ or cause.__context__ or cause
    if "corresponds to no data" in str(cause) or type(root_cause).__name__ in ("EmptyDataError", "SchemaInferenceError"):
        return DataError(f"data file {str(culprit)!r} has no rows")
    return DataError(f"cannot parse data file {str(culprit)!r} as {builder}: {_one_line(root_cause)}")


def _is_json_columns_object(path: pathlib.Path) -> bool:
    """True for a ``.json`` file holding one object of column lists (``{"text": [...], ...}``)."""
    if path.suffix.lower() != ".json":
        return False
    with open(path, encoding="utf-8", errors="replace") as handle:
        head = handle.read(4096).lstrip()
    if not head.startswith("{"):
        return False
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return False  # JSON lines (several objects) or broken: the json builder reports it
    return isinstance(document, dict) and bool(document) and all(isinstance(v, list) for v in document.values())


def _load_json_columns_object(path: pathlib.Path) -> datasets.Dataset:
    document = json.loads(path.read_text(encoding="utf-8"))
    lengths = {name: len(values) for name, values in document.items()}
    if len(set(lengths.values())) > 1:
        raise DataError(f"data file {str(path)!r}: column lists have different lengths {lengths}")
    return datasets.Dataset.from_dict(document)


def _concatenate(parts: list[datasets.Dataset], role: str, paths: list[pathlib.Path]) -> datasets.Dataset:
    try:
        dataset = datasets.concatenate_datasets(parts)
    except ValueError as error:
        raise DataError(f"{role} data files {_describe(paths)} do not combine: {_one_line(error)}") from None
    if len(dataset) == 0:
        raise DataError(f"{role} data ({_describe(paths)}) has no rows")
    return dataset


# ----------------------------------------------------------------------------- columns, labels, splits


def _check_spec(spec: DataSpec, bundled_names: tuple[str, ...]) -> None:
    if bool(spec.train_files) == bool(spec.bundled):
        raise DataError(
            f"give either data.train_files (local files) or data.bundled (one of: {', '.join(bundled_names)}), "
            "not both or neither"
        )
    if spec.bundled and spec.bundled not in bundled_names:
        close = difflib.get_close_matches(spec.bundled, bundled_names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise DataError(f"unknown bundled data set {spec.bundled!r} for this task; available: {', '.join(bundled_names)}{hint}")
    if spec.bundled and spec.eval_files:
        raise DataError("bundled data sets bring their own eval split (eval_fraction); drop data.eval_files")
    if not spec.eval_files and not 0.0 < spec.eval_fraction < 1.0:
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
                f"{role} column {column!r} not found in {_describe(files)}; available columns: {', '.join(available)}{hint}"
            )
    dataset = dataset.select_columns(list(columns.values()))
    renames = {given: canonical for canonical, given in columns.items() if given != canonical}
    return dataset.rename_columns(renames) if renames else dataset


def _check_no_missing(dataset: datasets.Dataset, canonical: list[str], columns: dict[str, str], files: Sequence[str]) -> None:
    """A null or blank text would crash the tokenizer far from its cause: reject it here."""
    for name in canonical:
        values = dataset[name]
        bad = [i for i, v in enumerate(values) if v is None or (isinstance(v, str) and not v.strip())]
        if bad:
            raise DataError(
                f"{len(bad)} row(s) of {_describe(files)} have an empty {columns[name]!r} value "
                f"(first at row {bad[0]}); remove or fill them"
            )


def _encode_labels(
    train: datasets.Dataset, evaluation: datasets.Dataset | None, spec: DataSpec
) -> tuple[list[str], datasets.Dataset, datasets.Dataset | None]:
    """Map label values to ids 0..K-1 (sorted values) and cast to ``ClassLabel``."""
    values_by_set = [(train, spec.train_files, _normalized_labels(train, spec.label_column, spec.train_files))]
    if evaluation is not None:
        values_by_set.append((evaluation, spec.eval_files, _normalized_labels(evaluation, spec.label_column, spec.eval_files)))
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


def _normalized_labels(dataset: datasets.Dataset, label_column: str, files: Sequence[str]) -> list:
    """Label values as ints or strs: a CSV with a gap reads ints as floats (1.0)."""
    values = dataset["label"]
    missing = [i for i, v in enumerate(values) if v is None or (isinstance(v, float) and math.isnan(v))]
    if missing:
        raise DataError(
            f"{len(missing)} row(s) of {_describe(files)} have no {label_column!r} value "
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
    dataset = _load_with_builder("csv", [path]).select_columns(["text", "category"])
    dataset = dataset.filter(lambda row: row["category"] in ROTTEN_TOMATOES_LABELS, desc="keeping reviews")
    dataset = dataset.map(
        lambda row: {"label": ROTTEN_TOMATOES_LABELS.index(row["category"])},
        remove_columns=["category"],
        desc="labels",
    )
    return dataset.cast_column("label", datasets.ClassLabel(names=ROTTEN_TOMATOES_LABELS))


# ----------------------------------------------------------------------------- small helpers


def _describe(files: Sequence[str | pathlib.Path] | None) -> str:
    names = [str(f) for f in files or []]
    return ", ".join(repr(n) for n in names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return (text[:300] + "...") if len(text) > 300 else text or type(error).__name__
