"""What every ecosystem case script shares (scripts/ecosystem_check.sh runs them; see there).

A case script is a driver and a worker in one file. The driver (no ``--worker``) builds the tiny model,
launches the worker on 2 CPU ranks once per mode (``ddp``: the tool's own non-DeepSpeed run, the
reference; ``zero2`` / ``zero3``: the same run with a DeepSpeed config, which the ``deepspeed`` alias
gives to zerotune), compares each method's logged training losses with the reference's and prints one
JSON summary line (``summarize``). The worker prints one ``{"rank": ...}`` JSON row per rank.

Only the standard library and two helpers of the test suite (its tiny Llama, its rank-row reader) are used here, so a
tool's case script can import this module from any environment that can run the tool and zerotune's tests.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REL = 1e-5
"""The largest relative difference of a logged loss from the reference run that counts as equal."""
NPROC = 2
MODES = ("ddp", "zero2", "zero3")
ROOT = Path(__file__).resolve().parents[2]


def _on_path(directory: Path) -> None:
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))


def make_tiny_llama(directory: Path) -> Path:
    """The test suite's tiny Llama (2 layers, hidden 32) and word-level tokenizer, saved with save_pretrained
    (no hub); its words: what color is the sky/grass/snow/coal/blood/sun, blue/green/white/black/red/yellow."""
    _on_path(ROOT)
    from tests.test_finetune_causal_lm import make_tiny_llama as make

    return make(directory)


def deepspeed_config(mode: str) -> dict | None:
    """The DeepSpeed config a tool is handed for ``mode`` ("auto" values filled in by transformers), or
    None for the reference run. fp32 throughout: the comparison is at 1e-5."""
    if mode == "ddp":
        return None
    stage = int(mode.removeprefix("zero"))
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "bf16": {"enabled": False}, "fp16": {"enabled": False},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto",
                                  "stage3_prefetch_bucket_size": "auto",
                                  "stage3_param_persistence_threshold": "auto"}}


def print_row(row: dict) -> None:
    """The worker's result for this rank, in one write (see ``rank_rows``)."""
    sys.stdout.write(json.dumps(row, default=str) + "\n")
    sys.stdout.flush()


def rank_rows(text: str) -> list[dict]:
    """Every ``{"rank": ...}`` object in the ranks' merged output, rank-ordered."""
    _on_path(ROOT)
    from tests.launch import _rank_rows

    return sorted(_rank_rows(text), key=lambda row: row["rank"])


def launch_command(script: Path) -> list[str]:
    """torchrun on NPROC ranks; where ``import deepspeed`` does not already resolve here (no
    ``zerotune deepspeed-alias install`` in this environment), ``zerotune run --as-deepspeed`` gives
    each rank the alias instead."""
    if importlib.util.find_spec("deepspeed") is not None:
        head = [sys.executable, "-m", "torch.distributed.run"]
    else:
        head = [sys.executable, "-m", "zerotune.cli.main", "run", "--as-deepspeed", "--no_local_rank"]
    return [*head, "--nproc_per_node", str(NPROC), "--master_port", str(_free_port()), str(script)]


def one_process(script: Path) -> list[str]:
    """The launch for a tool that starts its ranks itself (Ray's workers, a CLI's own torchrun): the worker is
    one plain process per mode, which prints every rank's row."""
    return [sys.executable, str(script)]


ENGINE_BANNER = "zerotune engine: world"
"""What zerotune logs at ``initialize``: how a case that only sees a CLI's output knows the ranks trained on
zerotune engines."""


def run_cli(command: list[str], env: dict[str, str], what: str) -> str:
    """A tool's own command line (its ranks started by it); its output goes to stderr (the driver's failure
    log) and is returned; a failure ends the worker naming WHAT."""
    progress(what)
    # the tool's CLI (and the torchrun it starts) from this interpreter's environment, as in an activated venv
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PATH": path, **env})
    sys.stderr.write(done.stdout[-20000:] + done.stderr[-20000:])
    if done.returncode != 0:
        raise SystemExit(f"{what}: exited {done.returncode}")
    return done.stdout + done.stderr


def print_mean_rows(mode: str, losses: dict[str, list[float]], engines: dict[str, str]) -> None:
    """The rows of a run whose log holds the ranks' mean loss (a CLI's trainer log): every rank the same."""
    for rank in range(NPROC):
        print_row({"rank": rank, "mode": mode, "losses": losses, "engines": engines})


def case_parser(doc: str, methods: tuple[str, ...]) -> argparse.ArgumentParser:
    """The options of every case script, driver and worker (a case adds its own)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help="(internal) one mode")
    parser.add_argument("--mode", default="ddp")
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--methods", default=",".join(methods))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mode")
    parser.add_argument("--line", action="store_true", help="print the one-line summary instead of JSON")
    return parser


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_mode(script: Path, mode: str, args: list[str], timeout: int,
             launch: Callable[[Path], list[str]] = launch_command) -> tuple[list[dict] | None, str]:
    """The ranks' rows of one worker launch, or None and the failure (the last traceback line). ``launch``:
    the command that starts SCRIPT's ranks (torchrun by default; a tool that starts its own workers, Ray,
    runs the script once)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    command = [*launch(script), "--worker", "--mode", mode, *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout}s"
    try:
        rows = rank_rows(done.stdout)
    except ValueError:  # a rank's row cut short: the launch failed anyway
        rows = []
    if done.returncode == 0 and len(rows) == NPROC:
        return rows, ""
    log = os.environ.get("ECOSYSTEM_LOG")
    if log:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as handle:
            handle.write(f"==== {mode}: {' '.join(command)}\n{done.stdout}\n{done.stderr}\n")
    return None, failure_line(done.stdout + "\n" + done.stderr, done.returncode)


def failure_line(text: str, returncode: int) -> str:
    """What a reader needs to act on: the first exception a rank raised (not torchrun's ChildFailedError) with
    its innermost frame, else the signal a rank died of, else the output's tail; and the step the ranks
    were at (the worker's ``progress`` markers)."""
    lines = text.splitlines()
    found = ""
    for i, line in enumerate(lines):
        if not line.startswith("Traceback (most recent call last)"):
            continue
        frames = []
        for follow in lines[i + 1:]:
            # a frame, its ^^^^ marker line, or another rank's traceback interleaved with this one
            if follow.startswith((" ", "\t", "Traceback (most recent")) or not follow.strip("^~ \t"):
                if follow.strip().startswith("File "):
                    frames.append(follow.strip())
                continue
            if "ChildFailedError" not in follow:
                found = follow.strip() + (f" [{frames[-1]}]" if frames else "")
            break
        if found:  # the first rank's first error: what the others then hit follows from it
            break
    if not found:
        signal = re.search(r"exitcode\s*:\s*(-\d+).*?\((SIG\w+)\)", text)
        found = (f"a rank died of {signal.group(2)} (exit {signal.group(1)})" if signal
                 else f"exit {returncode}: " + " | ".join(line.strip() for line in lines[-3:]))
    marks = re.findall(r"^\[ecosystem\] (.*)$", text, flags=re.M)
    return found + (f" (while: {marks[-1]})" if marks else "")


def progress(what: str) -> None:
    """A marker the driver quotes if the ranks fail (which method, which phase)."""
    sys.stderr.write(f"[ecosystem] {what}\n")
    sys.stderr.flush()


def compare_losses(got: dict[str, list[float]], want: dict[str, list[float]]) -> tuple[float, list[str]]:
    """The largest relative difference over every method's logged losses, and what does not match."""
    worst, problems = 0.0, []
    for method, reference in want.items():
        losses = got.get(method)
        if losses is None or len(losses) != len(reference) or not reference:
            problems.append(f"{method}: {len(losses or [])} logged losses, reference {len(reference)}")
            continue
        for step, (a, b) in enumerate(zip(losses, reference), 1):
            rel = abs(a - b) / max(abs(b), 1e-12)
            worst = max(worst, rel)
            if rel > REL:
                problems.append(f"{method} step {step}: {a!r} vs {b!r} (rel {rel:.1e})")
    return worst, problems


def drive(tool: str, version: str, script: Path, methods: tuple[str, ...], prepare: Callable[[Path], list[str]],
          workdir: Path, timeout: int = 900, launch: Callable[[Path], list[str]] = launch_command) -> dict[str, Any]:
    """Run every mode, compare with the reference and return the summary ``summarize`` prints (also written
    to WORKDIR/summary.json)."""
    started = time.time()
    args = prepare(workdir)
    summary: dict[str, Any] = {"tool": tool, "version": version, "methods": list(methods), "max_rel": None}
    reference, why = run_mode(script, "ddp", args + ["--out", str(workdir / "ddp")], timeout, launch)
    if reference is None:
        summary["reference"] = f"FAILED: {why}"
        summary.update({mode: "not run (the reference run failed)" for mode in MODES[1:]})
    else:
        want = reference[0]["losses"]
        if reference[0].get("stopped"):  # a case that went past the tool's own stop: where that was
            summary["ddp_stopped"] = reference[0]["stopped"]
        summary["reference"] = {method: len(losses) for method, losses in want.items()}
        for mode in MODES[1:]:
            rows, why = run_mode(script, mode, args + ["--out", str(workdir / mode)], timeout, launch)
            if rows is None:
                summary[mode] = f"FAILED: {why}"
                continue
            problems = [f"rank {row['rank']} {method} did not train on a zerotune engine ({engine})"
                        for row in rows for method in methods
                        if not (engine := row["engines"].get(method, "")).startswith("zerotune.")]
            worst = 0.0
            for row in rows:
                rel, mismatches = compare_losses(row["losses"], want)
                worst = max(worst, rel)
                problems += [f"rank {row['rank']} {m}" for m in mismatches]
            summary["max_rel"] = max(summary["max_rel"] or 0.0, worst)
            summary[f"{mode}_max_rel"] = worst
            summary[f"{mode}_engines"] = rows[0]["engines"]
            if rows[0].get("stopped"):
                summary[f"{mode}_stopped"] = rows[0]["stopped"]
            summary[mode] = "ok" if not problems else "MISMATCH: " + "; ".join(problems[:3])
    summary["seconds"] = round(time.time() - started)
    (workdir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def drive_and_print(tool: str, version: str, args: Any, script: Path, methods: tuple[str, ...],
                    prepare: Callable[[Path], list[str]], launch: Callable[[Path], list[str]] = launch_command) -> None:
    """A case's driver: ``drive`` in ARGS.workdir (a new temporary one if not given), its summary printed
    (``--line``: the one-line form)."""
    import tempfile

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix=f"zerotune-{tool}-"))
    summary = drive(tool, version, script, methods, prepare, workdir, args.timeout, launch)
    print(summarize(summary) if args.line else json.dumps(summary))


def summarize(summary: dict[str, Any]) -> str:
    """The one line scripts/ecosystem_check.sh prints for a tool."""
    rel = summary.get("max_rel")
    rel_text = "n/a" if rel is None else f"{rel:.1e}"
    if str(summary.get("reference", "")).startswith("FAILED"):
        return (f"{summary['tool']} {summary['version']}: the non-DeepSpeed reference run {summary['reference']}"
                f" ({'/'.join(summary['methods'])}; ZeRO 2 and 3 not run)")
    return (f"{summary['tool']} {summary['version']}: ZeRO 2 {summary.get('zero2')} | ZeRO 3 {summary.get('zero3')}"
            f" | max rel loss diff vs non-DeepSpeed {rel_text} ({'/'.join(summary['methods'])})")
