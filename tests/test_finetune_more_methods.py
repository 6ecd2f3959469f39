"""Fine-tuning methods beyond full / LoRA / prefix: DoRA and rsLoRA adapters, QLoRA (LoRA on a 4- or 8-bit
frozen base through bitsandbytes, which runs on CPU), and freeze tuning (the last N blocks or named
modules). Each trains at the ZeRO stages it supports; a combination that cannot train is refused when
the recipe loads, naming both."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed
from tests.test_finetune_causal_lm import make_qa_jsonl, make_tiny_llama
from zerotune.finetune.models import ModelLoadError, apply_method, freeze_except, load_model
from zerotune.finetune.recipe import RecipeError, load_recipe
from zerotune.finetune.recipe_sections import MethodSection


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


def _trainable(model: torch.nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def test_dora_and_rslora_reach_peft(llama_dir) -> None:
    model = apply_method(load_model(llama_dir, "causal-lm"), "causal-lm",
                         MethodSection(type="lora", r=4, alpha=8, dora=True, rslora=True))
    config = model.peft_config["default"]
    assert config.use_dora and config.use_rslora and config.r == 4
    assert any("lora_magnitude_vector" in name for name in _trainable(model))  # DoRA's magnitudes train


def test_freeze_trains_the_last_blocks_and_named_modules_only(llama_dir) -> None:
    model = freeze_except(load_model(llama_dir, "causal-lm"), "causal-lm", 1, ["lm_head"])
    trainable = _trainable(model)
    assert trainable and all(name.startswith(("model.layers.1.", "model.norm", "lm_head")) for name in trainable)
    assert any(name.startswith("model.layers.1.") for name in trainable) and "lm_head.weight" in trainable
    classifier = freeze_except(load_model(llama_dir, "sequence-classification", 2, ["a", "b"]),
                               "sequence-classification", None, r"model\.layers\.0\.self_attn\.q_proj")
    assert set(_trainable(classifier)) == {"model.layers.0.self_attn.q_proj.weight", "score.weight"}
    with pytest.raises(ModelLoadError, match="trainable_layers: 5, but the model has 2 blocks"):
        freeze_except(load_model(llama_dir, "causal-lm"), "causal-lm", 5, None)
    with pytest.raises(ModelLoadError, match="matches no module"):
        freeze_except(load_model(llama_dir, "causal-lm"), "causal-lm", None, ["attention_typo"])


@pytest.mark.parametrize("bits", [4, 8])
def test_qlora_loads_a_quantized_frozen_base_with_float_adapters(llama_dir, bits) -> None:
    pytest.importorskip("bitsandbytes")
    model = apply_method(load_model(llama_dir, "causal-lm", quantize_bits=bits), "causal-lm",
                         MethodSection(type="qlora", bits=bits, r=4, alpha=8))
    base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert type(base).__name__ == ("Linear4bit" if bits == 4 else "Linear8bitLt")
    assert all(model.get_parameter(name).dtype == torch.float32 for name in _trainable(model))
    ids = torch.tensor([[2, 8, 9, 10]])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(model.get_parameter(n).grad is not None for n in _trainable(model))


def _recipe(tmp: Path, llama: Path, method: dict, stage: int, precision: str = "fp32", **model: object) -> Path:
    recipe = {"model": {"name_or_path": str(llama), **model}, "task": "causal-lm",
              "data": {"train_files": [str(make_qa_jsonl(tmp / "qa.jsonl"))], "prompt_column": "question",
                       "response_column": "answer", "eval_fraction": 0.25, "max_length": 32},
              "method": method,
              "train": {"max_steps": 30, "lr": 2e-2, "micro_batch_size": 4, "seed": 3, "eval_every": 15},
              "engine": {"zero_stage": stage, "precision": precision}}
    path = tmp / "recipe.json"
    path.write_text(json.dumps(recipe))
    return path


def test_method_options_and_stages_that_cannot_train_are_refused_at_load(tmp_path, llama_dir) -> None:
    with pytest.raises(RecipeError, match="method.type.*qlora with ZeRO stage 3"):
        load_recipe(str(_recipe(tmp_path, llama_dir, {"type": "qlora"}, 3)))
    with pytest.raises(RecipeError, match="method.bits.*a qlora option, but method.type is 'lora'"):
        load_recipe(str(_recipe(tmp_path, llama_dir, {"type": "lora", "bits": 4}, 2)))
    with pytest.raises(RecipeError, match="method.dora.*a lora / qlora option, but method.type is 'freeze'"):
        load_recipe(str(_recipe(tmp_path, llama_dir, {"type": "freeze", "trainable_layers": 1, "dora": True}, 2)))
    with pytest.raises(RecipeError, match="freeze tuning trains nothing"):
        load_recipe(str(_recipe(tmp_path, llama_dir, {"type": "freeze"}, 2)))


def test_model_dtype_and_trust_remote_code_reach_the_loader(tmp_path, llama_dir, monkeypatch) -> None:
    assert {p.dtype for p in load_model(llama_dir, "causal-lm", dtype="bf16").parameters()} == {torch.bfloat16}
    import transformers

    seen = {}
    real = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda path, **kwargs: seen.update(kwargs) or real(path, **kwargs))
    load_model(llama_dir, "causal-lm", trust_remote_code=True)
    assert seen["trust_remote_code"] is True and seen["dtype"] == torch.float32
    with pytest.raises(RecipeError, match="model.dtype.*bf16 weights with engine.precision fp32"):
        load_recipe(str(_recipe(tmp_path, llama_dir, {"type": "lora"}, 2, "fp32", dtype="bf16")))


def _finetune(recipe: str, output: str) -> dict:
    from zerotune.finetune.worker import run

    return run(argparse.Namespace(recipe=recipe, output_dir=output, resume=False, merge=False, overrides=[]))


@pytest.mark.slow
@pytest.mark.parametrize("method, stage", [
    ({"type": "qlora", "bits": 4, "r": 4, "alpha": 8, "dropout": 0.0}, 2),
    ({"type": "lora", "dora": True, "rslora": True, "r": 4, "alpha": 8, "dropout": 0.0}, 3),
    ({"type": "freeze", "trainable_layers": 1, "trainable_modules": ["lm_head"]}, 1),
    ({"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0, "bf16 weights": True}, 2),
])
def test_each_method_lowers_the_answer_loss_on_two_ranks(tmp_path, llama_dir, method, stage) -> None:
    if method["type"] == "qlora":
        pytest.importorskip("bitsandbytes")
    bf16 = method.pop("bf16 weights", False)  # loaded in bf16, trained in bf16 (model.dtype, engine.precision)
    recipe = _recipe(tmp_path, llama_dir, method, stage, "bf16" if bf16 else "fp32", **({"dtype": "bf16"} if bf16 else {}))
    summary = run_distributed(_finetune, 2, str(recipe), str(tmp_path / "run"), timeout=300)[0]
    assert summary["after"] < 0.6 * summary["before"], summary
    print(f"{method['type']} (ZeRO {stage}): answer loss {summary['before']:.3f} -> {summary['after']:.3f}")


def test_best_model_and_early_stopping_keys_are_checked(tmp_path, llama_dir) -> None:
    path = _recipe(tmp_path, llama_dir, {"type": "lora"}, 2)
    recipe = json.loads(path.read_text())
    recipe["train"].update(eval_every=0, load_best_model_at_end=True)
    path.write_text(json.dumps(recipe))
    with pytest.raises(RecipeError, match="train.eval_every.*train.load_best_model_at_end needs evaluations"):
        load_recipe(str(path))
    recipe["train"].update(eval_every=5, metric_for_best_model="accuracy")
    path.write_text(json.dumps(recipe))
    with pytest.raises(RecipeError, match="'accuracy' is not an eval metric of task 'causal-lm'; expected one of loss"):
        load_recipe(str(path))


def _policy_run(tmp_path: Path, llama: Path, **train: object) -> tuple[dict, list[dict]]:
    path = _recipe(tmp_path, llama, {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0}, 2)
    recipe = json.loads(path.read_text())
    recipe["train"].update(eval_every=5, **train)
    path.write_text(json.dumps(recipe))
    summary = run_distributed(_finetune, 2, str(path), str(tmp_path / "run"), timeout=300)[0]
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["split"] == "eval"]
    return summary, evals


def test_early_stopping_ends_the_run_after_patience_evaluations_without_improvement(tmp_path, llama_dir) -> None:
    # An improvement must exceed 100 in loss: only the first evaluation counts as one.
    summary, evals = _policy_run(tmp_path, llama_dir, early_stopping_patience=2, early_stopping_min_delta=100.0)
    assert summary["steps"] == 15 and summary["stopped_early"] and summary["best_step"] == 5, summary
    assert [e["step"] for e in evals] == [0, 5, 10, 15, 15]  # before, three during training, the final one


def test_load_best_model_at_end_ends_with_the_best_evaluations_model(tmp_path, llama_dir) -> None:
    # "Best" by the highest loss: the first evaluation (step 5), deterministically not the last model.
    summary, evals = _policy_run(tmp_path, llama_dir, load_best_model_at_end=True, metric_for_best_model="loss",
                                 greater_is_better=True)
    at_step_5 = next(e for e in evals if e["step"] == 5)
    assert summary["best_step"] == 5 and summary["result_is_best_model"] and summary["steps"] == 30, summary
    assert summary["after"] == pytest.approx(at_step_5["loss"], rel=1e-5)
    assert summary["after"] > evals[-1]["loss"]  # the last model was better by loss: the best one was kept
    assert (tmp_path / "run" / "best" / "best").is_dir()


def test_a_model_id_resolves_through_the_hub_cache_offline(tmp_path, llama_dir, monkeypatch) -> None:
    """A cached hub snapshot is found offline (HF_HUB_OFFLINE=1 in tests); an uncached id says how to fetch it."""
    import shutil

    from huggingface_hub import constants

    from zerotune.finetune.models import resolve_model_path

    snapshot = tmp_path / "hub" / "models--tiny--llama" / "snapshots" / "0123abcd"
    shutil.copytree(llama_dir, snapshot)
    (tmp_path / "hub" / "models--tiny--llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--tiny--llama" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_path("tiny/llama") == snapshot
    assert load_model(resolve_model_path("tiny/llama"), "causal-lm").config.model_type == "llama"
    with pytest.raises(ModelLoadError, match=r"'tiny/uncached' is not in the Hugging Face cache .* hub is offline "
                                             r"\(HF_HUB_OFFLINE=1\); fetch it once where the hub is reachable: hf download"):
        resolve_model_path("tiny/uncached")


MATRIX = [  # every method at every ZeRO stage it allows (qlora: not 3, refused at load above)
    *[({"type": "qlora", "bits": 4, "r": 4, "alpha": 8, "dropout": 0.0}, stage) for stage in (0, 1, 2)],
    *[({"type": "lora", "dora": True, "r": 4, "alpha": 8, "dropout": 0.0}, stage) for stage in (0, 1, 2, 3)],
    *[({"type": "lora", "rslora": True, "r": 4, "alpha": 8, "dropout": 0.0}, stage) for stage in (0, 1, 2, 3)],
    *[({"type": "freeze", "trainable_layers": 1}, stage) for stage in (0, 1, 2, 3)],
    *[({"type": "prefix", "num_virtual_tokens": 4}, stage) for stage in (0, 1, 2, 3)],
]


def _train_each_combination(llama: str) -> list[tuple[str, int, list[float]]]:
    """Six steps on one fixed batch per (method, stage), each a fresh engine: (method, stage, losses)."""
    import zerotune

    results = []
    ids = torch.tensor([[2, 8, 9, 10, 11, 12, 13, 14]] * 2)
    for options, stage in MATRIX:
        torch.manual_seed(0)
        method = MethodSection(**options)
        bits = method.bits if method.type == "qlora" else None
        model = apply_method(load_model(Path(llama), "causal-lm", quantize_bits=bits), "causal-lm", method)
        engine, *_ = zerotune.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
                    "optimizer": {"type": "AdamW", "params": {"lr": 2e-2}}, "steps_per_print": 1000})
        losses = []
        for _ in range(6):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.destroy()
        name = method.type + ("+dora" if method.dora else "+rslora" if method.rslora else "")
        results.append((name, stage, losses))
    return results


@pytest.mark.slow
def test_every_method_trains_at_every_zero_stage_it_allows(llama_dir) -> None:
    pytest.importorskip("bitsandbytes")
    results = run_distributed(_train_each_combination, 2, str(llama_dir), timeout=600)[0]
    assert len(results) == len(MATRIX)
    at_stage_0 = {name: losses for name, stage, losses in results if stage == 0}
    for name, stage, losses in results:
        assert losses[-1] < 0.9 * losses[0], (name, stage, losses)
        assert losses == pytest.approx(at_stage_0[name], rel=1e-4), (name, stage)  # ZeRO changes no result
