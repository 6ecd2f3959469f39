"""``zerotune compare-methods [RECIPE] [--methods full,lora,prefix,qlora | --objectives dpo,orpo,simpo]
[--lr METHOD=LR ...] [--output-dir DIR]``.

Fine-tunes the recipe's model on its data once per method (``zerotune finetune`` with ``method.type``
switched, one after another) and prints, from measurement, the method table: per-rank memory as % of full
fine-tuning, steps to reach the full run's final eval metric as % of full, the final metric and the
trainable parameters; ``DIR/compare.md``, ``compare.json`` and ``curves.png`` keep them. Evaluations are
needed along the way: a recipe without ``train.eval_every`` is evaluated every tenth of its steps.
``--objectives`` compares preference objectives instead (``objective.type`` switched, the recipe's method
kept, the same pairs), by each objective's own eval reward accuracy, against the first one listed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from zerotune.config.errors import ConfigError


def add_compare_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("compare-methods", help="fine-tune with full, LoRA, prefix and QLoRA and compare",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", default="smollm2-lora",
                        help="recipe YAML/JSON or bundled name (default: smollm2-lora)")
    parser.add_argument("--methods", default="full,lora,prefix,qlora",
                        help="comma-separated method types, full first (default: full,lora,prefix,qlora)")
    parser.add_argument("--objectives", default=None,
                        help="compare preference objectives instead of methods: comma-separated objective types "
                             "(dpo,orpo,simpo,kto,...; the first is the reference), each with the recipe's method, "
                             "on the same pairs; the table's metric is each objective's eval reward accuracy")
    parser.add_argument("--lr", action="append", default=[], metavar="METHOD=LR",
                        help="peak lr of one method (repeatable); others use the recipe's train.lr")
    parser.add_argument("--output-dir", default="compare-methods", help="one run directory per method, and the table")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe value for every method (repeatable)")
    parser.add_argument("--reuse", action="store_true",
                        help="read the finished runs already in --output-dir instead of fine-tuning again (the table "
                             "only)")
    parser.set_defaults(func=run_compare)


def _method_lrs(methods: list[str], given: list[str]) -> dict[str, float]:
    lrs = {}
    for item in given:
        method, sep, value = item.partition("=")
        if not sep or method not in methods:
            raise ConfigError("--lr", f"{item!r}: expected METHOD=LR with METHOD one of {', '.join(methods)}")
        try:
            lrs[method] = float(value)
        except ValueError:
            raise ConfigError("--lr", f"{item!r}: {value!r} is not a number") from None
    return lrs


def run_compare(args: argparse.Namespace) -> int:
    from zerotune.finetune.compare import compare, format_table, plot_curves, read_run, run_method
    from zerotune.finetune.recipe import METHODS, load_recipe
    from zerotune.finetune.recipe_sections import PREFERENCE_OBJECTIVES

    by_objective = args.objectives is not None
    option, given, valid = (("--objectives", args.objectives, PREFERENCE_OBJECTIVES) if by_objective
                            else ("--methods", args.methods, METHODS))
    switched = "objective.type" if by_objective else "method.type"
    methods = [m.strip() for m in given.split(",") if m.strip()]
    try:
        unknown = [m for m in methods if m not in valid]
        if unknown or not methods:
            raise ConfigError(option, f"{given!r}: each must be one of {', '.join(valid)}")
        lrs = _method_lrs(methods, args.lr)
        recipe = load_recipe(args.recipe, args.overrides)
        overrides = list(args.overrides)
        if not recipe.train.eval_every:
            if not recipe.train.max_steps:
                raise ConfigError("train.eval_every", "compare-methods needs evaluations during training: set "
                                                      "train.eval_every (or train.max_steps)")
            overrides.append(f"train.eval_every={max(1, recipe.train.max_steps // 10)}")
        if "train.eval_samples" not in " ".join(overrides) and recipe.task == "causal-lm":
            overrides.append("train.eval_samples=0")  # generated samples are not compared; they cost time
        for method in methods:  # every method's recipe loads before the first run starts
            load_recipe(args.recipe, [*overrides, f"{switched}={method}", *_lr_override(lrs, method)])
    except ConfigError as error:
        print(f"zerotune compare-methods: {error}", file=sys.stderr)
        return 2
    if by_objective:  # each objective's own eval reward accuracy: the share of pairs it ranks right
        metric = "reward_accuracy" if "kto" not in methods else "reward_margin"
    else:
        metric = "loss" if recipe.task == "causal-lm" else "accuracy"  # each task's headline (summary.json)
    greater = metric != "loss"
    reference = methods[0] if by_objective else "full"
    output = Path(args.output_dir)
    runs = []
    for method in methods:
        if args.reuse and (output / method / "summary.json").is_file():
            run = read_run(method, output / method, metric)
        else:
            print(f"compare-methods: fine-tuning with {method} ({output / method}) ...", flush=True)
            run = run_method(args.recipe, method, output / method, [*overrides, *_lr_override(lrs, method)], metric,
                             switched)
        print(f"compare-methods: {method}: " + (run.error or f"{run.summary['metric']} {run.summary['before']:.4f} "
                                                 f"-> {run.summary['after']:.4f} in {run.summary['steps']} steps"),
              flush=True)
        runs.append(run)
    rows = compare(runs, metric, greater, reference)
    full = next((r for r in runs if r.method == reference and r.error is None and r.evals), None)
    table = format_table(rows, f"eval {metric}", full.evals[-1][1] if full else None, reference,
                         "objective" if by_objective else "method")
    lr_note = ", ".join(f"{m} {lrs.get(m, recipe.train.lr):g}" for m in methods)
    text = f"{table}\n\nrecipe: {args.recipe}; peak lr: {lr_note}; overrides: {' '.join(overrides) or 'none'}\n"
    output.mkdir(parents=True, exist_ok=True)
    (output / "compare.md").write_text(text)
    lr_by_method = {m: lrs.get(m, recipe.train.lr) for m in methods}
    (output / "compare.json").write_text(json.dumps({"rows": rows, "metric": metric, "lr": lr_by_method,
                                                     "compared": switched}, indent=2))
    plot_curves(runs, metric, output / "curves.png")
    print(text + f"written: {output / 'compare.md'}, {output / 'compare.json'}, {output / 'curves.png'}")
    return 0 if all(r.error is None for r in runs) else 1


def _lr_override(lrs: dict[str, float], method: str) -> list[str]:
    return [f"train.lr={lrs[method]}"] if method in lrs else []
