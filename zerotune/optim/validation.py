"""Validation helpers for the ``optimizer`` / ``scheduler`` config sections.

Every failure is a ``zerotune.config.ConfigError`` whose ``path`` names the offending
value (``optimizer.type``, ``scheduler.params.warmup_num_steps``) so a user can find it
in a 200-line JSON file; the message says what would be valid, with a did-you-mean when
the value looks like a typo.
"""

from __future__ import annotations

import difflib
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
