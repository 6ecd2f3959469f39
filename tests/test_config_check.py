"""`zerotune check`: prints the resolved table, or exactly one error line and exit status 2."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from zerotune.cli.check import add_check_parser, main, run_check

CONFIGS = Path(__file__).parent / "data" / "configs"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="zerotune")
    add_check_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(list(argv))


def test_registers_subcommand_with_defaults():
    args = parse("check", "cfg.json")
    assert args.func is run_check and args.config == "cfg.json" and args.world_size == 1
    assert parse("check", "cfg.json", "--world-size", "4").world_size == 4


def test_rejects_bad_world_size(capsys):
    with pytest.raises(SystemExit):
        parse("check", "cfg.json", "--world-size", "0")


def test_typo_key_one_line_suggestion(capsys):
    args = parse("check", str(CONFIGS / "typo_key.json"))
    assert args.func(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err == (
        "zerotune check: zerotune config: zero_optimization.reduce_bucket_sise: unknown key; "
        "did you mean 'reduce_bucket_size'?\n"
    )


def test_missing_file_one_line(capsys, tmp_path):
    assert main([str(tmp_path / "absent.json")]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("zerotune check: ") and "absent.json" in err and err.count("\n") == 1
    assert "Traceback" not in err


def test_unsupported_block_one_line(capsys, tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train_batch_size": 8, "autotuning": {"enabled": True}}))
    assert main([str(path)]) == 2
    assert "'autotuning' is a DeepSpeed feature zerotune does not support" in capsys.readouterr().err


def test_inconsistent_batch_for_world_size(capsys, tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}))
    assert main([str(path), "--world-size", "8"]) == 0
    assert main([str(path), "--world-size", "3"]) == 2
    assert "not divisible" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["ds_config_zero2.json", "ds_config_zero3.json", "zero1_adamw.yaml"])
def test_valid_configs_print_table(capsys, name):
    assert main([str(CONFIGS / name), "--world-size", "4"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.splitlines()[0].split() == ["key", "value", "source"]
    assert "zero_optimization.stage" in out


def test_check_does_not_require_implemented_features(capsys):
    # ZeRO-3 with CPU offload is valid schema even where the engine lacks it.
    assert main([str(CONFIGS / "ds_config_zero3.json")]) == 0
    out = capsys.readouterr().out
    assert "auto (unresolved)" in out
    row = next(line for line in out.splitlines() if line.startswith("zero_optimization.offload_param.device"))
    assert row.split()[1:] == ['"cpu"', "file"]


@pytest.mark.parametrize("section, expected", [
    ({"scheduler": {"type": "WarmupDecayLR"}},
     "scheduler.params.total_num_steps: required by WarmupDecayLR but missing"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 3}}},
     "scheduler.params.warmup_num_step: unknown parameter 'warmup_num_step'. Did you mean 'warmup_num_steps'?"),
    ({"scheduler": {"type": "WarmupCosine", "params": {}}}, "scheduler.type: unknown scheduler 'WarmupCosine'"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "weight_decy": 0.1}}},
     "optimizer.params.weight_decy: unknown parameter 'weight_decy'. Did you mean 'weight_decay'?"),
])
def test_optimizer_and_scheduler_arguments_are_checked_before_any_model_is_built(capsys, tmp_path, section, expected):
    """What the builders would refuse when the engine is built (a minute into a fine-tuning run) is one line here."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train_batch_size": 8, **section}))
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1
