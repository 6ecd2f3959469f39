"""Callables and classes that stand for DeepSpeed features zerotune refuses, failing on use."""

from __future__ import annotations

from typing import Any, Callable

from zerotune.compat.paths import REFUSED_NAMES, DeepSpeedFeatureNotSupported


def refused_function(name: str) -> Callable[..., Any]:
    """A function that raises DeepSpeedFeatureNotSupported naming ``name``'s feature when called."""
    feature = REFUSED_NAMES[name]

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise DeepSpeedFeatureNotSupported(name, feature)

    refuse.__name__ = refuse.__qualname__ = name.rsplit(".", 1)[-1]
    refuse.__doc__ = f"Refused: {feature} is a DeepSpeed feature zerotune does not support."
    return refuse


def refused_class(name: str) -> type:
    """A class whose construction raises DeepSpeedFeatureNotSupported naming ``name``'s feature."""
    feature = REFUSED_NAMES[name]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise DeepSpeedFeatureNotSupported(name, feature)

    short = name.rsplit(".", 1)[-1]
    return type(short, (), {"__init__": __init__, "__doc__": f"Refused: {feature} is not supported by zerotune."})
