"""``deepspeed.checkpoint.constants``: DeepSpeed's names of the keys and files of its checkpoint layout.

Only the names zerotune actually reads: the keys and file names of a DeepSpeed-layout checkpoint that
``zerotune/checkpoint/deepspeed_format.py`` takes over (ZeRO 1-3 model and optimizer files), and the client-state
key ``UNIVERSAL_CHECKPOINT_INFO``, which DeepSpeed's converter requires and zerotune keeps with the client state.
DeepSpeed's tensor-parallel merge patterns (vocabulary / row-parallel / replicated parameter patterns), its
pipeline layer files, AutoEP and folding metadata are left out: zerotune joins tensor-parallel shards by its own
layout records (``parallel/tensor/layout.py``) and has no expert parallelism.
"""

from __future__ import annotations

# optimizer files (zero_pp_rank_{r}_mp_rank_00_optim_states.pt)
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
FP32_FLAT_GROUPS = "fp32_flat_groups"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
BASE_OPTIMIZER_STATE_STEP = "base_optimizer_state_step"
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
PARAM_GROUPS = "param_groups"
GROUP_PADDINGS = "group_paddings"
PARTITION_COUNT = "partition_count"
ZERO_STAGE = "zero_stage"

# model files (mp_rank_00_model_states.pt; zero_pp_rank_{r}_mp_rank_00_model_states.pt at stage 3)
PARAM_SHAPES = "param_shapes"
BUFFER_NAMES = "buffer_names"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"
DS_VERSION = "ds_version"

# file names
MODEL_FILE_PREFIX = "mp_rank_"
ZERO_FILE_PREFIX = "zero_pp_rank_"
BF16_ZERO_FILE_PREFIX = "bf16_" + ZERO_FILE_PREFIX
OPTIM_FILE_SUFFIX = "_optim_states.pt"
MODEL_FILE_SUFFIX = "_model_states.pt"

# client state
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"

__all__ = ["OPTIMIZER_STATE_DICT", "FP32_FLAT_GROUPS", "BASE_OPTIMIZER_STATE", "BASE_OPTIMIZER_STATE_STEP",
           "SINGLE_PARTITION_OF_FP32_GROUPS", "PARAM_GROUPS", "GROUP_PADDINGS", "PARTITION_COUNT", "ZERO_STAGE",
           "PARAM_SHAPES", "BUFFER_NAMES", "FROZEN_PARAM_SHAPES", "FROZEN_PARAM_FRAGMENTS", "DS_VERSION",
           "MODEL_FILE_PREFIX", "ZERO_FILE_PREFIX", "BF16_ZERO_FILE_PREFIX", "OPTIM_FILE_SUFFIX", "MODEL_FILE_SUFFIX",
           "UNIVERSAL_CHECKPOINT_INFO"]
