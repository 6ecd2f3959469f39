"""Other tools' training YAMLs as zerotune recipes: LLaMA-Factory's and axolotl's, run unchanged.

``zerotune finetune their.yaml`` reads the file, tells the dialect from its keys
(:func:`detect_dialect`) and translates it key by key into a recipe dict
(``foreign_llamafactory.py``, ``foreign_axolotl.py``), which then loads like any recipe. Every key
of the foreign file is accounted for, never silently dropped:

- translated into a recipe key (an error the recipe checks raise later names the foreign key too);
- accepted and *reported* once, when it only matters to the other tool's runtime
  (``plot_loss``, ``report_to: none``, ``ddp_timeout``, ...);
- refused in one line naming the key and value, when it would change the result and zerotune
  cannot honour it (``zerotune recipe: llamafactory key 'stage: ppo': not supported; ...``).

This module tells the dialects apart, calls the dialect's translation and reports its notes; what both
dialects share (the key reader that enforces the above, the helpers) is in ``foreign_keys.py``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from zerotune.finetune.foreign_keys import ForeignKeys, Translation

_SHOWN_ENV = "ZEROTUNE_FOREIGN_NOTES_SHOWN"  # set by the launcher so its ranks do not report the notes again
_shown: set[str] = set()


def detect_dialect(raw: Mapping[str, Any]) -> str:
    """zerotune (a ``model`` / ``task`` section), llamafactory (``model_name_or_path`` with ``stage`` or
    ``finetuning_type``) or axolotl (``base_model``); anything else is treated as a zerotune recipe, whose
    did-you-mean then names the keys it does not know."""
    if "model" in raw or "task" in raw:
        return "zerotune"
    if "base_model" in raw:
        return "axolotl"
    if "model_name_or_path" in raw and ("stage" in raw or "finetuning_type" in raw):
        return "llamafactory"
    return "zerotune"


def translate_foreign(raw: Mapping[str, Any], dialect: str, base_dir: Path) -> Translation:
    """The recipe a LLaMA-Factory or axolotl YAML asks for; one-line :class:`RecipeError` for what zerotune lacks.

    ``base_dir`` is the YAML's directory: the other tools resolve relative paths against the working
    directory, so that is tried first and the YAML's directory second.
    """
    if dialect == "llamafactory":
        from zerotune.finetune.foreign_llamafactory import translate
    elif dialect == "axolotl":
        from zerotune.finetune.foreign_axolotl import translate
    else:
        raise ValueError(f"not a foreign dialect: {dialect!r}")
    keys = ForeignKeys(raw, dialect, base_dir)
    translation = translate(keys)
    keys.refuse_leftovers()
    translation.notes = keys.notes
    translation.origins = keys.origins
    return translation


def read_foreign(source: Any) -> Optional[Translation]:
    """The translation of ``source`` when it is a LLaMA-Factory / axolotl file or dict, else None."""
    from zerotune.config.files import read_config_file

    if isinstance(source, Mapping):
        raw, base_dir = dict(source), Path.cwd()
    elif isinstance(source, (str, os.PathLike)) and Path(source).expanduser().is_file():
        path = Path(source).expanduser()
        try:
            raw, base_dir = read_config_file(path), path.absolute().parent
        except Exception:  # noqa: BLE001 - load_recipe reports an unreadable file in its own words
            return None
    else:
        return None
    dialect = detect_dialect(raw) if isinstance(raw, Mapping) else "zerotune"
    return None if dialect == "zerotune" else translate_foreign(raw, dialect, base_dir)


def report_notes(translation: Translation) -> None:
    """Print each no-effect / default note once, to stderr (stdout may be ``--print-recipe``'s YAML): in the
    launcher, or on rank 0 of a run started under torchrun."""
    if os.environ.get(_SHOWN_ENV) or os.environ.get("RANK", "0") not in ("", "0"):
        return
    for note in translation.notes:
        if note not in _shown:
            _shown.add(note)
            print(f"zerotune recipe: {note}", file=sys.stderr)


def mark_notes_shown() -> None:
    """Ranks the launcher starts inherit this, so the notes it reported are not repeated by rank 0."""
    os.environ[_SHOWN_ENV] = "1"


