"""Command-line arguments of ``zerotune finetune`` (shared by the launcher and each rank's worker).

Kept apart from the worker so building the ``zerotune`` parser imports nothing heavy.
"""

from __future__ import annotations

import argparse

DEFAULT_OUTPUT_DIR = "runs/finetune"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("recipe", nargs="?", default=None,
                        help="recipe YAML/JSON, or a LLaMA-Factory / axolotl training YAML (default: the bundled "
                             "default)")
    parser.add_argument("--output-dir", default=None,
                        help="where metrics, checkpoints and the model go (default: a LLaMA-Factory / axolotl "
                             f"YAML's output_dir, else {DEFAULT_OUTPUT_DIR})")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    parser.add_argument("--merge", action="store_true", help="also save LoRA weights merged into the base model")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe value, e.g. --set train.lr=3e-5 (repeatable)")
    parser.add_argument("--print-recipe", action="store_true",
                        help="print the recipe as zerotune YAML (a LLaMA-Factory / axolotl YAML translated, with "
                             "the --set overrides) and exit without training")
    parser.add_argument("--preview", nargs="?", type=int, const=3, default=None, metavar="N",
                        help="print the first N (default 3) tokenized training examples with the trained tokens "
                             "marked, then exit; loads only the tokenizer and the data (causal LM; put it after "
                             "RECIPE)")
    return parser


def resolve_output_dir(args: argparse.Namespace) -> str:
    """``--output-dir``, else the ``output_dir`` of a LLaMA-Factory / axolotl YAML, else runs/finetune; set on
    ``args`` so the ranks and the resume hint see the same directory."""
    if not getattr(args, "output_dir", None):
        from zerotune.finetune.foreign_recipes import read_foreign

        translation = read_foreign(args.recipe) if args.recipe else None
        args.output_dir = (translation.output_dir if translation is not None and translation.output_dir
                           else DEFAULT_OUTPUT_DIR)
    return str(args.output_dir)
