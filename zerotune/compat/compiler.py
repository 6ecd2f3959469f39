"""``deepspeed.runtime.compiler``: the helpers DeepSpeed code calls around ``torch.compile``.

``disable`` keeps a function out of compiled graphs; ``is_compiling`` says whether the caller runs
inside a trace; ``compiled_autograd`` is a context that zerotune never enables (``engine.compile``
refuses ``compiled_autograd_enabled=True``), so it only passes through.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

__all__ = ["is_compile_supported", "disable", "enable", "is_compiling", "compiled_autograd"]


def is_compile_supported() -> bool:
    """torch.compile exists in every torch zerotune runs on (2.1 and later)."""
    return hasattr(torch, "compile")


def disable(func: Callable) -> Callable:
    return torch.compiler.disable(func)


def is_compiling() -> bool:
    return torch.compiler.is_compiling()


def enable(min_version: str | Callable | None = None) -> Callable:
    """DeepSpeed's decorator: inside a trace, run the function compiled only on torch >= ``min_version``
    (else as a graph break); outside a trace, the function itself."""
    def decorate(func: Callable) -> Callable:
        @functools.wraps(func)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not is_compiling() or min_version is None or _torch_at_least(str(min_version)):
                return func(*args, **kwargs)
            return disable(func)(*args, **kwargs)

        return wrapped

    if callable(min_version):
        func, min_version = min_version, None
        return decorate(func)
    return decorate


def _torch_at_least(version: str) -> bool:
    from packaging.version import Version

    return Version(torch.__version__.split("+")[0]) >= Version(version)


@contextlib.contextmanager
def compiled_autograd(enabled: bool, kwargs: dict[str, Any]) -> Iterator[None]:
    if enabled:
        raise NotImplementedError("compiled autograd: zerotune's gradient hooks reduce buckets during backward, "
                                  "which compiled autograd would trace; run with it off")
    yield
