"""ZeRO stages 0 (data parallel), 1, 2 and 3 reproduce single-process PyTorch on 2 and 4 gloo ranks.

fp32: losses and global gradient norms within 1e-5 relative over 8 steps with GAS 2 and
clipping; bf16 and fp16 within 2% of the fp32 reference.
"""

from __future__ import annotations

import pytest
import torch

import zerotune
from tests.harness import run_distributed
from tests.models import (assert_close_traces, engine_run, gpt2_batch, make_gpt2, make_mlp, mlp_batch,
                          mlp_param_groups, reference_run)

STEPS, GAS, CLIP = 8, 2, 0.5
OPTIMIZERS = {
    "AdamW": ({"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01},
              lambda groups, p: torch.optim.AdamW(groups, lr=p["lr"], betas=tuple(p["betas"]), eps=p["eps"],
                                                   weight_decay=p["weight_decay"])),
    "SGD": ({"lr": 0.05, "momentum": 0.9},
            lambda groups, p: torch.optim.SGD(groups, lr=p["lr"], momentum=p["momentum"])),
}


def _config(world: int, micro: int, opt_type: str, precision: str, stage: int) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "optimizer": {"type": opt_type, "params": OPTIMIZERS[opt_type][0]},
        # small buckets: several collectives (and parameters split across buckets) even for tiny models
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 200,
                              "overlap_comm": world == 4},  # stage 2: both the async and the blocking path
        "steps_per_print": 1000,
    }
    if stage == 3:  # release every unit after use and prefetch about one GPT-2 block ahead
        config["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=20000)
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return config


def _mlp_parity(opt_type: str, micro: int, precision: str, stage: int) -> dict:
    world = torch.distributed.get_world_size()
    params, make_reference_optimizer = OPTIMIZERS[opt_type]
    reference_model = make_mlp()
    reference = reference_run(reference_model, make_reference_optimizer(mlp_param_groups(reference_model), params),
                              mlp_batch, steps=STEPS, gas=GAS, global_rows=micro * world, clip=CLIP)
    model = make_mlp()
    engine, _, _, _ = zerotune.initialize(model=model, model_parameters=mlp_param_groups(model),
                                          config=_config(world, micro, opt_type, precision, stage))
    trace = engine_run(engine, mlp_batch, steps=STEPS, gas=GAS, global_rows=micro * world)
    assert engine.sharded == (stage > 0) and engine.zero_optimization_stage() == stage
    with zerotune.zero.GatheredParameters(model.frozen.weight):  # whole again at stage 3
        frozen_untouched = torch.equal(model.frozen.weight.float(), make_mlp().frozen.weight)
    engine.destroy()
    return {"trace": trace, "reference": reference, "frozen_untouched": frozen_untouched,
            "skipped": engine.skipped_steps}


def _gpt2_parity(micro: int, precision: str, stage: int) -> dict:
    world = torch.distributed.get_world_size()
    params, make_reference_optimizer = OPTIMIZERS["AdamW"]
    reference_model = make_gpt2()
    reference = reference_run(reference_model, make_reference_optimizer(reference_model.parameters(), params),
                              gpt2_batch, steps=STEPS, gas=GAS, global_rows=micro * world, clip=CLIP)
    model = make_gpt2()
    engine, _, _, _ = zerotune.initialize(model=model, model_parameters=model.parameters(),
                                          config=_config(world, micro, "AdamW", precision, stage))
    trace = engine_run(engine, gpt2_batch, steps=STEPS, gas=GAS, global_rows=micro * world)
    assert engine.sharded == (stage > 0) and engine.zero_optimization_stage() == stage
    tied = model.transformer.wte.weight is model.lm_head.weight
    engine.destroy()
    return {"trace": trace, "reference": reference, "tied": tied, "skipped": engine.skipped_steps}


STAGES = [0, 1, 2, 3]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("opt_type", ["AdamW", "SGD"])
def test_mlp_fp32_matches_single_process(world: int, opt_type: str, stage: int) -> None:
    result = run_distributed(_mlp_parity, world, opt_type, 2, "fp32", stage)[0]
    assert_close_traces(result["trace"], result["reference"], rel=1e-5)
    assert result["frozen_untouched"]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world", [2, 4])
def test_gpt2_tied_fp32_matches_single_process(world: int, stage: int) -> None:
    result = run_distributed(_gpt2_parity, world, 2, "fp32", stage, timeout=120)[0]
    assert result["tied"]
    assert_close_traces(result["trace"], result["reference"], rel=1e-5)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mlp_mixed_precision_within_two_percent(precision: str, stage: int) -> None:
    result = run_distributed(_mlp_parity, 2, "AdamW", 4, precision, stage)[0]
    assert result["skipped"] == 0
    assert_close_traces(result["trace"], result["reference"], rel=0.02)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gpt2_mixed_precision_within_two_percent(precision: str, stage: int) -> None:
    result = run_distributed(_gpt2_parity, 2, 2, precision, stage, timeout=120)[0]
    assert result["skipped"] == 0
    assert_close_traces(result["trace"], result["reference"], rel=0.02)
