"""The installed ``zerotune`` command itself (not just its functions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _zerotune(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerotune.cli.main", *args], capture_output=True, text=True,
                          timeout=120)


def test_check_typo_exits_nonzero_with_one_line_suggestion(tmp_path: Path) -> None:
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"train_batch_size": 8, "gradient_clipping": 1.0, "zero_optimization": {"stge": 1}}))
    done = _zerotune("check", str(path))
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert "zero_optimization.stge" in lines[0] and "did you mean 'stage'" in lines[0]


def test_check_hf_zero3_config_with_autos_passes() -> None:
    done = _zerotune("check", str(REPO / "tests" / "data" / "configs" / "ds_config_zero3.json"), "--world-size", "8")
    assert done.returncode == 0, done.stderr
    assert "auto" in done.stdout and "zero_optimization.stage" in done.stdout


def test_check_bundled_example_config_shows_provenance() -> None:
    done = _zerotune("check", str(REPO / "examples" / "ds_config.json"), "--world-size", "2")
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("train_batch_size"))
    assert row.split()[1:] == ["32", "inferred"]


def test_run_without_script_prints_torchrun_help() -> None:
    done = _zerotune("run", "--help")
    assert done.returncode == 0 and "--nproc_per_node" in done.stdout


def _bad_column_recipe(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "reviews.csv"
    data.write_text("review,sentiment\ngreat movie,pos\nawful plot,neg\n" * 10)
    recipe = {"model": {"name_or_path": str(model)}, "task": "sequence-classification",
              "data": {"train_files": [str(data)], "text_column": "reviw", "label_column": "sentiment"},
              "launch": {"nproc_per_node": 2}}
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    return path


def test_finetune_misspelled_column_is_one_line_naming_the_available_ones(tmp_path: Path) -> None:
    done = _zerotune("finetune", str(_bad_column_recipe(tmp_path)), "--output-dir", str(tmp_path / "out"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "reviw" in lines[0] and "review" in lines[0]


def test_finetune_recipe_typo_is_one_line_with_a_suggestion(tmp_path: Path) -> None:
    done = _zerotune("finetune", "--set", "train.lrr=1e-4", "--output-dir", str(tmp_path / "out"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.lrr" in lines[0] and "'lr'" in lines[0], done.stderr
