"""Which contiguous run of layers each pipeline stage owns (pure arithmetic, no processes).

``partition_method`` as DeepSpeed spells it:
* ``"parameters"`` -- balance the stages' parameter counts;
* ``"uniform"`` -- balance the number of layers;
* ``"type:REGEX"`` -- balance the number of layers whose class name matches REGEX (e.g.
  ``"type:GPT2Block"``), so embeddings and heads ride along with their neighbours.

Balancing = contiguous parts, every stage owning at least one layer, whose heaviest part is as light as
possible and, among those, whose lightest part is as heavy as possible (so no stage idles more than it must).
DeepSpeed's ``runtime.utils.partition_balanced`` / ``partition_uniform`` are this function too
(``zerotune/compat/runtime_utils.py``).

How: every part weighs the difference of two prefix sums, so the best bounds are among those differences.
A binary search over them finds the lightest feasible heaviest part, a second one the heaviest feasible
lightest part under it; feasibility is a table of which layer prefixes split into ``j`` parts within the
bounds (``_reach``, linear per part count). Weights may be integers or floats: bounds are compared with the
same subtractions the parts are weighed with, so a float bound is exact.
"""

from __future__ import annotations

import re
from itertools import accumulate
from typing import Callable, Sequence

Weight = float
"""A layer's weight: an int (parameter or layer count) or a float (DeepSpeed's partition_balanced accepts both)."""


class PartitionError(ValueError):
    """The layers cannot be split as asked; the message names the numbers."""


def _reach(prefix: Sequence[Weight], parts: int, low: Weight, high: Weight) -> list[list[bool]]:
    """``reach[j][i]``: the first ``i`` layers split into ``j`` non-empty parts each weighing within [low, high].

    For a fixed end ``i`` the last part's start ``k`` is valid on a contiguous range (the part weighs less as
    ``k`` grows), and both ends of that range only move right as ``i`` grows: two pointers, and a running count
    of the reachable starts, make each row linear."""
    n = len(prefix) - 1
    reach = [[i == 0 for i in range(n + 1)]]
    for _ in range(parts):
        count = list(accumulate(reach[-1], initial=0))  # count[k]: reachable starts among [0, k)
        row = [False] * (n + 1)
        first = last = 0  # valid starts: [first, last)
        for i in range(1, n + 1):
            while first < i and prefix[i] - prefix[first] > high:
                first += 1
            while last < i and prefix[i] - prefix[last] >= low:
                last += 1
            row[i] = count[last] > count[first]
        reach.append(row)
    return reach


def _first_fitting(candidates: Sequence[Weight], fits: Callable[[Weight], bool]) -> Weight:
    """The first candidate that fits, where fitting is monotone along ``candidates`` and the last one fits."""
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        middle = (lo + hi) // 2
        if fits(candidates[middle]):
            hi = middle
        else:
            lo = middle + 1
    return candidates[lo]


def balanced_boundaries(weights: Sequence[Weight], parts: int) -> list[int]:
    """Boundaries ``b`` (len parts + 1): stage s owns layers ``[b[s], b[s+1])``; heaviest stage minimal, then
    lightest stage maximal; of several such splits, the one whose later stages are lightest."""
    if parts < 1:
        raise PartitionError(f"num_stages must be >= 1, got {parts}")
    if parts > len(weights):
        raise PartitionError(f"{parts} pipeline stages but only {len(weights)} layer(s): every stage needs at "
                             f"least one layer; use at most {len(weights)} stages")
    if any(w < 0 for w in weights):
        raise PartitionError(f"layer weights must be >= 0, got {min(weights)}")
    prefix = list(accumulate(weights, initial=0))
    n = len(weights)
    sums = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    high = _first_fitting(sums, lambda bound: _reach(prefix, parts, float("-inf"), bound)[parts][n])
    lows = [s for s in reversed(sums) if s <= high]  # heaviest first: the first that fits is the best
    low = _first_fitting(lows, lambda bound: _reach(prefix, parts, bound, high)[parts][n])
    reach = _reach(prefix, parts, low, high)
    boundaries = [n]
    for j in range(parts, 0, -1):  # from the end, each part's start as late as the earlier parts allow
        end = boundaries[-1]
        boundaries.append(next(k for k in range(end - 1, -1, -1)
                               if reach[j - 1][k] and low <= prefix[end] - prefix[k] <= high))
    return boundaries[::-1]


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
