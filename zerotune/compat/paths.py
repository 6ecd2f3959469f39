"""Which DeepSpeed module paths exist under the ``deepspeed`` alias, and what each one is.

The one table of the compatibility layer: each DeepSpeed path maps onto a zerotune module
(zerotune's own where the names already match, else a small ``zerotune.compat`` module that
gives zerotune's objects DeepSpeed's names) and lists the public names DeepSpeed code takes
from it. ``python -m zerotune.compat.listing`` prints the table; the README's list is
generated from it, and a test imports every listed name through the alias.

Refused paths are DeepSpeed features zerotune does not have; importing one raises
``DeepSpeedFeatureNotSupported`` (an ImportError, so ``try: import ... except ImportError``
probes keep working) with one line naming the feature.
"""

from __future__ import annotations

from dataclasses import dataclass


class DeepSpeedFeatureNotSupported(ImportError, NotImplementedError):
    """A DeepSpeed feature zerotune does not implement was imported or called."""

    def __init__(self, name: str, feature: str) -> None:
        super().__init__(f"{name}: {feature} is a DeepSpeed feature zerotune does not support", name=name)
        self.feature = feature

    def __reduce__(self) -> tuple:
        # Rebuilt from both arguments: a process pool or Ray sends a worker's exception to the parent pickled, and
        # one that cannot be unpickled there kills the pool's result thread (every later task then waits forever).
        return type(self), (self.name, self.feature)


@dataclass(frozen=True)
class Mapped:
    module: str
    """The zerotune module that *is* the DeepSpeed module under the alias."""
    names: tuple[str, ...]
    """The DeepSpeed names client code takes from it (checked by the tests)."""


_COMM = ("init_distributed", "is_initialized", "is_available", "get_rank", "get_world_size", "get_local_rank",
         "get_global_rank", "get_world_group", "get_all_ranks_from_group", "get_backend", "new_group",
         "destroy_process_group", "all_reduce", "inference_all_reduce", "all_reduce_coalesced", "broadcast",
         "all_gather", "all_gather_into_tensor", "allgather_fn", "reduce_scatter_tensor", "reduce_scatter_fn",
         "reduce_scatter", "reduce", "all_to_all_single", "all_to_all", "gather", "scatter", "send", "recv",
         "isend", "irecv", "barrier", "monitored_barrier", "has_all_reduce_coalesced",
         "has_all_gather_into_tensor", "has_reduce_scatter_tensor", "configure", "log_summary", "ReduceOp",
         "comms_logger", "initialize_mesh_device")
_ACCELERATOR = ("get_accelerator", "set_accelerator", "is_current_accelerator_supported")
_PIPE = ("PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology", "PipeDataParallelTopology",
         "PipeModelDataParallelTopology")
_ZERO = ("Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter",
         "ZeroParamStatus")
_CHECKPOINTING = ("checkpoint", "configure", "is_configured", "reset", "non_reentrant_checkpoint",
                  "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed", "CudaRNGStatesTracker",
                  "PARTITION_ACTIVATIONS", "CONTIGUOUS_CHECKPOINTING", "num_layers", "CPU_CHECKPOINT", "SYNCHRONIZE",
                  "PROFILE_TIME", "mpu", "deepspeed_checkpointing_enabled")
_LR_SCHEDULES = ("VALID_LR_SCHEDULES", "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_LR", "WARMUP_DECAY_LR",
                 "WARMUP_COSINE_LR", "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
                 "add_tuning_arguments")
_FLOPS_PROFILER = ("FlopsProfiler", "get_model_profile", "number_to_string", "macs_to_string", "flops_to_string",
                   "bytes_to_string", "params_to_string", "duration_to_string")
_OPS_ADAM = ("FusedAdam", "DeepSpeedCPUAdam")
_TENSOR_FRAGMENT = ("safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_optimizer_state",
                    "safe_set_full_optimizer_state", "safe_get_full_grad", "safe_set_full_grad",
                    "safe_update_full_grad_vectorized", "safe_get_local_fp32_param", "safe_set_local_fp32_param",
                    "safe_get_local_optimizer_state", "safe_set_local_optimizer_state", "safe_get_local_grad",
                    "safe_set_local_grad")
_Z3_LEAF = ("set_z3_leaf_modules", "unset_z3_leaf_modules", "set_z3_leaf_modules_by_name",
            "set_z3_leaf_modules_by_suffix", "get_z3_leaf_modules", "z3_leaf_module")
_ELASTICITY = ("compute_elastic_config", "elasticity_enabled", "ensure_immutable_elastic_config")
_COMPRESSION = "the compression library (deepspeed.compression)"
_ALST_FLOW = ("DeepSpeed's script-sharded Ulysses flow (attention swapped in transformers' global table, batches "
              "sharded by the script; zerotune: sequence_parallel_size in the config, the engine shards full batches)")
_KERNEL_INJECTION = "inference kernel injection (init_inference splits with AutoTP and runs the model's own modules)"
_CONSTRUCTOR_PATCHING = ("zero.Init's patching of module classes and torch.nn.functional.linear (zerotune's zero.Init "
                         "uses torch's module-registration hooks and stage 3 runs torch's own linear)")
_PARAMETER_DICT = ("ZeRO-3's replacement of each module's _parameters dict (zerotune leaves modules' containers as "
                   "torch made them; a parameter used outside its module is declared with register_external_parameter)")
_TP_LAYERS_REFUSED = {
    "SubParamLinearLayer": "AutoTP's shaped sub-parameter splits (layer_specs 'shape'; zerotune splits fused outputs "
                           "with 'parts')",
    "SubParamLinearAllreduce": "AutoTP's shaped sub-parameter splits (layer_specs 'shape'; zerotune splits fused "
                               "outputs with 'parts')",
    "EmbeddingLayer": "DeepSpeed's inference kernel layers (an embedding splits as zerotune's VocabParallelEmbedding)",
    "Normalize": "DeepSpeed's inference kernel layers (norms stay the model's own modules)",
    "fused_LinearLayer": "AutoTP's per-architecture fused-qkv heuristic layer (zerotune's plans and layer_specs split "
                         "fused outputs with 'parts' / 'shape')",
}
_MODULE_INJECT_REFUSED = {
    "replace_transformer_layer": _KERNEL_INJECTION, "revert_transformer_layer": _KERNEL_INJECTION,
    "generic_injection": _KERNEL_INJECTION,
    "ReplaceWithTensorSlicing": "DeepSpeed's inference tensor slicing (AutoTP splits through zerotune.parallel.tensor)",
    "GroupQuantizer": "int8 weight quantization for the inference kernels",
    "quantize_transformer_layer": "int8 weight quantization for the inference kernels",
}

DEEPSPEED_MODULES: dict[str, Mapped] = {
    "deepspeed": Mapped("zerotune.compat.deepspeed", (
        "initialize", "init_distributed", "add_config_arguments", "add_tuning_arguments", "DeepSpeedEngine",
        "PipelineEngine", "DeepSpeedConfig", "DeepSpeedConfigError", "zero", "comm", "checkpointing", "pipe", "ops",
        "accelerator", "utils", "runtime", "get_accelerator", "__version__", "__version_major__", "__version_minor__",
        "__version_patch__", "OnDevice",
        "init_inference", "DeepSpeedTransformerLayer", "DeepSpeedTransformerConfig", "InferenceEngine",
        "DeepSpeedInferenceConfig", "tp_model_init", "_TP_MODEL_INIT_ARGS")),
    "deepspeed.comm": Mapped("zerotune.compat.comm", _COMM),
    "deepspeed.comm.comm": Mapped("zerotune.compat.comm", _COMM),
    "deepspeed.accelerator": Mapped("zerotune.compat.accelerator", _ACCELERATOR),
    "deepspeed.accelerator.real_accelerator": Mapped("zerotune.compat.accelerator", _ACCELERATOR),
    "deepspeed.accelerator.abstract_accelerator": Mapped("zerotune.compat.accelerator", ("DeepSpeedAccelerator",)),
    "deepspeed.utils": Mapped("zerotune.compat.utils", (
        "logger", "log_dist", "logging", "RepeatingLoader", "groups", *_Z3_LEAF, "set_random_seed",
        "instrument_w_nvtx", "OnDevice", "set_log_level_from_string", *_TENSOR_FRAGMENT)),
    "deepspeed.utils.z3_leaf_module": Mapped("zerotune.zero.stage3.leaves", _Z3_LEAF),
    "deepspeed.utils.init_on_device": Mapped("zerotune.zero.on_device", ("OnDevice",)),
    # one fp32 state dict from a zerotune or DeepSpeed ZeRO checkpoint (checkpoint/consolidate.py)
    "deepspeed.utils.zero_to_fp32": Mapped("zerotune.compat.zero_to_fp32", (
        "get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
        "load_state_dict_from_zero_checkpoint", "get_optim_files", "get_model_state_files", "get_checkpoint_files")),
    "deepspeed.utils.tensor_fragment": Mapped("zerotune.compat.tensor_fragment", _TENSOR_FRAGMENT),
    "deepspeed.utils.torch": Mapped("zerotune.compat.torch_version", (
        "required_torch_version", "is_functorch_transforming", "register_grad_hook", "jit_script_compat")),
    "deepspeed.utils.logging": Mapped("zerotune.compat.ds_logging", (
        "logger", "log_dist", "print_json_dist", "warning_once", "LoggerFactory", "get_current_level",
        "should_log_le", "set_log_level_from_string", "get_log_level_from_string", "log_levels")),
    # the collective layer's latency log (the process's is deepspeed.comm.comms_logger) and its trimmed mean
    "deepspeed.utils.comms_logging": Mapped("zerotune.distributed.comm_log", (
        "CommsLogger", "get_caller_func", "calc_bw_log", "convert_size")),
    "deepspeed.utils.timer": Mapped("zerotune.monitor.timers", ("trim_mean",)),
    "deepspeed.utils.numa": Mapped("zerotune.compat.numa", ("parse_range_list", "get_numactl_cmd")),
    "deepspeed.utils.nvtx": Mapped("zerotune.compat.nvtx", ("instrument_w_nvtx", "enable_nvtx",
                                                           "DEEPSPEED_NVTX_DOMAIN")),
    # the pinned host memory zerotune's offload paths allocated (offload/pinned.py)
    "deepspeed.utils.pin_memory_tracker": Mapped("zerotune.compat.pin_memory_tracker", (
        "track_pinned_memory", "pinned_memory_summary", "_tracker", "_fmt_bytes")),
    "deepspeed.utils.groups": Mapped("zerotune.compat.groups", (
        "_get_data_parallel_group", "_get_data_parallel_world_size", "_get_data_parallel_rank",
        "_get_model_parallel_group", "_get_model_parallel_world_size", "_get_model_parallel_rank",
        "_get_sequence_parallel_group", "_get_sequence_parallel_world_size", "_get_sequence_parallel_rank",
        "_get_pipe_parallel_group", "get_tensor_model_parallel_group", "get_tensor_model_parallel_world_size",
        "get_tensor_model_parallel_rank", "get_tensor_model_parallel_src_rank", "get_model_parallel_group",
        "get_model_parallel_world_size", "get_model_parallel_rank", "get_data_parallel_group",
        "get_data_parallel_world_size", "get_data_parallel_rank", "_init_tp_mesh_device",
        "_TENSOR_MODEL_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP",
        "_create_expert_and_data_parallel", "_get_expert_parallel_ranks",
        "_get_expert_parallel_group",
        "_get_expert_data_parallel_group", "_get_expert_parallel_world_size", "_get_expert_parallel_rank",
        "_get_expert_data_parallel_world_size", "_get_expert_data_parallel_rank", "_get_max_expert_size",
        "_get_max_expert_parallel_group")),
    # DeepSpeed's monitors over zerotune's scalar writers (monitor/writers.py); Comet refused when built
    "deepspeed.monitor": Mapped("zerotune.compat.monitor", ()),
    "deepspeed.monitor.config": Mapped("zerotune.compat.monitor", (
        "DeepSpeedMonitorConfig", "TensorBoardConfig", "WandbConfig", "CSVConfig", "get_monitor_config")),
    "deepspeed.monitor.monitor": Mapped("zerotune.compat.monitor", ("Monitor", "MonitorMaster")),
    "deepspeed.monitor.tensorboard": Mapped("zerotune.compat.monitor", ("TensorBoardMonitor",)),
    "deepspeed.monitor.wandb": Mapped("zerotune.compat.monitor", ("WandbMonitor",)),
    "deepspeed.monitor.csv_monitor": Mapped("zerotune.compat.monitor", ("csvMonitor",)),
    "deepspeed.monitor.comet": Mapped("zerotune.compat.monitor", ("CometMonitor",)),
    "deepspeed.runtime": Mapped("zerotune.compat.runtime", ("DeepSpeedEngine", "DeepSpeedConfig", "zero", "pipe",
                                                            "lr_schedules", "utils")),
    "deepspeed.runtime.engine": Mapped("zerotune.compat.runtime", ("DeepSpeedEngine",)),
    "deepspeed.runtime.config": Mapped("zerotune.compat.runtime", (
        "DeepSpeedConfig", "DeepSpeedConfigError", "ADAGRAD_OPTIMIZER", "ADAM_OPTIMIZER", "ADAMW_OPTIMIZER",
        "LAMB_OPTIMIZER", "ONEBIT_ADAM_OPTIMIZER", "DEEPSPEED_OPTIMIZERS", "get_gradient_clipping", "get_log_level")),
    "deepspeed.runtime.config_utils": Mapped("zerotune.compat.config_utils", (
        "DeepSpeedConfigModel", "get_config_default", "pp_int", "ScientificNotationEncoder", "DeepSpeedConfigObject",
        "get_scalar_param", "get_list_param", "get_dict_param", "dict_raise_error_on_duplicate_keys")),
    "deepspeed.runtime.precision_config": Mapped("zerotune.compat.precision_config", (
        "DeepSpeedFP16Config", "DeepSpeedBF16Config", "get_float16_config", "get_bfloat16_config", "FP16",
        "BFLOAT16", "BFLOAT16_OLD")),
    "deepspeed.runtime.constants": Mapped("zerotune.compat.runtime_constants", (
        "ROUTE_TRAIN", "ROUTE_EVAL", "ROUTE_PREDICT", "ROUTE_ENCODE", "TRAIN_BATCH_SIZE", "GRADIENT_CLIPPING",
        "GRADIENT_CLIPPING_DEFAULT", "LOG_LEVEL", "LOG_LEVEL_DEFAULT", "STEPS_PER_PRINT", "STEPS_PER_PRINT_DEFAULT",
        "FP16", "BFLOAT16", "OPTIMIZER", "SCHEDULER")),
    "deepspeed.runtime.utils": Mapped("zerotune.compat.runtime_utils", (
        "set_random_seed", "see_memory_usage", "call_to_str", "prefix_sum_inc", "partition_uniform",
        "partition_balanced", "is_model_parallel_parameter", "clip_grad_norm_", "get_weight_norm", "CheckOverflow",
        "check_internal_apis_for_count_used_parameters", "count_used_parameters_in_backward", "move_to_device")),
    "deepspeed.runtime.dataloader": Mapped("zerotune.compat.runtime", ("RepeatingLoader",)),
    # Ulysses: DeepSpeed's layer names and ALST pieces on zerotune.parallel.sequence
    "deepspeed.sequence": Mapped("zerotune.compat.sequence_layer", ()),
    "deepspeed.sequence.layer": Mapped("zerotune.compat.sequence_layer", (
        "DistributedAttention", "_SeqAllToAll", "single_all_to_all", "apply_rotary_pos_emb", "_rotate_half",
        "_torchembed_available")),
    "deepspeed.runtime.sequence_parallel": Mapped("zerotune.compat.ulysses_sp", ()),
    "deepspeed.runtime.sequence_parallel.ulysses_sp": Mapped("zerotune.compat.ulysses_sp", (
        "TiledMLP", "sequence_tiled_compute", "TiledFusedLogitsLoss", "UlyssesSPAttentionHF",
        "UlyssesSPDataLoaderAdapter")),
    # one batched reduce-scatter on zerotune's collective layer; ZeRO++'s quantized all-to-all refused when called
    "deepspeed.runtime.comm": Mapped("zerotune.compat.coalesced_collectives", ()),
    "deepspeed.runtime.comm.coalesced_collectives": Mapped("zerotune.compat.coalesced_collectives", (
        "reduce_scatter_coalesced", "all_to_all_quant_reduce")),
    "deepspeed.runtime.compiler": Mapped("zerotune.compat.compiler", (
        "is_compile_supported", "disable", "enable", "is_compiling", "compiled_autograd")),
    "deepspeed.runtime.lr_schedules": Mapped("zerotune.compat.lr_schedules", _LR_SCHEDULES),
    "deepspeed.runtime.data_pipeline": Mapped("zerotune.curriculum", ("curriculum_scheduler", "CurriculumScheduler")),
    "deepspeed.runtime.data_pipeline.curriculum_scheduler": Mapped("zerotune.curriculum.scheduler",
                                                                   ("CurriculumScheduler",)),
    "deepspeed.runtime.zero": Mapped("zerotune.compat.zero", (*_ZERO, "DeepSpeedZeRoOffload",
                                                             "unwrap_model_for_generation")),
    "deepspeed.runtime.zero.partition_parameters": Mapped("zerotune.compat.zero", (
        *_ZERO, "zero_wrapper_for_fp_tensor_constructor", "_orig_torch_arange", "get_accelerator",
        "partitioned_param_data_shape", "MultipleAllGatherHandles", "_contradicting_single_rank_pg_error",
        "MiCS_Init", "InsertPostInitMethodToModuleSubClasses", "zero3_linear_wrap")),
    "deepspeed.runtime.zero.parameter_offload": Mapped("zerotune.compat.parameter_offload", (
        "DeepSpeedZeRoOffload", "ZeROOrderedDict", "ensure_zero_ordered_dict")),
    "deepspeed.runtime.zero.linear": Mapped("zerotune.compat.zero_linear", (
        "LinearFunctionForZeroStage3", "LinearModuleForZeroStage3", "zero3_linear_wrap", "autocast_custom_fwd",
        "autocast_custom_bwd")),
    "deepspeed.runtime.zero.tiling": Mapped("zerotune.zero.tiled_linear", (
        "TiledLinear", "TiledLinearReturnBias", "split_tensor_along_last_dim")),
    "deepspeed.runtime.zero.leaf_module_config": Mapped("zerotune.compat.zero_config", (
        "DeepSpeedZeroLeafModuleConfig", "DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES",
        "DEFAULT_LEAF_MODULE_NAME_SUFFIXES")),
    "deepspeed.zero": Mapped("zerotune.compat.zero", (*_ZERO, "DeepSpeedZeRoOffload", "MiCS_Init")),
    "deepspeed.pipe": Mapped("zerotune.compat.pipe", _PIPE),
    "deepspeed.runtime.pipe": Mapped("zerotune.compat.pipe", _PIPE),
    "deepspeed.runtime.pipe.module": Mapped("zerotune.compat.pipe", ("PipelineModule", "LayerSpec", "TiedLayerSpec")),
    "deepspeed.runtime.pipe.topology": Mapped("zerotune.compat.pipe_topology", (
        "ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid")),
    "deepspeed.runtime.pipe.engine": Mapped("zerotune.compat.pipe", ("PipelineEngine",)),
    "deepspeed.runtime.pipe.schedule": Mapped("zerotune.pipe.steps", (
        "PipeSchedule", "TrainSchedule", "InferenceSchedule", "DataParallelSchedule", "PipeInstruction",
        "OptimizerStep", "ReduceGrads", "ReduceTiedGrads", "BufferOpInstruction", "LoadMicroBatch", "ForwardPass",
        "BackwardPass", "SendActivation", "RecvActivation", "SendGrad", "RecvGrad")),
    # MoE is importable (DeepSpeed code imports it at module level) and refused when built: refusals.py
    "deepspeed.moe": Mapped("zerotune.compat.moe", ()),
    "deepspeed.moe.layer": Mapped("zerotune.compat.moe", ("MoE",)),
    "deepspeed.moe.utils": Mapped("zerotune.compat.moe", (
        "is_moe_param", "has_moe_layers", "is_moe_param_group", "split_params_into_different_moe_groups_for_optimizer",
        "configure_moe_param_groups", "split_params_into_shared_and_expert_params")),
    "deepspeed.checkpointing": Mapped("zerotune.compat.checkpointing", _CHECKPOINTING),
    "deepspeed.runtime.activation_checkpointing": Mapped("zerotune.compat.checkpointing", _CHECKPOINTING),
    "deepspeed.runtime.activation_checkpointing.checkpointing": Mapped("zerotune.compat.checkpointing",
                                                                        _CHECKPOINTING),
    "deepspeed.checkpoint": Mapped("zerotune.compat.checkpoint", ("clone_tensors_for_torch_save",
                                                                 "UNIVERSAL_CHECKPOINT_INFO")),
    # the keys and files of DeepSpeed's layout that zerotune reads (checkpoint/deepspeed_format.py)
    "deepspeed.checkpoint.constants": Mapped("zerotune.compat.checkpoint_constants", (
        "OPTIMIZER_STATE_DICT", "FP32_FLAT_GROUPS", "BASE_OPTIMIZER_STATE", "SINGLE_PARTITION_OF_FP32_GROUPS",
        "PARAM_GROUPS", "GROUP_PADDINGS", "PARTITION_COUNT", "ZERO_STAGE", "PARAM_SHAPES", "BUFFER_NAMES",
        "FROZEN_PARAM_SHAPES", "FROZEN_PARAM_FRAGMENTS", "DS_VERSION", "MODEL_FILE_PREFIX", "ZERO_FILE_PREFIX",
        "BF16_ZERO_FILE_PREFIX", "OPTIM_FILE_SUFFIX", "MODEL_FILE_SUFFIX", "UNIVERSAL_CHECKPOINT_INFO",
        "UNIVERSAL_CHECKPOINT_VERSION_KEY", "UNIVERSAL_CHECKPOINT_VERSION_VALUE", "ORIGINAL_VOCAB_SIZE",
        "VOCABULARY_PARAMETER_PATTERNS", "PARAMETER_WITH_ROW_PARALLELISM_PATTERNS", "TP_REPLICATED_PARAMETER_PATTERNS",
        "PARAMETER_WITH_SUB_PARAMS")),
    # every zerotune (and DeepSpeed ZeRO 1-3) checkpoint already loads at any layout: the converter checks and copies
    "deepspeed.checkpoint.ds_to_universal": Mapped("zerotune.compat.ds_to_universal", ("main", "parse_arguments")),
    "deepspeed.checkpoint.utils": Mapped("zerotune.compat.checkpoint", ("clone_tensors_for_torch_save",
                                                                       "get_model_ckpt_name_for_rank")),
    # DeepSpeed's checkpoint-file writer API over zerotune's atomic, verified writes (checkpoint/atomic.py)
    "deepspeed.runtime.checkpoint_engine": Mapped("zerotune.compat.checkpoint_engine", (
        "CheckpointEngine", "CheckpointCommitInfo", "TorchCheckpointEngine")),
    "deepspeed.runtime.checkpoint_engine.checkpoint_engine": Mapped("zerotune.compat.checkpoint_engine", (
        "CheckpointEngine", "CheckpointCommitInfo")),
    "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine": Mapped("zerotune.compat.checkpoint_engine", (
        "TorchCheckpointEngine",)),
    "deepspeed.ops": Mapped("zerotune.compat.ops", ("adam", "lamb", "adagrad", "op_builder", "__compatible_ops__",
                                                    "__installed_ops__")),
    "deepspeed.ops.op_builder": Mapped("zerotune.compat.op_builder", (
        "OpBuilder", "ALL_OPS", "CPUAdamBuilder", "FusedAdamBuilder", "FusedLambBuilder", "AsyncIOBuilder",
        "InferenceBuilder", "TransformerBuilder", "QuantizerBuilder", "SparseAttnBuilder", "PinMemoryBuilder")),
    "deepspeed.ops.op_builder.all_ops": Mapped("zerotune.compat.op_builder", ("ALL_OPS",)),
    "deepspeed.ops.aio": Mapped("zerotune.compat.op_builder", ("AsyncIOBuilder",)),
    "deepspeed.runtime.swap_tensor": Mapped("zerotune.compat.swap_tensor", ("MIN_SWAPPABLE_BYTES", "MIN_AIO_BYTES",
                                                                          "AIO_ALIGNED_BYTES")),
    "deepspeed.git_version_info": Mapped("zerotune.compat.git_version_info", (
        "version", "git_hash", "git_branch", "installed_ops", "compatible_ops", "torch_info")),
    "deepspeed.ops.adam": Mapped("zerotune.compat.ops", _OPS_ADAM),
    "deepspeed.ops.lamb": Mapped("zerotune.compat.ops", ("FusedLamb",)),
    "deepspeed.ops.adagrad": Mapped("zerotune.compat.ops", ("DeepSpeedCPUAdagrad",)),
    # zerotune's short path for the ZeRO optimizer wrapper driven without the engine (compat/pt.py); DeepSpeed's
    # own classes live in runtime.zero
    "deepspeed.pt": Mapped("zerotune.compat.pt", ("DeepSpeedZeROOptimizer",)),
    "deepspeed.runtime.fp16": Mapped("zerotune.compat.fp16", ("fused_optimizer", "unfused_optimizer")),
    "deepspeed.runtime.bf16_optimizer": Mapped("zerotune.compat.bf16_optimizer", ("BF16_Optimizer",)),
    "deepspeed.runtime.fp16.fused_optimizer": Mapped("zerotune.compat.fp16", ("FP16_Optimizer",)),
    "deepspeed.runtime.fp16.unfused_optimizer": Mapped("zerotune.compat.fp16", ("FP16_UnfusedOptimizer",)),
    "deepspeed.launcher": Mapped("zerotune.compat.launcher", ("runner",)),
    "deepspeed.launcher.runner": Mapped("zerotune.compat.launcher", (
        "DEEPSPEED_ENVIRONMENT_NAME", "DEEPSPEED_ENVIRONMENT_PATHS", "parse_args", "main")),
    "deepspeed.runtime.zero.utils": Mapped("zerotune.compat.zero_utils", ("ZeRORuntimeException",)),
    "deepspeed.runtime.zero.config": Mapped("zerotune.compat.zero_config", (
        "DeepSpeedZeroConfig", "DeepSpeedZeroOffloadParamConfig", "DeepSpeedZeroOffloadOptimizerConfig",
        "ZeroStageEnum")),
    "deepspeed.runtime.zero.stage_1_and_2": Mapped("zerotune.compat.stage_1_and_2", (
        "DeepSpeedZeroOptimizer", "estimate_zero2_model_states_mem_needs",
        "estimate_zero2_model_states_mem_needs_all_live",
        "estimate_zero2_model_states_mem_needs_all_cold", "model_to_params")),
    "deepspeed.runtime.zero.stage3": Mapped("zerotune.compat.stage3", (
        "DeepSpeedZeroOptimizer_Stage3", "estimate_zero3_model_states_mem_needs",
        "estimate_zero3_model_states_mem_needs_all_live", "estimate_zero3_model_states_mem_needs_all_cold",
        "model_to_params")),
    # engine.offload_states(include=[OffloadStateTypeEnum...], device=OffloadDeviceEnum.cpu) and its helpers
    "deepspeed.runtime.zero.offload_config": Mapped("zerotune.compat.offload_states", (
        "OffloadDeviceEnum", "OffloadStateTypeEnum", "DeepSpeedZeroOffloadParamConfig",
        "DeepSpeedZeroOffloadOptimizerConfig")),
    "deepspeed.runtime.zero.offload_states": Mapped("zerotune.compat.offload_states", ("get_state_devices",)),
    # init_inference on zerotune's AutoTP (zerotune/inference/); kernel injection refused by name
    "deepspeed.inference": Mapped("zerotune.compat.inference", ("InferenceEngine", "DeepSpeedInferenceConfig")),
    "deepspeed.inference.engine": Mapped("zerotune.inference.engine", ("InferenceEngine",)),
    "deepspeed.inference.config": Mapped("zerotune.compat.inference",
                                         ("DeepSpeedInferenceConfig", "DeepSpeedTPConfig")),
    "deepspeed.module_inject": Mapped("zerotune.compat.module_inject", (
        "AutoTP", "LinearAllreduce", "LinearLayer", "set_autotp_mode", *_MODULE_INJECT_REFUSED)),
    # DeepSpeed's tensor-parallel layer names on zerotune's column/row-parallel layers (parallel/tensor/layers.py)
    "deepspeed.module_inject.layers": Mapped("zerotune.compat.tp_layers", (
        "LinearLayer", "LinearAllreduce", "LmHeadLinearAllreduce", "set_autotp_mode", "is_autotp_training_mode",
        *_TP_LAYERS_REFUSED)),
    # DeepSpeed's AutoTP driver (AutoTPConfig specs -> zerotune's layers, by hand) and the config names it re-exports
    "deepspeed.module_inject.auto_tp": Mapped("zerotune.compat.auto_tp", ("AutoTP", "AutoTPConfig", "PartitionType",
                                                                         "TPLayerSpec")),
    # DeepSpeed's partition-config objects and HF tp_plan converter over zerotune's LayerRules (parallel/tensor)
    "deepspeed.module_inject.autotp_config": Mapped("zerotune.compat.autotp_config", (
        "AutoTPConfig", "PartitionType", "TPLayerSpec")),
    "deepspeed.module_inject.tp_plan_converter": Mapped("zerotune.compat.tp_plan_converter", ("TPPlanConverter",)),
    "deepspeed.runtime.tensor_parallel": Mapped("zerotune.compat.tensor_parallel_config", ()),
    "deepspeed.runtime.tensor_parallel.config": Mapped("zerotune.compat.tensor_parallel_config", ("_get_hf_tp_plan",)),
    # the dotted-path helpers DeepSpeed-Chat's LoRA imports; the compression library itself refused
    "deepspeed.compression": Mapped("zerotune.compat.compression", ("init_compression", "redundancy_clean")),
    "deepspeed.compression.helper": Mapped("zerotune.compat.compression", ("recursive_getattr", "recursive_setattr")),
    # the elastic batch a resource scheduler plans with; the engine applies the config's block itself
    # DeepSpeed's flops profiler on torch's FlopCounterMode (zerotune/profiling/); the engine runs it at the
    # config's flops_profiler.profile_step
    "deepspeed.profiling": Mapped("zerotune.compat.profiling", ("flops_profiler",)),
    "deepspeed.profiling.flops_profiler": Mapped("zerotune.profiling", _FLOPS_PROFILER),
    "deepspeed.profiling.flops_profiler.profiler": Mapped("zerotune.profiling", _FLOPS_PROFILER),
    "deepspeed.elasticity": Mapped("zerotune.compat.elasticity", (*_ELASTICITY, "is_torch_elastic_compatible",
                                                                 "DSElasticAgent", "ELASTICITY", "ENABLED",
                                                                 "ENABLED_DEFAULT", "config", "elasticity")),
    "deepspeed.elasticity.elasticity": Mapped("zerotune.compat.elasticity", _ELASTICITY),
    "deepspeed.elasticity.config": Mapped("zerotune.compat.elasticity", (
        "ElasticityConfig", "ElasticityError", "ElasticityConfigError", "ElasticityIncompatibleWorldSize")),
    "deepspeed.elasticity.constants": Mapped("zerotune.compat.elasticity", (
        "ELASTICITY", "ENABLED", "ENABLED_DEFAULT", "LATEST_ELASTICITY_VERSION", "MINIMUM_DEEPSPEED_VERSION",
        "DEEPSPEED_ELASTICITY_CONFIG")),
}

REFUSED_MODULES: dict[str, str] = {
    "deepspeed.sequence.fpdt_layer": "FPDT (chunked, host-offloaded Ulysses attention: deepspeed.sequence.fpdt_layer)",
    "deepspeed.compile": "DeepCompile's graph passes (deepspeed.compile; engine.compile() runs torch.compile)",
    "deepspeed.inference.v2": "DeepSpeed-FastGen (inference v2: ragged batching and its kernels)",
    "deepspeed.module_inject.replace_module": _KERNEL_INJECTION,
    "deepspeed.module_inject.containers": _KERNEL_INJECTION,
    "deepspeed.model_implementations": "the fused inference kernels' model implementations",
    "deepspeed.moe.experts": "Mixture-of-Experts layers (deepspeed.moe)",
    "deepspeed.moe.sharded_moe": "Mixture-of-Experts layers (deepspeed.moe)",
    "deepspeed.ops.sparse_attention": "sparse attention (deepspeed.ops.sparse_attention)",
    "deepspeed.runtime.sparse_tensor": ("the row-sparse exchange of embedding gradients (SparseTensor; zerotune "
                                        "reduces them dense: the same values)"),
    "deepspeed.ops.transformer": "the fused transformer kernel (DeepSpeedTransformerLayer)",
    "deepspeed.compression.compress": _COMPRESSION,
    "deepspeed.compression.basic_layer": _COMPRESSION,
    "deepspeed.compression.scheduler": _COMPRESSION,
    "deepspeed.runtime.data_pipeline.data_sampling": "the data efficiency library's data sampler and offline data "
                                                     "analyzer (the data_efficiency curriculum runs on the engine's "
                                                     "data loader instead)",
    "deepspeed.runtime.data_pipeline.data_routing": "random layerwise token dropping (random-LTD)",
    "deepspeed.runtime.torch_autocast": ("torch_autocast (torch.autocast inside the engine with per-parameter "
                                         "communication dtypes; zerotune's mixed precision is the bf16 / fp16 "
                                         "sections, its gradients' wire dtype communication_data_type)"),
}

# Names refused when *called* (they live in modules that are otherwise supported).
REFUSED_NAMES: dict[str, str] = {
    "deepspeed.utils.numa.get_numactl_cmd": "binding ranks to cores (numactl; zerotune's launcher is torchrun)",
    "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF": _ALST_FLOW,
    "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPDataLoaderAdapter": _ALST_FLOW,
    "deepspeed.runtime.bf16_optimizer.BF16_Optimizer": "DeepSpeed's bf16 optimizer wrapper (zerotune's bf16 masters "
                                                       "live in the engine)",
    "deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer": "DeepSpeed's fp16 optimizer wrapper (zerotune's mixed "
                                                             "precision lives in the engine)",
    "deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer": "DeepSpeed's fp16 optimizer wrapper (zerotune's "
                                                                      "mixed precision lives in the engine)",
    "deepspeed.moe.layer.MoE": "Mixture-of-Experts layers (deepspeed.moe)",
    "deepspeed.compression.init_compression": _COMPRESSION,
    "deepspeed.compression.redundancy_clean": _COMPRESSION,
    **{f"deepspeed.module_inject.{name}": feature for name, feature in _MODULE_INJECT_REFUSED.items()},
    **{f"deepspeed.module_inject.layers.{name}": feature for name, feature in _TP_LAYERS_REFUSED.items()},
    "deepspeed.elasticity.DSElasticAgent": "DeepSpeed's torch-elastic agent (its launcher's --enable_elastic_training; "
                                           "`zerotune run --max-restarts` restarts workers through torchrun's agent)",
    "deepspeed.zero.MiCS_Init": "MiCS (ZeRO-3 sharding within sub-groups of ranks; zerotune shards over the whole "
                                "data-parallel group)",
    "deepspeed.runtime.zero.partition_parameters.InsertPostInitMethodToModuleSubClasses": _CONSTRUCTOR_PATCHING,
    "deepspeed.runtime.zero.partition_parameters.zero3_linear_wrap": _CONSTRUCTOR_PATCHING,
    "deepspeed.runtime.zero.parameter_offload.ZeROOrderedDict": _PARAMETER_DICT,
    "deepspeed.runtime.zero.parameter_offload.ensure_zero_ordered_dict": _PARAMETER_DICT,
    "deepspeed.runtime.comm.coalesced_collectives.all_to_all_quant_reduce": ("the quantized gradient all-to-all "
                                                                             "(ZeRO++ qgZ: DeepSpeed's CUDA kernels)"),
    "deepspeed.monitor.comet.CometMonitor": "the Comet monitor (zerotune writes tensorboard, csv_monitor and wandb)",
    "deepspeed.DeepSpeedTransformerLayer": "the fused transformer kernel (DeepSpeedTransformerLayer)",
    "deepspeed.DeepSpeedTransformerConfig": "the fused transformer kernel (DeepSpeedTransformerLayer)",
}
