"""Pipeline parallelism with DeepSpeed's API: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``."""

from zerotune.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
