"""Command-line arguments of ``zerotune finetune`` (shared by the launcher and each rank's worker).

Kept apart from the worker so building the ``zerotune`` parser imports nothing heavy.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("recipe", nargs="?", default=None, help="recipe YAML/JSON (default: the bundled default)")
    parser.add_argument("--output-dir", default="runs/finetune", help="where metrics, checkpoints and the model go")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    parser.add_argument("--merge", action="store_true", help="also save LoRA weights merged into the base model")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe value, e.g. --set train.lr=3e-5 (repeatable)")
    parser.add_argument("--preview", nargs="?", type=int, const=3, default=None, metavar="N",
                        help="print the first N (default 3) tokenized training examples with the trained tokens "
                             "marked, then exit; loads only the tokenizer and the data (causal LM; put it after "
                             "RECIPE)")
    return parser
