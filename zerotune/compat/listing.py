"""``python -m zerotune.compat.listing``: the supported and refused DeepSpeed names, as Markdown.

Generated from the table in ``zerotune.compat.paths``; the README's list between the
``deepspeed-names`` markers is this output (``--write-readme README.md`` refreshes it, and a test
checks that it is current).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zerotune.compat.paths import DEEPSPEED_MODULES, REFUSED_MODULES, REFUSED_NAMES

BEGIN, END = "<!-- deepspeed-names:begin -->", "<!-- deepspeed-names:end -->"


def render() -> str:
    """The Markdown list: one row per DeepSpeed module, then the refused modules and names."""
    lines = ["| DeepSpeed module | names | zerotune module |", "|---|---|---|"]
    for path, mapped in DEEPSPEED_MODULES.items():
        names = ", ".join(f"`{n}`" for n in mapped.names if f"{path}.{n}" not in REFUSED_NAMES)
        lines.append(f"| `{path}` | {names} | `{mapped.module}` |")
    lines += ["", "Refused with one line naming the feature (`DeepSpeedFeatureNotSupported`, an `ImportError`):", ""]
    lines += [f"- `import {path}`: {feature}" for path, feature in REFUSED_MODULES.items()]
    lines += [f"- `{name}(...)`: {feature}" for name, feature in REFUSED_NAMES.items()]
    return "\n".join(lines) + "\n"


def with_listing(readme: str) -> str:
    """``readme`` with the text between the markers replaced by ``render()``."""
    if BEGIN not in readme or END not in readme:
        raise ValueError(f"the README has no {BEGIN} ... {END} markers")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{render()}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zerotune.compat.listing", description=__doc__)
    parser.add_argument("--write-readme", metavar="README", help="replace the list between the markers in README")
    args = parser.parse_args(argv)
    if args.write_readme:
        path = Path(args.write_readme)
        path.write_text(with_listing(path.read_text()))
        return 0
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
