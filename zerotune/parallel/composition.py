"""Which ZeRO stages, offloads and parallel sizes zerotune runs together: one rule for the engine and the plan.

``initialize`` refuses a combination this module refuses (``NotSupportedYetError`` naming the key) before any
work starts, ``zero/build.py`` asks the same question of the mesh it builds a stage over, and
``zerotune plan --auto`` / ``"stage": "auto"`` never choose one -- a plan that picked a layout the engine then
refused would be worse than no plan. Nothing else states which of these combine.
"""

from __future__ import annotations

from zerotune.config import NotSupportedYetError


def refusal(stage: int, offload_optimizer: str, tp: int, pp: int, sp: int) -> tuple[str, str] | None:
    """(config key, why) when zerotune cannot run this combination yet; None when it can."""
    if pp > 1:
        if stage not in (0, 1, 2):
            return ("zero_optimization.stage", f"{stage} with pipeline parallelism is not supported yet: stages 0-2 "
                    "compose with pipelines (ZeRO-3 would gather every unit once per micro-batch and pass)")
        if stage == 2 and offload_optimizer != "none":
            return ("zero_optimization.offload_optimizer.device", "optimizer offload with pipeline parallelism at "
                    "ZeRO stage 2 is not supported yet (tied weights are summed over the stages after the gradient "
                    "slices reach the host); use stage 1")
        if sp > 1:
            return ("sequence_parallel_size", "sequence parallelism together with pipeline parallelism is not "
                    "supported yet")
    return None


def check_composes(stage: int, offload_optimizer: str, tp: int, pp: int, sp: int) -> None:
    """Raise ``NotSupportedYetError`` naming the key when ``refusal`` refuses the combination."""
    refused = refusal(stage, offload_optimizer, tp, pp, sp)
    if refused is not None:
        raise NotSupportedYetError(*refused)
