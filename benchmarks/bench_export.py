"""``zerotune export`` streams: peak memory while exporting a ~300M-parameter checkpoint stays within the largest
tensor plus one output shard, next to the naive export (load the whole state dict, write it) in the same run.

    python benchmarks/bench_export.py                    # GPT-2 of ~285M parameters (fp32), 500 MB shards
    python benchmarks/bench_export.py --layers 2 --width 256 --shard-mb 5   # a quick run

A single-process engine (ZeRO 0, fp32) saves a checkpoint of the model; then, each in a fresh process, (1)
``export_checkpoint`` to safetensors shards of ``--shard-mb`` and (2) the naive way: ``torch.load`` of the
whole model states file and one ``safetensors.save_file``. Memory per process: the peak of anonymous resident
memory (``RssAnon`` of /proc/self/status, sampled every 5 ms: checkpoint files are memory-mapped, and mapped file
pages are the OS's cache, not the export's memory) above the process's level before the export, and the peak of
tensor bytes allocated (torch's allocator events, mmap'd storages left out). Exits nonzero if the streamed export
exceeds its bound (largest tensor + one shard, + 16 MiB for the interpreter's own allocations while it runs).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rss_anon() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class AnonPeak:
    """Peak of ``RssAnon`` above its value at entry, sampled by a thread."""

    def __enter__(self) -> "AnonPeak":
        self.base = self.peak = _rss_anon()
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, _rss_anon())
            time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, _rss_anon())

    @property
    def above(self) -> int:
        return self.peak - self.base


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64),
                                      vocab_size=args.vocab, n_positions=256, bos_token_id=0, eos_token_id=0,
                                      tie_word_embeddings=True))


def save_checkpoint(args: argparse.Namespace, directory: str, result: dict) -> None:
    import zerotune

    engine, *_ = zerotune.initialize(model=make_model(args), config={
        "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9, "zero_optimization": {"stage": 0}})
    result["params"] = sum(p.numel() for p in engine.module.parameters())
    result["largest"] = max(p.numel() * p.element_size() for p in engine.module.parameters())
    engine.save_checkpoint(directory, tag="t")
    engine.destroy()


def streamed(directory: str, out: str, shard_bytes: int, result: dict) -> None:
    import safetensors.torch  # noqa: F401  (imported before measuring)

    from tests.memory_probe import PeakTensorBytes
    from zerotune.checkpoint.export import export_checkpoint

    started = time.perf_counter()
    with AnonPeak() as anon:  # (the profiler's own records would count as anonymous memory: measured apart)
        files = export_checkpoint(Path(directory), Path(out), max_shard_bytes=shard_bytes)
    seconds = time.perf_counter() - started
    with PeakTensorBytes(exclude_mapped_files=True) as probe:
        export_checkpoint(Path(directory), Path(out + "_probed"), max_shard_bytes=shard_bytes)
    result.update(seconds=seconds, anon=anon.above, tensors=probe.peak, files=len(files))


def naive(directory: str, out: str, shard_bytes: int, result: dict) -> None:
    from safetensors.torch import save_file

    from tests.memory_probe import PeakTensorBytes

    def export(target: Path) -> None:
        state = torch.load(Path(directory) / "t" / "model_states.pt", weights_only=True)["module"]
        target.mkdir()
        save_file({k: v.contiguous().clone() for k, v in state.items()}, str(target / "model.safetensors"))

    started = time.perf_counter()
    with AnonPeak() as anon:
        export(Path(out))
    seconds = time.perf_counter() - started
    with PeakTensorBytes() as probe:
        export(Path(out + "_probed"))
    result.update(seconds=seconds, anon=anon.above, tensors=probe.peak, files=1)


def _child(target: str, args: tuple, queue: mp.Queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result: dict = {}
    try:
        globals()[target](*args, result)
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        import traceback

        result = {"error": traceback.format_exc()}
    queue.put(result)


def in_fresh_process(target: str, *args: object) -> dict:
    context = mp.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_child, args=(target, args, queue))
    process.start()
    result = queue.get()
    process.join()
    if "error" in result or process.exitcode:
        raise RuntimeError(f"{target} failed (exit code {process.exitcode}):\n{result.get('error', '')}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-mb", type=int, default=500)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    shard = args.shard_mb << 20
    root = Path(tempfile.mkdtemp(prefix="bench_export_"))
    try:
        model = in_fresh_process("save_checkpoint", args, str(root / "ckpt"))
        size = sum(p.stat().st_size for p in (root / "ckpt" / "t").iterdir())
        rows = {"zerotune export (streamed)": in_fresh_process("streamed", str(root / "ckpt"), str(root / "a"), shard),
                "torch.load + save_file (whole)": in_fresh_process("naive", str(root / "ckpt"), str(root / "b"), shard)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mib, bound = 2**20, model["largest"] + shard + (16 << 20)
    print(f"export of a GPT-2 of {model['params'] / 1e6:.0f}M parameters (fp32 checkpoint {size / mib:.0f} MiB), "
          f"{args.shard_mb} MB shards; bound = largest tensor ({model['largest'] / mib:.0f} MiB) + one shard + 16 MiB = "
          f"{bound / mib:.0f} MiB")
    print("| export | seconds | files | peak anonymous memory MiB | peak tensor bytes MiB | x bound |")
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['seconds']:.1f} | {row['files']} | {row['anon'] / mib:.0f} | {row['tensors'] / mib:.0f} "
              f"| {max(row['anon'], row['tensors']) / bound:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "rows": rows}, indent=1))
    streamed_row = rows["zerotune export (streamed)"]
    return 0 if max(streamed_row["anon"], streamed_row["tensors"]) <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
