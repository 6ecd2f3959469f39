"""The preference losses, on sequence log-probabilities (or, for a reward model, scalar scores).

Each function takes what the model produced for a batch -- the policy's (and, where the method has
one, the reference's) summed log-probability of each completion, or the reward head's score -- and
returns a :class:`PreferenceLoss`: the scalar to back-propagate and the per-example *rewards* the
methods report (DPO's implicit reward ``beta * (log pi - log pi_ref)``, ORPO's / SimPO's
``beta * average log-prob``, the reward model's score). The formulas are the papers', in the forms TRL
implements them, so a recipe moved from TRL trains the same objective; ``tests/test_preference_losses.py``
holds each equal to TRL's own code on the same batch to 1e-6.

Paired methods get chosen and rejected completions of the same prompts, in matching order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

DPO_LOSSES = ("sigmoid", "ipo", "hinge")


@dataclass
class PreferenceLoss:
    """A batch's loss and the rewards its metrics are computed from (detached).

    ``chosen_rewards`` / ``rejected_rewards`` hold one value per chosen / rejected example; for KTO they
    are the desirable and undesirable rows of the batch, either possibly empty.
    """

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, *, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, chosen_lengths: torch.Tensor | None = None,
             rejected_lengths: torch.Tensor | None = None) -> PreferenceLoss:
    """Direct Preference Optimization (Rafailov et al. 2023) and its IPO / hinge variants.

    ``sigmoid``: ``-log sigmoid(beta * delta)`` with ``delta`` the chosen log-ratio minus the rejected one;
    with ``label_smoothing`` eps > 0 the conservative cDPO form ``-(1-eps) log sigmoid(beta delta) - eps log
    sigmoid(-beta delta)``. ``ipo`` (Azar et al. 2023): ``(delta_per_token - 1 / (2 beta))^2``, the log-ratios
    averaged over each completion's tokens (TRL's normalization, confirmed with the IPO authors), so it needs
    the lengths. ``hinge`` (SLiC): ``relu(1 - beta * delta)``. Reference-free DPO passes zeros as the
    reference log-probs.
    """
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    delta = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta) * (1 - label_smoothing) - F.logsigmoid(-beta * delta) * label_smoothing
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("the ipo loss averages the log-ratios over each completion's tokens: pass chosen_lengths "
                             "and rejected_lengths")
        per_token = chosen_logratios / chosen_lengths.clamp(min=1) - rejected_logratios / rejected_lengths.clamp(min=1)
        losses = (per_token - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown dpo loss {loss_type!r}; expected one of {', '.join(DPO_LOSSES)}")
    return PreferenceLoss(losses.mean(), (beta * chosen_logratios).detach(), (beta * rejected_logratios).detach())


def orpo_loss(chosen_avg_logps: torch.Tensor, rejected_avg_logps: torch.Tensor, chosen_nll: torch.Tensor, *,
              beta: float) -> PreferenceLoss:
    """Odds Ratio Preference Optimization (Hong et al. 2024): the chosen answers' language-model loss minus
    ``beta`` times the log-sigmoid of the log odds ratio of chosen over rejected, on per-token average
    log-probs. No reference model. ``chosen_nll`` is the token-mean cross-entropy of the chosen completions."""
    chosen, rejected = chosen_avg_logps.float(), rejected_avg_logps.float()
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    return PreferenceLoss(chosen_nll - beta * ratio.mean(), (beta * chosen).detach(), (beta * rejected).detach())


def simpo_loss(chosen_avg_logps: torch.Tensor, rejected_avg_logps: torch.Tensor, *, beta: float, gamma: float,
               label_smoothing: float = 0.0) -> PreferenceLoss:
    """Simple Preference Optimization (Meng et al. 2024): ``-log sigmoid(beta * (avg chosen - avg rejected) -
    gamma)`` on per-token average log-probs, ``gamma`` the target reward margin; no reference model."""
    logits = (chosen_avg_logps - rejected_avg_logps) - gamma / beta
    losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    return PreferenceLoss(losses.mean(), (beta * chosen_avg_logps).detach(), (beta * rejected_avg_logps).detach())


def kto_loss(logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor, *,
             beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> PreferenceLoss:
    """Kahneman-Tversky Optimization (Ethayarajh et al. 2024), on unpaired rows labelled desirable or not.

    A desirable row's loss is ``1 - sigmoid(beta * (log-ratio - kl))``, an undesirable one's
    ``1 - sigmoid(beta * (kl - log-ratio))``, weighted by ``desirable_weight`` / ``undesirable_weight`` and
    averaged over the batch's rows. ``kl`` is the batch's reference point: the policy's KL from the reference
    estimated on mismatched prompt/completion pairs (``kto_reference_point``), not back-propagated.
    """
    logratios = logps - ref_logps
    wanted = desirable.bool()
    chosen_losses = 1 - torch.sigmoid(beta * (logratios[wanted] - kl))
    rejected_losses = 1 - torch.sigmoid(beta * (kl - logratios[~wanted]))
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses))
    return PreferenceLoss(losses.nanmean(), (beta * logratios[wanted]).detach(),
                          (beta * logratios[~wanted]).detach())


def kto_reference_point(mismatched_logps: torch.Tensor, ref_mismatched_logps: torch.Tensor) -> torch.Tensor:
    """KTO's ``z_ref``: the mean log-ratio on mismatched pairs, floored at 0 and detached. Under data
    parallelism the caller averages the per-rank means before flooring (``kto_loss`` takes the result)."""
    return (mismatched_logps - ref_mismatched_logps).mean().detach()


def reward_model_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, *,
                      margin: torch.Tensor | None = None,
                      center_rewards_coefficient: float | None = None) -> PreferenceLoss:
    """The Bradley-Terry pairwise loss of a scalar reward head, ``-log sigmoid(r_chosen - r_rejected [- margin])``,
    plus, when asked, ``coefficient * mean((r_chosen + r_rejected)^2)`` to keep the rewards centred
    (Eisenstein et al. 2023)."""
    difference = chosen_scores - rejected_scores
    if margin is not None:
        difference = difference - margin
    loss = -F.logsigmoid(difference).mean()
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * torch.mean((chosen_scores + rejected_scores) ** 2)
    return PreferenceLoss(loss, chosen_scores.detach(), rejected_scores.detach())


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate at both ends (Maechler 2012)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))
