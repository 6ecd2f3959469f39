"""Which contiguous run of layers each pipeline stage owns (pure arithmetic, no processes).

``partition_method`` as DeepSpeed spells it:
* ``"parameters"`` -- balance the stages' parameter counts;
* ``"uniform"`` -- balance the number of layers;
* ``"type:REGEX"`` -- balance the number of layers whose class name matches REGEX (e.g.
  ``"type:GPT2Block"``), so embeddings and heads ride along with their neighbours.

Balancing = contiguous parts minimising the heaviest part (binary search over that bound with a
greedy fill), with every stage owning at least one layer.
"""

from __future__ import annotations

import re
from typing import Sequence


class PartitionError(ValueError):
    """The layers cannot be split as asked; the message names the numbers."""


def _greedy(weights: Sequence[int], parts: int, bound: int) -> list[int] | None:
    """Fill stages left to right up to ``bound``; open a stage early when the layers left are just enough
    for one per remaining stage. The boundaries, or None when some stage would exceed ``bound``."""
    boundaries, load = [0], 0
    for index, weight in enumerate(weights):
        if index > boundaries[-1]:
            stages_to_open = parts - len(boundaries)
            if stages_to_open > 0 and (load + weight > bound or len(weights) - index == stages_to_open):
                boundaries.append(index)
                load = 0
        load += weight
        if load > bound:
            return None
    return boundaries + [len(weights)] if len(boundaries) == parts else None


def balanced_boundaries(weights: Sequence[int], parts: int) -> list[int]:
    """Boundaries ``b`` (len parts + 1): stage s owns layers ``[b[s], b[s+1])``; heaviest stage minimal."""
    if parts < 1:
        raise PartitionError(f"num_stages must be >= 1, got {parts}")
    if parts > len(weights):
        raise PartitionError(f"{parts} pipeline stages but only {len(weights)} layer(s): every stage needs at "
                             f"least one layer; use at most {len(weights)} stages")
    low, high = max(weights, default=0), sum(weights)
    while low < high:
        middle = (low + high) // 2
        if _greedy(weights, parts, middle) is not None:
            high = middle
        else:
            low = middle + 1
    boundaries = _greedy(weights, parts, low)
    if boundaries is None:  # (the search only ever lowers ``high`` to a load that fits, starting from the sum)
        raise PartitionError(f"no partition of {len(weights)} layers into {parts} stages fits a load of {low}")
    return boundaries


def layer_weights(method: str, param_counts: Sequence[int], class_names: Sequence[str]) -> list[int]:
    """Per-layer weights for ``method`` (see the module docstring)."""
    if method == "parameters":
        return list(param_counts)
    if method == "uniform":
        return [1] * len(param_counts)
    if method.startswith("type:"):
        pattern = method[len("type:"):]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as error:
            raise PartitionError(f"partition_method {method!r}: {pattern!r} is not a valid regex ({error})") from None
        weights = [1 if regex.search(name) else 0 for name in class_names]
        if not any(weights):
            raise PartitionError(f"partition_method {method!r}: no layer class matches {pattern!r} "
                                 f"(layer classes: {sorted(set(class_names))})")
        return weights
    raise PartitionError(f"partition_method {method!r} is not one of 'parameters', 'uniform', 'type:REGEX'")
