"""Which DeepSpeed ops zerotune stands in for, and with what: the answers ``deepspeed.ops.__compatible_ops__``
and the builders (``op_builder.py``) give. Its own module so that ``ops.py`` (the op implementations) and
``op_builder.py`` (whose ``load()`` returns ``ops``) both read it without importing each other.
"""

from __future__ import annotations

# op NAME -> the zerotune capability that stands for it (None: zerotune does not have it)
CAPABILITIES: dict[str, str | None] = {
    "cpu_adam": "DeepSpeedCPUAdam (torch's Adam on the host)", "cpu_adagrad": "torch's Adagrad on the host",
    "cpu_lion": None, "fused_adam": "FusedAdam (torch's fused Adam)", "fused_lamb": "FusedLamb (zerotune's Lamb)",
    "fused_lion": None, "async_io": "zerotune's threaded swap-file IO (offload to nvme)", "gds": None,
    "pin_memory": "torch's pinned host memory", "utils": "torch's flatten / unflatten",
    "transformer": None, "stochastic_transformer": None, "transformer_inference": None, "inference_core_ops": None,
    "cutlass_ops": None, "ragged_ops": None, "ragged_device_ops": None, "quantizer": None, "fp_quantizer": None,
    "sparse_attn": None, "spatial_inference": None, "evoformer_attn": None, "random_ltd": None, "flash_attn": None,
    "dc": None, "deepspeed_ccl_comm": None, "deepspeed_shm_comm": None, "pack_bits": None,
    "deepspeed_not_implemented": None,
}

installed_ops = dict.fromkeys(CAPABILITIES, False)  # nothing was compiled at install
compatible_ops = {name: capability is not None for name, capability in CAPABILITIES.items()}
