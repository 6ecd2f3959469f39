"""Per-module FLOPs, MACs, parameters and latency of a model's forward, with DeepSpeed's flops profiler API
(``deepspeed.profiling.flops_profiler`` under the alias).

``FlopsProfiler`` measures the forwards between ``start_profile`` and ``stop_profile`` and prints them as
DeepSpeed does; ``get_model_profile`` profiles one forward outside training; the engine runs a profiler at the
config's ``flops_profiler.profile_step``. The counts come from torch's ``FlopCounterMode`` (``counting.py``).
"""

from zerotune.profiling.formatting import (
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)
from zerotune.profiling.profiler import FlopsProfiler, get_model_profile

__all__ = ["FlopsProfiler", "get_model_profile", "number_to_string", "macs_to_string", "flops_to_string",
           "bytes_to_string", "params_to_string", "duration_to_string"]
