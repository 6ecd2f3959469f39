"""The best checkpoint and early stopping: which evaluation was best by a named metric, and when to stop.

HF Trainer's policy, with its names: ``metric_for_best_model`` (an eval metric of the task),
``greater_is_better`` (inferred from the metric when not given), ``load_best_model_at_end``, and early
stopping after ``early_stopping_patience`` evaluations without an improvement larger than
``early_stopping_min_delta``. The tracker is plain state, saved in every checkpoint's client state so a
resumed run keeps counting where it stopped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from zerotune.finetune.recipe_sections import Recipe, TrainSection

_REWARDS = ("reward_margin", "chosen_reward", "rejected_reward")
METRICS = {"causal-lm": ("loss", "perplexity"), "sequence-classification": ("accuracy", "macro_f1", "loss"),
           "preference": ("loss", "reward_accuracy", *_REWARDS), "kto": ("loss", *_REWARDS),
           "reward": ("loss", "reward_accuracy", *_REWARDS)}
"""The eval metrics of each kind of evaluation (``evaluation_kind``)."""
DEFAULT_METRIC = {"causal-lm": "loss", "sequence-classification": "accuracy", "preference": "loss", "kto": "loss",
                  "reward": "reward_accuracy"}
HIGHER_IS_BETTER = ("accuracy", "macro_f1", "reward_accuracy", "reward_margin", "chosen_reward")


def evaluation_kind(recipe: Recipe) -> str:
    """What a recipe's evaluation measures: its task's metrics, or a preference objective's rewards."""
    objective = recipe.objective.type
    if objective == "sft":
        return recipe.task
    return {"kto": "kto", "reward": "reward"}.get(objective, "preference")
BEST_DIR = "best"
"""Under the run's output directory: the best evaluation's checkpoint (tag ``best``), apart from the
periodic ones so their retention never deletes it."""


@dataclass
class BestTracker:
    metric: str
    greater_is_better: bool
    patience: int | None = None
    min_delta: float = 0.0
    best: float | None = None
    best_step: int | None = None
    evals_without_improvement: int = 0

    def update(self, step: int, result: dict) -> bool:
        """Record one evaluation; True when it is the best so far (by more than ``min_delta``)."""
        value = float(result[self.metric])
        margin = value - self.best if self.best is not None else None
        improved = margin is None or (margin > self.min_delta if self.greater_is_better else -margin > self.min_delta)
        if improved:
            self.best, self.best_step, self.evals_without_improvement = value, step, 0
        else:
            self.evals_without_improvement += 1
        return improved

    @property
    def should_stop(self) -> bool:
        return self.patience is not None and self.evals_without_improvement >= self.patience

    def state(self) -> dict:
        return asdict(self)


def tracker_for(kind: str, train: TrainSection) -> BestTracker | None:
    """The recipe's tracker (``kind``: its ``evaluation_kind``), or None when it asks for neither the best model
    nor early stopping."""
    if not train.load_best_model_at_end and train.early_stopping_patience is None:
        return None
    metric = train.metric_for_best_model or DEFAULT_METRIC[kind]
    greater = train.greater_is_better if train.greater_is_better is not None else metric in HIGHER_IS_BETTER
    return BestTracker(metric, greater, train.early_stopping_patience, train.early_stopping_min_delta)
