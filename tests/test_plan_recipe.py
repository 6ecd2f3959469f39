"""``zerotune plan RECIPE``: the recipe's own job, counted as it trains (frozen base vs adapters, the
preference objective's doubled rows), on a tiny Llama built on the meta device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_finetune_causal_lm import make_qa_jsonl, make_tiny_llama
from zerotune.plan.recipe_job import is_recipe, plan_job, quantized_weight_bytes, recipe_job

REPO = Path(__file__).resolve().parents[1]
HIDDEN, KV, INTER, LAYERS = 32, 16, 64, 2  # make_tiny_llama's shapes (4 heads of 8, 2 key/value heads)
BLOCK = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV + 3 * HIDDEN * INTER + 2 * HIDDEN  # attention, MLP, two norms
LINEARS = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV + 3 * HIDDEN * INTER  # the weights bitsandbytes would quantize


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("plan_recipe")
    model_dir = make_tiny_llama(tmp / "tiny-llama")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    pairs = tmp / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"what is {i}", "chosen": "blue", "rejected": "red"}) + "\n"
                             for i in range(16)))
    return {"dir": str(model_dir), "qa": str(make_qa_jsonl(tmp / "qa.jsonl")), "pairs": str(pairs), "tmp": tmp,
            "base": 2 * vocab * HIDDEN + HIDDEN + LAYERS * BLOCK}


def _recipe(tiny: dict, method: dict, objective: str = "sft", stage: int = 2, name: str = "r") -> str:
    data = ({"train_files": [tiny["pairs"]]} if objective != "sft" else
            {"train_files": [tiny["qa"]], "prompt_column": "question", "response_column": "answer"})
    recipe = {"model": {"name_or_path": tiny["dir"]}, "task": "causal-lm",
              "data": {**data, "eval_fraction": 0.25, "max_length": 32}, "method": method,
              "objective": {"type": objective},
              "train": {"max_steps": 2, "micro_batch_size": 4}, "engine": {"zero_stage": stage, "precision": "fp32"},
              "launch": {"nproc_per_node": 2}}
    path = Path(tiny["tmp"]) / f"{name}.json"
    path.write_text(json.dumps(recipe))
    return str(path)


def _plan(path: str, **kwargs: object) -> tuple:
    job = recipe_job(path, [], **kwargs)  # type: ignore[arg-type]
    plan, _, layout = plan_job(job)
    return job, plan, layout, {row.name: row.bytes for row in plan.rows}


LORA = {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0}
LORA_PARAMS = LAYERS * (2 * 4 * (HIDDEN + HIDDEN) + 2 * 4 * (HIDDEN + KV))  # r=4 on q, o (32 -> 32) and k, v (32 -> 16)


def test_lora_counts_frozen_base_and_adapters(tiny: dict) -> None:
    job, plan, layout, rows = _plan(_recipe(tiny, LORA))
    assert (plan.trainable, plan.frozen) == (LORA_PARAMS, tiny["base"])
    assert (job.world_size, layout.dp, layout.stage, layout.micro_batch, job.seq_len) == (2, 2, 2, 4, 32)
    assert rows["parameters"] == 4 * (LORA_PARAMS + tiny["base"])  # the frozen base stays whole, in fp32
    assert rows["gradients"] == 4 * LORA_PARAMS // 2  # stage 2: only the adapters' gradients, sharded
    assert rows["optimizer state"] == 8 * LORA_PARAMS // 2 and rows["fp32 master weights"] == 0


def test_methods_and_objectives_differ_as_they_train(tiny: dict) -> None:
    _, full, _, full_rows = _plan(_recipe(tiny, {"type": "full"}, name="full"))
    _, lora, _, lora_rows = _plan(_recipe(tiny, LORA, name="lora"))
    _, freeze, _, freeze_rows = _plan(_recipe(tiny, {"type": "freeze", "trainable_layers": 1}, name="freeze"))
    assert (full.trainable, full.frozen) == (tiny["base"], 0)
    assert (freeze.trainable, freeze.frozen) == (BLOCK + HIDDEN, tiny["base"] - BLOCK - HIDDEN)  # + final norm
    assert lora_rows["optimizer state"] < freeze_rows["optimizer state"] < full_rows["optimizer state"]
    assert full_rows["parameters"] == freeze_rows["parameters"] == 4 * tiny["base"]

    dpo_job, dpo, dpo_layout, dpo_rows = _plan(_recipe(tiny, LORA, "dpo", name="dpo"))
    assert dpo_layout.micro_batch == 8  # 4 pairs: chosen + rejected in one forward
    assert (dpo.trainable, dpo.frozen) == (lora.trainable, lora.frozen)  # no reference copy
    assert dpo_rows["optimizer state"] == lora_rows["optimizer state"]
    assert dpo.activations.saved_bytes == 2 * lora.activations.saved_bytes
    assert any("adapter disabled" in note for note in dpo_job.notes)
    full_dpo_job, full_dpo, _, _ = _plan(_recipe(tiny, {"type": "full"}, "dpo", name="full-dpo"))
    assert (full_dpo.trainable, full_dpo.frozen) == (tiny["base"], 0)
    assert any("precomputed once" in note for note in full_dpo_job.notes)
    kto_job, _, kto_layout, _ = _plan(_recipe(tiny, LORA, "kto", name="kto"))
    assert kto_layout.micro_batch == 4  # unpaired rows

    reward_job, reward, _, _ = _plan(_recipe(tiny, {"type": "full"}, "reward", name="reward"))
    assert reward_job.task == "sequence-classification"
    assert reward.trainable == tiny["base"] - (tiny["base"] - LAYERS * BLOCK - HIDDEN) // 2 + HIDDEN  # score: 32 x 1


def test_overrides_world_size_and_seq_len(tiny: dict) -> None:
    job, plan, layout, rows = _plan(_recipe(tiny, LORA), world_size=4, seq_len=16)
    assert (job.world_size, layout.dp, job.seq_len) == (4, 4, 16)
    assert rows["optimizer state"] == 8 * LORA_PARAMS // 4


def test_qlora_counts_packed_frozen_linears(tiny: dict) -> None:
    _, plan, _, rows = _plan(_recipe(tiny, {**LORA, "type": "qlora", "bits": 4}, name="qlora"))
    linears = LAYERS * LINEARS
    assert (plan.trainable, plan.frozen) == (LORA_PARAMS, tiny["base"] - linears)
    assert rows["parameters"] == 4 * (LORA_PARAMS + tiny["base"] - linears)
    packed = sum(quantized_weight_bytes(out * inp, out, 4) for out, inp in
                 [(HIDDEN, HIDDEN)] * 2 + [(KV, HIDDEN)] * 2 + [(INTER, HIDDEN)] * 2 + [(HIDDEN, INTER)]) * LAYERS
    assert rows["quantized frozen weights"] == packed
    assert quantized_weight_bytes(4096, 64, 4) == 2048 + 64 + 4 and quantized_weight_bytes(4096, 64, 8) == 4096 + 256


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerotune.cli.main", "plan", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})


def test_cli_plans_a_recipe_and_refuses_bad_ones_in_one_line(tiny: dict) -> None:
    path = _recipe(tiny, LORA, name="cli")
    assert is_recipe(path) and is_recipe("smollm2-lora") and not is_recipe(str(REPO / "README.md"))
    done = _cli(path, "--set", "train.micro_batch_size=2")
    assert done.returncode == 0, done.stderr
    assert f"{LORA_PARAMS:,} trainable parameters, {tiny['base']:,} frozen" in done.stdout
    assert "micro-batch 2 x 32 tokens" in done.stdout and "planned at the worst case" in done.stdout
    for args, key in (([path, "--set", "method.type=lorra"], "method.type"), ([path, "--model", "gpt2"], "--model"),
                      ([path, "--task", "causal-lm"], "--task"), ([path, "--auto"], "--auto"),
                      (["smollm2-lorra"], "not a recipe")):
        done = _cli(*args)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and key in lines[0], done.stderr


def test_stage2_buckets_follow_overlap_comm() -> None:
    """Without overlap_comm (stage 2's default) the engine reuses one reduce bucket; with it, up to three are held
    (one filling, two in flight). The default follows the planned stage, also under --zero-stage."""
    from zerotune.plan.memory import layout_from_config, plan_from_profile, profile_model
    from zerotune.plan.meta_model import meta_model

    base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}}
    assert layout_from_config(base, 2).overlap_comm is None
    assert layout_from_config({**base, "zero_optimization": {"stage": 3}}, 2).overlap_comm is None  # not given
    overlapped = {**base, "zero_optimization": {**base["zero_optimization"], "overlap_comm": True}}
    profile = profile_model(meta_model("tests.models:make_gpt2"), 8, "fp32")
    buckets = [next(row.bytes for row in plan_from_profile(profile, layout_from_config(config, 2)).rows
                    if row.name == "communication buckets") for config in (base, overlapped)]
    assert buckets == [4 * 1000, 3 * 4 * 1000]
