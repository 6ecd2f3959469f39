"""benchmarks/gpu_check.py's CUDA-free parts: the FLOP count behind MFU, the verdicts, the table, the configs
it trains with, and its answer on a machine without CUDA (issue 19)."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import gpu_check
from zerotune.config import load_config, resolve_config


def test_the_flop_count_is_palms_and_mfu_is_its_share_of_the_peak() -> None:
    # Llama 2 7B at 4096 tokens: 6 x 6.48e9 (without the input embedding) + 12 x 32 x 4096 x 4096 per token
    per_token = gpu_check.flops_per_token(6_476_271_616, 32, 4096, 4096)
    assert per_token == pytest.approx(6 * 6_476_271_616 + 12 * 32 * 4096 * 4096)
    assert per_token / 1e9 == pytest.approx(45.3, abs=0.1)
    assert gpu_check.mfu(3000.0, per_token, 989e12) == pytest.approx(3000 * per_token / 989e12)
    assert gpu_check.peak_tflops_for("NVIDIA H200", None) == 989.0
    assert gpu_check.peak_tflops_for("NVIDIA A100-SXM4-80GB", None) == 312.0
    assert gpu_check.peak_tflops_for("Some GPU", 123.0) == 123.0


def test_parity_verdicts_hold_losses_to_the_tolerance() -> None:
    reference = [10.0, 9.0, 8.0]
    assert gpu_check.relative_difference([10.0, 9.0, 8.00004], reference) == pytest.approx(5e-6)
    assert gpu_check.parity_row("ZeRO 3", [10.0, 9.0, 8.00004], reference, 1e-5).verdict == "pass"
    assert gpu_check.parity_row("ZeRO 3", [10.0, 9.0, 8.001], reference, 1e-5).verdict == "FAIL"
    assert gpu_check.relative_difference([10.0, math.nan, 8.0], reference) == math.inf
    assert gpu_check.relative_difference([10.0], reference) == math.inf


def test_the_table_states_each_target_met_or_not() -> None:
    Row = gpu_check.Row
    rows = [Row("parity", "ZeRO 0, fp32", "pass", {"max rel. loss difference": 1e-7, "losses": [1.0]}),
            Row("throughput", "full, ZeRO 0, ckpt on", "ran", {"tokens/s": 20000.0, "MFU": 0.47, "peak GiB": 30.0}),
            Row("throughput", "full, ZeRO 3, ckpt on", "ran", {"tokens/s": 18000.0, "MFU": 0.42, "peak GiB": 20.0}),
            Row("throughput", "full, fsdp2, ckpt on", "ERROR", {"error": "ImportError: no fully_shard"})]
    text = gpu_check.render(rows)
    assert "| parity | ZeRO 0, fp32 | pass | max rel. loss difference 1e-07 |" in text  # losses left to the JSON
    assert "full fine-tuning, ZeRO 0, ckpt on: MFU 47.0% (target >= 45%: met)" in text
    assert "ZeRO 3 / ZeRO 0 throughput, ckpt on: 0.900 (target >= 0.95: NOT met)" in text
    assert "| throughput | full, fsdp2, ckpt on | ERROR | error ImportError: no fully_shard |" in text


@pytest.mark.parametrize("kwargs", [{"stage": 0}, {"stage": 3}, {"stage": 2, "offload_optimizer": "cpu"},
                                    {"stage": 3, "offload_optimizer": "cpu", "offload_param": "nvme",
                                     "nvme_path": "/tmp/swap"},
                                    {"stage": 3, "precision": "bf16"}, {"stage": 2, "precision": "fp16"}])
def test_the_configs_it_trains_with_are_valid(kwargs) -> None:
    config = resolve_config(load_config(gpu_check.engine_config(**kwargs)), dp_world_size=1)
    assert config.zero_optimization.stage == kwargs["stage"]
    assert config.bf16.enabled == (kwargs.get("precision") == "bf16")


def test_without_cuda_it_says_so_and_exits_2(capsys, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--quick"]) == 2
    assert "no CUDA device here" in capsys.readouterr().err


def _tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=50304, n_positions=1024, n_layer=2, n_embd=64, n_head=2))


def _parity_section_on_cpu() -> list[tuple[str, str, float]]:
    gpu_check._gpt2 = _tiny_gpt2  # (this rank process's copy of the module)
    return [(row.name, row.verdict, row.figures.get("max rel. loss difference", math.nan))
            for row in gpu_check.parity(2, torch.device("cpu"))]


@pytest.mark.slow
def test_the_parity_section_runs_every_mode_against_pytorch_on_a_small_model_here() -> None:
    """The same parity() the GPU runs, on CPU with a 2-layer GPT-2: every mode within its tolerance."""
    from tests.harness import run_distributed

    rows = run_distributed(_parity_section_on_cpu, 1, timeout=300)[0]
    assert len(rows) == 10
    for name, verdict, difference in rows:
        assert verdict == "pass", (name, verdict, difference)
    print("\n".join(f"{name}: {difference:.2e}" for name, _, difference in rows))
