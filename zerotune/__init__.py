"""zerotune: memory-efficient distributed training and fine-tuning for PyTorch.

A DeepSpeed script runs unchanged with ``import zerotune as deepspeed``.
"""

from zerotune import checkpointing, zero
from zerotune.distributed import comm
from zerotune.distributed.env import init_distributed
from zerotune.engine import Engine
from zerotune.initialize import add_config_arguments, initialize

__version__ = "0.1.0"
DeepSpeedEngine = Engine  # the name DeepSpeed scripts use in isinstance checks and type hints

__all__ = ["initialize", "zero", "checkpointing", "init_distributed", "add_config_arguments", "comm", "Engine", "DeepSpeedEngine",
           "__version__"]
