"""``deepspeed.ops.op_builder`` and ``deepspeed.git_version_info``: which of DeepSpeed's compiled ops exist.

DeepSpeed code asks a builder ``is_compatible()`` (or reads ``deepspeed.ops.__compatible_ops__[NAME]``)
before using an op, and skips or falls back when it is not. zerotune compiles nothing, so the question
it answers is whether the *capability* the op gives is here: CPU Adam / Adagrad, fused Adam / Lamb run
on torch's kernels, async IO is zerotune's threaded swap-file IO, pinned memory is torch's. Those say
yes; the kernels of features zerotune does not have (inference, quantizers, sparse attention, ...) say
no. ``load()`` never builds: it returns zerotune's Python stand-in where the op is an optimizer class,
and otherwise raises ``DeepSpeedFeatureNotSupported`` naming the op -- code that needs a kernel's
functions (``create_adam``, ``aio_handle``) is testing DeepSpeed's extension, not the capability.
"""

from __future__ import annotations

from typing import Any

import torch

from zerotune.compat import ops
from zerotune.compat.op_capabilities import CAPABILITIES, compatible_ops, installed_ops
from zerotune.compat.paths import DeepSpeedFeatureNotSupported

_CLASS_NAMES = {
    "cpu_adam": "CPUAdamBuilder", "cpu_adagrad": "CPUAdagradBuilder", "cpu_lion": "CPULionBuilder",
    "fused_adam": "FusedAdamBuilder", "fused_lamb": "FusedLambBuilder", "fused_lion": "FusedLionBuilder",
    "async_io": "AsyncIOBuilder", "gds": "GDSBuilder", "pin_memory": "PinMemoryBuilder", "utils": "UtilsBuilder",
    "transformer": "TransformerBuilder", "stochastic_transformer": "StochasticTransformerBuilder",
    "transformer_inference": "InferenceBuilder", "inference_core_ops": "InferenceCoreBuilder",
    "cutlass_ops": "InferenceCutlassBuilder", "ragged_ops": "RaggedOpsBuilder",
    "ragged_device_ops": "RaggedUtilsBuilder",
    "quantizer": "QuantizerBuilder", "fp_quantizer": "FPQuantizerBuilder", "sparse_attn": "SparseAttnBuilder",
    "spatial_inference": "SpatialInferenceBuilder", "evoformer_attn": "EvoformerAttnBuilder",
    "random_ltd": "RandomLTDBuilder", "flash_attn": "FlashAttentionBuilder", "dc": "DeepCompileBuilder",
    "deepspeed_ccl_comm": "CCLCommBuilder", "deepspeed_shm_comm": "ShareMemCommBuilder", "pack_bits": "PackbitsBuilder",
    "deepspeed_not_implemented": "NotImplementedBuilder",
}


class OpBuilder:
    """One DeepSpeed op; subclasses only set ``NAME``."""

    NAME = "deepspeed_not_implemented"

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.name}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        return CAPABILITIES.get(self.name) is not None

    def load(self, verbose: bool = True) -> Any:
        capability = CAPABILITIES.get(self.name)
        if self.name in ("cpu_adam", "fused_adam", "fused_lamb"):
            return ops
        if capability is None:
            raise DeepSpeedFeatureNotSupported(self.absolute_name(), f"the compiled op '{self.name}'")
        raise DeepSpeedFeatureNotSupported(self.absolute_name(), f"the compiled op '{self.name}' itself (zerotune "
                                                                  f"provides the capability through {capability})")

    def jit_load(self, verbose: bool = True) -> Any:
        return self.load(verbose)

    @staticmethod
    def installed_rocm_version() -> tuple[int, int]:
        """(major, minor) of the ROCm torch was built with, (0, 0) without: tests and tools gate ROCm-only paths
        on it. zerotune builds no ops, so this is torch's own ``torch.version.hip``."""
        hip = getattr(torch.version, "hip", None)
        parts = str(hip).split(".") if hip else []
        if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
            return int(parts[0]), int(parts[1])
        return 0, 0

    def builder(self) -> None:
        raise DeepSpeedFeatureNotSupported(self.absolute_name(), f"building the op '{self.name}' (zerotune compiles "
                                                                  "no extensions)")


BUILDERS: dict[str, type[OpBuilder]] = {
    class_name: type(class_name, (OpBuilder,), {"NAME": name, "__doc__": f"DeepSpeed's '{name}' op."})
    for name, class_name in _CLASS_NAMES.items()
}
globals().update(BUILDERS)
ALL_OPS = {cls.NAME: cls() for cls in BUILDERS.values()}



def _version(text: str | None) -> str:
    return ".".join(text.split(".")[:2]) if text else "0.0"


torch_info = {
    "version": _version(torch.__version__.split("+")[0]),
    "cuda_version": _version(torch.version.cuda),
    "hip_version": _version(getattr(torch.version, "hip", None)),
    "nccl_version": (".".join(map(str, torch.cuda.nccl.version()[:2])) if torch.cuda.is_available() else "0.0"),
}


def get_builder_class(class_name: str) -> type[OpBuilder] | None:
    """The builder class named ``class_name`` (the accelerator's ``get_op_builder``), None if DeepSpeed has none."""
    return BUILDERS.get(class_name)


__all__ = ["OpBuilder", "ALL_OPS", "installed_ops", "compatible_ops", "torch_info", "get_builder_class", *BUILDERS]
