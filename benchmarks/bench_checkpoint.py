"""Checkpoint save / load: seconds and bytes per rank at ZeRO stages 0-3 next to torch.distributed.checkpoint
(DCP) of an FSDP2 model, and peak memory while loading at another layout.

    python benchmarks/bench_checkpoint.py                      # ~95M-parameter GPT-2, 2 gloo ranks
    python benchmarks/bench_checkpoint.py --layers 2 --width 128 --vocab 1000   # a quick run

Workload: a GPT-2 (``--layers`` blocks of width ``--width``, vocabulary ``--vocab``), fp32 + AdamW, one
training step (so Adam state exists), then ``save_checkpoint`` and, in a fresh engine at the same layout,
``load_checkpoint``; the baseline is FSDP2 (``fully_shard`` per block) saving model + optimizer state dicts
with ``torch.distributed.checkpoint`` and loading them back. Bytes per rank: the files each rank wrote.
Cross-layout: the stage-0 checkpoint loaded at stage 3 and the stage-3 one at stage 0; the peak of tensor
memory allocated during ``load_checkpoint`` (torch's allocator events, ``tests/memory_probe.py``) against the
bound the design promises: one rank's share of the new layout plus the largest tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_dp_vs_ddp import _free_port, spawn_ranks, write_gathered  # noqa: E402


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64), vocab_size=args.vocab,
                        n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    return GPT2LMHeadModel(config)


def _batch(args: argparse.Namespace) -> dict:
    ids = torch.randint(0, args.vocab, (1, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
    return {"input_ids": ids, "labels": ids}


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


def _engine(args: argparse.Namespace, stage: int):
    import zerotune

    engine, *_ = zerotune.initialize(model=make_model(args), config=_config(stage))
    return engine


def _rank_bytes(directory: Path) -> dict[int, int]:
    """Bytes of the files each rank wrote (model_states and the manifest: rank 0)."""
    files = json.loads((directory / "manifest.json").read_text())["files"]
    per_rank: dict[int, int] = {}
    for name, entry in files.items():
        match = re.search(r"rank(\d+)", name)
        rank = int(match.group(1)) if match else 0
        per_rank[rank] = per_rank.get(rank, 0) + entry["bytes"]
    return per_rank


def _timed(work) -> float:
    dist.barrier()
    start = time.perf_counter()
    work()
    dist.barrier()
    return time.perf_counter() - start


def measure_zerotune(args: argparse.Namespace, stage: int, root: Path) -> dict:
    engine = _engine(args, stage)
    engine.backward(engine(**_batch(args)).loss)
    engine.step()
    save = _timed(lambda: engine.save_checkpoint(str(root / f"stage{stage}"), tag="t"))
    engine.destroy()
    fresh = _engine(args, stage)
    load = _timed(lambda: fresh.load_checkpoint(str(root / f"stage{stage}"), tag="t"))
    fresh.destroy()
    return {"what": f"zerotune ZeRO-{stage}", "save_s": save, "load_s": load,
            "bytes": _rank_bytes(root / f"stage{stage}" / "t").get(dist.get_rank(), 0)}


def measure_cross_layout(args: argparse.Namespace, saved_stage: int, load_stage: int, root: Path) -> dict:
    from tests.memory_probe import PeakTensorBytes

    engine = _engine(args, load_stage)
    psi = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters())
    largest = max((p.ds_numel if hasattr(p, "ds_numel") else p.numel()) for p in engine.module.parameters()) * 4
    world = dist.get_world_size()
    share = 12 * psi if load_stage == 0 else 4 * psi + 8 * psi // world if load_stage < 3 else 12 * psi // world
    with PeakTensorBytes(exclude_mapped_files=True) as probe:
        seconds = _timed(lambda: engine.load_checkpoint(str(root / f"stage{saved_stage}"), tag="t"))
    engine.destroy()
    return {"what": f"ZeRO-{saved_stage} checkpoint -> ZeRO-{load_stage}", "load_s": seconds,
            "peak": probe.peak, "mapped": probe.mapped, "bound": share + largest, "share": share, "largest": largest}


def measure_fsdp2(args: argparse.Namespace, root: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    def build():
        model = make_model(args)
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    model, optimizer = build()
    model(**_batch(args)).loss.backward()
    optimizer.step()
    target = root / "dcp"

    def save() -> None:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=str(target))

    save_s = _timed(save)
    model, optimizer = build()

    def load() -> None:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optimizer_state}
        dcp.load(state, checkpoint_id=str(target))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    load_s = _timed(load)
    rank_file = target / f"__{dist.get_rank()}_0.distcp"
    written = rank_file.stat().st_size + ((target / ".metadata").stat().st_size if dist.get_rank() == 0 else 0)
    return {"what": "FSDP2 + torch.distributed.checkpoint", "save_s": save_s, "load_s": load_s, "bytes": written}


def _rank_main(rank: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import zerotune

    zerotune.init_distributed()
    root = Path(out_dir) / "checkpoints"
    try:
        results = [measure_fsdp2(args, root)]
        for stage in (0, 1, 2, 3):
            results.append(measure_zerotune(args, stage, root))
        results.append(measure_cross_layout(args, 0, 3, root))
        results.append(measure_cross_layout(args, 3, 0, root))
        write_gathered(results, out_dir)
    finally:
        dist.destroy_process_group()


def report(per_rank: list[list[dict]], psi: int) -> list[str]:
    mib = 2**20
    baseline = per_rank[0][0]
    lines = [f"checkpoint save / load, GPT-2 of {psi / 1e6:.1f}M parameters, fp32 + AdamW, {len(per_rank)} ranks "
             "(slowest rank's seconds; MiB written per rank)",
             "| checkpoint | save s | load s | save x DCP | load x DCP | " +
             " | ".join(f"rank {r} MiB" for r in range(len(per_rank))) + " |",
             "|---|---|---|---|---|" + "---|" * len(per_rank)]
    for index, row in enumerate(per_rank[0]):
        if "bytes" not in row:
            continue
        save = max(ranks[index]["save_s"] for ranks in per_rank)
        load = max(ranks[index]["load_s"] for ranks in per_rank)
        base_save = max(ranks[0]["save_s"] for ranks in per_rank)
        base_load = max(ranks[0]["load_s"] for ranks in per_rank)
        lines.append(f"| {row['what']} | {save:.2f} | {load:.2f} | {save / base_save:.2f} | {load / base_load:.2f} | " +
                     " | ".join(f"{ranks[index]['bytes'] / mib:.1f}" for ranks in per_rank) + " |")
    lines += ["", "loading at another layout: peak tensor memory allocated during load_checkpoint, per rank, MiB "
              "(bound: this rank's share at the new layout + the largest tensor; files are memory-mapped, "
              "the OS pages in what is read: 'mapped' is the checkpoint bytes mapped, not allocated)",
              "| checkpoint | load s | " + " | ".join(f"rank {r} peak" for r in range(len(per_rank))) +
              " | mapped | share | largest tensor | bound | peak / bound |", "|---|---|" + "---|" * (len(per_rank) + 5)]
    for index, row in enumerate(per_rank[0]):
        if "peak" not in row:
            continue
        peak = max(ranks[index]["peak"] for ranks in per_rank)
        lines.append(f"| {row['what']} | {max(r[index]['load_s'] for r in per_rank):.2f} | " +
                     " | ".join(f"{ranks[index]['peak'] / mib:.1f}" for ranks in per_rank) +
                     f" | {row['mapped'] / mib:.1f} | {row['share'] / mib:.1f} | {row['largest'] / mib:.1f} | {row['bound'] / mib:.1f} | "
                     f"{peak / row['bound']:.2f} |")
    del baseline
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the per-rank results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    psi = sum(p.numel() for p in make_model(args).parameters())
    out_dir = tempfile.mkdtemp(prefix="bench_checkpoint_")
    try:
        spawn_ranks(_rank_main, (_free_port(), args, out_dir), args.ranks)
        per_rank = json.loads((Path(out_dir) / "result.json").read_text())
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    print("\n".join(report(per_rank, psi)))
    if args.json:
        Path(args.json).write_text(json.dumps(per_rank, indent=1))
    worst = max(ranks[i]["peak"] / ranks[i]["bound"] for ranks in per_rank for i, r in enumerate(ranks) if "peak" in r)
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
