"""Each preference loss equals TRL's implementation of the same loss on the same batch, to 1e-6.

TRL's side is TRL's own code: ``DPOTrainer._compute_loss`` / ``KTOTrainer._compute_loss`` (with its fused
LM head computing the log-probs), ``ORPOTrainer`` / ``CPOTrainer.get_batch_loss_metrics`` (their own
concatenated forward) and ``RewardTrainer.compute_loss``, each called on a stand-in for the trainer object
that holds only the attributes those methods read. zerotune's side is ``PreferenceObjective.batch_loss``
on the same tiny model and the same padded batch.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from tests.models import make_llama
from zerotune.finetune.preference.batches import paired_collator, unpaired_collator
from zerotune.finetune.preference.objective import PreferenceObjective

trl = pytest.importorskip("trl")

PAD = 0


class Direct:
    """The objective's view of an engine -- a forward, the module, a one-rank mesh -- on a bare model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.module = model
        self.mesh = SimpleNamespace(size=lambda axis: 1, rank=lambda axis: 0, group=lambda axis: None)

    def __call__(self, **batch):
        return self.module(**batch)


def _rows(seed: int, count: int = 3) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)

    def ids(low: int, high: int) -> list[int]:
        length = int(torch.randint(low, high, (1,), generator=generator))
        return torch.randint(1, 96, (length,), generator=generator).tolist()

    return [{"prompt_ids": ids(2, 7), "chosen_ids": ids(1, 6), "rejected_ids": ids(2, 9)} for _ in range(count)]


def _accelerator() -> SimpleNamespace:
    same = lambda tensor: tensor  # noqa: E731 - one rank: gathering returns the tensor
    return SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=same, gather=same,
                           unwrap_model=same)


def _trainer_stub(model: torch.nn.Module, **fields) -> SimpleNamespace:
    return SimpleNamespace(model=model, accelerator=_accelerator(), aux_loss_enabled=False,
                           _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                           _total_train_tokens=0, _tp_size=1, **fields)


def _fused(model: torch.nn.Module) -> torch.nn.Module:
    from trl.trainer.utils import add_fused_lm_head

    fused = copy.deepcopy(model)
    add_fused_lm_head(fused, outputs=("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"))
    return fused


def _ours(kind: str, model: torch.nn.Module, batch: dict, **options):
    objective = PreferenceObjective(kind=kind, **options)
    return objective.batch_loss(Direct(model), batch)


@pytest.mark.parametrize(("loss_type", "beta"), [("sigmoid", 0.1), ("sigmoid", 0.5), ("ipo", 0.1), ("hinge", 0.3)])
def test_dpo_equals_trl(loss_type: str, beta: float) -> None:
    from trl import DPOTrainer

    model = make_llama(1).train()
    batch = paired_collator(PAD)(_rows(1))
    generator = torch.Generator().manual_seed(7)
    batch["ref_chosen_logps"] = -20 * torch.rand(3, generator=generator)
    batch["ref_rejected_logps"] = -20 * torch.rand(3, generator=generator)
    stub = _trainer_stub(model, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
                         loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=0.0,
                         use_weighting=False)
    theirs = DPOTrainer._compute_loss(stub, _fused(model), dict(batch), return_outputs=False)
    ours = _ours("dpo", model, batch, beta=beta, dpo_loss=loss_type)
    assert ours.loss.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-6)
    metrics = stub._metrics["train"]
    assert ours.chosen_rewards.mean().item() == pytest.approx(metrics["rewards/chosen"][0], rel=1e-6, abs=1e-6)
    assert ours.rejected_rewards.mean().item() == pytest.approx(metrics["rewards/rejected"][0], rel=1e-6, abs=1e-6)
    margin = (ours.chosen_rewards - ours.rejected_rewards).mean().item()
    assert margin == pytest.approx(metrics["rewards/margins"][0], rel=1e-6, abs=1e-6)
    accuracy = (ours.chosen_rewards > ours.rejected_rewards).float().mean().item()
    assert accuracy == metrics["rewards/accuracies"][0]


def test_reference_free_dpo_equals_trl_against_a_zero_reference() -> None:
    from trl import DPOTrainer

    model = make_llama(2).train()
    batch = paired_collator(PAD)(_rows(2))
    zeros = torch.zeros(3)
    stub = _trainer_stub(model, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
                         loss_types=["sigmoid"], loss_weights=[1.0], beta=0.1, label_smoothing=0.0,
                         use_weighting=False)
    theirs = DPOTrainer._compute_loss(stub, _fused(model), {**batch, "ref_chosen_logps": zeros,
                                                            "ref_rejected_logps": zeros}, return_outputs=False)
    ours = _ours("dpo", model, batch, beta=0.1, reference_free=True)
    assert ours.loss.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-6)


def test_conservative_dpo_equals_trl_cpo_sigmoid_on_the_log_ratios() -> None:
    """cDPO (label smoothing) is TRL's CPO sigmoid loss applied to the log-ratios (TRL's DPO dropped the option)."""
    from trl.experimental.cpo import CPOTrainer

    model = make_llama(3).train()
    batch = paired_collator(PAD)(_rows(3))
    batch["ref_chosen_logps"] = torch.tensor([-12.0, -7.5, -20.0])
    batch["ref_rejected_logps"] = torch.tensor([-9.0, -14.0, -11.0])
    ours = _ours("dpo", model, batch, beta=0.2, label_smoothing=0.1)
    stub = SimpleNamespace(alpha=0.0, beta=0.2, loss_type="sigmoid", label_smoothing=0.1, accelerator=_accelerator())
    chosen_ratio = ours.chosen_rewards / 0.2
    rejected_ratio = ours.rejected_rewards / 0.2
    theirs, _, _ = CPOTrainer.cpo_loss(stub, chosen_ratio, rejected_ratio)
    assert ours.loss.item() == pytest.approx(theirs.mean().item(), rel=1e-6, abs=1e-6)


def _trl_pair_batch(batch: dict) -> dict:
    """zerotune's [chosen; rejected] batch in the chosen_* / rejected_* keys TRL's ORPO and CPO trainers take."""
    rows = batch["input_ids"].shape[0] // 2
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    out = {}
    for name, part in (("chosen", slice(0, rows)), ("rejected", slice(rows, None))):
        out[f"{name}_input_ids"] = batch["input_ids"][part]
        out[f"{name}_attention_mask"] = batch["attention_mask"][part]
        out[f"{name}_labels"] = labels[part]
    return out


def _pair_trainer_stub(cls, **fields) -> SimpleNamespace:
    stub = SimpleNamespace(is_encoder_decoder=False, padding_value=PAD, pad_token_id=PAD, label_pad_token_id=-100,
                           accelerator=_accelerator(), aux_loss_enabled=False, **fields)
    stub.concatenated_inputs = cls.concatenated_inputs
    stub.get_batch_logps = cls.get_batch_logps
    stub.concatenated_forward = partial(cls.concatenated_forward, stub)
    return stub


@pytest.mark.parametrize("beta", [0.1, 0.25])
def test_orpo_equals_trl(beta: float) -> None:
    from trl.experimental.orpo import ORPOTrainer

    model = make_llama(4).train()
    batch = paired_collator(PAD)(_rows(4))
    stub = _pair_trainer_stub(ORPOTrainer, beta=beta)
    stub.odds_ratio_loss = partial(ORPOTrainer.odds_ratio_loss, stub)
    theirs, metrics = ORPOTrainer.get_batch_loss_metrics(stub, model, _trl_pair_batch(batch))
    ours = _ours("orpo", model, batch, beta=beta)
    assert ours.loss.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-6)
    assert ours.chosen_rewards.mean().item() == pytest.approx(metrics["rewards/chosen"], rel=1e-6, abs=1e-6)
    margin = (ours.chosen_rewards - ours.rejected_rewards).mean().item()
    assert margin == pytest.approx(metrics["rewards/margins"], rel=1e-6, abs=1e-6)


@pytest.mark.parametrize(("beta", "gamma", "smoothing"), [(2.0, 0.5, 0.0), (2.5, 1.0, 0.1)])
def test_simpo_equals_trl(beta: float, gamma: float, smoothing: float) -> None:
    from trl.experimental.cpo import CPOTrainer

    model = make_llama(5).train()
    batch = paired_collator(PAD)(_rows(5))
    stub = _pair_trainer_stub(CPOTrainer, beta=beta, loss_type="simpo", simpo_gamma=gamma, cpo_alpha=0.0,
                              label_smoothing=smoothing, alpha=0.0)
    stub.cpo_loss = partial(CPOTrainer.cpo_loss, stub)
    theirs, metrics = CPOTrainer.get_batch_loss_metrics(stub, model, _trl_pair_batch(batch))
    ours = _ours("simpo", model, batch, beta=beta, gamma=gamma, label_smoothing=smoothing)
    assert ours.loss.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-6)
    margin = (ours.chosen_rewards - ours.rejected_rewards).mean().item()
    assert margin == pytest.approx(metrics["rewards/margins"], rel=1e-6, abs=1e-6)


@pytest.mark.parametrize(("desirable", "undesirable"), [(1.0, 1.0), (1.33, 0.8)])
def test_kto_equals_trl(desirable: float, undesirable: float) -> None:
    from trl import KTOTrainer

    model = make_llama(6).train()
    generator = torch.Generator().manual_seed(11)
    rows = []
    for index, pair in enumerate(_rows(6, count=4)):
        rows.append({"prompt_ids": pair["prompt_ids"], "completion_ids": pair["chosen_ids"],
                     "kl_completion_ids": pair["rejected_ids"], "label": index % 3 != 1})
    batch = unpaired_collator(PAD)(rows)
    batch["ref_logps"] = -15 * torch.rand(4, generator=generator)
    batch["ref_kl_logps"] = -25 * torch.rand(4, generator=generator)
    stub = _trainer_stub(model, precompute_ref_logps=True, calculate_KL=True, loss_type="kto", beta=0.1,
                         desirable_weight=desirable, undesirable_weight=undesirable)
    stub._compute_kl_logps = partial(KTOTrainer._compute_kl_logps, stub)
    trl_batch = {key: value for key, value in batch.items() if not key.startswith("kl_")}
    trl_batch.update({"KL_input_ids": batch["kl_input_ids"], "KL_attention_mask": batch["kl_attention_mask"],
                      "KL_completion_mask": batch["kl_completion_mask"], "ref_KL_logps": batch["ref_kl_logps"]})
    theirs = KTOTrainer._compute_loss(stub, _fused(model), trl_batch, return_outputs=False)
    ours = _ours("kto", model, batch, beta=0.1, desirable_weight=desirable, undesirable_weight=undesirable)
    assert ours.loss.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-6)
    metrics = stub._metrics["train"]
    assert ours.chosen_rewards.mean().item() == pytest.approx(metrics["rewards/chosen"][0], rel=1e-6, abs=1e-6)
    assert ours.rejected_rewards.mean().item() == pytest.approx(metrics["rewards/rejected"][0], rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("center", [None, 0.01])
def test_reward_model_loss_equals_trl(center: float | None) -> None:
    from transformers import LlamaConfig, LlamaForSequenceClassification
    from trl import RewardTrainer

    torch.manual_seed(8)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=96, num_labels=1, pad_token_id=PAD)
    model = LlamaForSequenceClassification(config).train()
    batch = paired_collator(PAD)(_rows(8))
    stub = _trainer_stub(model, args=SimpleNamespace(center_rewards_coefficient=center))
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    theirs = RewardTrainer.compute_loss(stub, model, inputs)
    ours = _ours("reward", model, batch, center_rewards_coefficient=center)
    assert ours.loss.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-6)
    assert (ours.chosen_rewards > ours.rejected_rewards).float().mean().item() == \
        pytest.approx(stub._metrics["train"]["accuracy"][0])
    margin = (ours.chosen_rewards - ours.rejected_rewards).mean().item()
    assert margin == pytest.approx(stub._metrics["train"]["margin"][0], rel=1e-6, abs=1e-6)
