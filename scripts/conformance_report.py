"""The table of ``scripts/deepspeed_conformance.sh``: DeepSpeed's unit tests per feature area, run through
zerotune's alias and (where a baseline ran) against the real DeepSpeed, from the JUnit files it wrote.

Per side: tests collected, passed, failed (failures and errors, collection errors included) and skipped;
"DS only" counts the tests the real DeepSpeed passed and zerotune did not. A module with no JUnit file
(a run killed by the per-module timeout) counts as one failure and is listed by name.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

SIDES = ("zerotune", "deepspeed")


def area_of(module: str) -> str:
    """``runtime/zero/test_x`` -> ``runtime/zero``; ``utils/test_y`` -> ``utils``; ``test_z`` -> ``(top)``."""
    parts = module.split("/")[:-1]
    return "/".join(parts[:2]) if parts else "(top)"


def outcomes(xml: Path) -> dict[str, str]:
    """test id -> passed / failed / skipped."""
    results = {}
    for case in ElementTree.parse(xml).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            results[test_id] = "failed"
        elif case.find("skipped") is not None:
            results[test_id] = "skipped"
        else:
            results[test_id] = "passed"
    return results


def collect(results: Path) -> tuple[dict, list[str]]:
    """{area: {side: {"collected", "passed", "failed", "skipped"}, "ds_only": n, "modules": set}} and the
    modules that left no result."""
    table: dict = defaultdict(lambda: {**{s: defaultdict(int) for s in SIDES}, "ds_only": 0, "modules": set()})
    missing = []
    per_module: dict[str, dict[str, dict[str, str]]] = defaultdict(dict)
    for side in SIDES:
        for rc_file in sorted((results / side).rglob("*.rc")):
            module = rc_file.relative_to(results / side).with_suffix("").as_posix()
            xml = rc_file.with_suffix(".xml")
            row = table[area_of(module)]
            row["modules"].add(module)
            if not xml.exists():
                missing.append(f"{side}: {module} (rc {rc_file.read_text().split()[0]}: no JUnit file, killed?)")
                row[side]["failed"] += 1
                continue
            found = outcomes(xml)
            per_module[module][side] = found
            for outcome in found.values():
                row[side][outcome] += 1
            row[side]["collected"] += len(found)
    for module, sides in per_module.items():
        if "deepspeed" in sides:
            ours = sides.get("zerotune", {})
            only = [test for test, outcome in sides["deepspeed"].items()
                    if outcome == "passed" and ours.get(test) != "passed"]
            table[area_of(module)]["ds_only"] += len(only)
            table[area_of(module)].setdefault("ds_only_tests", []).extend(
                f"{module}: {test} (zerotune: {ours.get(test, 'not collected')})" for test in only)
    return table, missing


def render(table: dict, missing: list[str]) -> str:
    header = ("| area | modules | zerotune collected / passed / failed / skipped | DeepSpeed collected / passed / "
              "failed / skipped | DS only |")
    lines = [header, "|---|---|---|---|---|"]
    totals = {s: defaultdict(int) for s in SIDES}
    ds_only = 0
    for area in sorted(table):
        row = table[area]
        cells = []
        for side in SIDES:
            counts = row[side]
            for key in ("collected", "passed", "failed", "skipped"):
                totals[side][key] += counts[key]
            cells.append(" / ".join(str(counts[k]) for k in ("collected", "passed", "failed", "skipped"))
                         if counts else "-")
        ds_only += row["ds_only"]
        lines.append(f"| {area} | {len(row['modules'])} | {cells[0]} | {cells[1]} | {row['ds_only']} |")
    total_cells = [" / ".join(str(totals[s][k]) for k in ("collected", "passed", "failed", "skipped")) for s in SIDES]
    lines.append(f"| **all** | {sum(len(r['modules']) for r in table.values())} | {total_cells[0]} | "
                 f"{total_cells[1]} | {ds_only} |")
    if missing:
        lines += ["", "Modules without a result:", *(f"- {m}" for m in missing)]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    list_ds_only = "--list-ds-only" in argv
    argv = [arg for arg in argv if arg != "--list-ds-only"]
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python scripts/conformance_report.py RESULTS_DIR [--list-ds-only] (RESULTS_DIR written by "
              "scripts/deepspeed_conformance.sh; --list-ds-only names each test only DeepSpeed passed)",
              file=sys.stderr)
        return 2
    table, missing = collect(Path(argv[0]))
    sys.stdout.write(render(table, missing))
    if list_ds_only:
        tests = [test for area in sorted(table) for test in table[area].get("ds_only_tests", [])]
        sys.stdout.write("\nPassed by DeepSpeed only:\n" + "".join(f"- {test}\n" for test in tests))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
