"""The config error family.

Every failure while loading or resolving a config is a :class:`ConfigError` (a
``ValueError``), so callers and the CLI need exactly one ``except`` clause and users
always see one line naming the offending key.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value is missing, malformed, inconsistent or unknown.

    ``path`` is the dotted key (``"zero_optimization.stage"``), or ``""`` when the
    problem concerns the whole config (an unreadable file, a non-mapping top level).
    """

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        text = f"zerotune config: {path}: {message}" if path else f"zerotune config: {message}"
        super().__init__(text)

    def __reduce__(self):
        # Errors cross process boundaries in multi-rank runs; the default reduce would
        # call cls(formatted_text) and fail on the two-argument constructor.
        return (self.__class__, (self.path, self.message))


class NotSupportedError(ConfigError, NotImplementedError):
    """A DeepSpeed feature zerotune does not model at all (e.g. ``autotuning``), or a combination DeepSpeed
    refuses too. Also a ``NotImplementedError``: what DeepSpeed raises for those, so code and tests written
    against DeepSpeed catch it."""


class NotSupportedYetError(ConfigError):
    """A modelled feature the engine does not implement yet (e.g. ZeRO stage 3)."""


class BatchSizeError(ConfigError, AssertionError):
    """train_batch_size, the micro batch, accumulation and the data-parallel size do not fit together. Also an
    ``AssertionError``: DeepSpeed's batch check (``DeepSpeedConfig._batch_assertion``) is an assert, so code
    written against DeepSpeed catches that."""
