"""A checkpoint saved at one layout loads at any other and training continues as if it had run there.

Each case (fp32) trains ``SAVE_AT`` steps at layout A and saves; at layout B it loads that checkpoint
and trains ``CONTINUE`` more steps, next to an uninterrupted run at layout B from the same initial
weights. The global batch is the same at every layout (each data-parallel rank takes its slice), so
the two runs' losses and gradient norms agree to 1e-6 relative. The cases are the issue's list:
data-parallel size and ZeRO stage change, CPU offload -> NVMe offload, tensor- and pipeline-parallel
checkpoints into pure data parallelism.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerotune
from tests.harness import run_distributed
from tests.models import Trace, assert_close_traces, engine_run, gpt2_batch, make_gpt2, mse, pipeline_layers
from zerotune.pipe import PipelineModule

SAVE_AT, CONTINUE, GAS, ROWS, REL = 3, 5, 2, 8, 1e-6


def _config(dp: int, stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": ROWS // dp, "gradient_accumulation_steps": GAS,
            "gradient_clipping": 1.0, "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000,
                                                            "allgather_bucket_size": 3000, **extra},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": 20}},
            "steps_per_print": 1000}


def _later(first: int):
    return lambda step, micro, rows: gpt2_batch(step + first, micro, rows)


def _save_gpt2(save_dir: str, config: dict) -> None:
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=config)
    engine_run(engine, gpt2_batch, steps=SAVE_AT, gas=GAS, global_rows=ROWS)
    engine.save_checkpoint(save_dir, tag="a")
    engine.destroy()


def _continue_gpt2(save_dir: str, config: dict) -> tuple[Trace, Trace]:
    """(resumed from the checkpoint, uninterrupted) traces of the CONTINUE steps after SAVE_AT, at this layout."""
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=config)
    engine_run(engine, gpt2_batch, steps=SAVE_AT, gas=GAS, global_rows=ROWS)
    uninterrupted = engine_run(engine, _later(SAVE_AT), steps=CONTINUE, gas=GAS, global_rows=ROWS)
    engine.destroy()
    resumed, *_ = zerotune.initialize(model=make_gpt2(seed=5), config=config)  # other weights: all must load
    resumed.load_checkpoint(save_dir, tag="a")
    assert resumed.global_steps == SAVE_AT
    trace = engine_run(resumed, _later(SAVE_AT), steps=CONTINUE, gas=GAS, global_rows=ROWS)
    resumed.destroy()
    return trace, uninterrupted


def _nvme(path: Path) -> dict:
    return {"offload_optimizer": {"device": "nvme", "nvme_path": str(path), "buffer_count": 4},
            "sub_group_size": 97}


GPT2_CASES = {
    "dp2-stage3 -> dp1-stage0": (2, lambda d: _config(2, 3), 1, lambda d: _config(1, 0)),
    "dp4-stage2 -> dp2-stage1": (4, lambda d: _config(4, 2), 2, lambda d: _config(2, 1)),
    "dp2-stage1-cpu-offload -> dp2-stage3-nvme-offload": (
        2, lambda d: _config(2, 1, offload_optimizer={"device": "cpu"}), 2, lambda d: _config(2, 3, **_nvme(d))),
    "tp2xdp2-stage1 -> dp4-stage2": (
        4, lambda d: {**_config(2, 1), "tensor_parallel": {"autotp_size": 2}}, 4, lambda d: _config(4, 2)),
    "tp2xdp2-stage3 -> dp4-stage2": (
        4, lambda d: {**_config(2, 3), "tensor_parallel": {"autotp_size": 2}}, 4, lambda d: _config(4, 2)),
    "dp2-stage1 -> tp2xdp2-stage3": (
        2, lambda d: _config(2, 1), 4, lambda d: {**_config(2, 3), "tensor_parallel": {"autotp_size": 2}}),
}


@pytest.mark.parametrize("case", list(GPT2_CASES))
def test_a_gpt2_checkpoint_continues_at_another_layout(tmp_path: Path, case: str) -> None:
    save_world, save_config, load_world, load_config = GPT2_CASES[case]
    run_distributed(_save_gpt2, save_world, str(tmp_path / "ckpt"), save_config(tmp_path / "swap_a"), timeout=240)
    resumed, uninterrupted = run_distributed(_continue_gpt2, load_world, str(tmp_path / "ckpt"),
                                             load_config(tmp_path / "swap_b"), timeout=240)[0]
    assert_close_traces(resumed, uninterrupted, REL)


# ---- pipeline-parallel checkpoint -> data parallel with ZeRO-3 --------------------------------------
WIDTH = 16


def _pipe(stages: int) -> PipelineModule:
    return PipelineModule(pipeline_layers(WIDTH), num_stages=stages, loss_fn=mse, seed_layers=True, base_seed=7)


class _Unsplit(nn.Module):
    """The pipeline's layers as one ordinary module, under the same parameter names (``local_layers.<i>``,
    ``tied_modules.<key>``), trained by the plain engine: the layout a pipeline checkpoint moves to."""

    def __init__(self) -> None:
        super().__init__()
        whole = _pipe(1)
        self.local_layers, self.tied_modules = whole.local_layers, whole.tied_modules
        self.layers = whole.forward_funcs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _micro_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(ROWS, WIDTH, generator=generator), torch.randn(ROWS, WIDTH, generator=generator)


def _rows(batch: tuple[torch.Tensor, ...], rank: int, world: int) -> tuple[torch.Tensor, ...]:
    rows = ROWS // world
    return tuple(t[rank * rows:(rank + 1) * rows] for t in batch)


def _save_pipeline(save_dir: str) -> None:
    engine, *_ = zerotune.initialize(model=_pipe(2), config=_config(2, 1))
    dp, rank = engine.mpu.get_data_parallel_world_size(), engine.mpu.get_data_parallel_rank()
    for step in range(SAVE_AT):
        engine.train_batch(iter([_rows(_micro_batch(step, m), rank, dp) for m in range(GAS)]))
    engine.save_checkpoint(save_dir, tag="a")
    engine.destroy()


def _run_unsplit(engine, first: int, steps: int) -> Trace:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, norms = [], []
    for step in range(first, first + steps):
        total = torch.zeros(())
        for micro in range(GAS):
            x, y = _rows(_micro_batch(step, micro), rank, world)
            loss = mse(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / GAS / world)
        norms.append(engine.get_global_grad_norm())
    return Trace(losses, norms)


def _continue_unsplit(save_dir: str) -> tuple[Trace, Trace]:
    config = _config(4, 3)
    engine, *_ = zerotune.initialize(model=_Unsplit(), config=config)
    _run_unsplit(engine, 0, SAVE_AT)
    uninterrupted = _run_unsplit(engine, SAVE_AT, CONTINUE)
    engine.destroy()
    torch.manual_seed(11)
    model = _Unsplit()
    with torch.no_grad():
        for param in model.parameters():  # other weights: every one must come from the checkpoint
            param.normal_()
    resumed, *_ = zerotune.initialize(model=model, config=config)
    resumed.load_checkpoint(save_dir, tag="a")
    trace = _run_unsplit(resumed, SAVE_AT, CONTINUE)
    resumed.destroy()
    return trace, uninterrupted


def test_a_pipeline_checkpoint_continues_as_data_parallel_zero3(tmp_path: Path) -> None:
    run_distributed(_save_pipeline, 4, str(tmp_path), timeout=240)
    resumed, uninterrupted = run_distributed(_continue_unsplit, 4, str(tmp_path), timeout=240)[0]
    assert_close_traces(resumed, uninterrupted, REL)
