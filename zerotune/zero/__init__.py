"""ZeRO: partitioned optimizer state (stage 1), gradients (stage 2) and parameters (stage 3).

``zerotune.zero.Init`` and ``zerotune.zero.GatheredParameters`` are DeepSpeed's stage-3 contexts.
"""

from zerotune.zero.stage3.gathered import GatheredParameters
from zerotune.zero.stage3.init import Init
from zerotune.zero.stage3.loading import WeightLoadingError, load_partitioned_weights

__all__ = ["GatheredParameters", "Init", "load_partitioned_weights", "WeightLoadingError"]
