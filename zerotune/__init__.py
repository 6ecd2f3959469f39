"""zerotune: memory-efficient distributed training and fine-tuning for PyTorch.

A DeepSpeed script runs unchanged under ``zerotune run --as-deepspeed`` (or after
``zerotune.install_deepspeed_alias()``, which makes ``import deepspeed`` resolve here), or with
its import changed to ``import zerotune as deepspeed``.
"""

from zerotune import checkpointing, comm, zero
from zerotune.compat.alias import install_deepspeed_alias, install_zerotune_deepspeed_paths, uninstall_deepspeed_alias
from zerotune.compat.spellings import install_spellings
from zerotune.distributed.env import init_distributed
from zerotune.engine import Engine
from zerotune.inference import init_inference
from zerotune.initialize import add_config_arguments, initialize

__version__ = "0.1.0"
install_zerotune_deepspeed_paths()  # ``import zerotune.runtime.pipe.engine`` etc., as DeepSpeed's paths
install_spellings()  # DeepSpeedEngine.initialize(...), PipelineEngine(model, config=...)
DeepSpeedEngine = Engine  # the name DeepSpeed scripts use in isinstance checks and type hints

__all__ = ["initialize", "init_inference", "zero", "checkpointing", "init_distributed", "add_config_arguments", "comm",
           "Engine", "DeepSpeedEngine", "install_deepspeed_alias", "uninstall_deepspeed_alias", "__version__"]
