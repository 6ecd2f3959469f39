"""Ray Train on zerotune: a ``TorchTrainer`` whose ``train_loop_per_worker`` calls ``deepspeed.initialize``
(the shape of Ray's DeepSpeed examples: optimizer in the DeepSpeed config, ``engine.backward`` /
``engine.step``) trains the tiny Llama on 2 CPU Ray workers at ZeRO 2 and ZeRO 3, and every step's loss
(averaged over the workers) equals the same loop with plain DDP (``ray.train.torch.prepare_model``,
``torch.optim.AdamW``) to 1e-5. Ray's workers are processes Ray starts itself: ``import deepspeed``
resolves there only through the persistent alias (``zerotune deepspeed-alias install``'s .pth), which is
what this checks.

    python scripts/ecosystem/ray_case.py [--workdir DIR] [--steps N]

prints one JSON summary line (scripts/ecosystem/common.py ``drive``); ``--line`` prints the one-line form
that scripts/ecosystem_check.sh shows. Each mode is one local Ray instance (``ray.init(num_cpus=2,
include_dashboard=False)`` on 127.0.0.1), shut down after the run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import case_parser, drive_and_print, make_tiny_llama, one_process, print_row, progress  # noqa: E402

METHODS = ("train",)
LR = 1e-3
MICRO_BATCH = 2
TEXTS = [f"what color is the {thing} the {thing} is {color}" for thing, color in
         [("sky", "blue"), ("grass", "green"), ("snow", "white"), ("coal", "black"), ("sun", "yellow"),
          ("blood", "red")] * 4]


def ds_config(stage: int) -> dict:
    """Ray's DeepSpeed examples hand deepspeed.initialize a config like this one (fp32 here: the comparison is
    at 1e-5; the optimizer matches the DDP loop's torch.optim.AdamW)."""
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": 0.0}},
            "bf16": {"enabled": False}, "fp16": {"enabled": False},
            "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
            "steps_per_print": 1000}


def train_loop_per_worker(config: dict) -> None:
    """One Ray worker (a process Ray started): the tiny Llama, this worker's shard of the data, STEPS steps."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ray.train
    import ray.train.torch

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(config["model"])
    encoded = tokenizer(TEXTS, padding="max_length", max_length=12, truncation=True, return_tensors="pt")
    rows = [{"input_ids": ids, "attention_mask": mask} for ids, mask in
            zip(encoded["input_ids"], encoded["attention_mask"])]
    # prepare_data_loader: a DistributedSampler over the workers (no shuffling: the same order in every mode)
    loader = ray.train.torch.prepare_data_loader(DataLoader(rows, batch_size=MICRO_BATCH, shuffle=False))
    model = AutoModelForCausalLM.from_pretrained(config["model"], dtype=torch.float32)
    engine_name = ""
    if config["mode"] == "ddp":
        model = ray.train.torch.prepare_model(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    else:
        import deepspeed  # resolves to zerotune in Ray's worker processes only through the alias's .pth

        model, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                      config=ds_config(int(config["mode"].removeprefix("zero"))))
        engine_name = f"{type(model).__module__}.{type(model).__name__}"
    losses = []
    batches = iter(loader)
    for _ in range(config["steps"]):
        batch = next(batches)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
        if config["mode"] == "ddp":
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        else:
            model.backward(loss)
            model.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    rank = ray.train.get_context().get_world_rank()
    row = {"rank": rank, "mode": config["mode"], "losses": {"train": losses},
           "engines": {"train": engine_name} if engine_name else {},
           "deepspeed": sys.modules["deepspeed"].__file__ if "deepspeed" in sys.modules else None}
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(row))


def worker(args: argparse.Namespace) -> None:
    """One mode: a local Ray instance, a TorchTrainer on 2 CPU workers, then the workers' rows."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    progress(f"{args.mode}: starting Ray")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=True,
             configure_logging=False)
    try:
        progress(f"{args.mode}: training")
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"model": args.model, "mode": args.mode, "steps": args.steps, "out": str(out)},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name=args.mode, storage_path=str(out / "ray_results")))
        trainer.fit()
    finally:
        ray.shutdown()
    for rank in range(2):
        print_row(json.loads((out / f"rank{rank}.json").read_text()))


def main() -> None:
    args = case_parser(__doc__, METHODS).parse_args()
    if args.worker:
        worker(args)
        return

    import ray

    def prepare(directory: Path) -> list[str]:
        model = make_tiny_llama(directory / "tiny-llama")
        return ["--model", str(model), "--steps", str(args.steps)]

    drive_and_print("ray", ray.__version__, args, Path(__file__).resolve(), METHODS, prepare,
                    launch=one_process)  # Ray starts the workers itself


if __name__ == "__main__":
    main()
