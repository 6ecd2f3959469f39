"""Checkpoints: resume in a fresh process group continues bit-identically; writes are atomic."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zerotune
from tests.harness import run_distributed, shutdown_pools
from tests.models import gpt2_batch, loss_of, make_gpt2, rank_slice
from zerotune.checkpoint.atomic import CheckpointError, prepare_partial_dir

TOTAL, SAVE_AT, GAS = 6, 3, 2


def _config(precision: str, stage: int = 0) -> dict:
    config = {
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "allgather_bucket_size": 3000},
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": 20}},
        "steps_per_print": 100,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _dropout_gpt2(seed: int = 0):
    model = make_gpt2(seed)
    for module in model.modules():  # dropout on: resume must restore the RNG streams
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.1
    return model


def _train(engine, first: int, last: int) -> list[tuple[float, float]]:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    trace = []
    for step in range(first, last):
        for micro in range(GAS):
            loss = loss_of(engine, rank_slice(gpt2_batch(step, micro, 2 * world), rank, world))
            engine.backward(loss)
            engine.step()
        trace.append((loss.item(), engine.get_global_grad_norm()))
    return trace


def _whole_weights(engine) -> dict:
    with zerotune.zero.GatheredParameters(list(engine.module.parameters())):  # stage 3: whole again
        return {k: v.clone() for k, v in engine.module.state_dict().items()}


def _uninterrupted(save_dir: str, precision: str, stage: int) -> dict:
    torch.manual_seed(1234 + torch.distributed.get_rank())
    engine, *_ = zerotune.initialize(model=_dropout_gpt2(), config=_config(precision, stage))
    engine.train()
    trace = _train(engine, 0, SAVE_AT)
    engine.save_checkpoint(save_dir, client_state={"note": "midway"})
    trace += _train(engine, SAVE_AT, TOTAL)
    weights = _whole_weights(engine)
    engine.destroy()
    return {"trace": trace, "weights": weights}


def _resumed(save_dir: str, precision: str, stage: int) -> dict:
    torch.manual_seed(999)  # a different RNG state: the checkpoint must restore it
    engine, *_ = zerotune.initialize(model=_dropout_gpt2(seed=7), config=_config(precision, stage))
    engine.train()
    path, client_state = engine.load_checkpoint(save_dir)
    steps = engine.global_steps
    trace = _train(engine, SAVE_AT, TOTAL)
    weights = _whole_weights(engine)
    engine.destroy()
    return {"trace": trace, "weights": weights, "client_state": client_state, "path": path, "steps": steps}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_in_fresh_process_group_is_bit_identical(tmp_path: Path, precision: str, stage: int) -> None:
    full = run_distributed(_uninterrupted, 2, str(tmp_path), precision, stage, timeout=120)
    shutdown_pools()  # the resumed run gets new processes and a new process group
    resumed = run_distributed(_resumed, 2, str(tmp_path), precision, stage, timeout=120)
    for rank in range(2):
        assert resumed[rank]["client_state"] == {"note": "midway"}
        assert resumed[rank]["steps"] == SAVE_AT
        assert resumed[rank]["trace"] == full[rank]["trace"][SAVE_AT:]
        for name, tensor in full[rank]["weights"].items():
            assert torch.equal(tensor, resumed[rank]["weights"][name]), name
    assert (tmp_path / "latest").read_text() == f"global_step{SAVE_AT}"
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())


def _load_missing(save_dir: str, tag: str | None) -> str:
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=_config("fp32"))
    try:
        return repr(engine.load_checkpoint(save_dir, tag=tag))
    except CheckpointError as error:
        return str(error)
    finally:
        engine.destroy()


def test_missing_checkpoint_files_are_named(tmp_path: Path) -> None:
    assert run_distributed(_load_missing, 2, str(tmp_path), None)[0] == "(None, None)"  # DeepSpeed: no latest
    assert "does not exist" in run_distributed(_load_missing, 2, str(tmp_path), "nope")[0]
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model_states.pt").write_bytes(b"truncated")
    message = run_distributed(_load_missing, 2, str(tmp_path), "broken")[0]
    assert f"{tmp_path / 'broken'} has no manifest.json: not a complete zerotune checkpoint" in message
    run_distributed(_save_twice, 2, str(tmp_path))
    model_states = tmp_path / "same" / "model_states.pt"
    model_states.write_bytes(model_states.read_bytes()[:-100])  # truncated after the save
    messages = run_distributed(_load_missing, 2, str(tmp_path), "same")
    assert all(m == f"checkpoint file {model_states} is damaged: its SHA-256 does not match manifest.json"
               for m in messages)  # rank 1 does not read it, but fails with rank 0


def _save_twice(save_dir: str) -> list[str]:
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=_config("fp32"))
    engine.save_checkpoint(save_dir, tag="same")
    engine.save_checkpoint(save_dir, tag="same")  # overwriting a tag replaces it whole
    engine.destroy()
    return sorted(p.name for p in Path(save_dir).iterdir())


def test_stale_partial_save_is_replaced_and_latest_points_to_complete_tag(tmp_path: Path) -> None:
    prepare_partial_dir(tmp_path, "same")  # as if an earlier save crashed midway
    (tmp_path / ".same.partial" / "junk").write_text("x")
    names = run_distributed(_save_twice, 2, str(tmp_path))[0]
    assert names == ["latest", "same"]
    # (fp32 before the first step: no optimizer state and no separate masters, so no shard file)
    assert sorted(p.name for p in (tmp_path / "same").iterdir()) == [
        "manifest.json", "model_states.pt", "rng_state_rank0.pt", "rng_state_rank1.pt"]


def _save_sharded(save_dir: str) -> list[str]:
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=_config("fp32", stage=2))
    _train(engine, 0, 1)  # one step: Adam state exists
    engine.save_checkpoint(save_dir, tag="zero2")
    engine.destroy()
    return sorted(p.name for p in (Path(save_dir) / "zero2").iterdir())


def _load_sharded(save_dir: str, load_optimizer_states: bool) -> str:
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=_config("fp32", stage=2))
    try:
        engine.load_checkpoint(save_dir, load_optimizer_states=load_optimizer_states)
        return "loaded"
    except CheckpointError as error:
        return str(error)
    finally:
        engine.destroy()


def test_zero_shards_are_saved_by_parameter_name_and_load_on_another_dp_size(tmp_path: Path) -> None:
    names = run_distributed(_save_sharded, 2, str(tmp_path))[0]
    assert names == ["manifest.json", "model_states.pt", "rng_state_rank0.pt", "rng_state_rank1.pt",
                     "shard_rank0.pt", "shard_rank1.pt"]
    # fp32: no separate masters; the two ranks' pieces of Adam's state cover every trainable element once
    covered: dict[tuple[str, str], int] = {}
    for rank in range(2):
        shard = torch.load(tmp_path / "zero2" / f"shard_rank{rank}.pt", weights_only=True)
        for entry in shard["entries"]:
            assert entry["stop"] - entry["start"] == shard["tensors"][entry["key"]].numel()
            key = (entry["name"], entry["kind"])
            covered[key] = covered.get(key, 0) + entry["stop"] - entry["start"]
    expected = {(name, kind): p.numel() for name, p in make_gpt2().named_parameters()
                for kind in ("optim.exp_avg", "optim.exp_avg_sq")}
    assert covered == expected
    assert run_distributed(_load_sharded, 4, str(tmp_path), True) == ["loaded"] * 4
    assert run_distributed(_load_sharded, 4, str(tmp_path), False) == ["loaded"] * 4
