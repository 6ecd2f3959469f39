"""Validation helpers for the ``optimizer`` / ``scheduler`` config sections.

Every failure is a ``zerotune.config.ConfigError`` whose ``path`` names the offending
value (``optimizer.type``, ``scheduler.params.warmup_num_steps``) so a user can find it
in a 200-line JSON file; the message says what would be valid, with a did-you-mean when
the value looks like a typo.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any

from zerotune.config.errors import ConfigError


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return " Did you mean 'x'?" for the closest choice (case-insensitive), or ""."""
    by_lower = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" Did you mean '{by_lower[close[0]]}'?" if close else ""


def check_known_keys(params: Mapping[str, Any], valid: Iterable[str], section: str) -> None:
    """Raise on the first key of ``params`` not in ``valid``, naming ``<section>.<key>``.

    Why check at all: DeepSpeed passes ``params`` as ``**kwargs``, so a typo such as
    ``weight_decy`` surfaces as a bare ``TypeError`` from a constructor; naming the key,
    the valid keys and the likely intended one turns that into a one-line fix.
    """
    valid = sorted(valid)
    for key in params:
        if key not in valid:
            raise ConfigError(
                f"{section}.{key}",
                f"unknown parameter '{key}'.{did_you_mean(key, valid)} Valid keys: {', '.join(valid)}",
            )


def reject_auto_values(params: Mapping[str, Any], section: str) -> None:
    """Raise if a value is still the HF placeholder "auto": it must be resolved upstream."""
    for key, value in params.items():
        if isinstance(value, str) and value == "auto":
            raise ConfigError(
                f"{section}.{key}",
                "value 'auto' was not resolved; resolve it from the training arguments "
                "(see zerotune.optim.optimizer_defaults) before building",
            )


def per_param_group(value: Any, optimizer: Any, section: str, key: str) -> list[float]:
    """A scalar for every param group, or a list with exactly one non-negative number per group."""
    count = len(optimizer.param_groups)
    values = list(value) if isinstance(value, (list, tuple)) else [value] * count
    if len(values) != count:
        raise ConfigError(f"{section}.{key}", f"got {len(values)} values but the optimizer has {count} param groups")
    return [number_at_least(v, 0.0, section, key) for v in values]


def number_at_least(value: Any, minimum: float, section: str, key: str) -> float:
    """``value`` as a float, or a ConfigError at ``<section>.<key>`` unless it is a finite number >= minimum."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise ConfigError(f"{section}.{key}", f"must be a finite number >= {minimum}, got {value!r}")
    return float(value)


def int_at_least(value: Any, minimum: int, section: str, key: str) -> int:
    """``value`` as an int (integral floats accepted), or a ConfigError at ``<section>.<key>``."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{section}.{key}", f"must be an integer >= {minimum}, got {value!r}")
    return value
