"""Scalar field types shared by every config section.

DeepSpeed configs are JSON, so pydantic's lax coercions ("5" -> 5, "yes" -> True) would
silently accept typos of type. These types are strict where it matters while still
accepting the JSON idioms real configs use: ``5e8`` for an integer bucket size, ``1``
for a float, ``0`` / ``1`` for a flag. Every numeric and boolean leaf may also hold HF's ``"auto"`` until
:func:`zerotune.config.resolve_config` replaces it.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Final, Literal, Optional, Union

from pydantic import BeforeValidator, Field, StrictStr

AUTO: Final = "auto"
Auto = Literal["auto"]


def _integer(value: Any) -> Any:
    """Accept ints and integral floats (``5e8``); reject bools, strings, fractions."""
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got boolean {str(value).lower()}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"expected a finite integer, got {value}")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, float):
        raise ValueError(f"expected an integer, got fraction {value}")
    raise ValueError(f"expected an integer, got {type(value).__name__}")


def _element_budget(value: Any) -> Any:
    """An element count used as a budget: an integer, or a fraction rounded down. TRL's reference-model setup
    writes ``stage3_prefetch_bucket_size = 0.9 * hidden_size**2`` (a fraction unless hidden_size is a
    multiple of 10); a budget one element smaller changes nothing."""
    if isinstance(value, float) and math.isfinite(value) and not value.is_integer():
        return math.floor(value)
    return _integer(value)


def _number(value: Any) -> Any:
    """Accept ints and floats as floats; reject bools and numeric-looking strings."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value}")
    return float(value)


def _boolean(value: Any) -> Any:
    """Accept true / false and JSON's 0 / 1 (DeepSpeed reads its flags by truth value, and configs -- DeepSpeed's own
    tests among them -- write ``"zero_allow_untested_optimizer": 1``); reject other numbers and strings."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError("expected a boolean: true / false, or 0 / 1")


Bool = Annotated[bool, BeforeValidator(_boolean)]
Int = Annotated[int, BeforeValidator(_integer)]
NonNegInt = Annotated[int, BeforeValidator(_integer), Field(ge=0)]
PosInt = Annotated[int, BeforeValidator(_integer), Field(ge=1)]
NonNegBudget = Annotated[int, BeforeValidator(_element_budget), Field(ge=0)]
NonNegFloat = Annotated[float, BeforeValidator(_number), Field(ge=0)]
PosFloat = Annotated[float, BeforeValidator(_number), Field(gt=0)]
Fraction = Annotated[float, BeforeValidator(_number), Field(ge=0, le=1)]
Stage = Annotated[int, BeforeValidator(_integer), Field(ge=0, le=3)]

# The "auto"-able variants: what a field may hold between load_config and resolve_config.
AutoInt = Union[Int, Auto]
AutoStage = Union[Stage, Auto]
AutoNonNegInt = Union[NonNegInt, Auto]
AutoNonNegBudget = Union[NonNegBudget, Auto]
AutoPosInt = Union[PosInt, Auto]
AutoNonNegFloat = Union[NonNegFloat, Auto]
AutoPosFloat = Union[PosFloat, Auto]
AutoFraction = Union[Fraction, Auto]
AutoBool = Union[Bool, Auto]
OptAutoPosInt = Optional[Union[PosInt, Auto]]
OffloadDevice = Literal["none", "cpu", "nvme"]
Str = StrictStr
