"""Local data files -> one ``datasets.Dataset``, with one-line errors naming the file.

Split from ``data.py`` (which turns a dataset into the tasks' columns and splits) because reading
files is its own concern: which builder a suffix means, JSON's three layouts, and finding the one
file of several that does not parse. Every failure is a ``DataError`` meant for the user.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
from collections.abc import Iterator, Sequence

import datasets

_BUILDER_BY_SUFFIX = {".csv": "csv", ".tsv": "tsv", ".json": "json", ".jsonl": "json", ".parquet": "parquet",
                      ".txt": "text"}
_COMPRESSION_SUFFIXES = {".bz2", ".gz", ".xz"}


class DataError(ValueError):
    """Bad training data or data settings; the message is one line meant for the user."""


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """No per-call progress bars: with several ranks they only interleave into noise."""
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


@quiet_datasets()
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
        dataset = load_with_builder(builder, paths)
    except DataError:
        raise
    except Exception as error:  # noqa: BLE001 -- re-raised as one line naming the culprit file
        raise _parse_error(builder, paths, error) from None
    if builder == "text":
        dataset = dataset.filter(lambda row: bool(row["text"].strip()), desc="dropping blank lines")
    if len(dataset) == 0:
        raise DataError(f"{role} data ({describe_files(paths)}) has no rows")
    return dataset


def load_dataset_split(name: str, config: str | None, split: str, role: str = "train") -> datasets.Dataset:
    """One split of a Hugging Face data set id (through the hub's cache: offline once cached) or of a local
    data set directory (``save_to_disk``'s, or a folder of data files ``datasets.load_dataset`` reads)."""
    path = pathlib.Path(name).expanduser()
    try:
        if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise DataError(f"{role} split {split!r} is not in {name}; its splits: {', '.join(loaded)}")
                loaded = loaded[split]
            elif split != "train":
                raise DataError(f"{name} is a single data set (saved without splits); it has no {split!r} split")
        else:
            loaded = datasets.load_dataset(str(path) if path.is_dir() else name, config, split=split)
    except DataError:
        raise
    except ValueError as error:  # an unknown split or config names the valid ones
        raise DataError(f"data set {name!r} ({role} split {split!r}): {one_line(error)}") from None
    except Exception as error:  # noqa: BLE001 - not cached offline, no such data set: one line
        offline = datasets.config.HF_HUB_OFFLINE
        how = (f"; it is not in the Hugging Face cache and the hub is offline (HF_HUB_OFFLINE=1): fetch it once where "
               f"the hub is reachable: python -c \"import datasets; datasets.load_dataset({name!r})\""
               ) if offline else ""
        raise DataError(f"data set {name!r} ({role} split {split!r}) could not be loaded: {type(error).__name__}: "
                        f"{one_line(error)[:200]}{how}") from None
    if len(loaded) == 0:
        raise DataError(f"{role} data ({name} [{split}]) has no rows")
    return loaded


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


def load_with_builder(builder: str, paths: list[pathlib.Path]) -> datasets.Dataset:
    options = {"delimiter": "\t"} if builder == "tsv" else {}
    name = "csv" if builder == "tsv" else builder
    return datasets.load_dataset(name, data_files=[str(p) for p in paths], split="train", **options)


def _parse_error(builder: str, paths: list[pathlib.Path], error: Exception) -> DataError:
    """Name the file that failed: with several files, load them one by one to find it."""
    culprit, cause = paths[0], error
    if len(paths) > 1:
        for path in paths:
            try:
                load_with_builder(builder, [path])
            except Exception as single_error:  # noqa: BLE001
                culprit, cause = path, single_error
                break
        else:  # each file parses alone: they disagree with each other (columns or types)
            return DataError(f"data files {describe_files(paths)} do not combine (different columns or types?): "
                             f"{one_line(error)}")
    if culprit.stat().st_size == 0:  # the json builder's own words for this are "StopIteration"
        return DataError(f"data file {str(culprit)!r} is empty (0 bytes)")
    if builder == "json" and (problem := _json_syntax_problem(culprit)):
        return DataError(f"data file {str(culprit)!r}: {problem}")
    root_cause = cause.__cause__ or cause.__context__ or cause
    empty_error = type(root_cause).__name__ in ("EmptyDataError", "SchemaInferenceError")
    if "corresponds to no data" in str(cause) or empty_error:
        return DataError(f"data file {str(culprit)!r} has no rows")
    return DataError(f"cannot parse data file {str(culprit)!r} as {builder}: {one_line(root_cause)}")


def _json_syntax_problem(path: pathlib.Path) -> str | None:
    """Where a JSON / JSON-lines file stops being JSON, or None when its syntax is fine.

    pyarrow reports a truncated line by its effect on the column types ("changed from string to object"
    in a 0-based row that skips blank lines); this reads the file the way a user counts lines. A file whose
    first line parses alone is JSON lines, checked line by line as it streams; otherwise one document.
    Compressed files are left to the builder's message.
    """
    if path.suffix.lower() in _COMPRESSION_SUFFIXES:
        return None
    with open(path, encoding="utf-8", errors="replace") as handle:
        first = next((line for line in handle if line.strip()), "")
        if not first:
            return None  # only blank lines: the builder says it has no rows
        if _json_error(first) is None:
            handle.seek(0)
            for number, line in enumerate(handle, start=1):
                if line.strip() and (error := _json_error(line.rstrip("\r\n"))):
                    return (f"line {number} is not valid JSON ({error.msg}: column {error.colno}; truncated?); "
                            "a JSON-lines file holds one complete JSON object per line")
            return None
        handle.seek(0)
        error = _json_error(handle.read())
    return None if error is None else f"not valid JSON: {error.msg}: line {error.lineno} column {error.colno}"


def _json_error(text: str) -> json.JSONDecodeError | None:
    try:
        json.loads(text)
    except json.JSONDecodeError as error:
        return error
    return None


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
        raise DataError(f"{role} data files {describe_files(paths)} do not combine: {one_line(error)}") from None
    if len(dataset) == 0:
        raise DataError(f"{role} data ({describe_files(paths)}) has no rows")
    return dataset


def describe_files(files: Sequence[str | pathlib.Path] | None) -> str:
    """The first three file names, quoted, and how many more: short enough for a one-line error."""
    names = [str(f) for f in files or []]
    return ", ".join(repr(n) for n in names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


def one_line(error: BaseException) -> str:
    """A library error squeezed onto one line of at most ~300 characters."""
    text = " ".join(str(error).split())
    return (text[:300] + "...") if len(text) > 300 else text or type(error).__name__
