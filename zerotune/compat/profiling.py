"""``deepspeed.profiling``: the package DeepSpeed code reaches the flops profiler through
(``deepspeed.profiling.flops_profiler``, which is ``zerotune.profiling`` under the alias)."""

from zerotune import profiling as flops_profiler

__all__ = ["flops_profiler"]
