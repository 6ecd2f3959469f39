"""Hugging Face cache arguments of a checkpointed block: dropped when empty, as HF's own checkpointing does.

A checkpointed block runs its forward twice (the call, then the recompute in backward); a cache object it
writes would be written twice. Training passes an empty cache that nothing reads, so it is dropped; one
holding past states for the block's layer (prefix tuning) cannot be, and the call goes uncheckpointed.
Recognised by class name, so transformers stays an optional dependency.
"""

from __future__ import annotations

from typing import Any

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def without_empty_caches(args: tuple, kwargs: dict, layer_idx: int | None) -> tuple[tuple, dict, bool]:
    """Drop Hugging Face cache objects (as HF's own checkpointing does): the recompute would write them twice.

    Training passes an empty cache that nothing reads; one holding past states for this layer (prefix
    tuning) cannot be dropped, so the third value says the call must not be checkpointed.
    """
    def drop(value: Any) -> tuple[Any, bool]:
        if not _is_hf_cache(value):
            return value, True
        return (value, False) if _past_length(value, layer_idx) > 0 else (None, True)

    dropped_args = [drop(value) for value in args]
    dropped_kwargs = {key: drop(value) if key in _CACHE_KWARGS else (value, True) for key, value in kwargs.items()}
    if not all(ok for _, ok in [*dropped_args, *dropped_kwargs.values()]):
        return args, kwargs, False
    new_args = tuple(value for value, _ in dropped_args)
    new_kwargs = {key: value for key, (value, _) in dropped_kwargs.items()}
    if new_kwargs.get("use_cache"):
        new_kwargs["use_cache"] = False
    return new_args, new_kwargs, True


def _is_hf_cache(value: Any) -> bool:
    # By name, so transformers stays an optional dependency.
    return any(cls.__name__ == "Cache" and cls.__module__.startswith("transformers") for cls in type(value).__mro__)


def _past_length(cache: Any, layer_idx: int | None) -> int:
    try:
        return int(cache.get_seq_length() if layer_idx is None else cache.get_seq_length(layer_idx))
    except (IndexError, KeyError):
        return 0
