"""One training objective per preference method: the loss of a batch through the engine, the reference
model, and the evaluation metrics.

**The reference model.** DPO and KTO measure the policy against the model they started from. With an
adapter (LoRA / QLoRA / prefix) that model *is* the frozen base: its log-probs come from the same engine
with the adapter switched off (peft's ``disable_adapter``), so there is no second copy at any ZeRO stage.
Full and freeze fine-tuning change the base itself; there the reference log-probs are computed once,
before the first step, by the engine's own forward over the train and eval sets (``precompute_reference``)
and carried in the batches -- the model at step 0 *is* the reference, so this is exact, costs one
no-grad pass instead of a frozen copy's memory (a copy sharded like the policy at stage 3 would double the
parameter memory for the whole run), and works unchanged at every ZeRO stage. ORPO, SimPO and
reference-free DPO have no reference.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager

import datasets
import torch

from zerotune.distributed import comm
from zerotune.finetune.preference import losses
from zerotune.finetune.preference.batches import paired_collator, unpaired_collator


@dataclass
class PreferenceObjective:
    """The recipe's ``objective`` section bound to a model: ``loss(engine, batch)`` and ``evaluate``."""

    kind: str
    beta: float = 0.1
    dpo_loss: str = "sigmoid"
    reference_free: bool = False
    label_smoothing: float = 0.0
    gamma: float = 0.5
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    center_rewards_coefficient: float | None = None
    adapter_reference: bool = False
    """The reference is the engine's model with its peft adapter disabled (else: precomputed log-probs)."""

    @classmethod
    def from_recipe(cls, section: Any, model: Any) -> PreferenceObjective:
        beta = section.effective_beta() if section.type != "reward" else 0.0
        return cls(kind=section.type, beta=beta, dpo_loss=section.loss, reference_free=section.reference_free,
                   label_smoothing=section.label_smoothing, gamma=section.gamma,
                   desirable_weight=section.desirable_weight, undesirable_weight=section.undesirable_weight,
                   center_rewards_coefficient=section.center_rewards_coefficient,
                   adapter_reference=hasattr(model, "peft_config"))

    @property
    def needs_reference(self) -> bool:
        return self.kind == "kto" or (self.kind == "dpo" and not self.reference_free)

    @property
    def precomputes_reference(self) -> bool:
        return self.needs_reference and not self.adapter_reference

    def collator(self, pad_id: int) -> Any:
        return unpaired_collator(pad_id) if self.kind == "kto" else paired_collator(pad_id)

    # --- the loss of one micro-batch -------------------------------------------------------------

    def loss(self, engine: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """The batch's loss (to back-propagate) and its reward metrics."""
        result = self.batch_loss(engine, batch)
        chosen, rejected = result.chosen_rewards, result.rejected_rewards
        metrics = {}
        if len(chosen) and len(rejected):
            metrics["reward_margin"] = (chosen.mean() - rejected.mean()).item()
        if self.kind != "kto" and len(chosen):
            metrics["reward_accuracy"] = (chosen > rejected).float().mean().item()
        return result.loss, metrics

    def batch_loss(self, engine: Any, batch: dict[str, torch.Tensor]) -> losses.PreferenceLoss:
        if self.kind == "reward":
            scores = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
            chosen, rejected = scores.float().chunk(2)
            return losses.reward_model_loss(chosen, rejected,
                                            center_rewards_coefficient=self.center_rewards_coefficient)
        if self.kind == "kto":
            return self._kto(engine, batch)
        reference = self._paired_reference(engine, batch)
        per_token, completion, real = token_logps(engine, batch)
        chosen_logps, rejected_logps = (per_token * completion).sum(-1).chunk(2)
        chosen_counts, rejected_counts = completion.sum(-1).chunk(2)
        if self.kind == "dpo":
            ref_chosen, ref_rejected = reference
            return losses.dpo_loss(chosen_logps, rejected_logps, ref_chosen, ref_rejected, beta=self.beta,
                                   loss_type=self.dpo_loss, label_smoothing=self.label_smoothing,
                                   chosen_lengths=chosen_counts, rejected_lengths=rejected_counts)
        chosen_avg = chosen_logps / chosen_counts.clamp(min=1)
        rejected_avg = rejected_logps / rejected_counts.clamp(min=1)
        if self.kind == "orpo":
            # ORPO's language-model term, as TRL computes it: the token-mean NLL of the chosen sequences,
            # prompt included
            chosen_tokens, chosen_real = per_token.chunk(2)[0], real.chunk(2)[0]
            chosen_nll = -chosen_tokens.sum() / chosen_real.sum().clamp(min=1)
            return losses.orpo_loss(chosen_avg, rejected_avg, chosen_nll, beta=self.beta)
        return losses.simpo_loss(chosen_avg, rejected_avg, beta=self.beta, gamma=self.gamma,
                                 label_smoothing=self.label_smoothing)

    def _paired_reference(self, engine: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = batch["input_ids"].shape[0] // 2
        if self.kind != "dpo":
            return torch.zeros(0), torch.zeros(0)
        if self.reference_free:
            zeros = torch.zeros(rows, device=batch["input_ids"].device)
            return zeros, zeros
        if "ref_chosen_logps" in batch:
            return batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        with torch.no_grad(), self._reference_model(engine):
            logps, _ = sequence_logps(engine, batch)
        chosen, rejected = logps.chunk(2)
        return chosen, rejected

    def _kto(self, engine: Any, batch: dict[str, torch.Tensor]) -> losses.PreferenceLoss:
        mismatched = {key[3:]: value for key, value in batch.items() if key.startswith("kl_")}
        if "ref_logps" in batch:
            ref_logps, ref_kl_logps = batch["ref_logps"], batch["ref_kl_logps"]
        else:
            with torch.no_grad(), self._reference_model(engine):
                ref_logps, _ = sequence_logps(engine, batch)
                ref_kl_logps, _ = sequence_logps(engine, mismatched)
        with torch.no_grad():
            kl_logps, _ = sequence_logps(engine, mismatched)
        kl = losses.kto_reference_point(kl_logps, ref_kl_logps)
        kl = _mean_over_ranks(kl, engine).clamp(min=0)
        logps, _ = sequence_logps(engine, batch)
        return losses.kto_loss(logps, ref_logps, batch["label"], kl, beta=self.beta,
                               desirable_weight=self.desirable_weight, undesirable_weight=self.undesirable_weight)

    def _reference_model(self, engine: Any) -> ContextManager[Any]:
        return engine.module.disable_adapter() if self.adapter_reference else nullcontext()

    # --- evaluation ------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, engine: Any, loader: Any) -> dict[str, float]:
        """Loss, mean chosen / rejected rewards, their margin and (paired methods) the share of pairs whose
        chosen answer earns the higher reward, over the whole eval set (summed over ranks)."""
        was_training = engine.module.training
        engine.eval()
        # loss x rows, rows, chosen reward sum, chosen count, rejected reward sum, rejected count, correct pairs
        sums = torch.zeros(7, dtype=torch.float64, device=engine.device)
        for batch in loader:
            batch = {key: value.to(engine.device) for key, value in batch.items()}
            scored = self.batch_loss(engine, batch)
            chosen, rejected = scored.chosen_rewards, scored.rejected_rewards
            rows = len(chosen) + (len(rejected) if self.kind == "kto" else 0)
            correct = (chosen > rejected).sum().item() if self.kind != "kto" else 0
            sums += torch.tensor([scored.loss.item() * rows, rows, chosen.sum().item(), len(chosen),
                                  rejected.sum().item(), len(rejected), correct],
                                 dtype=torch.float64, device=engine.device)
        comm.all_reduce(sums, engine.mesh.group("dp"))
        loss_sum, rows, chosen_sum, chosen_count, rejected_sum, rejected_count, correct = sums.tolist()
        chosen_mean = chosen_sum / max(chosen_count, 1)
        rejected_mean = rejected_sum / max(rejected_count, 1)
        result = {"loss": loss_sum / max(rows, 1), "chosen_reward": chosen_mean, "rejected_reward": rejected_mean,
                  "reward_margin": chosen_mean - rejected_mean}
        if self.kind != "kto":
            result["reward_accuracy"] = correct / max(chosen_count, 1)
        if was_training:
            engine.train()
        return result


def sequence_logps(engine: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's summed log-probability of its answer tokens (``completion_mask``) under the engine's
    model, and the number of those tokens."""
    logps, completion, _ = token_logps(engine, batch)
    return (logps * completion).sum(-1), completion.sum(-1)


def token_logps(engine: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position ``t``, the log-probability of token ``t + 1`` (fp32, from the logits: one gather and one
    logsumexp, no full log-softmax copy of the vocabulary), with the answer-token mask and the real-token
    mask of the predicted positions (both 0 / 1 floats)."""
    ids = batch["input_ids"]
    logits = engine(input_ids=ids, attention_mask=batch["attention_mask"]).logits
    logits = logits[:, -ids.shape[1]:-1].float()  # prompt-learning adapters prepend virtual positions
    targets = ids[:, 1:]
    logps = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    completion = batch["completion_mask"][:, 1:].to(logps.dtype)
    real = batch["attention_mask"][:, 1:].to(logps.dtype)
    return torch.where(real.bool(), logps, torch.zeros_like(logps)), completion, real


def _mean_over_ranks(value: torch.Tensor, engine: Any) -> torch.Tensor:
    world = engine.mesh.size("dp")
    if world <= 1:
        return value
    total = value.detach().clone().reshape(1)
    comm.all_reduce(total, engine.mesh.group("dp"))
    return (total / world).reshape(())


@torch.no_grad()
def precompute_reference(engine: Any, objective: PreferenceObjective, dataset: datasets.Dataset, pad_id: int,
                         batch_size: int) -> datasets.Dataset:
    """``dataset`` with the reference model's log-probs as columns (``ref_chosen_logps`` / ``ref_rejected_logps``,
    or KTO's ``ref_logps`` / ``ref_kl_logps``), computed by the engine in eval mode before training.

    Each rank scores its share of the rows; every rank runs the same number of forwards (ZeRO 3 gathers
    weights in each), the last short share padded with repeats of its first row, and the results are
    gathered so every rank holds them all."""
    rank, world, group = engine.mesh.rank("dp"), engine.mesh.size("dp"), engine.mesh.group("dp")
    indices = list(range(rank, len(dataset), world))
    per_rank = math.ceil(len(dataset) / world)
    indices += indices[:1] * (per_rank - len(indices)) if indices else [0] * per_rank
    collate = objective.collator(pad_id)
    was_training = engine.module.training
    engine.eval()
    scored: dict[int, tuple[float, float]] = {}
    for start in range(0, per_rank, batch_size):
        chunk = indices[start:start + batch_size]
        batch = {key: value.to(engine.device) for key, value in collate([dataset[i] for i in chunk]).items()}
        if objective.kind == "kto":
            first, _ = sequence_logps(engine, batch)
            second, _ = sequence_logps(engine, {key[3:]: value for key, value in batch.items()
                                                if key.startswith("kl_")})
        else:
            logps, _ = sequence_logps(engine, batch)
            first, second = logps.chunk(2)
        for index, a, b in zip(chunk, first.tolist(), second.tolist()):
            scored[index] = (a, b)
    if was_training:
        engine.train()
    everything: dict[int, tuple[float, float]] = {}
    for part in comm.all_gather_object(scored, group):
        everything.update(part)
    names = ("ref_logps", "ref_kl_logps") if objective.kind == "kto" else ("ref_chosen_logps", "ref_rejected_logps")
    dataset = dataset.add_column(names[0], [everything[i][0] for i in range(len(dataset))])
    return dataset.add_column(names[1], [everything[i][1] for i in range(len(dataset))])
