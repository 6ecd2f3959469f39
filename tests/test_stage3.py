"""ZeRO stage 3 beyond the shared parity suite: awkward models, zero.Init, loading, saving, contexts.

Parity (fp32, 1e-5 relative) for: a module called twice per forward, a layer that gets no
gradient, a frozen weight sharing a unit with trainable adapters (backward still needs it after
the adapters' gradients are done), peft LoRA on GPT-2, and the default persistence threshold.
"""

from __future__ import annotations

import warnings

from pathlib import Path

import pytest
import torch
from torch import nn

import zerotune
from tests.harness import run_distributed
from tests.memory_probe import PeakTensorBytes
from tests.models import assert_close_traces, engine_run, gpt2_batch, make_gpt2, mlp_batch, reference_run

STEPS, GAS, CLIP = 6, 2, 0.5


class AdapterLinear(nn.Module):
    """A frozen weight and two trainable low-rank factors owned by one module (one unit, two segments)."""

    def __init__(self, width: int, rank: int = 2) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5, requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, width) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(width, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + (x @ self.lora_a.t()) @ self.lora_b.t()


class AwkwardModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.shared = nn.Linear(16, 16)  # called twice per forward
        self.unused = nn.Linear(16, 16)  # never called: no gradient
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.adapter = AdapterLinear(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(torch.tanh(self.shared(h))))
        h = torch.tanh(self.adapter(torch.tanh(self.frozen(h))))
        return nn.functional.mse_loss(self.out(h), y)


def _awkward(seed: int = 0) -> AwkwardModel:
    torch.manual_seed(seed)
    return AwkwardModel()


def _config(micro: int, **zero: object) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}, "steps_per_print": 1000,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_prefetch_bucket_size": 600, "overlap_comm": True, **zero}}


def _awkward_parity() -> dict:
    world = torch.distributed.get_world_size()
    reference_model = _awkward()
    trainable = [p for p in reference_model.parameters() if p.requires_grad]
    reference = reference_run(reference_model, torch.optim.AdamW(trainable, lr=0.01, weight_decay=0.0), mlp_batch,
                              steps=STEPS, gas=GAS, global_rows=2 * world, clip=CLIP)
    model = _awkward()
    engine, *_ = zerotune.initialize(model=model, config=_config(2))
    trace = engine_run(engine, mlp_batch, steps=STEPS, gas=GAS, global_rows=2 * world)
    with zerotune.zero.GatheredParameters(list(model.parameters())):
        unused_kept = torch.equal(model.unused.weight, _awkward().unused.weight)
        frozen_kept = torch.equal(model.adapter.weight, _awkward().adapter.weight)
    engine.destroy()
    return {"trace": trace, "reference": reference, "unused_kept": unused_kept, "frozen_kept": frozen_kept}


@pytest.mark.parametrize("world", [2, 4])
def test_shared_unused_and_frozen_weights_match_single_process(world: int) -> None:
    result = run_distributed(_awkward_parity, world)[0]
    assert_close_traces(result["trace"], result["reference"], rel=1e-5)
    assert result["unused_kept"] and result["frozen_kept"]


def _gpt2_parity(lora: bool, zero: dict) -> dict:
    world = torch.distributed.get_world_size()

    def build():
        model = make_gpt2()
        if lora:
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(1)
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"],
                                                     init_lora_weights=False))
        return model

    reference_model = build()
    trainable = [p for p in reference_model.parameters() if p.requires_grad]
    reference = reference_run(reference_model, torch.optim.AdamW(trainable, lr=0.01, weight_decay=0.0), gpt2_batch,
                              steps=STEPS, gas=GAS, global_rows=2 * world, clip=CLIP)
    model = build()
    engine, *_ = zerotune.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                     config=_config(2, **zero))
    trace = engine_run(engine, gpt2_batch, steps=STEPS, gas=GAS, global_rows=2 * world)
    units = [unit.name for unit in engine.state.units]
    engine.destroy()
    return {"trace": trace, "reference": reference, "units": units}


def test_peft_lora_gpt2_matches_single_process() -> None:
    result = run_distributed(_gpt2_parity, 2, True, {}, timeout=120)[0]
    assert_close_traces(result["trace"], result["reference"], rel=1e-5)
    assert any(name.endswith("h.0") for name in result["units"])  # GPT2Block units found through peft


def test_default_persistence_keeps_small_units_gathered_and_matches() -> None:
    result = run_distributed(_gpt2_parity, 2, False, {"stage3_param_persistence_threshold": 10**5,
                                                      "stage3_prefetch_bucket_size": 5 * 10**7}, timeout=120)[0]
    assert_close_traces(result["trace"], result["reference"], rel=1e-5)


# ---- zero.Init ------------------------------------------------------------------------------
def _deep_mlp() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(32)])  # 2.1M params


def _init_within_budget(save_dir: str) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0,
                                    "stage3_gather_16bit_weights_on_model_save": True}}
    with PeakTensorBytes() as probe:
        torch.manual_seed(0)
        with zerotune.zero.Init(config_dict_or_path=config):
            model = _deep_mlp()
        engine, *_ = zerotune.initialize(model=model, config=config)
        x = torch.randn(2, 256, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
        saved = engine.save_16bit_model(save_dir, "model.safetensors")
    psi = sum(p.numel() for p in model.parameters())
    complete = None
    if torch.distributed.get_rank() == 0:  # the streamed file holds every tensor, whole
        from safetensors.torch import load_file

        written = load_file(str(Path(save_dir) / "model.safetensors"))
        expected = _deep_mlp().state_dict()
        complete = set(written) == set(expected) and all(written[k].shape == v.shape for k, v in expected.items())
    engine.destroy()
    return {"peak": probe.peak, "psi": psi, "saved": saved, "written_complete": complete}


def test_zero_init_builds_trains_and_saves_a_model_larger_than_the_per_rank_budget(tmp_path: Path) -> None:
    """8 ranks: shards + gradient shards are 1/4 of the fp32 model; the rest of the budget covers one or
    two gathered units with their gradients and gloo's staging copies (CPU collectives copy through
    buffers of their own), so the whole model never fits in it."""
    results = run_distributed(_init_within_budget, 8, str(tmp_path), timeout=300)
    psi = results[0]["psi"]
    full_fp32 = 4 * psi
    budget = 3 * full_fp32 // 4
    for rank, result in enumerate(results):
        assert result["saved"]
        assert result["peak"] < budget, (rank, result["peak"] / full_fp32)
    assert results[0]["written_complete"]


def _init_parity() -> dict:
    world = torch.distributed.get_world_size()
    torch.manual_seed(0)
    reference_model = AwkwardModel()
    trainable = [p for p in reference_model.parameters() if p.requires_grad]
    reference = reference_run(reference_model, torch.optim.AdamW(trainable, lr=0.01, weight_decay=0.0), mlp_batch,
                              steps=3, gas=GAS, global_rows=2 * world, clip=CLIP)
    torch.manual_seed(0)
    with zerotune.zero.Init():
        model = AwkwardModel()
    placeholders = all(p.stride() == (0,) * p.dim() for p in model.parameters())
    engine, *_ = zerotune.initialize(model=model, config=_config(2))
    trace = engine_run(engine, mlp_batch, steps=3, gas=GAS, global_rows=2 * world)
    engine.destroy()
    return {"trace": trace, "reference": reference, "placeholders": placeholders}


def test_zero_init_model_trains_exactly_like_the_eager_one() -> None:
    result = run_distributed(_init_parity, 2)[0]
    assert result["placeholders"]  # partitioned as built: no parameter whole after the context
    assert_close_traces(result["trace"], result["reference"], rel=1e-5)


# ---- loading and saving ---------------------------------------------------------------------
def _load_pretrained_then_save(source: str, target: str) -> dict:
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    torch.manual_seed(123)  # different weights than the pretrained files
    with zerotune.zero.Init():
        model = make_gpt2(seed=5)
    report = zerotune.zero.load_partitioned_weights(model, source)
    config = _config(2, stage3_gather_16bit_weights_on_model_save=True)
    config["bf16"] = {"enabled": True}
    engine, *_ = zerotune.initialize(model=model, config=config)
    with zerotune.zero.GatheredParameters(list(model.parameters())):
        gathered = {k: v.clone() for k, v in model.state_dict().items()}
    assert engine.save_16bit_model(target, "model.safetensors")
    assert engine.save_16bit_model(target, "pytorch_model.bin")
    result = {"missing": report["missing"]}
    if torch.distributed.get_rank() == 0:
        pretrained = GPT2LMHeadModel.from_pretrained(source).state_dict()
        result["loaded_exactly"] = all(torch.equal(gathered[k], v.to(torch.bfloat16)) for k, v in pretrained.items())
        streamed = load_file(str(Path(target) / "model.safetensors"))
        pickled = torch.load(Path(target) / "pytorch_model.bin", weights_only=True)
        result["safetensors_exact"] = set(streamed) == set(gathered) and all(
            torch.equal(streamed[k], v) for k, v in gathered.items())
        result["torch_load_exact"] = all(torch.equal(pickled[k], v) for k, v in gathered.items())
        model.config.save_pretrained(target)
        (Path(target) / "pytorch_model.bin").unlink()
        reloaded = GPT2LMHeadModel.from_pretrained(target, dtype=torch.bfloat16).state_dict()
        result["from_pretrained_exact"] = all(torch.equal(reloaded[k], gathered[k]) for k in reloaded)
    engine.destroy()
    return result


def test_pretrained_weights_load_per_slice_and_save_16bit_model_round_trips(tmp_path: Path) -> None:
    source, target = tmp_path / "pretrained", tmp_path / "export"
    make_gpt2(seed=0).save_pretrained(source, safe_serialization=True)
    result = run_distributed(_load_pretrained_then_save, 2, str(source), str(target), timeout=120)[0]
    assert result["missing"] == []
    assert result["loaded_exactly"], "the partitioned model does not hold the pretrained weights"
    assert result["safetensors_exact"] and result["torch_load_exact"] and result["from_pretrained_exact"]


def _save_without_flag(target: str) -> dict:
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=_config(2))
    saved = engine.save_16bit_model(target)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = engine.module.state_dict()
    fresh = make_gpt2()
    try:
        fresh.load_state_dict(state)
        load_error = ""
    except RuntimeError as error:
        load_error = str(error)
    partitioned = {name for name, p in engine.module.named_parameters(remove_duplicate=False) if p.ds_numel != p.ds_tensor.numel()
                   or p.stride() == (0,) * p.dim()}
    result = {"saved": saved, "warnings": [str(w.message) for w in caught], "load_error": load_error,
              "empty": sorted(k for k, v in state.items() if v.numel() == 0),
              "partitioned": sorted(partitioned)}
    engine.destroy()
    return result


def test_partitioned_weights_are_not_saved_silently(tmp_path: Path) -> None:
    """state_dict() of a partitioned model returns DeepSpeed's empty entries (DeepSpeed-Chat saves it, then
    overwrites the file with gathered weights), warns how to get the values, and what it returns can never
    be loaded as weights."""
    result = run_distributed(_save_without_flag, 2, str(tmp_path))[0]
    assert result["saved"] is False and not any(tmp_path.iterdir())
    assert result["empty"] and set(result["empty"]) == set(result["partitioned"])
    assert len(result["warnings"]) == 1
    assert "partitioned by ZeRO stage 3" in result["warnings"][0] and "GatheredParameters" in result["warnings"][0]
    assert "size mismatch" in result["load_error"]


def _modify_under_gathered() -> dict:
    config = _config(2)
    config["bf16"] = {"enabled": True}
    model = _awkward()
    engine, *_ = zerotune.initialize(model=model, config=config)
    rank = torch.distributed.get_rank()
    with zerotune.zero.GatheredParameters(model.out.weight, modifier_rank=0):
        model.out.weight.data.fill_(1.0 if rank == 0 else 2.0)  # rank 1's change is discarded
    with zerotune.zero.GatheredParameters(model.out.weight):
        seen = model.out.weight.float().unique().tolist()
    unit = next(u for u in engine.state.units if u.name == "out")
    master = engine.state.master_flats[id(unit)]
    start = unit.trainable.layout.owned_range(unit.trainable.rank)[0]
    weight_part = master[:max(0, min(model.out.weight.numel() - start, master.numel()))]
    engine.destroy()
    return {"seen": seen, "master_ones": bool((weight_part == 1.0).all())}


def test_gathered_parameters_modifier_rank_reaches_every_rank_and_the_fp32_masters() -> None:
    for result in run_distributed(_modify_under_gathered, 2):
        assert result["seen"] == [1.0]
        assert result["master_ones"]
