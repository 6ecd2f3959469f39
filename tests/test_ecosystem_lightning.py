"""PyTorch Lightning's DeepSpeedStrategy on zerotune (issue 28), as far as Lightning goes on CPU: the unchanged
``Trainer(strategy=DeepSpeedStrategy(stage=N)).fit`` stops in Lightning's own CUDA check (before any DeepSpeed
call); past it, the strategy's own steps (init_distributed, its config with the activation_checkpointing block,
deepspeed.initialize, checkpointing.configure) train on a zerotune engine at ZeRO 2 and 3 with the losses of
Lightning's DDP run to 1e-5. Runs scripts/ecosystem/lightning_case.py where Lightning is installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CASE = ROOT / "scripts" / "ecosystem" / "lightning_case.py"


def test_the_line_says_where_lightning_stops_and_how_the_runs_past_it_compare() -> None:
    sys.path.insert(0, str(CASE.parent))
    from lightning_case import line

    stop = "lightning/pytorch/strategies/deepspeed.py:343 RuntimeError: The DeepSpeed strategy is only supported on CUDA"
    summary = {"tool": "lightning", "version": "2.6.6", "methods": ["fit"], "reference": {"fit rank 0": 3},
               "zero2": "ok", "zero3": "ok", "max_rel": 0.0, "stop": stop,
               "stops": {"zero2": {"stop": stop, "stop2": "lightning/fabric/strategies/deepspeed.py:881 RuntimeError: x"}}}
    text = line(summary)
    assert text.startswith("lightning 2.6.6: Trainer(strategy=DeepSpeedStrategy) on CPU stops")
    assert "deepspeed.py:343" in text and "deepspeed.py:881" in text
    assert text.endswith("ZeRO 2 ok | ZeRO 3 ok | max rel loss diff vs Lightning DDP 0.0e+00 (fit)")


@pytest.mark.slow
def test_lightning_deepspeed_strategy_on_zerotune_matches_lightning_ddp(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from tests.ecosystem import run_case

    summary = run_case("lightning", tmp_path, timeout=1300)
    assert summary["zero2"] == "ok" and summary["zero3"] == "ok", summary
    assert summary["max_rel"] <= 1e-5, summary
    assert summary["stop"].startswith("lightning/pytorch/strategies/deepspeed.py:"), summary
    blocks = summary["stops"]["zero3"]["config_blocks"]
    assert "activation_checkpointing" in blocks and "zero_optimization" in blocks, summary


def test_gpu_checks_ecosystem_section_skips_tools_that_are_not_installed(monkeypatch) -> None:
    import importlib.util

    from benchmarks import gpu_ecosystem

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("lightning", "accelerate") else real(name, *a))
    rows = gpu_ecosystem.ecosystem_rows()
    assert [(row.section, row.verdict) for row in rows] == [("ecosystem", "skipped")] * 2
