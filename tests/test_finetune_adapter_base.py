"""A LoRA adapter names its base as the recipe did (a bundled name, a hub id or the user's path), not the local
cache directory it was loaded from, so it loads on another machine; ``zerotune generate`` resolves that name."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tests.harness import run_distributed
from tests.test_finetune_causal_lm import _run_worker, make_tiny_llama, write_recipe
from zerotune.cli.main import main
from zerotune.finetune import assets
from zerotune.finetune.gguf_models import DEQUANTIZED_SUFFIX

BUNDLED = "SmolLM2-135M-Instruct"


def _bundled_cache(root: Path) -> Path:
    """An asset cache whose bundled SmolLM2 (a GGUF asset, used as its dequantized copy) is a tiny Llama."""
    make_tiny_llama(root / f"{BUNDLED}{DEQUANTIZED_SUFFIX}")
    return root


def _run_with_cache(cache: str, recipe: str, output: str) -> dict:
    previous = os.environ.get(assets.CACHE_ENV_VAR)
    os.environ[assets.CACHE_ENV_VAR] = cache
    try:
        return _run_worker(recipe, output, False)
    finally:
        if previous is None:
            del os.environ[assets.CACHE_ENV_VAR]
        else:
            os.environ[assets.CACHE_ENV_VAR] = previous


def _short_lora_recipe(tmp_path: Path, name_or_path: str) -> Path:
    path = write_recipe(tmp_path, stage=0)
    recipe = json.loads(path.read_text())
    recipe["model"]["name_or_path"] = name_or_path
    recipe["train"].update(max_steps=4, eval_every=0, eval_samples=0)
    path.write_text(json.dumps(recipe))
    return path


def test_adapter_names_the_bundled_model_and_generate_loads_it_from_another_cache(tmp_path: Path, capsys,
                                                                                    monkeypatch) -> None:
    cache = _bundled_cache(tmp_path / "cache")
    run = tmp_path / "run"
    run_distributed(_run_with_cache, 2, str(cache), str(_short_lora_recipe(tmp_path, BUNDLED)), str(run), timeout=240)
    adapter_config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == BUNDLED
    # another machine: the same bundled model in a cache somewhere else
    elsewhere = tmp_path / "other-machine-cache"
    shutil.move(str(cache), str(elsewhere))
    monkeypatch.setenv(assets.CACHE_ENV_VAR, str(elsewhere))
    assert main(["generate", str(run), "--prompt", "what color is the sky", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.strip()  # an answer from the base found through the bundled name


def test_adapter_names_the_users_path_as_the_recipe_gave_it(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "my-llama")
    run = tmp_path / "run"
    run_distributed(_run_worker, 2, str(_short_lora_recipe(tmp_path, str(model))), str(run), False, timeout=240)
    adapter_config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(model)


def test_generate_names_a_base_it_cannot_find(tmp_path: Path, capsys, monkeypatch) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "no/such-model-here"}))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["generate", str(tmp_path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "its base model 'no/such-model-here' cannot be loaded here" in err and "\n" not in err.strip(), err
