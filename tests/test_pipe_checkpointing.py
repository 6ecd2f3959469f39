"""Activation checkpointing inside a ``PipelineModule``: ``set_checkpoint_interval`` and the per-interval block
results forward reads, the ``pipeline`` section's ``activation_checkpoint_interval`` / ``use_reentrant``, and the
engine marking the first stage's inputs for a script's own reentrant checkpoint function."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import zerotune
from tests.harness import run_distributed
from tests.models import mse
from zerotune.parallel.activation_checkpointing import checkpoint, non_reentrant_checkpoint
from zerotune.pipe import PipelineModule

WIDTH = 8


def _mixed_layers() -> list[nn.Module]:
    """Weightless layers first, then linear ones: the blocks' checkpointing differs with the interval."""
    torch.manual_seed(0)
    return [nn.ReLU(), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)]


def test_set_checkpoint_interval_rebuilds_the_block_results_for_the_new_interval() -> None:
    pipe = PipelineModule(_mixed_layers(), num_stages=1, activation_checkpoint_interval=2)
    pipe._precompute_checkpointable_values()
    assert pipe.is_checkpointable_results == [False, True, True]
    pipe.set_checkpoint_interval(3)
    assert pipe.activation_checkpoint_interval == 3 and pipe.is_checkpointable_results == [True, True]
    pipe.set_checkpoint_interval(1)
    assert pipe.is_checkpointable_results == [False, False, True, False, True, True]
    with pytest.raises(ValueError, match="set_checkpoint_interval needs an integer >= 0, got -1"):
        pipe.set_checkpoint_interval(-1)


def test_forward_checkpoints_exactly_the_blocks_with_weights_and_matches_a_plain_forward() -> None:
    calls = []

    def counting(function, *args):
        calls.append(function)
        return checkpoint(function, *args)

    plain = PipelineModule(_mixed_layers(), num_stages=1)
    pipe = PipelineModule(_mixed_layers(), num_stages=1, activation_checkpoint_func=counting)
    x = torch.randn(4, WIDTH)
    expected = plain(x)
    expected.sum().backward()
    pipe.activation_checkpoint_interval = 2  # assigned directly: forward recomputes the results for it
    output = pipe(x)
    output.sum().backward()
    assert len(calls) == 2 and torch.equal(output, expected)
    for mine, theirs in zip(pipe.parameters(), plain.parameters()):
        assert torch.equal(mine.grad, theirs.grad)


# ---- through initialize (one rank) -----------------------------------------------------------------
def _config(**pipeline) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "pipeline": pipeline}


def _engine(layers: list, config: dict, **module_kwargs):
    pipe = PipelineModule(layers, num_stages=1, loss_fn=mse, **module_kwargs)
    engine, *_ = zerotune.initialize(model=pipe, config=config)
    return engine


def _which_function_and_interval() -> dict:
    out = {}
    engine = _engine(_mixed_layers(), _config(activation_checkpoint_interval=0))
    out["off"] = engine._reentrant_activation_checkpointing()
    engine.module.set_checkpoint_interval(2)
    out["after_setter"] = (engine._reentrant_activation_checkpointing(), engine._first_inputs_need_grad())
    engine = _engine(_mixed_layers(), _config(activation_checkpoint_interval=0, use_reentrant=False))
    engine.module.set_checkpoint_interval(1)
    out["non_reentrant"] = (engine.module.activation_checkpoint_func is non_reentrant_checkpoint,
                            engine._reentrant_activation_checkpointing())
    engine = _engine(_mixed_layers(), _config(activation_checkpoint_interval=3), activation_checkpoint_interval=1)
    out["config_overrides"] = (engine.module.activation_checkpoint_interval, engine.module.is_checkpointable_results)
    return out


def test_the_config_and_the_setter_decide_the_function_and_interval() -> None:
    out = run_distributed(_which_function_and_interval, 1, timeout=120)[0]
    assert out["off"] is False
    assert out["after_setter"] == (True, False)  # zerotune's checkpoint needs no input gradients
    assert out["non_reentrant"] == (True, False)
    assert out["config_overrides"] == (3, [True, True])


def _weights_after_one_step(interval: int) -> list[list[float]]:
    reentrant = partial(torch_checkpoint.checkpoint, use_reentrant=True)
    engine = _engine(_mixed_layers()[2:], _config(), activation_checkpoint_interval=interval,
                     activation_checkpoint_func=reentrant)
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(4, WIDTH, generator=generator), torch.randn(4, WIDTH, generator=generator))
    engine.train_batch(iter([copy.deepcopy(batch)]))
    return [p.detach().flatten().tolist() for p in engine.module.parameters()]


def test_a_scripts_reentrant_function_gets_its_first_inputs_marked_and_trains_like_no_checkpointing() -> None:
    plain = run_distributed(_weights_after_one_step, 1, 0, timeout=120)[0]
    checkpointed = run_distributed(_weights_after_one_step, 1, 1, timeout=120)[0]
    # without the mark, the reentrant first block would get no gradient and its weights would not move
    assert checkpointed == plain
