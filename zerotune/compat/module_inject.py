"""``deepspeed.module_inject``: DeepSpeed's AutoTP parser over zerotune's plans; kernel injection refused by name.

``init_inference`` splits models with zerotune's AutoTP (``zerotune/parallel/tensor``), so what DeepSpeed code
takes from here to *describe* a split works: ``AutoTP.tp_parser(model)`` is the built-in plan as an injection
policy (``{block class: row-parallel linear names}``), which ``init_inference(injection_policy=...)`` accepts.
``AutoTP`` also splits a model by an ``AutoTPConfig`` by hand (``auto_tp.py``). ``LinearLayer`` /
``LinearAllreduce`` are zerotune's tensor-parallel layers under DeepSpeed's names (``tp_layers.py``).
DeepSpeed's fused-kernel injection, its inference tensor slicing and int8 quantizer are not here; each name
fails on use with one line naming the feature.
"""

from __future__ import annotations

from zerotune.compat.auto_tp import AutoTP
from zerotune.compat.refusals import refused_class, refused_function
from zerotune.compat.tp_layers import LinearAllreduce, LinearLayer, set_autotp_mode

replace_transformer_layer = refused_function("deepspeed.module_inject.replace_transformer_layer")
revert_transformer_layer = refused_function("deepspeed.module_inject.revert_transformer_layer")
generic_injection = refused_function("deepspeed.module_inject.generic_injection")
quantize_transformer_layer = refused_function("deepspeed.module_inject.quantize_transformer_layer")
ReplaceWithTensorSlicing = refused_class("deepspeed.module_inject.ReplaceWithTensorSlicing")
GroupQuantizer = refused_class("deepspeed.module_inject.GroupQuantizer")

__all__ = ["AutoTP", "GroupQuantizer", "LinearAllreduce", "LinearLayer", "ReplaceWithTensorSlicing",
           "generic_injection", "quantize_transformer_layer", "replace_transformer_layer", "revert_transformer_layer",
           "set_autotp_mode"]
