"""``OnDevice`` (``zero/on_device.py``, DeepSpeed's ``deepspeed.OnDevice``): modules built inside land on the device
in the floating dtype, integer tensors keep theirs, and nothing changes outside the block."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerotune.zero.on_device import OnDevice


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Embedding(5, 8))


def test_meta_half_builds_nothing_and_every_parameter_is_meta_half() -> None:
    with OnDevice(dtype=torch.half, device="meta"):
        model = _model()
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.half)}


def test_cpu_bfloat16_keeps_initialization_integer_tensors_and_explicit_devices() -> None:
    torch.manual_seed(0)
    expected = nn.Linear(4, 8).weight.detach().to(torch.bfloat16)
    torch.manual_seed(0)
    with OnDevice(dtype=torch.bfloat16, device="cpu"):
        built = nn.Linear(4, 8)
        index = torch.zeros(3, dtype=torch.long)
        pinned_meta = torch.empty(2, device="meta")
    assert built.weight.dtype == torch.bfloat16 and torch.equal(built.weight.detach(), expected)
    assert index.dtype == torch.long
    assert pinned_meta.device.type == "meta" and pinned_meta.dtype == torch.bfloat16


def test_nothing_changes_outside_the_block_or_when_disabled() -> None:
    with OnDevice(dtype=torch.half, device="meta"):
        pass
    assert torch.empty(2).dtype == torch.float32 and torch.ones(2).device.type == "cpu"
    with OnDevice(dtype=torch.half, device="meta", enabled=False):
        plain = nn.Linear(2, 2)
    assert plain.weight.dtype == torch.float32 and plain.weight.device.type == "cpu"
    with pytest.raises(ValueError), OnDevice(dtype=torch.half):
        raise ValueError("the block's own error passes through and the mode is popped")
    assert torch.zeros(1).dtype == torch.float32


def test_refuses_a_non_floating_dtype() -> None:
    with pytest.raises(TypeError, match="floating torch.dtype"):
        OnDevice(dtype=torch.int8)
