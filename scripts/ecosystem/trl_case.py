"""TRL on zerotune: SFTTrainer, DPOTrainer (with its reference model, which TRL's ``prepare_deepspeed`` hands
to ``deepspeed.initialize``) and GRPOTrainer (online: generation under ``unwrap_model_for_generation``, a
tiny reward function, a KL reference model) train on 2 CPU ranks with ``deepspeed=`` ZeRO 2 and ZeRO 3
configs, and every logged training loss equals TRL's own non-DeepSpeed run (DDP on 2 ranks, fp32) to 1e-5.

    python scripts/ecosystem/trl_case.py [--workdir DIR] [--methods sft,dpo,grpo] [--steps N]

prints one JSON summary line (scripts/ecosystem/common.py ``drive``); ``--line`` prints the one-line form
that scripts/ecosystem_check.sh shows. TRL's code runs unchanged: the worker only builds the configs,
datasets and trainers as a TRL user would and passes ``deepspeed=<dict>`` in the TRL config; TRL's other
defaults stay (gradient checkpointing on; at ZeRO 3 the policy and reference models load under zero.Init).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import case_parser, deepspeed_config, drive_and_print, make_tiny_llama, print_row, progress  # noqa: E402

METHODS = ("sft", "dpo", "grpo")


def _common_args(mode: str, out: Path, steps: int) -> dict:
    """What every TRL config here shares: fp32, CPU, same seed and data order, a loss logged every step."""
    return dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=steps,
                learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, logging_steps=1,
                save_strategy="no", report_to=[], seed=0, data_seed=0, use_cpu=True, bf16=False, fp16=False,
                disable_tqdm=True, deepspeed=deepspeed_config(mode), dataloader_drop_last=True)


def _sft(model: str, mode: str, out: Path, steps: int):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    texts = [f"what color is the {thing} the {thing} is {color}" for thing, color in
             [("sky", "blue"), ("grass", "green"), ("snow", "white"), ("coal", "black"), ("sun", "yellow")] * 4]
    config = SFTConfig(**_common_args(mode, out, steps), max_length=24)
    return SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"text": texts}))


def _dpo(model: str, mode: str, out: Path, steps: int):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    pairs = [("sky", "blue", "green"), ("grass", "green", "white"), ("snow", "white", "black"),
             ("coal", "black", "yellow"), ("sun", "yellow", "blue")] * 4
    data = Dataset.from_dict({"prompt": [f"what color is the {thing}" for thing, _, _ in pairs],
                              "chosen": [f" the {thing} is {good}" for thing, good, _ in pairs],
                              "rejected": [f" the {thing} is {bad}" for thing, _, bad in pairs]})
    # ref_model=None: TRL builds the reference from the policy's path and, under DeepSpeed, prepares it
    # with trl.models.utils.prepare_deepspeed (deepspeed.initialize with dotted zero_optimization.* keys at ZeRO 3)
    config = DPOConfig(**_common_args(mode, out, steps), max_length=24, beta=0.1)
    return DPOTrainer(model=model, args=config, train_dataset=data)


def _color_reward(completions, **kwargs) -> list[float]:
    """A tiny reward: colour words are good, long answers are not."""
    colors = {"blue", "green", "white", "black", "yellow"}
    return [sum(word in colors for word in c.split()) - 0.1 * len(c.split()) for c in completions]


def _grpo(model: str, mode: str, out: Path, steps: int):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    prompts = [f"what color is the {thing}" for thing in ("sky", "grass", "snow", "coal", "sun")] * 4
    # beta > 0: a KL reference model, prepared through prepare_deepspeed like DPO's. entropy_coef > 0 keeps the
    # loss away from zero: on-policy with equal-length completions the policy term is a sum of advantages
    # that cancel (~1e-8 of float noise, which no relative comparison can judge)
    config = GRPOConfig(**_common_args(mode, out, steps), num_generations=4, max_completion_length=6, beta=0.1,
                        entropy_coef=0.01, use_vllm=False)
    return GRPOTrainer(model=model, reward_funcs=_color_reward, args=config,
                       train_dataset=Dataset.from_dict({"prompt": prompts}))


BUILDERS = {"sft": _sft, "dpo": _dpo, "grpo": _grpo}
ONLINE = ("grpo",)


def _engine_name(module) -> str:
    return f"{type(module).__module__}.{type(module).__name__}"


def worker(args: argparse.Namespace) -> None:
    import torch

    losses, engines = {}, {}
    for method in args.methods.split(","):
        progress(f"{args.mode} {method}: building the trainer")
        trainer = BUILDERS[method](args.model, args.mode, Path(args.out) / method, args.steps)
        progress(f"{args.mode} {method}: training")
        trainer.train()
        losses[method] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        if method in ONLINE:  # the same completions were sampled: the same rewards
            losses[f"{method} reward"] = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
        if trainer.is_deepspeed_enabled:
            engines[method] = _engine_name(trainer.model_wrapped)
            ref = getattr(trainer, "ref_model", None)
            if ref is not None:
                engines[f"{method}_ref"] = _engine_name(ref)
        del trainer
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    print_row({"rank": rank, "mode": args.mode, "losses": losses, "engines": engines})
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main() -> None:
    args = case_parser(__doc__, METHODS).parse_args()
    if args.worker:
        worker(args)
        return

    import trl

    def prepare(directory: Path) -> list[str]:
        model = make_tiny_llama(directory / "tiny-llama")
        return ["--model", str(model), "--methods", args.methods, "--steps", str(args.steps)]

    drive_and_print("trl", trl.__version__, args, Path(__file__).resolve(), tuple(args.methods.split(",")), prepare)


if __name__ == "__main__":
    main()
