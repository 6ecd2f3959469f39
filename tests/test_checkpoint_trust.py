"""Checkpoints are trusted only after verification: no code runs on load, damaged files are named,
a crash between any two filesystem operations of a save leaves a loadable checkpoint, tags stay
inside the save directory, a checkpoint that does not fit is refused before anything changes, and
old checkpoints are pruned on request."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import zerotune
from tests.harness import run_distributed
from tests.models import engine_run, gpt2_batch, make_gpt2
from zerotune.checkpoint import atomic
from zerotune.checkpoint.atomic import CheckpointError


def _config(precision: str = "fp32", stage: int = 0, **extra) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}, **extra}
    if precision != "fp32":
        config[precision] = {"enabled": True}
    return config


def _weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _load_or_error(directory: str, tag: str | None = None, **config) -> str:
    engine, *_ = zerotune.initialize(model=make_gpt2(seed=5), config=_config(**config))
    try:
        return repr(engine.load_checkpoint(directory, tag=tag))
    except CheckpointError as error:
        return str(error)
    finally:
        engine.destroy()


def _train_and_save(directory: str, tag: str = "t", steps: int = 1, **config) -> dict:
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=_config(**config))
    engine_run(engine, gpt2_batch, steps=steps, gas=1, global_rows=2 * torch.distributed.get_world_size())
    engine.save_checkpoint(directory, tag=tag)
    weights = _weights(engine)
    engine.destroy()
    return weights


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _rehash(directory: Path, name: str) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": (directory / name).stat().st_size,
                               "sha256": atomic.file_digest(directory / name)}
    (directory / "manifest.json").write_text(json.dumps(manifest))


def test_a_pickle_that_runs_code_is_refused_and_never_runs(tmp_path: Path) -> None:
    run_distributed(_train_and_save, 1, str(tmp_path))
    marker = tmp_path / "pwned"
    torch.save({"module": _Payload(str(marker))}, tmp_path / "t" / "model_states.pt")
    _rehash(tmp_path / "t", "model_states.pt")  # even with a matching manifest: weights_only refuses it
    message = run_distributed(_load_or_error, 1, str(tmp_path), "t")[0]
    assert message.startswith(f"checkpoint file {tmp_path / 't' / 'model_states.pt'} (model states) was refused")
    assert not marker.exists()


def test_a_flipped_bit_is_found_before_anything_loads(tmp_path: Path) -> None:
    run_distributed(_train_and_save, 2, str(tmp_path), "t", 1, stage=1)
    shard = tmp_path / "t" / "shard_rank1.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    messages = run_distributed(_load_or_error, 2, str(tmp_path), None, stage=1)
    assert messages == [f"checkpoint file {shard} is damaged: its SHA-256 does not match manifest.json"] * 2


@pytest.mark.parametrize("tag", ["../outside", "/tmp/absolute", ".hidden", "a/b", "latest", ""])
def test_tags_must_stay_inside_the_save_directory(tmp_path: Path, tag: str) -> None:
    with pytest.raises(CheckpointError, match="is not a valid tag"):
        atomic.check_tag(tag)
    (tmp_path / "latest").write_text(tag or "..")
    assert "is not a valid tag" in run_distributed(_load_or_error, 1, str(tmp_path))[0]


def _save_with_bad_tag(directory: str) -> str:
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=_config())
    try:
        engine.save_checkpoint(directory, tag="../x")
    except CheckpointError as error:
        return str(error)
    finally:
        engine.destroy()
    return "saved"


def test_save_refuses_a_tag_outside_the_directory(tmp_path: Path) -> None:
    assert "checkpoint tag '../x' is not a valid tag" in run_distributed(_save_with_bad_tag, 1, str(tmp_path / "d"))[0]
    assert not (tmp_path / "x").exists()


class _Crash(Exception):
    pass


def _crash_every_step(directory: str, retag: bool) -> dict:
    """Save v1; then, for every filesystem operation k of the next save (v2, same tag or a new one),
    crash right before k, load whatever is there, and check it is v1 or v2 exactly."""
    import shutil

    root = Path(directory)
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=_config())
    engine_run(engine, gpt2_batch, steps=1, gas=1, global_rows=2)
    engine.save_checkpoint(str(root / "pristine"), tag="t")
    v1 = _weights(engine)
    engine_run(engine, lambda s, m, r: gpt2_batch(s + 1, m, r), steps=1, gas=1, global_rows=2)
    v2 = _weights(engine)
    new_tag = "t2" if retag else "t"
    operations: list[str] = []
    shutil.copytree(root / "pristine", root / "count")
    (root / "count" / ".stale.partial").mkdir()
    atomic.set_crash_hook(operations.append)
    engine.save_checkpoint(str(root / "count"), tag=new_tag)
    atomic.set_crash_hook(None)
    outcomes = []
    for k in range(len(operations) + 1):
        work = root / f"crash{k}"
        shutil.copytree(root / "pristine", work)
        (work / ".stale.partial").mkdir()  # a crashed save of another tag, long ago
        done = []

        def crash(what: str) -> None:
            if len(done) == k:
                raise _Crash(what)
            done.append(what)

        atomic.set_crash_hook(crash)
        try:
            engine.save_checkpoint(str(work), tag=new_tag)
        except _Crash:
            pass
        finally:
            atomic.set_crash_hook(None)
        reader, *_ = zerotune.initialize(model=make_gpt2(seed=9), config=_config())
        reader.load_checkpoint(str(work))
        got = _weights(reader)
        reader.destroy()
        version = "v2" if all(torch.equal(got[n], v2[n]) for n in v2) else \
            "v1" if all(torch.equal(got[n], v1[n]) for n in v1) else "garbage"
        engine.save_checkpoint(str(work), tag=new_tag)  # the next save repairs whatever the crash left
        leftovers = sorted(p.name for p in work.iterdir() if p.name.startswith("."))
        outcomes.append((k, version, leftovers))
        shutil.rmtree(work)
    engine.destroy()
    return {"operations": operations, "outcomes": outcomes}


@pytest.mark.parametrize("retag", [False, True], ids=["resave-same-tag", "save-new-tag"])
def test_a_crash_between_any_two_filesystem_operations_leaves_a_loadable_checkpoint(tmp_path: Path, retag: bool):
    result = run_distributed(_crash_every_step, 1, str(tmp_path), retag, timeout=400)[0]
    assert len(result["operations"]) >= 8  # writes, renames, manifest, publish, latest, cleanup
    versions = [version for _, version, _ in result["outcomes"]]
    assert "garbage" not in versions
    assert versions[0] == "v1" and versions[-1] == "v2"
    assert versions == sorted(versions)  # v1 until the new tag is published, v2 from then on
    assert all(leftovers == [] for _, _, leftovers in result["outcomes"])  # no .partial / .old survives a save


def _resume_at(directory: str, precision: str, stage: int) -> list[float]:
    engine, *_ = zerotune.initialize(model=make_gpt2(seed=5), config=_config(precision, stage=stage))
    engine.load_checkpoint(directory, tag="t")
    losses = engine_run(engine, lambda s, m, r: gpt2_batch(s + 1, m, r), steps=2, gas=1, global_rows=2).losses
    engine.destroy()
    return losses


@pytest.mark.parametrize("stage", [0, 1])
def test_an_fp32_checkpoint_resumes_in_bf16(tmp_path: Path, stage: int) -> None:
    run_distributed(_train_and_save, 1, str(tmp_path), "t", 1, stage=stage)
    fp32, bf16 = (run_distributed(_resume_at, 1, str(tmp_path), p, stage)[0] for p in ("fp32", "bf16"))
    assert all(abs(a - b) <= 0.02 * abs(a) for a, b in zip(bf16, fp32))


def _load_into_wider(directory: str) -> tuple[str, bool]:
    engine, *_ = zerotune.initialize(model=make_gpt2(seed=5, width=48), config=_config())
    before = _weights(engine)
    try:
        engine.load_checkpoint(directory, tag="t")
        message = "loaded"
    except CheckpointError as error:
        message = str(error)
    unchanged = all(torch.equal(before[n], t) for n, t in _weights(engine).items())
    engine.destroy()
    return message, unchanged


def test_a_checkpoint_of_another_model_is_refused_before_anything_changes(tmp_path: Path) -> None:
    run_distributed(_train_and_save, 1, str(tmp_path))
    message, unchanged = run_distributed(_load_into_wider, 1, str(tmp_path))[0]
    assert message == (f"{tmp_path / 't'} does not fit this model: 'transformer.wte.weight' has "
                       "shape (96, 32) in the checkpoint and (96, 48) in the model")
    assert unchanged


def _save_four(directory: str) -> list[str]:
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=_config(checkpoint={"keep_last": 2}))
    for step in range(4):
        engine_run(engine, lambda s, m, r: gpt2_batch(s + step, m, r), steps=1, gas=1, global_rows=4)
        engine.save_checkpoint(directory)
    engine.destroy()
    return sorted(p.name for p in Path(directory).iterdir())


def test_keep_last_prunes_old_checkpoints(tmp_path: Path) -> None:
    assert run_distributed(_save_four, 2, str(tmp_path))[0] == ["global_step3", "global_step4", "latest"]


def _save_without_frozen_base(directory: str) -> int:
    from tests.models import make_mlp, mlp_batch

    engine, *_ = zerotune.initialize(model=make_mlp(), config=_config())
    engine.backward(engine(**mlp_batch(0, 0, 2)))
    engine.step()
    engine.save_checkpoint(directory, tag="peft", exclude_frozen_parameters=True)
    engine.destroy()
    return torch.load(Path(directory) / "peft" / "model_states.pt", weights_only=True)


def _load_with_base(directory: str, seed: int) -> str:
    from tests.models import make_mlp

    engine, *_ = zerotune.initialize(model=make_mlp(seed=seed), config=_config())
    try:
        engine.load_checkpoint(directory, tag="peft")
        return "loaded " + str(engine.global_steps)
    except CheckpointError as error:
        return str(error)
    finally:
        engine.destroy()


def test_a_checkpoint_without_its_frozen_base_checks_the_base_on_resume(tmp_path: Path) -> None:
    saved = run_distributed(_save_without_frozen_base, 1, str(tmp_path))[0]
    assert "frozen.weight" not in saved["module"] and "inp.weight" in saved["module"]
    assert set(saved["frozen_fingerprint"]["shapes"]) == {"frozen.weight", "frozen.bias"}
    assert run_distributed(_load_with_base, 1, str(tmp_path), 0)[0] == "loaded 1"  # the same base
    message = run_distributed(_load_with_base, 1, str(tmp_path), 3)[0]  # another base of the same shapes
    assert message == (f"{tmp_path / 'peft' / 'model_states.pt'} was saved without its frozen base, and this model's "
                       "frozen weights are not the ones it was trained on (their SHA-256 differs): load the same base "
                       "model")


def _save_on_a_full_disk(directory: str, failing: str, kind: str) -> tuple[list[str], list[str], str, bool]:
    """Save tag a, train on, then save b and overwrite a while writing ``failing`` hits a full disk (an OSError
    ENOSPC, or torch's inline_container enforce RuntimeError); then load what is there."""
    import errno

    engine, *_ = zerotune.initialize(model=make_gpt2(), config=_config())
    engine_run(engine, gpt2_batch, steps=1, gas=1, global_rows=2)
    engine.save_checkpoint(directory, tag="a")
    saved = _weights(engine)
    engine_run(engine, lambda s, m, r: gpt2_batch(s + 1, m, r), steps=1, gas=1, global_rows=2)
    real_save = torch.save

    def full_disk(obj, handle, *args, **kwargs):
        if Path(handle.name).name.startswith(failing):
            handle.write(b"the first bytes fit")
            if kind == "enforce":
                raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, handle, *args, **kwargs)

    torch.save = full_disk
    messages = []
    try:
        for tag in ("b", "a"):
            try:
                engine.save_checkpoint(directory, tag=tag)
                messages.append("saved")
            except CheckpointError as error:
                messages.append(str(error))
    finally:
        torch.save = real_save
    engine.destroy()
    listing = sorted(p.name for p in Path(directory).iterdir())
    engine, *_ = zerotune.initialize(model=make_gpt2(seed=5), config=_config())
    loaded, _ = engine.load_checkpoint(directory)
    same = all(torch.equal(saved[n], t) for n, t in _weights(engine).items())
    engine.destroy()
    return messages, listing, loaded, same


@pytest.mark.parametrize("failing, kind", [("model_states", "enospc"), ("rng_state", "enforce")])
def test_a_full_disk_during_a_save_names_checkpoint_and_file_and_keeps_the_previous_one(
        tmp_path: Path, failing: str, kind: str) -> None:
    messages, listing, loaded, same = run_distributed(_save_on_a_full_disk, 1, str(tmp_path), failing, kind)[0]
    reason = "No space left on device" if kind == "enospc" else "[enforce fail at inline_container.cc:626]"
    for tag, message in zip("ba", messages):
        assert message.startswith(f"saving checkpoint {tmp_path / tag} failed writing {failing}"), message
        assert f"({reason}" in message and "MiB free there); the previous checkpoint is kept" in message
    assert listing == ["a", "latest"]  # no staging directory, no retired copy of a, latest as it was
    assert (tmp_path / "latest").read_text() == "a" and not list((tmp_path / "a").glob("*.tmp"))
    assert loaded == str(tmp_path / "a") and same


def _save_unloadable_client_state(directory: str) -> tuple[str, list[str], dict]:
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=_config())
    engine.save_checkpoint(directory, tag="a", client_state={"epoch": 1})
    try:
        engine.save_checkpoint(directory, tag="b", client_state={"epoch": 2, "extra": {"model": torch.nn.Linear(2, 2)}})
        message = "saved"
    except CheckpointError as error:
        message = str(error)
    listing = sorted(p.name for p in Path(directory).iterdir())
    _, client_state = engine.load_checkpoint(directory)
    engine.destroy()
    return message, listing, client_state


def test_a_client_state_the_loader_would_refuse_is_refused_at_save_naming_its_key(tmp_path: Path) -> None:
    message, listing, client_state = run_distributed(_save_unloadable_client_state, 1, str(tmp_path))[0]
    assert message.startswith("client_state['extra']['model'] is a torch.nn.modules.linear.Linear, which a "
                              "checkpoint cannot hold: checkpoints load with torch.load(weights_only=True), so only "
                              "tensors, numbers, strings"), message
    assert listing == ["a", "latest"] and client_state == {"epoch": 1}  # nothing written, the previous one loads


@pytest.mark.parametrize("value, loadable", [
    ({"a": [1, 2.5, "x", None, b"b", (True, 1j)], "t": torch.ones(2), "s": {1}}, True),
    ({"dtype": torch.bfloat16, "device": torch.device("cpu"), "size": torch.Size([2])}, True),
    ({"model": torch.nn.Linear(1, 1)}, False),
    ({"best": __import__("numpy").float64(1.0)}, False),
    ({"counts": __import__("collections").defaultdict(int)}, False),
    ({frozenset([1]): 1}, False),
])
def test_check_loadable_agrees_with_the_restricted_loader(tmp_path: Path, value, loadable: bool) -> None:
    torch.save(value, tmp_path / "f.pt")
    try:
        torch.load(tmp_path / "f.pt", weights_only=True)
        loads = True
    except Exception:  # noqa: BLE001 - the loader's refusal, whatever its type
        loads = False
    assert loads == loadable
    if loadable:
        atomic.check_loadable(value, "client_state")
    else:
        with pytest.raises(CheckpointError, match=r"^client_state\S* (key .* )?is a "):
            atomic.check_loadable(value, "client_state")


def _save_to_an_empty_directory_name(directory: str) -> tuple[str, list[str]]:
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=_config())
    cwd = os.getcwd()
    os.chdir(directory)
    try:
        engine.save_checkpoint(save_dir="")
        message = "saved"
    except ValueError as error:
        message = str(error)
    finally:
        os.chdir(cwd)
        engine.destroy()
    return message, sorted(p.name for p in Path(directory).iterdir())


def test_save_checkpoint_to_an_empty_directory_name_is_a_value_error(tmp_path: Path) -> None:
    message, listing = run_distributed(_save_to_an_empty_directory_name, 1, str(tmp_path))[0]
    assert message.startswith("engine.save_checkpoint() needs a directory") and listing == []
