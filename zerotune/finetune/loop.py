"""The fine-tuning loop on the engine: train, evaluate, log, checkpoint, resume.

Every rank runs this; only rank 0 writes ``metrics.jsonl`` and shows the progress bar. The data
order depends only on the recipe's seed and the step, so a run resumed from a checkpoint sees
exactly the batches the uninterrupted run would have seen (and the checkpoint restores the RNG
streams for dropout).
"""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, Subset

from zerotune.distributed import comm
from zerotune.finetune.best import BestTracker
from zerotune.monitor.logging import log_rank0


@dataclass
class MetricsLog:
    """``metrics.jsonl``: one JSON line per optimizer step (split "step": its loss and applied lr), per train
    log window (split "train", with throughput) and per evaluation (rank 0 only); evaluations also go to the
    engine's configured writers (TensorBoard, CSV, W&B) as ``Eval/<metric>``, beside the engine's own train
    scalars."""

    path: Path | None
    writers: Any = None

    def write(self, record: dict) -> None:
        if self.path is not None:
            with open(self.path, "a") as handle:
                handle.write(json.dumps(record) + "\n")
        if self.writers is not None and self.writers.enabled and record.get("split") == "eval":
            self.writers.write(record["step"], {f"Eval/{name}": value for name, value in record.items()
                                                if name not in ("split", "step") and isinstance(value, (int, float))})
            self.writers.flush()


def train_loader(dataset: Any, collate: Callable, micro_batch: int, seed: int, rank: int, world: int) -> DataLoader:
    """Shuffled, sharded over data-parallel ranks; its own generator keeps the global RNG untouched."""
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                                          seed=seed, drop_last=True)
    return DataLoader(dataset, batch_size=micro_batch, sampler=sampler, collate_fn=collate, drop_last=True,
                      generator=torch.Generator().manual_seed(seed))


def eval_loader(dataset: Any, collate: Callable, batch: int, rank: int, world: int) -> DataLoader:
    """Every example exactly once over all ranks (no padding duplicates, unlike DistributedSampler)."""
    return DataLoader(Subset(dataset, range(rank, len(dataset), world)), batch_size=batch, collate_fn=collate)


@torch.no_grad()
def evaluate(engine: Any, loader: DataLoader, task: str, num_labels: int = 0) -> dict[str, float]:
    """Accuracy and macro-F1 (classification) or loss and perplexity (causal LM), summed over ranks."""
    was_training = engine.module.training
    engine.eval()
    device = engine.device
    if task == "sequence-classification":
        counts = torch.zeros(3, num_labels, dtype=torch.float64, device=device)  # true positives, predicted, actual
        loss_sum = torch.zeros(2, dtype=torch.float64, device=device)
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            out = engine(**batch)
            predicted, labels = out.logits.argmax(-1), batch["labels"]
            counts[0] += torch.bincount(labels[predicted == labels], minlength=num_labels)
            counts[1] += torch.bincount(predicted, minlength=num_labels)
            counts[2] += torch.bincount(labels, minlength=num_labels)
            loss_sum += torch.tensor([out.loss.item() * len(labels), len(labels)], dtype=torch.float64)
        comm.all_reduce(counts, _world(engine))
        comm.all_reduce(loss_sum, _world(engine))
        tp, predicted, actual = counts
        f1 = torch.where(predicted + actual > 0, 2 * tp / (predicted + actual).clamp(min=1), torch.zeros_like(tp))
        result = {"accuracy": (tp.sum() / actual.sum().clamp(min=1)).item(), "macro_f1": f1.mean().item(),
                  "loss": (loss_sum[0] / loss_sum[1].clamp(min=1)).item()}
    else:
        sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss x tokens, tokens
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            out = engine(**batch)
            tokens = (batch["labels"][:, 1:] != -100).sum().item()
            sums += torch.tensor([out.loss.item() * tokens, tokens], dtype=torch.float64)
        comm.all_reduce(sums, _world(engine))
        loss = (sums[0] / sums[1].clamp(min=1)).item()
        result = {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}
    if was_training:
        engine.train()
    return result


def _world(engine: Any) -> dist.ProcessGroup | None:
    return engine.mesh.group("dp")


@dataclass
class LoopSettings:
    total_steps: int
    log_every: int
    eval_every: int
    save_every: int
    checkpoint_dir: Path
    client_state: dict = field(default_factory=dict)
    exclude_frozen: bool = False
    """Save the trainable weights and a fingerprint of the frozen base, not the base (LoRA / prefix)."""
    tracker: BestTracker | None = None
    """The best evaluation so far and early stopping (``best.py``); its state rides in ``client_state``."""
    best_dir: Path | None = None
    """Where the best evaluation's checkpoint goes (tag ``best``), when the run keeps it."""
    forward_loss: Callable[[Any, dict], tuple[torch.Tensor, dict[str, float]]] | None = None
    """A micro-batch's loss and the metrics it reports (a preference objective's rewards); None: the model's
    own loss (supervised fine-tuning)."""


def model_loss(engine: Any, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
    """Supervised fine-tuning's loss: the one the model computes from the batch's labels."""
    return engine(**batch).loss, {}


def train(engine: Any, loader: DataLoader, evaluate_fn: Callable[[], dict], settings: LoopSettings,
          metrics: MetricsLog, progress: Any = None) -> dict[str, float]:
    """Run optimizer steps from ``engine.global_steps`` to ``settings.total_steps``; returns throughput figures.

    samples/s has one definition everywhere (the bar, ``metrics.jsonl``, ``summary.json``): training samples
    per second of training since this run started or resumed, evaluations, generated samples and checkpoint
    saves excluded."""
    gas = engine.gradient_accumulation_steps()
    per_epoch = len(loader)
    if per_epoch == 0:
        raise ValueError("the training set is smaller than one global micro-batch; lower train.micro_batch_size")
    consumed = engine.global_steps * gas  # micro-batches already trained on (after a resume)
    epoch, skip = divmod(consumed, per_epoch)
    sampler = loader.sampler
    if not isinstance(sampler, DistributedSampler):
        raise TypeError(f"the training loader's sampler is a {type(sampler).__name__}; train() takes the loader "
                        "train_loader() builds (a DistributedSampler, reshuffled each epoch)")
    clock = TrainingClock()
    forward_loss = settings.forward_loss or model_loss
    samples, window_loss, window_steps, step_loss = 0, 0.0, 0, 0.0
    step_metrics: dict[str, float] = {}
    engine.train()
    while engine.global_steps < settings.total_steps:
        sampler.set_epoch(epoch)
        for index, batch in enumerate(loader):
            if index < skip:
                continue
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            loss, reported = forward_loss(engine, batch)
            for name, value in reported.items():
                step_metrics[name] = step_metrics.get(name, 0.0) + value / gas
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            applied_lr = engine.get_lr()[0]  # what this step trains with (the scheduler moves on in step())
            engine.step()
            window_loss += loss.item() / gas
            step_loss += loss.item() / gas
            if not boundary:
                continue
            samples += engine.train_batch_size()
            window_steps += 1
            step = engine.global_steps
            throughput = samples / clock.training_seconds()
            metrics.write({"split": "step", "step": step, "loss": step_loss, "lr": applied_lr, **step_metrics})
            step_loss, step_metrics = 0.0, {}
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{window_loss / window_steps:.4f}", lr=f"{applied_lr:.2e}",
                                     samples_s=f"{throughput:.1f}")
            if step % settings.log_every == 0 or step == settings.total_steps:
                metrics.write({"split": "train", "step": step, "epoch": consumed_epochs(engine, per_epoch),
                               "loss": window_loss / window_steps, "lr": applied_lr,
                               "samples_per_s": throughput, "time_s": clock.training_seconds()})
                window_loss, window_steps = 0.0, 0
            with clock.paused():
                stop = False
                if settings.eval_every and step % settings.eval_every == 0 and step < settings.total_steps:
                    result = evaluate_fn()
                    metrics.write({"split": "eval", "step": step, **result})
                    stop = settings.tracker is not None and _track(engine, settings, settings.tracker, step, result)
                if not stop and settings.save_every and step % settings.save_every == 0:
                    engine.save_checkpoint(str(settings.checkpoint_dir), client_state=settings.client_state,
                                           exclude_frozen_parameters=settings.exclude_frozen)
            if stop or step >= settings.total_steps:
                break
        if settings.tracker is not None and settings.tracker.should_stop:
            break
        skip = 0
        epoch += 1
    seconds = clock.training_seconds()
    return {"samples_per_s": samples / seconds if samples else 0.0, "train_seconds": seconds}


class TrainingClock:
    """Seconds spent training: wall time since construction minus the ``paused()`` spans."""

    def __init__(self) -> None:
        self._started = time.perf_counter()
        self._paused = 0.0

    def training_seconds(self) -> float:
        return max(time.perf_counter() - self._started - self._paused, 1e-9)

    @contextmanager
    def paused(self) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - began


def _track(engine: Any, settings: LoopSettings, tracker: BestTracker, step: int, result: dict) -> bool:
    """Record an evaluation in ``tracker`` (``settings.tracker``): the best one's checkpoint is kept; True when
    early stopping ends the run."""
    improved = tracker.update(step, result)
    settings.client_state["best"] = tracker.state()
    if improved and settings.best_dir is not None:
        engine.save_checkpoint(str(settings.best_dir), tag="best", client_state=settings.client_state,
                               exclude_frozen_parameters=settings.exclude_frozen)
    if tracker.should_stop:
        log_rank0("early stopping at step %d: %s has not improved by more than %g for %d evaluations (best %.4f at "
                  "step %d)", step, tracker.metric, tracker.min_delta, tracker.patience, tracker.best,
                  tracker.best_step, rank=engine.global_rank)
    return tracker.should_stop


def consumed_epochs(engine: Any, per_epoch: int) -> float:
    return engine.global_steps * engine.gradient_accumulation_steps() / per_epoch
