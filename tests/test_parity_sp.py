"""Ulysses sequence parallelism through the engine reproduces single-process PyTorch.

fp32, 8 steps, GAS 2, clipping 0.5, 256-token sequences: the script feeds whole sequences to
``engine(...)``; the engine gives each sp rank its 128 tokens (global positions, labels shifted on
the full sequence) and returns the full-sequence loss. SP 2 on 2 ranks (GPT-2 with its learned
positions, Llama with rotary ones and grouped kv heads), SP 2 x DP 2 on 4 ranks with ZeRO 1-3.
"""

from __future__ import annotations

import pytest
import torch

import zerotune
from tests.harness import run_distributed
from tests.models import assert_close_traces, engine_run, gpt2_batch, make_gpt2, make_llama, reference_run

STEPS, GAS, CLIP, ROWS, SEQ = 8, 2, 0.5, 4, 256


def _make(kind: str):
    return make_gpt2(positions=SEQ) if kind == "gpt2" else make_llama(positions=SEQ)


def _batch(step: int, micro: int, rows: int) -> dict:
    return gpt2_batch(step, micro, rows, seq=SEQ)


def _reference(kind: str):
    model = _make(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return reference_run(model, optimizer, _batch, steps=STEPS, gas=GAS, global_rows=ROWS, clip=CLIP)


def _sp_run(kind: str, stage: int, sp: int):
    dp = torch.distributed.get_world_size() // sp
    config = {"train_micro_batch_size_per_gpu": ROWS // dp, "gradient_accumulation_steps": GAS,
              "gradient_clipping": CLIP, "zero_optimization": {"stage": stage}, "sequence_parallel_size": sp,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}
    engine, *_ = zerotune.initialize(model=_make(kind), config=config)
    assert engine.train_batch_size() == ROWS * GAS  # sp ranks share samples: the batch counts dp only
    return engine_run(engine, _batch, steps=STEPS, gas=GAS, global_rows=ROWS)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_sp2_matches_single_process(kind):
    expected = _reference(kind)
    for trace in run_distributed(_sp_run, 2, kind, 0, 2, timeout=300):
        assert_close_traces(trace, expected, rel=1e-5)


@pytest.mark.parametrize("stage", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_sp2_x_dp2_with_zero_matches_single_process(stage):
    expected = _reference("gpt2")
    for trace in run_distributed(_sp_run, 4, "gpt2", stage, 2, timeout=300):
        assert_close_traces(trace, expected, rel=1e-5)


def _indivisible_sequence() -> str:
    config = {"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = zerotune.initialize(model=_make("gpt2"), config=config)
    try:
        engine(**gpt2_batch(0, 0, 2, seq=255))
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_sequence_the_sp_ranks_cannot_split_evenly_is_refused_with_the_numbers():
    for message in run_distributed(_indivisible_sequence, 2, timeout=120):
        assert "255" in message and "2" in message, message
