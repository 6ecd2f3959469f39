"""``zero_optimization.leaf_module``: which modules ZeRO stage 3 gathers whole, chosen from the config.

A ZeRO-3 leaf is gathered as one unit with everything under it, so submodules that run data-dependently (MoE
experts chosen by a router) never ask for a gather the other ranks do not join. The block names them by class
(``module.qualname`` or the bare class name), by exact module name or by module-name suffix -- DeepSpeed's
``leaf_module`` block, with its defaults: the MoE blocks of Mixtral, Qwen2-MoE and Qwen3-MoE.
"""

from __future__ import annotations

from typing import Any

from pydantic import field_validator

from .section import Section

DEFAULT_LEAF_MODULE_CLASSES: list[str] = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []


class LeafModuleConfig(Section):
    """``zero_optimization.leaf_module``: modules marked as ZeRO-3 leaves when ``initialize`` builds stage 3."""

    classes: list[str] = list(DEFAULT_LEAF_MODULE_CLASSES)
    """Classes whose instances are leaves: ``package.module.Class`` or the bare class name."""
    names: list[str] = list(DEFAULT_LEAF_MODULE_NAMES)
    """Module names, exactly as ``model.named_modules()`` gives them."""
    name_suffixes: list[str] = list(DEFAULT_LEAF_MODULE_NAME_SUFFIXES)
    """Module-name endings: every module whose name ends so is a leaf."""

    @field_validator("classes", "names", "name_suffixes", mode="before")
    @classmethod
    def _one_string_is_a_list(cls, value: Any) -> Any:
        """One string stands for a list of one (DeepSpeed accepts ``"names": "decoder.moe"``)."""
        return [value] if isinstance(value, str) else value

    @field_validator("classes", "names", "name_suffixes")
    @classmethod
    def _dedupe(cls, value: list[str]) -> list[str]:
        return list(dict.fromkeys(value))

    def customized(self) -> bool:
        """Whether the block differs from the defaults (only then does matching nothing deserve a warning)."""
        return (self.classes != DEFAULT_LEAF_MODULE_CLASSES or self.names != DEFAULT_LEAF_MODULE_NAMES
                or self.name_suffixes != DEFAULT_LEAF_MODULE_NAME_SUFFIXES)
