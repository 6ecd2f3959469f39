"""``deepspeed.git_version_info``: what DeepSpeed records at install time, answered for zerotune."""

from __future__ import annotations

from zerotune.compat.alias import DEEPSPEED_VERSION
from zerotune.compat.op_builder import ALL_OPS, compatible_ops, installed_ops, torch_info

version = DEEPSPEED_VERSION
git_hash = "zerotune"
git_branch = "zerotune"
accelerator_name = "cuda" if torch_info["cuda_version"] != "0.0" else "cpu"

__all__ = ["version", "git_hash", "git_branch", "installed_ops", "compatible_ops", "torch_info", "accelerator_name",
           "ALL_OPS"]
