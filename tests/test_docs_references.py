"""docs/ stands alone: every file it names resolves inside the repository.

A path in backticks (``zerotune/zero/build.py``, ``zero/build.py`` relative to the package,
``tests/test_import_graph.py``, or a bare module file the package holds exactly once) must exist, so a
reader following the architecture page never lands outside the repository or on a moved file.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILE_IN_BACKTICKS = re.compile(r"`([A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*\.(?:py|md|sh|toml|yaml|yml|json))`")


def unresolved(text: str) -> list[str]:
    missing = []
    for name in sorted(set(FILE_IN_BACKTICKS.findall(text))):
        if any((base / name).exists() for base in (ROOT, ROOT / "zerotune", ROOT / "docs")):
            continue
        if "/" not in name and len(list((ROOT / "zerotune").rglob(name))) == 1:
            continue  # a module file named once in the package: unambiguous
        missing.append(name)
    return missing


def test_every_file_the_docs_name_exists_in_the_repository():
    docs = sorted((ROOT / "docs").glob("*.md"))
    assert docs, "no docs/*.md found"
    missing = {doc.name: names for doc in docs if (names := unresolved(doc.read_text()))}
    assert not missing, f"files named in docs/ that the repository does not hold: {missing}"


def test_the_check_catches_a_moved_file():
    assert unresolved("see `zerotune/no_such_module.py` and `zero/build.py`") == ["zerotune/no_such_module.py"]
