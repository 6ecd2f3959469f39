"""``deepspeed.checkpoint.constants``: DeepSpeed's names of the keys and files of its checkpoint layout.

Only the names zerotune actually reads: the keys and file names of a DeepSpeed-layout checkpoint that
``zerotune/checkpoint/deepspeed_format.py`` takes over (ZeRO 1-3 model and optimizer files), and the client-state
key ``UNIVERSAL_CHECKPOINT_INFO``, which DeepSpeed's converter requires and zerotune keeps with the client state,
and the keys of that info's tensor-parallel schema (row-parallel / replicated / vocabulary parameter patterns,
sub-parameters), which ``deepspeed.initialize`` leaves on a model it split (``autotp_checkpoint_info.py``,
derived from zerotune's layout records: zerotune itself joins shards by those records). DeepSpeed's pipeline
layer files, AutoEP and folding metadata are left out: zerotune has no expert parallelism.
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

# the universal-checkpoint info's tensor-parallel schema (autotp_checkpoint_info.py)
UNIVERSAL_CHECKPOINT_VERSION_KEY = "universal_checkpoint_version"
UNIVERSAL_CHECKPOINT_VERSION_VALUE = 0.3
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
VOCABULARY_PARAMETER_PATTERNS = "vocabulary_parameter_patterns"
PARAMETER_WITH_ROW_PARALLELISM_PATTERNS = "parameter_with_row_parallelism_patterns"
TP_REPLICATED_PARAMETER_PATTERNS = "tp_replicated_parameter_patterns"
PARAMETER_WITH_SUB_PARAMS = "parameter_with_sub_params"

__all__ = ["OPTIMIZER_STATE_DICT", "FP32_FLAT_GROUPS", "BASE_OPTIMIZER_STATE", "BASE_OPTIMIZER_STATE_STEP",
           "SINGLE_PARTITION_OF_FP32_GROUPS", "PARAM_GROUPS", "GROUP_PADDINGS", "PARTITION_COUNT", "ZERO_STAGE",
           "PARAM_SHAPES", "BUFFER_NAMES", "FROZEN_PARAM_SHAPES", "FROZEN_PARAM_FRAGMENTS", "DS_VERSION",
           "MODEL_FILE_PREFIX", "ZERO_FILE_PREFIX", "BF16_ZERO_FILE_PREFIX", "OPTIM_FILE_SUFFIX", "MODEL_FILE_SUFFIX",
           "UNIVERSAL_CHECKPOINT_INFO", "UNIVERSAL_CHECKPOINT_VERSION_KEY", "UNIVERSAL_CHECKPOINT_VERSION_VALUE",
           "ORIGINAL_VOCAB_SIZE", "VOCABULARY_PARAMETER_PATTERNS", "PARAMETER_WITH_ROW_PARALLELISM_PATTERNS",
           "TP_REPLICATED_PARAMETER_PATTERNS", "PARAMETER_WITH_SUB_PARAMS"]
