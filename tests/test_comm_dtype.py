"""``communication_data_type``: gradient reductions carry bf16 / fp16 instead of fp32 at every ZeRO stage --
half the bytes on the wire -- and training follows the fp32-communication run closely (issue 19)."""

from __future__ import annotations

import pytest
import torch

import zerotune
from tests.harness import run_distributed
from tests.models import make_mlp, mlp_batch

GRADIENT_OP = {0: "all_reduce", 1: "reduce_scatter", 2: "reduce", 3: "reduce_scatter"}
"""The collective each stage reduces gradients with (others carry norms and flags, not gradients)."""


def _run(stage: int, wire: str | None) -> dict:
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    if wire is not None:
        config["communication_data_type"] = wire
    engine, *_ = zerotune.initialize(model=make_mlp(), config=config)
    zerotune.comm.reset_comm_stats()
    losses = []
    for step in range(4):
        loss = engine(**mlp_batch(step, engine.global_rank, 2))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    stats = zerotune.comm.comm_stats()
    gradient_bytes = stats[GRADIENT_OP[stage]].bytes
    engine.destroy()
    return {"losses": losses, "gradient_bytes": gradient_bytes}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_and_fp16_reductions_halve_the_gradient_bytes_and_follow_the_fp32_run(stage: int) -> None:
    fp32 = run_distributed(_run, 2, stage, None)[0]
    for wire in ("bf16", "fp16"):
        narrow = run_distributed(_run, 2, stage, wire)[0]
        assert narrow["gradient_bytes"] * 2 == pytest.approx(fp32["gradient_bytes"], rel=0.02), (wire, narrow, fp32)
        assert narrow["losses"] != fp32["losses"]  # the gradients really went through the narrow type
        for ours, reference in zip(narrow["losses"], fp32["losses"]):
            assert ours == pytest.approx(reference, rel=2e-2), (wire, narrow["losses"], fp32["losses"])


def _with_compression() -> str:
    config = {"train_micro_batch_size_per_gpu": 2, "communication_data_type": "bf16",
              "gradient_compression": {"method": "topk", "ratio": 0.1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    try:
        zerotune.initialize(model=make_mlp(), config=config)
    except zerotune.config.ConfigError as error:
        return str(error)
    return "initialize did not refuse"


def test_a_narrow_wire_with_gradient_compression_is_refused_by_name() -> None:
    message = run_distributed(_with_compression, 2)[0]
    assert "communication_data_type: bf16 together with gradient_compression is not supported yet" in message
