"""``deepspeed.runtime.constants``: DeepSpeed's config key names and the defaults zerotune applies to them.

Each ``*_DEFAULT`` is read from zerotune's schema (``ZeroTuneConfig``), so the constant says what the engine does
when a config omits the key. They are DeepSpeed 0.18's defaults (the release zerotune's alias reports). One differs
from DeepSpeed 0.19.5: ``GRADIENT_CLIPPING_DEFAULT`` is 0.0 (no clipping), where 0.19 clips at 1.0 when the key is
absent (DeepSpeed PR 8068); zerotune keeps 0.18's so that a config means the same numbers it meant before,
and a config that wants clipping says ``"gradient_clipping": 1.0``.
"""

from __future__ import annotations

from typing import Any

from zerotune.config.schema import ZeroTuneConfig

# The route a PipelineEngine batch takes (DeepSpeed's names)
ROUTE_TRAIN = "train"
ROUTE_EVAL = "eval"
ROUTE_PREDICT = "predict"
ROUTE_ENCODE = "encode"


def _default(key: str) -> Any:
    return ZeroTuneConfig.model_fields[key].default


TRAIN_BATCH_SIZE = "train_batch_size"
TRAIN_BATCH_SIZE_DEFAULT = _default(TRAIN_BATCH_SIZE)
TRAIN_MICRO_BATCH_SIZE_PER_GPU = "train_micro_batch_size_per_gpu"
TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT = _default(TRAIN_MICRO_BATCH_SIZE_PER_GPU)
GRADIENT_ACCUMULATION_STEPS = "gradient_accumulation_steps"
GRADIENT_ACCUMULATION_STEPS_DEFAULT = _default(GRADIENT_ACCUMULATION_STEPS)
OPTIMIZER = "optimizer"
OPTIMIZER_TYPE_DEFAULT = None
OPTIMIZER_PARAMS = "params"
TYPE = "type"
SCHEDULER = "scheduler"
SCHEDULER_TYPE_DEFAULT = None
SCHEDULER_PARAMS = "params"
MAX_GRAD_NORM = "max_grad_norm"  # an optimizer param DeepSpeed refuses in favour of gradient_clipping
FP16 = "fp16"
BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"
GRADIENT_CLIPPING = "gradient_clipping"
GRADIENT_CLIPPING_DEFAULT = _default(GRADIENT_CLIPPING)
LOG_LEVEL = "log_level"
LOG_LEVEL_DEFAULT = _default(LOG_LEVEL)
STEPS_PER_PRINT = "steps_per_print"
STEPS_PER_PRINT_DEFAULT = _default(STEPS_PER_PRINT)
WALL_CLOCK_BREAKDOWN = "wall_clock_breakdown"
WALL_CLOCK_BREAKDOWN_DEFAULT = _default(WALL_CLOCK_BREAKDOWN)
MEMORY_BREAKDOWN = "memory_breakdown"
MEMORY_BREAKDOWN_DEFAULT = _default(MEMORY_BREAKDOWN)
PRESCALE_GRADIENTS = "prescale_gradients"
PRESCALE_GRADIENTS_DEFAULT = _default(PRESCALE_GRADIENTS)
GRADIENT_PREDIVIDE_FACTOR = "gradient_predivide_factor"
GRADIENT_PREDIVIDE_FACTOR_DEFAULT = _default(GRADIENT_PREDIVIDE_FACTOR)
SPARSE_GRADIENTS = "sparse_gradients"
SPARSE_GRADIENTS_DEFAULT = _default(SPARSE_GRADIENTS)
ZERO_ALLOW_UNTESTED_OPTIMIZER = "zero_allow_untested_optimizer"
ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT = _default(ZERO_ALLOW_UNTESTED_OPTIMIZER)
COMMUNICATION_DATA_TYPE = "communication_data_type"
COMMUNICATION_DATA_TYPE_DEFAULT = _default(COMMUNICATION_DATA_TYPE)
DATALOADER_DROP_LAST = "dataloader_drop_last"
DATALOADER_DROP_LAST_DEFAULT = _default(DATALOADER_DROP_LAST)
