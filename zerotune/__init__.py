"""zerotune: memory-efficient distributed training and fine-tuning for PyTorch.

A DeepSpeed script runs unchanged under ``zerotune run --as-deepspeed`` (or after
``zerotune.install_deepspeed_alias()``, which makes ``import deepspeed`` resolve here), or with
its import changed to ``import zerotune as deepspeed``.

This file is the package's front door and the one place the core meets the DeepSpeed face
(``zerotune.compat``): it offers zerotune's own API (``initialize``, ``init_inference``, ``zero``,
``Engine``) together with the DeepSpeed names a script reaches through ``zerotune.`` (``comm``,
``checkpointing``, ``add_config_arguments``, ``DeepSpeedEngine``, ``zerotune.<deepspeed path>``
submodules). Nothing else outside ``compat`` imports it (tests/test_import_graph.py).
"""

from zerotune import zero
from zerotune.compat import checkpointing, comm
from zerotune.compat.alias import install_deepspeed_alias, install_zerotune_deepspeed_paths, uninstall_deepspeed_alias
from zerotune.compat.arguments import add_config_arguments
from zerotune.compat.spellings import install_spellings
from zerotune.distributed.env import init_distributed
from zerotune.engine import Engine
from zerotune.inference import init_inference
from zerotune.initialize import initialize

__version__ = "0.1.0"
install_zerotune_deepspeed_paths()  # ``import zerotune.runtime.pipe.engine`` etc., as DeepSpeed's paths
install_spellings()  # DeepSpeedEngine.initialize(...), PipelineEngine(model, config=...)
DeepSpeedEngine = Engine  # the name DeepSpeed scripts use in isinstance checks and type hints

__all__ = ["initialize", "init_inference", "zero", "checkpointing", "init_distributed", "add_config_arguments", "comm",
           "Engine", "DeepSpeedEngine", "install_deepspeed_alias", "uninstall_deepspeed_alias", "__version__"]
