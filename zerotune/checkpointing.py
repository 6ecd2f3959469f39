"""``deepspeed.checkpointing`` under zerotune's name: ``import zerotune as deepspeed`` keeps
``deepspeed.checkpointing.checkpoint(block, hidden)`` and ``configure(...)`` working.

The implementation lives in ``zerotune.parallel.activation_checkpointing``; this module only
re-exports it, plus the zerotune extension that checkpoints a model's transformer blocks.
"""

from __future__ import annotations

from zerotune.parallel.activation_checkpointing import (
    CheckpointPolicy,
    apply_activation_checkpointing,
    checkpoint,
    checkpointed_module_names,
    configure,
    configured_policy,
    is_configured,
    non_reentrant_checkpoint,
    policy_from_section,
    remove_activation_checkpointing,
    reset,
)

__all__ = [
    "CheckpointPolicy",
    "apply_activation_checkpointing",
    "checkpoint",
    "checkpointed_module_names",
    "configure",
    "configured_policy",
    "is_configured",
    "non_reentrant_checkpoint",
    "policy_from_section",
    "remove_activation_checkpointing",
    "reset",
]
