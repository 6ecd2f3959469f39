"""Write the DeepSpeed fixture checkpoints that zerotune's DeepSpeed-format reader is tested against.

Run with a Python that has DeepSpeed (zerotune's test venv must not need it), from anywhere:

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python tests/data/deepspeed_checkpoints/make_fixtures.py

For ZeRO stages 1, 2 and 3 it trains ``tiny_model.make_model()`` for 2 optimizer steps at data-parallel
world size 2 on CPU over gloo (fp32, torch AdamW lr 1e-2 weight_decay 0.01, micro-batch 2, no gradient
accumulation) and saves ``stage{s}/`` with ``engine.save_checkpoint(..., tag="global_step2")``. The
expected values come from an independent single-process PyTorch run of the same model, data and
optimizer and are written to ``expected.safetensors`` ("weight/<name>", "exp_avg/<name>",
"exp_avg_sq/<name>"); each DeepSpeed run checks that its gathered weights match them, so the fixtures
are known to be right before any reader looks at them. Only ``zero_to_fp32.py`` (copied by DeepSpeed
next to the tag directory, ~30 KB each, not needed to load) is deleted afterwards.
Stage 3's rank-1 files are not byte-identical between runs: DeepSpeed leaves its per-parameter padding
slots uninitialised. Only the padding differs; every value a reader uses is reproducible.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from tiny_model import batch, make_model

WORLD, STEPS, LR, WD, MICRO = 2, 2, 1e-2, 0.01, 2
TAG = f"global_step{STEPS}"


def reference() -> dict[str, torch.Tensor]:
    """Plain PyTorch: the data-parallel mean of the per-rank losses, stepped with torch AdamW."""
    model = make_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(WORLD):
            (model(*batch(step, rank, MICRO)) / WORLD).backward()
        opt.step()
    out = {f"weight/{n}": t.detach().clone() for n, t in model.state_dict().items()}
    for name, p in model.named_parameters():
        if p.requires_grad:
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{key}/{name}"] = opt.state[p][key].clone()
    return out


def train_and_save(rank: int, stage: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    import deepspeed
    from safetensors.torch import load_file

    deepspeed.init_distributed(dist_backend="gloo")
    model = make_model()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    for step in range(STEPS):
        loss = engine(*batch(step, rank, MICRO))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(out_dir, tag=TAG)

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        got = {f"weight/{n}": t.detach().clone().float() for n, t in engine.module.state_dict().items()}
    if rank == 0:
        want = load_file(str(HERE / "expected.safetensors"))
        for key, tensor in got.items():
            torch.testing.assert_close(tensor, want[key], rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"stage {stage} {key}: {m}")
        print(f"stage {stage}: DeepSpeed's gathered weights match the single-process reference", flush=True)
    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()


def main() -> None:
    from safetensors.torch import save_file

    save_file(reference(), str(HERE / "expected.safetensors"))
    for stage in (1, 2, 3):
        out = HERE / f"stage{stage}"
        shutil.rmtree(out, ignore_errors=True)
        mp.spawn(train_and_save, args=(stage, 29500 + stage, str(out)), nprocs=WORLD, join=True)
        (out / "zero_to_fp32.py").unlink(missing_ok=True)
    total = sum(f.stat().st_size for f in HERE.rglob("*") if f.is_file())
    print(f"fixtures written under {HERE}: {total / 1024:.0f} KB in all")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
