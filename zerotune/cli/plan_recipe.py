"""``zerotune plan RECIPE``: per-rank memory of the job ``zerotune finetune RECIPE`` would run.

The recipe decides the model, the world size (``launch``), the engine config, the micro-batch, the
sequence length (``data.max_length``) and what trains (``method``, ``objective``); the options that mean
the same for a DeepSpeed config (--world-size, --seq-len, --zero-stage, the hardware sizes) override it,
and --set overrides recipe keys as in ``zerotune finetune``. Options a recipe decides itself are refused
rather than ignored.
"""

from __future__ import annotations

import argparse
import sys

from zerotune.config.errors import ConfigError


def run_recipe_plan(args: argparse.Namespace) -> int:
    from zerotune.cli.plan_output import parse_number, parse_size, print_plan
    from zerotune.plan.auto import Hardware
    from zerotune.plan.meta_model import PlanModelError
    from zerotune.plan.recipe_job import plan_job, recipe_job

    try:
        for option, given in (("--model", args.model), ("--task", args.task)):
            if given is not None:
                raise ConfigError(option, f"{given!r}: the recipe {args.config!r} decides it (model.name_or_path; "
                                          "task and objective.type); change the recipe or pass --set")
        if args.auto:
            raise ConfigError("--auto", "plans DeepSpeed configs only; a recipe's job is data parallel with its own "
                                        "engine section (try --zero-stage N to compare stages)")
        if args.seq_len is not None and args.seq_len < 1:
            raise ConfigError("--seq-len", f"must be >= 1, got {args.seq_len}")
        job = recipe_job(args.config, args.overrides, args.world_size, args.seq_len)
        if args.nodes < 1 or job.world_size % args.nodes:
            raise ConfigError("--nodes", f"{job.world_size} ranks cannot be spread evenly over {args.nodes} nodes")
        hardware = Hardware(device_memory=parse_size(args.device_memory, "--device-memory"),
                            flops=parse_number(args.flops, "--flops"),
                            bandwidth=parse_size(args.bandwidth, "--bandwidth"),
                            intra_node_bandwidth=parse_size(args.intra_node_bandwidth, "--intra-node-bandwidth"),
                            host_bandwidth=parse_size(args.host_bandwidth, "--host-bandwidth"),
                            host_memory=parse_size(args.host_memory, "--host-memory") if args.host_memory else None,
                            ranks_per_node=job.world_size // args.nodes)
        base = getattr(job.model, "get_base_model", None)
        model_name = type(base() if hasattr(job.model, "peft_config") and callable(base) else job.model).__name__
        plan, profile, layout = plan_job(job, args.zero_stage)
    except (ConfigError, PlanModelError) as error:
        print(f"zerotune plan: {error}", file=sys.stderr)
        return 2
    print(f"recipe {args.config}: {plan.trainable:,} trainable parameters, "
          f"{plan.frozen + job.quantized_params:,} frozen")
    for note in job.notes:
        print(f"  {note}")
    return print_plan(plan, profile, layout, model_name, job.world_size, args.nodes, job.seq_len, hardware)
