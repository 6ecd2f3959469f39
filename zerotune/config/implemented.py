"""``assert_implemented``: reject modelled features the engine cannot run yet.

Loading accepts the whole modelled schema (so ``zerotune check`` can validate any
config); ``initialize`` calls this to fail before any work starts instead of silently
training differently from what the config asks. Each rule is one row of a table so
the list grows (shrinks) as the engine does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .errors import NotSupportedYetError
from .schema import ZeroTuneConfig

# (dotted path, predicate "value is unsupported", what is implemented)
_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("zero_optimization.zero_quantized_weights", bool, "false"),
    ("zero_optimization.zero_quantized_nontrainable_weights", bool, "false"),
    ("zero_optimization.zero_quantized_gradients", bool, "false"),
    ("zero_optimization.zero_hpz_partition_size", lambda v: v > 1, "1"),
    ("zero_optimization.mics_shard_size", lambda v: v > 0, "-1"),
    ("activation_checkpointing.partition_activations", bool, "false"),
    ("checkpoint.use_node_local_storage", bool, "false"),
    ("aio.use_gds", bool, "false"),
    ("memory_breakdown", bool, "false"),
)


def refused_paths() -> frozenset[str]:
    """The dotted keys this table refuses for some values (what a key-coverage test counts as "refused")."""
    return frozenset(path for path, _, _ in _RULES)


def assert_implemented(cfg: ZeroTuneConfig, *, zero_stages: Iterable[int] = (0,)) -> None:
    """Raise NotSupportedYetError for the first configured feature the engine lacks."""
    stages = tuple(zero_stages)
    stage = cfg.zero_optimization.stage
    if stage not in stages:
        implemented = ", ".join(str(s) for s in stages)
        raise NotSupportedYetError("zero_optimization.stage",
                                   f"{stage} is not supported yet (implemented: {implemented})")
    for path, unsupported, implemented in _RULES:
        value = _get(cfg, path)
        if isinstance(value, str) and value == "auto":
            continue  # an unresolved value is resolve_config's business, not a feature choice
        if unsupported(value):
            shown = str(value).lower() if isinstance(value, bool) else value
            raise NotSupportedYetError(path, f"{shown} is not supported yet (implemented: {implemented})")


def _get(cfg: ZeroTuneConfig, path: str) -> Any:
    node: Any = cfg
    for part in path.split("."):
        node = getattr(node, part)
    return node
