"""A Hugging Face model's own tensor-parallel plan (``_tp_plan`` / ``config.base_model_tp_plan``) as rules.

transformers models declare how their layers split: ``{"layers.*.self_attn.q_proj": "colwise", ...}``, glob
patterns over module names with a style each. zerotune reads that plan when the user gave no rules and it has
no built-in plan for the architecture (``autotp._plan_for``), so a model zerotune has never seen still splits
the way its authors meant. Precedence: the user's ``partition_config.layer_specs`` > zerotune's built-in plan
(``plans.PLANS``, which splits the embedding and LM head over the vocabulary with a vocab-parallel loss) > the
model's plan. DeepSpeed ranks the model's plan above its own heuristics; zerotune's built-in plans are complete
rule sets checked against each architecture, so they stay first.

Styles: ``colwise`` splits the output features, ``rowwise`` the input features; ``colwise_rep`` (renamed
``colwise_gather_output`` in transformers) splits the output features and all-gathers the output, so the next
layer sees the whole of it (an LM head whose logits the model's own loss reads). Any other style (sequence
parallel, local_*, packed, ...) is a layout zerotune's layers do not have: the whole plan is then unusable and
``rules_from_hf_plan`` returns None (a plan applied in part would leave layers whose neighbours expect a split
input with a whole one).
"""

from __future__ import annotations

from typing import Any

from zerotune.parallel.tensor.plans import LayerRule

HF_STYLES: dict[str, tuple[str, bool]] = {  # style -> (partition_type, gather_output)
    "colwise": ("column", False),
    "colwise_rep": ("column", True),
    "colwise_gather_output": ("column", True),
    "rowwise": ("row", False),
}


def wildcard_to_regex(pattern: str) -> str:
    """A plan key (``layers.*.q_proj``: dots literal, ``*`` any run) as a regex found anywhere after a prefix."""
    return ".*" + pattern.replace(".", r"\.").replace("*", ".*")


def weight_regex(pattern: str) -> str:
    """The regex over the *weight's* name of the module a plan key names (``...\\.weight$``)."""
    regex = wildcard_to_regex(pattern)
    return regex + "$" if regex.endswith(r"\.weight") else regex + r"\.weight$"


def unsupported_styles(plan: dict[str, str]) -> list[str]:
    return sorted({style for style in plan.values() if str(style).lower() not in HF_STYLES})


def rules_from_hf_plan(plan: dict[str, str]) -> tuple[LayerRule, ...] | None:
    """The plan as zerotune rules in the plan's order, or None when a style is one zerotune cannot honour."""
    if unsupported_styles(plan):
        return None
    rules = []
    for pattern, style in plan.items():
        partition_type, gather_output = HF_STYLES[style.lower()]
        rules.append(LayerRule((weight_regex(pattern),), partition_type, gather_output=gather_output))
    return tuple(rules)


def hf_tp_plan(model: Any) -> dict[str, str] | None:
    """The model's plan: ``config.base_model_tp_plan``, then the class's ``_tp_plan``, then the instance's.

    transformers may replace the instance's plan by the base model's, expanded with a ``model.`` prefix, while
    model-level entries (``lm_head``) stay on the class only: all three are merged, and a ``model.``-prefixed
    key repeating one already seen is dropped. Empty or absent plans give None.
    """
    config = getattr(model, "config", None)
    sources = (getattr(config, "base_model_tp_plan", None) if config is not None else None,
               getattr(type(model), "_tp_plan", None), getattr(model, "__dict__", {}).get("_tp_plan"))
    merged: dict[str, str] = {}
    seen: set[str] = set()
    for plan in sources:
        if not isinstance(plan, dict):
            continue
        for pattern, style in plan.items():
            bare = pattern.removeprefix("model.")
            if pattern.startswith("model.") and bare in seen:
                continue
            merged[pattern] = style
            seen.add(bare)
    return merged or None
