"""The flops profiler (zerotune/profiling/, DeepSpeed's deepspeed.profiling.flops_profiler) and the engine's
``flops_profiler`` config block (zerotune/engine_flops.py)."""

from __future__ import annotations

import contextlib
import io
import os
import re

import pytest
import torch
from torch import nn

import zerotune
from tests.harness import run_distributed
from zerotune.config.errors import ConfigError
from zerotune.config.loading import load_config
from zerotune.profiling import FlopsProfiler, get_model_profile


class LeNet5(nn.Module):
    """DeepSpeed's test model, whose figures its test pins: 866076672 flops, 426516480 MACs, 61706 params."""

    def __init__(self, n_classes: int = 10) -> None:
        super().__init__()
        self.feature_extractor = nn.Sequential(
            nn.Conv2d(1, 6, kernel_size=5), nn.Tanh(), nn.AvgPool2d(kernel_size=2),
            nn.Conv2d(6, 16, kernel_size=5), nn.Tanh(), nn.AvgPool2d(kernel_size=2),
            nn.Conv2d(16, 120, kernel_size=5), nn.Tanh())
        self.classifier = nn.Sequential(nn.Linear(120, 84), nn.Tanh(), nn.Linear(84, n_classes))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.classifier(torch.flatten(self.feature_extractor(x), 1))
        return logits, nn.functional.softmax(logits, dim=1)


def test_lenet_counts_match_deepspeeds_convention() -> None:
    # 2 flops per MAC of the convolutions and linears, plus the conv biases, pooling inputs and softmax elements
    flops, macs, params = get_model_profile(LeNet5(), (1024, 1, 32, 32), print_profile=False, as_string=False)
    assert (flops, macs, params) == (866076672, 426516480, 61706)
    assert get_model_profile(LeNet5(), (1024, 1, 32, 32), print_profile=False) == ("866.08 M", "426.52 MMACs",
                                                                                    "61.71 K")


def test_print_model_profile_lists_modules_and_writes_the_file(tmp_path) -> None:
    out = tmp_path / "deep" / "profile.txt"
    get_model_profile(LeNet5(), (8, 1, 32, 32), detailed=True, top_modules=2, output_file=str(out))
    text = out.read_text()
    assert "Profile Summary at step 1:" in text and "fwd MACs per GPU:" in text
    assert re.search(r"params per GPU:\s+61.71 K", text)
    assert "depth 1:" in text and "'Sequential'" in text
    # the detailed tree: each module's figures before its own arguments
    assert re.search(r"\(0\): Conv2d\(156 = 0.25% Params, .*MACs = .*% MACs, .* latency, .*FLOPS, 1, 6, kernel_size",
                     text)
    # ... and the modules' own repr is back afterwards
    assert "Params" not in repr(LeNet5())


def test_profiler_api_window_and_ignore_list() -> None:
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    model(torch.randn(3, 16))
    profiler.stop_profile()
    model(torch.randn(3, 16))  # not measured
    assert profiler.get_total_macs() == 3 * (16 * 8 + 8 * 4)
    assert profiler.get_total_flops() == 2 * 3 * (16 * 8 + 8 * 4) + 3 * 8  # + one per ReLU input element
    assert profiler.get_total_params() == 16 * 8 + 8 + 8 * 4 + 4 and profiler.get_total_duration() > 0
    assert profiler.get_total_flops(as_string=True) == "984 " and profiler.get_total_macs(as_string=True) == "480 MACs"
    profiler.end_profile()
    assert profiler.get_total_flops() == 0 and not profiler.started
    profiler.start_profile(ignore_list=[nn.Linear])  # an ignored module's figures are its children's (none)
    model(torch.randn(3, 16))
    assert profiler._counts.macs(model[0]) == 0 and profiler.get_total_macs() == 3 * (16 * 8 + 8 * 4)
    profiler.end_profile()


def test_tiny_gpt2_matches_the_analytic_estimate() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg)
    batch, seq = 2, 32
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    flops, macs, params = get_model_profile(model, kwargs={"input_ids": ids}, print_profile=False, as_string=False)
    tokens, d, layers = batch * seq, cfg.n_embd, cfg.n_layer
    matmul_weights = layers * 12 * d * d + cfg.vocab_size * d  # qkv, proj, mlp (4d) per layer; the tied lm head
    attention = 2 * batch * layers * seq * seq * d  # q.k and attention x v, per layer and sequence
    assert macs == matmul_weights * tokens + attention
    # the usual estimate: 2 flops per parameter per token (the position embedding is looked up, not multiplied)
    # plus the attention products; the rest is elementwise (norms, gelu, softmax)
    estimate = 2 * (params - model.transformer.wpe.weight.numel()) * tokens + 2 * attention
    assert abs(flops / estimate - 1) < 0.03, (flops, estimate)


class _Simple(nn.Module):
    def __init__(self, hidden: int = 10) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(hidden, hidden)])
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(self.linears[0](x), y)


def _train_with_profiler(output_file: str | None) -> dict:
    torch.manual_seed(0)
    model = _Simple()
    config = {"train_batch_size": 1, "steps_per_print": 100, "wall_clock_breakdown": True,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "fp16": {"enabled": True},
              "flops_profiler": {"enabled": True, "profile_step": 2, "top_modules": 3, "recompute_fwd_factor": 0.5,
                                 "output_file": output_file}}
    engine, *_ = zerotune.initialize(config=config, model=model, model_parameters=model.parameters())
    printed = io.StringIO()
    seen = []
    with contextlib.redirect_stdout(printed):
        for _ in range(4):
            loss = engine(torch.randn(1, 10, dtype=torch.half), torch.randint(0, 10, (1,)))
            engine.backward(loss)
            engine.step()
            seen.append(printed.getvalue().count("DeepSpeed Flops Profiler"))
    profiler = engine.flops_profiler
    assert engine.flops_profiler_enabled() and engine.flops_profiler_profile_step() == 2
    assert (engine.flops_profiler_top_modules(), engine.flops_profiler_module_depth()) == (3, -1)
    assert engine.flops_profiler_output_file() == output_file and engine.flops_profiler_recompute_fwd_factor() == 0.5
    return {"seen": seen, "printed": printed.getvalue(), "flops": profiler.flops, "macs": profiler.macs,
            "params": profiler.params, "started": profiler.started}


def test_engine_profiles_the_configured_step_and_prints_it() -> None:
    (result,) = run_distributed(_train_with_profiler, 1, None, timeout=120)
    assert result["seen"] == [0, 0, 1, 1]  # printed once, at step 2's optimizer step
    assert (result["flops"], result["macs"], result["params"]) == (200, 100, 110) and not result["started"]
    text = result["printed"]
    assert "Profile Summary at step 2:" in text and re.search(r"world size:\s+1\b", text)
    assert re.search(r"bwd FLOPS per GPU = 2.5 \* fwd flops per GPU / bwd latency:", text)  # recompute_fwd_factor
    assert "(0): Linear(110 = 100% Params, 100 MACs = 100% MACs" in text


def test_engine_writes_the_profile_to_output_file(tmp_path) -> None:
    out = tmp_path / "prof" / "flops.txt"
    (result,) = run_distributed(_train_with_profiler, 1, str(out), timeout=120)
    assert "DeepSpeed Flops Profiler" not in result["printed"]
    assert os.path.exists(out) and re.search(r"fwd flops per GPU:\s+200\b", out.read_text())


def test_config_keys_are_validated() -> None:
    cfg = load_config({"flops_profiler": {"enabled": True, "step": 1}})  # DeepSpeed's test sets "step": no effect
    assert cfg.flops_profiler.enabled and cfg.flops_profiler.profile_step == 1
    assert any(path == "flops_profiler.step" for path, _ in cfg.notes)
    for bad, key in [({"top_modules": 0}, "top_modules"), ({"module_depth": -2}, "module_depth"),
                     ({"recompute_fwd_factor": 1.5}, "recompute_fwd_factor"), ({"enabled": "yes"}, "enabled"),
                     ({"profile_step": -1}, "profile_step"), ({"output_file": 3}, "output_file")]:
        with pytest.raises(ConfigError, match=f"flops_profiler.{key}"):
            load_config({"flops_profiler": bad})
    with pytest.raises(ConfigError, match="flops_profiler.modul_depth.*did you mean 'module_depth'"):
        load_config({"flops_profiler": {"modul_depth": 1}})


def _zero3_and_pipeline() -> dict:
    from zerotune.config.errors import NotSupportedYetError
    from zerotune.pipe import LayerSpec, PipelineModule

    torch.manual_seed(0)
    model = _Simple()
    config = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3}, "flops_profiler": {"enabled": True, "profile_step": 0}}
    engine, *_ = zerotune.initialize(config=config, model=model, model_parameters=model.parameters())
    with contextlib.redirect_stdout(io.StringIO()):
        loss = engine(torch.randn(2, 10), torch.randint(0, 10, (2,)))
        engine.backward(loss)
        engine.step()
    profiler = engine.flops_profiler
    pipe = PipelineModule([LayerSpec(nn.Linear, 4, 4)], num_stages=1, loss_fn=nn.MSELoss())
    try:
        zerotune.initialize(config={"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                    "flops_profiler": {"enabled": True}}, model=pipe)
        refusal = ""
    except NotSupportedYetError as err:
        refusal = str(err)
    return {"flops": profiler.flops, "params": profiler.params, "refusal": refusal}


def test_zero3_counts_whole_parameters_and_a_pipeline_refuses_the_block() -> None:
    (result,) = run_distributed(_zero3_and_pipeline, 1, timeout=120)
    assert result["flops"] == 2 * 2 * 10 * 10 and result["params"] == 110  # ZeRO-3's gathered forward, ds_numel
    assert "flops_profiler.enabled" in result["refusal"] and "get_model_profile" in result["refusal"]
