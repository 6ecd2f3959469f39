"""``zerotune plan CONFIG --model HF_ID_OR_DIR|module:factory --world-size N [--nodes K] [--device-memory 80GiB]
[--host-memory 512GiB] [--seq-len L]``: what each rank will hold, before anything is launched.

The model is built on the meta device (no weights are read or allocated, so a 70B config plans in seconds);
activations come from a meta trace of one micro-batch forward. Prints one table per rank (every rank of a
data-parallel layout holds the same) and whether it fits the device with and without activation
checkpointing; exit status 0 when it fits at least with checkpointing (and the host memory, when given,
holds the offloaded state), 1 when it does not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from zerotune.cli.plan_output import parse_number, parse_size, print_plan
from zerotune.config.errors import ConfigError


def add_plan_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("plan", help="per-rank memory of a config and model, before launch",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="DeepSpeed-style JSON/YAML config, or a zerotune finetune recipe (a file with "
                                       "model: and task: sections, or a bundled name: default, smollm2-lora, "
                                       "smollm2-dpo) to plan the recipe's own job")
    parser.add_argument("--model", default=None, help="Hugging Face id (cached), directory or config.json, or "
                                                      "module:factory (a recipe names its own model)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks in all (data parallel x the config's tensor-parallel size x pipeline stages x "
                             "sequence-parallel size); a recipe's default: launch.nproc_per_node x launch.nnodes")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key, as zerotune finetune --set (recipes only; repeatable)")
    parser.add_argument("--nodes", type=int, default=1,
                        help="nodes the ranks are spread over (host memory is per node)")
    parser.add_argument("--device-memory", default="80GiB", help="memory of one accelerator (default 80GiB)")
    parser.add_argument("--host-memory", default=None, help="host memory of one node, for offload")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per example (default 2048; a recipe's default: data.max_length)")
    parser.add_argument("--task", choices=("causal-lm", "sequence-classification"), default=None,
                        help="the model's head (default causal-lm; a recipe's task and objective decide it)")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                        help="plan this ZeRO stage instead of the config's zero_optimization.stage")
    parser.add_argument("--auto", action="store_true",
                        help="choose the tensor-parallel size, pipeline stages or sequence-parallel size, the ZeRO "
                             "stage, offload, activation checkpointing and micro-batch for the config's global batch "
                             "(also when the config says \"stage\": \"auto\"): the fastest layout that fits, by the "
                             "cost model")
    parser.add_argument("--flops", default="400e12",
                        help="dense 16-bit flop/s of one device, for --auto (default 400e12)")
    parser.add_argument("--bandwidth", default="50GB", help="collective bandwidth per rank per second, for --auto "
                                                           "(default 50GB)")
    parser.add_argument("--intra-node-bandwidth", default="300GB", help="bytes per second between the ranks of a "
                        "node, for tensor and sequence parallelism in --auto (default 300GB)")
    parser.add_argument("--host-bandwidth", default="25GB", help="device <-> host bytes per second, for --auto "
                                                                 "(default 25GB)")
    parser.set_defaults(func=run_plan)


def _config_keys(best: Any) -> str:
    """The chosen layout as the config keys that say it."""
    layout = best.layout
    keys = [f'"zero_optimization": {{"stage": {layout.stage}'
            + (f', "offload_optimizer": {{"device": "{layout.offload_optimizer}"}}'
               if layout.offload_optimizer != "none" else "")
            + (f', "offload_param": {{"device": "{layout.offload_param}"}}' if layout.offload_param != "none" else "")
            + "}", f'"train_micro_batch_size_per_gpu": {layout.micro_batch}',
            f'"gradient_accumulation_steps": {layout.gas}']
    if layout.tp > 1:
        keys.append(f'"tensor_parallel": {{"autotp_size": {layout.tp}}}')
    if layout.pp > 1:
        keys.append(f'"pipeline": {{"stages": {layout.pp}}}')
    if layout.sp > 1:
        keys.append(f'"sequence_parallel_size": {layout.sp}')
    return ", ".join(keys) + ("; and checkpoint every block (zerotune.checkpointing."
                              "apply_activation_checkpointing(model) or model.gradient_checkpointing_enable())"
                              if best.checkpointing else "")


def run_plan(args: argparse.Namespace) -> int:
    from zerotune.plan.auto import Hardware, NoLayoutFits, choose_layout
    from zerotune.plan.memory import (
        asks_for_auto_stage,
        check_composes,
        layout_from_config,
        plan_from_profile,
        profile_model,
    )
    from zerotune.plan.meta_model import PlanModelError, meta_model
    from zerotune.plan.recipe_job import is_recipe
    from zerotune.plan.splits import split_profiles

    if is_recipe(args.config):
        from zerotune.cli.plan_recipe import run_recipe_plan

        return run_recipe_plan(args)
    try:
        for option, value in (("--model", args.model), ("--world-size", args.world_size)):
            if value is None:
                from zerotune.finetune.recipe import BUNDLED_RECIPES

                raise ConfigError(option, f"is required with a DeepSpeed config; {args.config!r} is not a recipe (a "
                                          "YAML/JSON file with model: and task: sections, or a bundled recipe: "
                                          f"{', '.join(BUNDLED_RECIPES)}), which would name its own")
        if args.overrides:
            raise ConfigError("--set", "overrides recipe keys; the config is not a recipe (no model: and task: "
                                       "sections)")
        args.seq_len = 2048 if args.seq_len is None else args.seq_len
        args.task = args.task or "causal-lm"
        if args.world_size < 1 or args.nodes < 1 or args.world_size % args.nodes:
            raise ConfigError("--world-size",
                              f"{args.world_size} ranks cannot be spread evenly over {args.nodes} nodes")
        if args.seq_len < 1:
            raise ConfigError("--seq-len", f"must be >= 1, got {args.seq_len}")
        device = parse_size(args.device_memory, "--device-memory")
        host = parse_size(args.host_memory, "--host-memory") if args.host_memory else None
        layout = layout_from_config(args.config, args.world_size)
        if args.zero_stage is not None:
            layout = dataclasses.replace(layout, stage=args.zero_stage)
        auto = args.auto or (asks_for_auto_stage(args.config) and args.zero_stage is None)
        if not auto:  # (--auto weighs only layouts that compose)
            check_composes(layout)
        hardware = Hardware(device_memory=device, flops=parse_number(args.flops, "--flops"),
                            bandwidth=parse_size(args.bandwidth, "--bandwidth"),
                            intra_node_bandwidth=parse_size(args.intra_node_bandwidth, "--intra-node-bandwidth"),
                            host_bandwidth=parse_size(args.host_bandwidth, "--host-bandwidth"), host_memory=host,
                            ranks_per_node=args.world_size // args.nodes)
        model = meta_model(args.model, task=args.task)
        model_name = type(model).__name__
        checkpointing_chosen = None
        if auto:
            profiles, left_out = split_profiles(lambda: meta_model(args.model, task=args.task), args.seq_len,
                                                layout.precision, args.task, args.world_size, hardware.ranks_per_node)
            choice = choose_layout(profiles, layout, args.world_size, layout.micro_batch * layout.gas * layout.dp,
                                   hardware)
            print(choice.explain())
            for reason in left_out:
                print(f"  not weighed: {reason}")
            layout, checkpointing_chosen = choice.best.layout, choice.best.checkpointing
            profile = profiles[(layout.tp, layout.pp, layout.sp)]
            print(f"  in the config: {_config_keys(choice.best)}")
        else:
            profile = profile_model(model, args.seq_len, layout.precision, args.task, layout.tp, layout.pp, layout.sp)
    except (ConfigError, PlanModelError, NoLayoutFits) as error:
        print(f"zerotune plan: {error}", file=sys.stderr)
        return 2
    return print_plan(plan_from_profile(profile, layout), profile, layout, model_name, args.world_size, args.nodes,
                      args.seq_len, hardware, checkpointing_chosen)
