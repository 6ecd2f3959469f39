"""One rank of ``zerotune finetune``: recipe -> model + data -> engine -> train -> evaluate -> save.

Started by the ``zerotune finetune`` launcher (through torchrun's API) or directly under
torchrun: ``torchrun --nproc_per_node 2 -m zerotune.finetune.worker RECIPE --output-dir DIR``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch

import zerotune
from zerotune.distributed import comm
from zerotune.finetune import loop
from zerotune.finetune.arguments import add_arguments, resolve_output_dir
from zerotune.finetune.best import BEST_DIR, BestTracker, evaluation_kind, tracker_for
from zerotune.finetune.console import quiet_libraries
from zerotune.finetune.interrupt import CHECKPOINTS, leave_quietly_on_interrupt
from zerotune.finetune.models import (
    apply_method,
    enable_gradient_checkpointing,
    load_model,
    load_tokenizer,
    resolve_model_path,
    save_trained_model,
    trainable_summary,
)
from zerotune.finetune.neftune import activate_neftune
from zerotune.finetune.packing import (
    pack_examples,
    packed_collator,
    prepare_for_packing,
)
from zerotune.finetune.preference.objective import PreferenceObjective, precompute_reference
from zerotune.finetune.preference.pairs import preference_prompts
from zerotune.finetune.recipe import RecipeError, load_recipe, recipe_engine_config
from zerotune.finetune.recipe_engine import fit_engine_to_run
from zerotune.finetune.samples import EvalSamples, sample_conversations
from zerotune.finetune.task_data import check_recipe_inputs, load_task_data
from zerotune.finetune.tokenization import make_collator
from zerotune.monitor.logging import log_rank0

SAMPLES = "samples.jsonl"


def _total_steps(recipe, batches_per_epoch: int) -> int:
    train = recipe.train
    if train.max_steps:
        return int(train.max_steps)
    return max(1, math.ceil(train.epochs * batches_per_epoch / train.gradient_accumulation_steps))


def check_merge(recipe, merge: bool) -> None:
    """``--merge`` merges LoRA-family adapters into their base; prefix tuning has nothing to merge (its
    virtual tokens are inputs, not weights) and full / freeze tuning already saves the whole model."""
    if not merge:
        return
    if recipe.method.type == "prefix":
        raise RecipeError("--merge", "prefix tuning learns virtual tokens that are fed as inputs, not weights that "
                                     "can be merged into the base; drop --merge (the run saves OUTPUT/adapter, which "
                                     "zerotune generate loads over its base)")
    if recipe.method.type in ("full", "freeze"):
        log_rank0("--merge has no effect on a %s run: it saves the whole model (OUTPUT/model)", recipe.method.type,
                  rank=int(os.environ.get("RANK", "0") or 0))


HEADLINES = {"causal-lm": ("eval_loss", "loss", "answer loss"), "sequence-classification": ("accuracy", "accuracy",
             "accuracy"), "preference": ("reward_margin", "reward_margin", "reward margin"),
             "kto": ("reward_margin", "reward_margin", "reward margin"),
             "reward": ("reward_accuracy", "reward_accuracy", "pair accuracy")}
"""Per evaluation kind: the name ``summary.json`` gives its one before / after number, the eval metric it is,
and how the closing line calls it."""


def run(args: argparse.Namespace) -> dict:
    # a launcher restart after a rank died (zerotune run --max-restarts / the recipe's launch.max_restarts)
    # continues from the newest checkpoint, as --resume does
    args.resume = args.resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    quiet_libraries(int(os.environ.get("RANK", "0") or 0))
    recipe = load_recipe(args.recipe, args.overrides)
    resolve_output_dir(args)
    check_merge(recipe, args.merge)
    check_recipe_inputs(recipe)
    env = zerotune.init_distributed()
    output = Path(args.output_dir)
    if env.rank == 0:
        output.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", SAMPLES):
            if not args.resume and (output / name).exists():
                (output / name).unlink()
    comm.barrier()
    torch.manual_seed(recipe.train.seed)
    model_path = resolve_model_path(recipe.model.name_or_path)
    tokenizer = load_tokenizer(model_path, recipe.model.trust_remote_code)
    train_set, eval_set, label_names, eval_rows = load_task_data(recipe, tokenizer)
    bits = recipe.method.bits if recipe.method.type == "qlora" else None
    objective_type = recipe.objective.type
    # a reward model is the causal LM's body under a one-output sequence-classification head
    model_task = "sequence-classification" if objective_type == "reward" else recipe.task
    model = load_model(model_path, model_task, 1 if objective_type == "reward" else len(label_names), label_names,
                       quantize_bits=bits, dtype=recipe.model.dtype, trust_remote_code=recipe.model.trust_remote_code)
    if objective_type == "reward":
        model.config.pad_token_id = tokenizer.pad_token_id  # the head scores each sequence's last real token
    if recipe.data.packing:
        prepare_for_packing(model)
        unpacked = len(train_set)
        train_set = pack_examples(train_set, recipe.data.max_length)
        log_rank0("data.packing: %d training examples in %d rows of up to %d tokens", unpacked, len(train_set),
                  recipe.data.max_length, rank=env.rank)
    model = apply_method(model, model_task, recipe.method)
    if recipe.train.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if recipe.train.neftune_noise_alpha is not None:
        activate_neftune(model, recipe.train.neftune_noise_alpha)
        log_rank0("NEFTune: noise alpha %g on the input embeddings while training", recipe.train.neftune_noise_alpha,
                  rank=env.rank)
    log_rank0("model %s: %s", model_path.name, trainable_summary(model), rank=env.rank)
    counts = (sum(p.numel() for p in model.parameters() if p.requires_grad), sum(p.numel() for p in model.parameters()))

    objective = None if objective_type == "sft" else PreferenceObjective.from_recipe(recipe.objective, model)
    collate = objective.collator(tokenizer.pad_token_id) if objective else make_collator(tokenizer, recipe.task)
    world = env.world_size
    train_collate = packed_collator(tokenizer.pad_token_id) if recipe.data.packing else collate
    loader = loop.train_loader(train_set, train_collate, recipe.train.micro_batch_size, recipe.train.seed, env.rank,
                               world)
    total_steps = _total_steps(recipe, len(loader))
    config = recipe_engine_config(recipe, total_steps=total_steps, dp_world_size=world)
    fit_engine_to_run(config, str(output))
    engine, *_ = zerotune.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                     config=config)
    if objective is not None and objective.precomputes_reference:
        log_rank0("objective %s: computing the reference model's log-probs once (%d train + %d eval rows)",
                  objective_type, len(train_set), len(eval_set), rank=env.rank)
        train_set = precompute_reference(engine, objective, train_set, tokenizer.pad_token_id,
                                         2 * recipe.train.micro_batch_size)
        eval_set = precompute_reference(engine, objective, eval_set, tokenizer.pad_token_id,
                                        2 * recipe.train.micro_batch_size)
        loader = loop.train_loader(train_set, train_collate, recipe.train.micro_batch_size, recipe.train.seed,
                                   env.rank, world)
    evaluation = loop.eval_loader(eval_set, collate, 2 * recipe.train.micro_batch_size, env.rank, world)

    samples = None
    if recipe.task == "causal-lm" and objective_type != "reward" and (recipe.train.eval_samples
                                                                      or recipe.train.sample_prompts):
        conversations = (sample_conversations(eval_rows, recipe.train.sample_prompts, recipe.train.eval_samples)
                         if objective is None else preference_prompts(eval_rows, recipe.train.sample_prompts,
                                                                      recipe.train.eval_samples))
        samples = EvalSamples(conversations, tokenizer, recipe.train.sample_max_new_tokens,
                              output / SAMPLES if env.rank == 0 else None)

    def evaluate() -> dict:
        if objective is not None:
            result = objective.evaluate(engine, evaluation)
        else:
            result = loop.evaluate(engine, evaluation, recipe.task, len(label_names))
        if samples is not None:
            samples(engine, engine.global_steps)
        return result

    metrics = loop.MetricsLog(output / "metrics.jsonl" if env.rank == 0 else None, engine.monitor)
    checkpoint_dir = output / CHECKPOINTS
    kind = evaluation_kind(recipe)
    tracker = tracker_for(kind, recipe.train)
    before = None
    if args.resume:
        path, client_state = engine.resume_newest_checkpoint(str(checkpoint_dir))
        if path is None:
            log_rank0("--resume: no complete checkpoint in %s, starting from scratch", checkpoint_dir, rank=env.rank)
        else:
            assert client_state is not None  # (None only where no checkpoint was found)
            before = client_state["before"]
            if tracker is not None and client_state.get("best"):
                tracker = BestTracker(**client_state["best"])
            log_rank0("resumed from %s at step %d", path, engine.global_steps, rank=env.rank)
    if before is None:
        before = evaluate()
        metrics.write({"split": "eval", "step": 0, **before})
    started = time.perf_counter()
    progress = None
    if env.rank == 0:
        from tqdm import tqdm

        progress = tqdm(total=total_steps, initial=engine.global_steps, desc="finetune", unit="step",
                        file=sys.stderr, dynamic_ncols=True)
    settings = loop.LoopSettings(total_steps, recipe.train.log_every, recipe.train.eval_every, recipe.train.save_every,
                                 checkpoint_dir, client_state={"before": before},
                                 exclude_frozen=any(not p.requires_grad for p in model.parameters()), tracker=tracker,
                                 best_dir=output / BEST_DIR if recipe.train.load_best_model_at_end else None,
                                 forward_loss=objective.loss if objective is not None else None)
    throughput = loop.train(engine, loader, evaluate, settings, metrics, progress)
    if progress is not None:
        progress.close()
    after = evaluate()
    metrics.write({"split": "eval", "step": engine.global_steps, **after})
    policy = {}
    if tracker is not None:
        stopped_early = tracker.should_stop
        last_is_best = tracker.update(engine.global_steps, after)
        if recipe.train.load_best_model_at_end and not last_is_best:
            engine.load_checkpoint(str(output / BEST_DIR), tag="best", load_optimizer_states=False,
                                   load_lr_scheduler_states=False, load_module_only=True)
            after = evaluate()
            log_rank0("load_best_model_at_end: the model of step %d (%s %.4f) is the run's result", tracker.best_step,
                      tracker.metric, tracker.best, rank=env.rank)
        policy = {"best_step": tracker.best_step, "best_metric": {tracker.metric: tracker.best},
                  "stopped_early": stopped_early, "result_is_best_model": recipe.train.load_best_model_at_end}
    peaks = comm.all_gather_object(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, engine.mesh.group("dp"))
    model_state = comm.all_gather_object(sum(engine.memory_breakdown().values()) / 2**20, engine.mesh.group("dp"))
    metric, eval_metric, headline = HEADLINES[kind]
    summary = {"metric": metric, "before": before[eval_metric], "after": after[eval_metric],
               "before_eval": before, "after_eval": after, "steps": engine.global_steps,
               "wall_seconds": time.perf_counter() - started, "samples_per_s": throughput["samples_per_s"],
               "peak_memory_mib_per_rank": peaks, "model_state_mib_per_rank": model_state,
               "trainable_parameters": counts[0], "total_parameters": counts[1],
               "train_seconds": throughput["train_seconds"], "task": recipe.task, "method": recipe.method.type,
               "model": recipe.model.name_or_path, "zero_stage": engine.zero_optimization_stage(),
               "objective": objective_type,
               "quantize_bits": bits, **policy}
    save_trained_model(engine, tokenizer, output, merge=args.merge, base_name=recipe.model.name_or_path)
    if env.rank == 0:
        (output / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"{headline} on the held-out split: {summary['before']:.3f} before -> {summary['after']:.3f} after "
              f"{summary['steps']} steps ({summary['wall_seconds']:.0f} s); model and metrics in {output}")
    comm.barrier()  # no rank leaves (and tears down its process group) while rank 0 is still writing
    engine.destroy()
    return summary


def main(argv: list[str] | None = None) -> int:
    args = add_arguments(argparse.ArgumentParser(prog="zerotune.finetune.worker")).parse_args(argv)
    if args.preview is not None:  # started under torchrun with --preview: rank 0 previews, no rank trains
        if int(os.environ.get("RANK", "0") or 0) == 0:
            from zerotune.finetune.preview import run_preview

            run_preview(load_recipe(args.recipe, args.overrides), args.preview)
        return 0
    resolve_output_dir(args)
    leave_quietly_on_interrupt(args, int(os.environ.get("RANK", "0") or 0))
    run(args)  # init_distributed tears its process group down at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
