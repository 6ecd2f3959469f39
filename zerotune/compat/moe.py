"""``deepspeed.moe`` / ``deepspeed.moe.layer``: the ``MoE`` name, refused when constructed.

zerotune has no mixture-of-experts layer yet. The module still imports, because DeepSpeed code imports
``MoE`` at module level beside everything else (DeepSpeed's own test models do): a script that never
builds an MoE layer runs, and one that does stops at that line with the feature named.
"""

from __future__ import annotations

from zerotune.compat.refusals import refused_class

MoE = refused_class("deepspeed.moe.layer.MoE")

__all__ = ["MoE"]
