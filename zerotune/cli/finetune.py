"""``zerotune finetune [RECIPE] [--output-dir DIR] [--resume] [--merge] [--preview [N]] [--set key=value ...]
[--print-recipe]``.

RECIPE may also be a LLaMA-Factory or axolotl training YAML, translated key by key
(``finetune/foreign_recipes.py``); ``--print-recipe`` prints the recipe as zerotune YAML and exits.

Validates the recipe and fetches its bundled assets once, in this process, so a bad recipe is
one clear line and ranks never race to download. Then, unless already under torchrun, starts
``launch.nproc_per_node`` ranks (and ``launch.nnodes`` nodes through a rendezvous) with
torchrun's own API, each running ``zerotune.finetune.worker``. A failed rank ends with a short summary
(``failures.py``); a Ctrl-C with one line saying how to resume (``finetune/interrupt.py``).
``--preview [N]`` prints N tokenized training examples with their trained tokens marked and exits, here,
before any rank starts or any weights load (``finetune/preview.py``).
"""

from __future__ import annotations

import argparse
import os
import sys

from zerotune.config import ConfigError
from zerotune.distributed.launcher_link import INTERRUPTED_STATUS
from zerotune.finetune.interrupt import resume_hint


def add_finetune_parser(subparsers: argparse._SubParsersAction) -> None:
    from zerotune.finetune.arguments import add_arguments

    parser = subparsers.add_parser("finetune", help="fine-tune a Hugging Face model from a recipe",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run_finetune)


def _worker_argv(args: argparse.Namespace) -> list[str]:
    argv = [args.recipe] if args.recipe else []
    argv += ["--output-dir", args.output_dir]
    argv += ["--resume"] if args.resume else []
    argv += ["--merge"] if args.merge else []
    for override in args.overrides:
        argv += ["--set", override]
    return argv


def _prefetch_assets(recipe) -> None:
    """Fetch bundled model and data assets before any rank starts."""
    from zerotune.finetune.assets import ASSETS, asset_path

    for name in (recipe.model.name_or_path, recipe.data.bundled):
        if name in ASSETS:
            asset_path(name)


def recipe_yaml(recipe) -> str:
    """The recipe's set values as YAML that ``load_recipe`` accepts again (paths absolute)."""
    import yaml

    from zerotune.finetune.recipe import recipe_to_dict

    return yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, allow_unicode=True)


def run_finetune(args: argparse.Namespace) -> int:
    from zerotune.finetune.arguments import resolve_output_dir
    from zerotune.finetune.assets import AssetError
    from zerotune.finetune.data import DataError
    from zerotune.finetune.foreign_recipes import mark_notes_shown
    from zerotune.finetune.models import ModelLoadError
    from zerotune.finetune.recipe import load_recipe

    try:
        recipe = load_recipe(args.recipe, args.overrides)
        if args.print_recipe:
            print(recipe_yaml(recipe), end="")
            return 0
        resolve_output_dir(args)
        mark_notes_shown()
        _prefetch_assets(recipe)
        if args.preview is not None:
            from zerotune.finetune.preview import run_preview

            run_preview(recipe, args.preview)
            return 0
        from zerotune.finetune.task_data import check_recipe_inputs
        from zerotune.finetune.worker import check_merge

        check_merge(recipe, args.merge)
        check_recipe_inputs(recipe)
        if "RANK" in os.environ or recipe.launch.nproc_per_node * recipe.launch.nnodes == 1:
            from zerotune.finetune.worker import run

            run(args)
            return 0
    except (ConfigError, AssetError, DataError, ModelLoadError, NotImplementedError) as error:
        print(f"zerotune finetune: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nzerotune finetune: interrupted (SIGINT); {resume_hint(args)}", file=sys.stderr)
        return INTERRUPTED_STATUS
    from torch.distributed import run as torchrun

    from zerotune.cli.failures import launch_ranks

    launch = recipe.launch
    torchrun_args = [f"--nproc_per_node={launch.nproc_per_node}", f"--nnodes={launch.nnodes}",
                     f"--max-restarts={launch.max_restarts}"]
    if launch.nnodes > 1:
        if not launch.rdzv_endpoint:
            print("zerotune finetune: launch.rdzv_endpoint is required when launch.nnodes > 1 "
                  "(host:port of the first node)", file=sys.stderr)
            return 2
        torchrun_args += [f"--rdzv_backend={launch.rdzv_backend}", f"--rdzv_endpoint={launch.rdzv_endpoint}",
                          f"--rdzv_id={launch.rdzv_id or 'zerotune'}"]
    else:
        torchrun_args += ["--standalone"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parsed = torchrun.parse_args(torchrun_args + ["-m", "zerotune.finetune.worker", *_worker_argv(args)])
    return launch_ranks(parsed, "zerotune finetune", on_interrupt=lambda: resume_hint(args))
