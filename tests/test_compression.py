"""Top-K gradient compression with error feedback (``gradient_compression``).

Unit: the error-feedback invariant (what was sent plus the final residual equals the sum of the
gradients), the sparse collectives against their dense meaning. Engine: ratio 1.0 is bit-identical
to no compression (stages 0-2, 2 and 4 ranks); ratio 0.01 cuts the gradient bytes read from the
comm counters by >= 90%; residuals survive save/resume bit-identically.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerotune
from tests.harness import run_distributed
from tests.models import engine_run, gpt2_batch, gpt2_traces_across_resume, make_gpt2
from zerotune.distributed import comm, compression
from zerotune.distributed.compression import GRADIENT_OPS, TopKCompressor


@pytest.mark.parametrize("ratio, numel, steps", [(0.01, 1000, 30), (0.1, 257, 12), (0.3, 64, 7)])
def test_sent_plus_final_residual_equals_the_sum_of_the_gradients(ratio, numel, steps):
    compressor = TopKCompressor(ratio, dense_when_cheaper=False)
    generator = torch.Generator().manual_seed(numel)
    sent, total = torch.zeros(numel), torch.zeros(numel)
    for _ in range(steps):
        grad = torch.randn(numel, generator=generator)
        total += grad
        indices, values = compressor.compress("bucket", grad)
        assert indices.numel() == compressor.k_of(numel)
        sent += TopKCompressor.decompress(indices, values, numel)
    torch.testing.assert_close(sent + compressor.residuals["bucket"], total, rtol=1e-5, atol=1e-5)


def test_without_error_feedback_nothing_is_kept_and_the_gradient_is_left_untouched():
    compressor = TopKCompressor(0.1, error_feedback=False, dense_when_cheaper=False)
    grad = torch.randn(100)
    before = grad.clone()
    indices, values = compressor.compress("b", grad)
    assert compressor.residuals == {} and torch.equal(grad, before)
    assert torch.equal(values.abs().sort().values, grad.abs().topk(10).values.sort().values)


def test_dense_when_sparse_is_not_smaller_during_warmup_and_for_small_buckets():
    compressor = TopKCompressor(0.01, warmup_steps=2, min_bucket_numel=1000)
    assert not compressor.compresses(10_000)  # warm-up
    compressor.step = 2
    assert compressor.compresses(10_000) and not compressor.compresses(999)
    assert not TopKCompressor(0.5).compresses(10_000)  # an index costs a value: k >= n/2 is no saving
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\], got 1.5"):
        TopKCompressor(1.5)


def _sparse_collectives() -> dict:
    """Each rank's sparse contribution, and what the three sparse collectives computed from them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(rank)
    out = {}
    for name in ("all_reduce", "reduce", "reduce_scatter"):
        grad = torch.randn(40, generator=generator)
        probe = TopKCompressor(0.1, dense_when_cheaper=False)
        indices, values = probe.compress("x", grad.clone())
        mine = TopKCompressor.decompress(indices, values, 40)
        compressor = TopKCompressor(0.1, dense_when_cheaper=False)
        if name == "all_reduce":
            compression.all_reduce(grad, group, compressor, "x")
            result = grad
        elif name == "reduce":
            compression.reduce(grad, 1, group, compressor, "x")
            result = grad if rank == 1 else None
        else:
            result = torch.empty(40 // world)
            compression.reduce_scatter(result, list(grad.chunk(world)), group, compressor, "x")
        out[name] = (mine, result)
    return out


def test_sparse_all_reduce_reduce_and_reduce_scatter_sum_what_every_rank_sent():
    per_rank = run_distributed(_sparse_collectives, 2, timeout=60)
    for name in ("all_reduce", "reduce", "reduce_scatter"):
        total = per_rank[0][name][0] + per_rank[1][name][0]
        for rank, outcome in enumerate(per_rank):
            result = outcome[name][1]
            if name == "all_reduce":
                torch.testing.assert_close(result, total)
            elif name == "reduce" and rank == 1:
                torch.testing.assert_close(result, total)
            elif name == "reduce_scatter":
                torch.testing.assert_close(result, total.chunk(2)[rank])


def _config(stage: int, ratio: float | None, **compression_keys) -> dict:
    config = {"train_micro_batch_size_per_gpu": 4 // dist.get_world_size(), "gradient_accumulation_steps": 2,
              "gradient_clipping": 0.5, "zero_optimization": {"stage": stage, "reduce_bucket_size": 20000},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "steps_per_print": 100}
    if ratio is not None:
        config["gradient_compression"] = {"ratio": ratio, **compression_keys}
    return config


def _run(stage: int, ratio: float | None, steps: int = 6) -> tuple[list[float], list[float], dict]:
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=_config(stage, ratio))
    comm.reset_comm_stats()
    trace = engine_run(engine, gpt2_batch, steps=steps, gas=2, global_rows=4)
    stats = comm.comm_stats()
    gradient_bytes = sum(stats[op].bytes for op in GRADIENT_OPS if op in stats) / steps
    return trace.losses, trace.grad_norms, {"gradient_bytes_per_step": gradient_bytes}


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ratio_one_reproduces_the_uncompressed_run_exactly(stage, world):
    dense = run_distributed(_run, world, stage, None, timeout=180)
    compressed = run_distributed(_run, world, stage, 1.0, timeout=180)
    for (losses, norms, _), (c_losses, c_norms, _) in zip(dense, compressed):
        assert (c_losses, c_norms) == (losses, norms)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_ratio_001_cuts_gradient_bytes_per_step_by_at_least_90_percent(stage):
    dense = run_distributed(_run, 2, stage, None, 2, timeout=180)[0][2]["gradient_bytes_per_step"]
    sparse = run_distributed(_run, 2, stage, 0.01, 2, timeout=180)[0][2]["gradient_bytes_per_step"]
    assert sparse <= 0.10 * dense, f"stage {stage}: {sparse:.0f} vs dense {dense:.0f} bytes per step"


def _holds_residuals(engine) -> None:
    assert engine.compressor.residuals  # something was held back, so the checkpoint must carry it


def _save_resume(directory: str) -> tuple[list, list]:
    return gpt2_traces_across_resume(_config(2, 0.05), directory, warm_steps=3, on_saved=_holds_residuals)


def test_residuals_survive_save_and_resume_bit_identically(tmp_path):
    for first, second in run_distributed(_save_resume, 2, str(tmp_path), timeout=180):
        assert first == second
    assert (tmp_path / "t" / "compression_rank0.pt").is_file()


def _stage3_refused() -> str:
    try:
        zerotune.initialize(model=make_gpt2(), config=_config(3, 0.01))
    except Exception as error:  # noqa: BLE001 - the message is what is tested
        return str(error)
    return "no error"


def test_stage3_with_compression_is_refused_naming_the_key():
    for message in run_distributed(_stage3_refused, 2, timeout=60):
        assert "gradient_compression" in message and "stage 3" in message
