"""The base class of every config section.

A section declares, besides its fields, the DeepSpeed key aliases it accepts and the
DeepSpeed keys it deliberately does not model, so the loader can rename the former and
reject the latter with a precise message instead of a generic "unknown key".
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional

from pydantic import BaseModel, ConfigDict

# An accepted-but-unmodelled DeepSpeed key: which values change nothing here (None: any value),
# those values in words (for the refusal of the others), and why they change nothing.
NoEffect = tuple[Optional[Callable[[Any], bool]], str, str]


class Section(BaseModel):
    """A typed block of the DeepSpeed JSON schema; unknown keys are forbidden."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=False)

    # alias key -> canonical field name (e.g. "bfloat16" -> "bf16")
    ALIASES: ClassVar[dict[str, str]] = {}
    # DeepSpeed keys of this block that zerotune does not model -> kind word for the message
    UNSUPPORTED: ClassVar[frozenset[str]] = frozenset()
    # DeepSpeed keys of this block zerotune accepts without modelling them, because for the
    # values the predicate allows they would change nothing here; other values are refused.
    NO_EFFECT: ClassVar[dict[str, NoEffect]] = {}
    # What the feature behind a refused key is, in words, for its refusal (the key alone can be cryptic).
    FEATURES: ClassVar[dict[str, str]] = {}
    # Modelled fields that nothing in zerotune reads (any value), with the reason: reported by
    # ``zerotune check`` and logged by ``initialize`` when a config sets them.
    NO_EFFECT_FIELDS: ClassVar[dict[str, str]] = {}
    # Other tools' names for this section's keys (or another section's, as a dotted path) -> the key to
    # suggest: did-you-mean consults it before the fuzzy match, which cannot know that 'learning_rate' is 'lr'.
    KNOWN_AS: ClassVar[dict[str, str]] = {}

    @classmethod
    def translate_legacy(cls, raw: dict[str, Any], prefix: str, notes: list[tuple[str, str]]) -> dict[str, Any]:
        """Rewrite DeepSpeed's legacy spellings of this block into the modern ones (noting each)."""
        return raw
