"""``objective``: a fine-tuning recipe's training objective -- supervised answers, a preference method, or a
reward model -- and which options belong to which type (checked in ``recipe_checks.py``)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import StrictBool

from zerotune.config.section import Section
from zerotune.config.types import Fraction, NonNegFloat, PosFloat

OBJECTIVES = ("sft", "dpo", "orpo", "simpo", "kto", "reward")
PREFERENCE_OBJECTIVES = OBJECTIVES[1:]
DEFAULT_BETA = {"dpo": 0.1, "orpo": 0.1, "simpo": 2.0, "kto": 0.1}
# Which objective.* options belong to which objective.type; "type" itself belongs to all.
OBJECTIVE_OPTIONS = {
    "dpo": ("beta", "loss", "reference_free", "label_smoothing"),
    "orpo": ("beta",),
    "simpo": ("beta", "gamma", "label_smoothing"),
    "kto": ("beta", "desirable_weight", "undesirable_weight"),
    "reward": ("center_rewards_coefficient",),
}


class ObjectiveSection(Section):
    """``objective``: what the causal LM is trained to do -- imitate answers (sft) or prefer chosen answers over
    rejected ones (dpo, orpo, simpo, kto), or score answers (reward: a scalar head on the model's body).

    Options belong to one objective type each, like method options.
    """

    type: Literal[OBJECTIVES] = "sft"  # type: ignore[valid-type]
    """sft (supervised: loss on the answers), dpo (Direct Preference Optimization against a frozen reference: the
    base with the adapter off for LoRA / QLoRA / prefix, reference log-probs computed once before training for full /
    freeze), orpo (odds-ratio preference, no reference), simpo (length-normalized preference with a margin, no
    reference), kto (unpaired desirable / undesirable answers against the reference) or reward (a reward model:
    AutoModelForSequenceClassification with one output, pairwise loss)."""
    beta: Optional[PosFloat] = None
    """The preference strength: DPO / KTO's KL weight, ORPO's odds-ratio weight (lambda), SimPO's reward scale; None
    takes the method's usual value (dpo 0.1, orpo 0.1, simpo 2.0, kto 0.1)."""
    loss: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    """DPO: sigmoid (the DPO paper), ipo (squared, per-token log-ratios) or hinge (SLiC)."""
    reference_free: StrictBool = False
    """DPO: compare against a uniform reference (log-probs 0) instead of the frozen model: no reference pass."""
    label_smoothing: Fraction = 0.0
    """DPO (sigmoid loss) / SimPO: the assumed fraction of flipped preference labels (conservative DPO); 0 trusts them
    all."""
    gamma: NonNegFloat = 0.5
    """SimPO: the target reward margin gamma (TRL's simpo_gamma)."""
    desirable_weight: PosFloat = 1.0
    """KTO: the weight of desirable answers' losses."""
    undesirable_weight: PosFloat = 1.0
    """KTO: the weight of undesirable answers' losses."""
    center_rewards_coefficient: Optional[PosFloat] = None
    """Reward model: weight of the mean squared sum of paired rewards, keeping them centred at 0; None: off."""

    def effective_beta(self) -> float:
        return self.beta if self.beta is not None else DEFAULT_BETA[self.type]
