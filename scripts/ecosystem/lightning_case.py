"""PyTorch Lightning's ``DeepSpeedStrategy`` on zerotune, as far as Lightning itself goes on CPU.

    python scripts/ecosystem/lightning_case.py [--workdir DIR] [--steps N] [--line]

Lightning refuses DeepSpeed without CUDA in its own code: ``DeepSpeedStrategy.setup_environment``
(lightning/pytorch/strategies/deepspeed.py, and the same in lightning/fabric/strategies/deepspeed.py) raises
"The DeepSpeed strategy is only supported on CUDA GPUs" when the accelerator is not a ``CUDAAccelerator``,
before it makes any DeepSpeed call; no public option of Lightning's lifts it. So each ZeRO rank here

1. runs the user's ``Trainer(accelerator="cpu", devices=2, strategy=DeepSpeedStrategy(stage=N)).fit(...)``
   unchanged and records where Lightning stops (file:line of the raise, from the traceback), after the
   strategy's construction (``deepspeed`` found through its distribution metadata, Lightning's default config
   with its always-written ``activation_checkpointing`` and ``aio`` blocks, ``deepspeed.utils.logging.logger``
   level set) and the Trainer's connection of the model;
2. then takes the steps Lightning would take next on CUDA with that same strategy object:
   ``setup_distributed`` (``deepspeed.init_distributed``), ``_format_config`` (micro batch from the
   dataloader, accumulation and clipping from the Trainer), ``_setup_model_and_optimizer``
   (``deepspeed.initialize`` with Lightning's config and the module's ``configure_optimizers``),
   ``_set_deepspeed_activation_checkpointing`` (``deepspeed.checkpointing.configure``), and trains the
   LightningModule's ``training_step`` on the engine (``engine.backward`` / ``engine.step``, what Lightning's
   DeepSpeed precision plugin and optimizer wrapper call) over the loader as Lightning's fit prepares it
   for that rank (``_process_dataloader``: its shuffled DistributedSampler).

The reference is Lightning's own ``Trainer(strategy="ddp")`` run on 2 CPU ranks; losses compared at 1e-5.
The GPU form (the unchanged ``Trainer.fit``) is benchmarks/gpu_ecosystem.py's Lightning section.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import case_parser, drive, print_row, progress, summarize  # noqa: E402

METHODS = ("fit",)
BATCH, SAMPLES = 4, 32


def build(steps: int, accelerator: str = "cpu", devices: int = 2):
    """The user's code: a LightningModule (recording its per-step losses), its data, its Trainer kwargs."""
    import lightning.pytorch as pl
    import torch

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.0)

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 8, generator=generator)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    trainer_kwargs = dict(accelerator=accelerator, devices=devices, num_nodes=1, max_steps=steps, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return Regressor(), loader, trainer_kwargs


def _where(error: BaseException) -> str:
    """file:line (inside the lightning package) of the frame that raised, with the message."""
    frame = traceback.extract_tb(error.__traceback__)[-1]
    path = frame.filename
    if "/lightning/" in path:
        path = "lightning/" + path.rsplit("/lightning/", 1)[1]
    return f"{path}:{frame.lineno} {type(error).__name__}: {str(error).splitlines()[0]}"


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch

    module, loader, kwargs = build(args.steps, args.accelerator, args.devices)
    row: dict = {"mode": args.mode, "engines": {}}
    if args.mode == "ddp":
        progress("ddp: Trainer(strategy='ddp').fit")
        trainer = pl.Trainer(strategy="ddp", **kwargs)
        trainer.fit(module, loader)
        rank = trainer.global_rank
    else:
        from lightning.pytorch.strategies import DeepSpeedStrategy

        stage = int(args.mode.removeprefix("zero"))
        strategy = DeepSpeedStrategy(stage=stage)  # Lightning's default config: activation_checkpointing block
        row["config_blocks"] = sorted(strategy.config)
        trainer = pl.Trainer(strategy=strategy, **kwargs)
        progress(f"{args.mode}: Trainer(strategy=DeepSpeedStrategy(stage={stage})).fit, unchanged")
        try:
            trainer.fit(module, loader)
            row["stop"] = None  # Lightning ran DeepSpeed on CPU: nothing more to do
        except RuntimeError as error:
            row["stop"] = _where(error)
        if row["stop"] is not None:
            progress(f"{args.mode}: the strategy's next steps by hand")
            try:  # setup_distributed: a second CUDA assumption (CPU devices have no index) ahead of init_distributed
                strategy.setup_distributed()
            except RuntimeError as error:
                row["stop2"] = _where(error)
                strategy.set_world_ranks()  # what setup_distributed does past that check
                strategy._init_deepspeed_distributed()  # deepspeed.init_distributed
            strategy._init_config_if_needed()
            row["config"] = {k: strategy.config[k] for k in ("train_micro_batch_size_per_gpu",
                                                             "gradient_accumulation_steps", "gradient_clipping")}
            optimizer = module.configure_optimizers()
            engine, _ = strategy._setup_model_and_optimizer(module, optimizer)
            strategy._set_deepspeed_activation_checkpointing()
            rank = strategy.global_rank
            # the loader as Lightning's fit prepares it for this rank (its DistributedSampler, shuffled, seed 0)
            from lightning.pytorch.trainer.connectors.data_connector import _process_dataloader
            from lightning.pytorch.trainer.states import RunningStage, TrainerFn

            batches = iter(_process_dataloader(trainer, TrainerFn.FITTING, RunningStage.TRAINING, loader))
            for step in range(args.steps):
                loss = module.training_step(next(batches), step)
                engine.backward(loss)
                engine.step()
            row["engines"]["fit"] = f"{type(engine).__module__}.{type(engine).__name__}"
        else:
            rank = trainer.global_rank
    everyone = [module.losses]  # each rank's own losses (its own batches)
    if torch.distributed.is_initialized():
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, module.losses)
    row = {"rank": rank, **row, "losses": {f"fit rank {r}": losses for r, losses in enumerate(everyone)}}
    if args.out and row.get("stop") is not None and rank == 0:  # for the driver's line
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "stop.json").write_text(json.dumps({k: row.get(k) for k in ("stop", "stop2", "config_blocks",
                                                                                     "config")}))
    print_row(row)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def line(summary: dict) -> str:
    """scripts/ecosystem_check.sh's line: where Lightning stops, then the ZeRO runs past that point."""
    stop = summary.get("stop")
    stop2 = next(iter(summary.get("stops", {}).values()), {}).get("stop2")
    head = f"{summary['tool']} {summary['version']}: "
    if stop:
        head += (f"Trainer(strategy=DeepSpeedStrategy) on CPU stops in Lightning's own CUDA check before any DeepSpeed "
                 f"call ({stop}; same in lightning/fabric/strategies/deepspeed.py)"
                 + (f", and setup_distributed in a second one ({stop2.split(':', 2)[0]}:{stop2.split(':', 2)[1]}: CPU "
                    f"devices have no index)" if stop2 else "")
                 + "; past them, the strategy's init_distributed + config + deepspeed.initialize + checkpointing.configure: ")
    return head + summarize(summary).split(": ", 1)[1].replace("non-DeepSpeed", "Lightning DDP")


def main() -> None:
    parser = case_parser(__doc__, METHODS)
    parser.add_argument("--accelerator", default="cpu", help="(worker) the Trainer's; cuda: benchmarks/gpu_ecosystem.py")
    parser.add_argument("--devices", type=int, default=2, help="(worker) the Trainer's")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    import lightning

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="zerotune-lightning-"))
    workdir.mkdir(parents=True, exist_ok=True)
    summary = drive("lightning", lightning.__version__, Path(__file__).resolve(), METHODS,
                    lambda directory: ["--steps", str(args.steps)], workdir, args.timeout)
    stops = {mode: json.loads((workdir / mode / "stop.json").read_text())
             for mode in ("zero2", "zero3") if (workdir / mode / "stop.json").exists()}
    summary["stops"] = stops
    summary["stop"] = next(iter(stops.values()), {}).get("stop")
    (workdir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(line(summary) if args.line else json.dumps(summary))


if __name__ == "__main__":
    main()
