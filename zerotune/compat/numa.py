"""``deepspeed.utils.numa``: DeepSpeed's core-list parser; binding ranks to cores is refused.

``parse_range_list`` reads the ``--bind_core_list`` syntax (``"0,2-4,6"``: single cores and inclusive ranges, in
ascending order, not overlapping) as DeepSpeed's does, so a script or tool validating such a list keeps working.
Binding itself (``get_numactl_cmd``: a ``numactl`` prefix per rank) is refused: zerotune's launcher is torchrun,
which does not bind ranks to cores, and the launcher refuses ``--bind_cores_to_rank`` in the same words.
"""

from __future__ import annotations

from zerotune.compat.refusals import refused_function


def _parse_range(sub_range: str) -> list[int]:
    bounds = sub_range.split("-")
    try:
        if len(bounds) == 1:
            return [int(bounds[0])]
        if len(bounds) == 2:
            first, last = int(bounds[0]), int(bounds[1])
            if first <= last:
                return list(range(first, last + 1))
    except ValueError:
        pass
    raise ValueError(f"Bad range: '{sub_range}': give a core number or an ascending range 'first-last'")


def parse_range_list(range_str: str) -> list[int]:
    """The cores of ``range_str`` (``"0,2-4"`` -> ``[0, 2, 3, 4]``); overlapping or descending parts are a
    ValueError naming the list."""
    cores: list[int] = []
    for sub_range in range_str.split(","):
        numbers = _parse_range(sub_range.strip())
        if cores and numbers[0] <= cores[-1]:
            raise ValueError(f"Bad range: '{range_str}', sub ranges must not overlap with each other and should be "
                             "in ascending order")
        cores.extend(numbers)
    return cores


get_numactl_cmd = refused_function("deepspeed.utils.numa.get_numactl_cmd")

__all__ = ["get_numactl_cmd", "parse_range_list"]
