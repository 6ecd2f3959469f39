"""The base class of every config section.

A section declares, besides its fields, the DeepSpeed key aliases it accepts and the
DeepSpeed keys it deliberately does not model, so the loader can rename the former and
reject the latter with a precise message instead of a generic "unknown key".
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A typed block of the DeepSpeed JSON schema; unknown keys are forbidden."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=False)

    # alias key -> canonical field name (e.g. "bfloat16" -> "bf16")
    ALIASES: ClassVar[dict[str, str]] = {}
    # DeepSpeed keys of this block that zerotune does not model -> kind word for the message
    UNSUPPORTED: ClassVar[frozenset[str]] = frozenset()
