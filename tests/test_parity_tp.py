"""Tensor parallelism (AutoTP) reproduces single-process PyTorch: fp32, 8 steps, GAS 2, clipping 0.5.

GPT-2 (Conv1D layers, fused q|k|v, embedding tied to the vocab-parallel LM head) and Llama
(q/k/v/o, gate/up/down, grouped kv heads) on tp 2; tp 2 x dp 2 with ZeRO-1, ZeRO-2 and ZeRO-3 on 4 ranks.
Also: the exported model (save_16bit_model) and the checkpoint hold full tensors that equal the
reference, and bad sizes are refused naming the module and the numbers.
"""

from __future__ import annotations


import pytest
import torch

import zerotune
from tests.harness import run_distributed
from tests.models import (assert_close_traces, engine_run, gpt2_batch, make_bert, make_gpt2, make_llama, mlp_batch,
                          reference_run)

STEPS, GAS, CLIP, ROWS = 8, 2, 0.5, 4


def _config(stage: int, tp: int, dp: int, kind: str = "gpt2") -> dict:
    tensor_parallel = {"autotp_size": tp, **({"partition_config": USER_PLAN} if kind == "mlp" else {})}
    return {"train_micro_batch_size_per_gpu": ROWS // dp, "gradient_accumulation_steps": GAS,
            "gradient_clipping": CLIP,
            "zero_optimization": {"stage": stage, **({"stage3_gather_16bit_weights_on_model_save": True}
                                                     if stage == 3 else {})},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "tensor_parallel": tensor_parallel}


class PlanMLP(torch.nn.Module):
    """A model no built-in plan knows: split by the user's partition_config rules."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(8, 32)
        self.down = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.down(torch.nn.functional.gelu(self.up(x))), y)


USER_PLAN = {"layer_specs": [{"patterns": [r"up\.weight"], "partition_type": "column"},
                             {"patterns": [r"down\.weight"], "partition_type": "row"}]}


def _make_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=False))


def _make(kind: str):
    return {"gpt2": make_gpt2, "llama": make_llama, "bert": make_bert, "qwen2": _make_qwen2, "mlp": PlanMLP}[kind]()


def _batch_fn(kind: str):
    return mlp_batch if kind == "mlp" else gpt2_batch


def _reference(kind: str):
    model = _make(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return reference_run(model, optimizer, _batch_fn(kind), steps=STEPS, gas=GAS, global_rows=ROWS, clip=CLIP), model


def _tp_run(kind: str, stage: int, tp: int, export_dir: str | None = None):
    world = torch.distributed.get_world_size()
    engine, *_ = zerotune.initialize(model=_make(kind), config=_config(stage, tp, world // tp, kind))
    if export_dir is not None:
        engine.save_16bit_model(export_dir, "initial.safetensors")
    trace = engine_run(engine, _batch_fn(kind), steps=STEPS, gas=GAS, global_rows=ROWS)
    if export_dir is not None:
        engine.save_16bit_model(export_dir, "model.safetensors")
    return trace


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2", "bert", "mlp"])
def test_tp2_matches_single_process(kind, tmp_path):
    expected, reference_model = _reference(kind)
    traces = run_distributed(_tp_run, 2, kind, 0, 2, str(tmp_path), timeout=180)
    for trace in traces:
        assert_close_traces(trace, expected, rel=1e-5)
    from safetensors.torch import load_file

    # The export joins the shards (fused q|k|v included) into the model's own tensors: exactly the
    # initial weights before training ...
    initial = load_file(tmp_path / "initial.safetensors")
    assert initial.keys() == _make(kind).state_dict().keys()
    for key, tensor in _make(kind).state_dict().items():
        if key in initial:
            assert torch.equal(initial[key], tensor), key
    # ... and the reference's after 8 AdamW steps (lr 1e-2), up to the float noise Adam's m / sqrt(v)
    # amplifies in near-zero gradients: a few elements differ by up to ~2e-5 (a misplaced shard: ~1e-2).
    exported = load_file(tmp_path / "model.safetensors")
    reference = reference_model.state_dict()
    for key, tensor in exported.items():
        torch.testing.assert_close(tensor, reference[key], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tp2_x_dp2_with_zero_matches_single_process(kind, stage):
    expected, _ = _reference(kind)
    for trace in run_distributed(_tp_run, 4, kind, stage, 2, timeout=300):
        assert_close_traces(trace, expected, rel=1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tp2_x_dp2_with_zero3_matches_single_process_and_exports_full_tensors(kind, tmp_path):
    """ZeRO-3 partitions each tp shard over the dp ranks; the norm sums over both (replicated ones counted once)."""
    expected, reference_model = _reference(kind)
    for trace in run_distributed(_tp_run, 4, kind, 3, 2, str(tmp_path), timeout=300):
        assert_close_traces(trace, expected, rel=1e-5)
    from safetensors.torch import load_file

    exported, reference = load_file(tmp_path / "model.safetensors"), reference_model.state_dict()
    assert exported.keys() == reference.keys()
    for key, tensor in exported.items():
        torch.testing.assert_close(tensor, reference[key], rtol=1e-4, atol=1e-4)


def _mixed_run(precision: str) -> list[float]:
    config = {**_config(1, 2, 1), precision: {"enabled": True}}
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=config)
    trace = engine_run(engine, gpt2_batch, steps=STEPS, gas=GAS, global_rows=ROWS)
    assert engine.skipped_steps == 0
    return trace.losses


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_tp2_in_bf16_and_fp16_tracks_the_fp32_reference_within_2_percent(precision):
    expected, _ = _reference("gpt2")
    for losses in run_distributed(_mixed_run, 2, precision, timeout=180):
        for got, want in zip(losses, expected.losses):
            assert abs(got - want) <= 0.02 * want


def _save_resume(stage: int, directory: str) -> tuple[list[float], list[float]]:
    """Train 3 steps, save, train 3 more; then a fresh engine loads the checkpoint and trains the same 3."""
    config = _config(stage, 2, torch.distributed.get_world_size() // 2)
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=config)
    engine_run(engine, gpt2_batch, steps=3, gas=GAS, global_rows=ROWS)
    engine.save_checkpoint(directory, tag="t")
    first = engine_run(engine, lambda s, m, r: gpt2_batch(s + 3, m, r), steps=3, gas=GAS, global_rows=ROWS)
    resumed, *_ = zerotune.initialize(model=make_gpt2(seed=7), config=config)
    resumed.load_checkpoint(directory, tag="t")
    second = engine_run(resumed, lambda s, m, r: gpt2_batch(s + 3, m, r), steps=3, gas=GAS, global_rows=ROWS)
    return first.losses + first.grad_norms, second.losses + second.grad_norms


@pytest.mark.parametrize("stage, world", [(0, 2), pytest.param(2, 4, marks=pytest.mark.slow), (3, 4)])
def test_checkpoint_resume_with_tp_is_bit_identical_and_holds_full_tensors(stage, world, tmp_path):
    for first, second in run_distributed(_save_resume, world, stage, str(tmp_path), timeout=300):
        assert first == second
    saved = torch.load(tmp_path / "t" / "model_states.pt", weights_only=False)
    assert saved["layout"]["tp_size"] == 2
    if stage == 3:  # the weights are in the per-rank shard files (tests/test_checkpoint_layouts.py loads them at tp 1)
        return
    reference = make_gpt2().state_dict()
    assert {k: v.shape for k, v in saved["module"].items()} == {k: v.shape for k, v in reference.items()}


def _initialize_error(model_kind: str, config: dict) -> str:
    models = {"gpt2_heads3": lambda: make_gpt2(heads=3, width=48), "gpt2_vocab95": lambda: make_gpt2(vocab=95),
              "gpt2": make_gpt2, "mlp": lambda: torch.nn.Sequential(torch.nn.Linear(4, 4))}
    try:
        zerotune.initialize(model=models[model_kind](), config=config)
    except Exception as error:  # noqa: BLE001 - the message is what is tested
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize("model_kind, config_change, expected", [
    ("gpt2_heads3", {}, "n_head=3 heads, not divisible by the tensor-parallel size 2"),
    ("gpt2_vocab95", {}, "'transformer.wte'"),
    ("gpt2_vocab95", {}, "95"),
    ("mlp", {}, "no built-in tensor-parallel plan for Sequential"),
    ("gpt2", {"tensor_parallel": {"autotp_size": 4}}, "world size 2 is not divisible by tensor parallel 4"),
    ("mlp", {"tensor_parallel": {"autotp_size": 2, "partition_config": {
        "layer_specs": [{"patterns": [r"nothing\.weight"], "partition_type": "row"}]}}}, "no layer of Sequential matched"),
])
def test_bad_tensor_parallel_setups_are_refused_with_the_numbers(model_kind, config_change, expected):
    config = {**_config(0, 2, 1), **config_change}
    for message in run_distributed(_initialize_error, 2, model_kind, config, timeout=120):
        assert expected in message, message
