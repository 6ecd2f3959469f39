"""Activation checkpointing: activation memory saved and step time paid, both variants in one run.

    python benchmarks/bench_activation_checkpointing.py                # 6 timed steps per variant
    python benchmarks/bench_activation_checkpointing.py --steps 2 --warmup 1   # smoke test

Workload: random-init GPT-2 (4 layers, width 256, 4 heads, vocab 8192, sequence 512, dropout 0.1 as
GPT-2's defaults), micro-batch 4, fp32, one process, one thread. A step is forward + backward (no
optimizer: it is the same for both variants). ``plain`` is the model as is; ``checkpointed`` has every
GPT2Block wrapped by ``apply_activation_checkpointing`` (default policy). It is the same model object:
wrapping is switched on and off between steps, so both variants use identical weights and data.

Memory, two measures per variant:

- **saved for backward** (the target's measure): bytes of the distinct tensor storages autograd holds
  between forward and backward, excluding parameters, counted by a ``saved_tensors_hooks`` pack hook
  around the forward (unique storages, so views of one buffer count once). Under checkpointing torch's
  own hooks take over inside each block, so what the outer hook sees is exactly what is kept: each
  block's input plus everything outside the blocks (embeddings, final norm, LM head and loss -- the
  logits alone are 4 x 512 x 8192 x 4 B = 64 MiB, which checkpointing the blocks cannot remove).
- **peak during the step**: the most tensor bytes allocated at once during forward + backward, from
  the allocator's own reports (``tests/memory_probe.PeakTensorBytes``). It adds what both variants
  need anyway (parameter gradients, the logits' gradient) and, for checkpointing, one block's
  recomputed activations, so its reduction is smaller than the first measure's.

Time: the variants' steps are interleaved (plain, checkpointed, plain, ...) after warm-up steps, so
machine noise hits both alike; medians are compared. Checkpointing recomputes each block's forward
once during backward, so the expected overhead is about blocks' forward / (forward + backward).

Targets: saved-for-backward reduction >= 70%, step-time overhead <= 40%. The losses of the two
variants are checked to be equal (same seed: dropout draws the same masks in the recompute).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.memory_probe import PeakTensorBytes, saved_for_backward  # noqa: E402
from zerotune.parallel.activation_checkpointing import CheckpointPolicy  # noqa: E402
from zerotune.parallel.block_checkpointing import apply_activation_checkpointing, remove_activation_checkpointing  # noqa: E402

MODEL = dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=512)
MEMORY_TARGET = 0.70  # fraction of saved-for-backward bytes removed
TIME_TARGET = 0.40  # step-time overhead
VARIANTS = ("plain", "checkpointed")


def build(seed: int = 0) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(**MODEL, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).train()


def batch(micro: int, seq: int) -> dict:
    ids = torch.randint(0, MODEL["vocab_size"], (micro, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def use(model: torch.nn.Module, variant: str) -> None:
    if variant == "checkpointed":
        apply_activation_checkpointing(model, CheckpointPolicy())
    else:
        remove_activation_checkpointing(model)


def step(model: torch.nn.Module, inputs: dict, seed: int = 0) -> float:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**inputs).loss
    loss.backward()
    return loss.item()


def saved_bytes(model: torch.nn.Module, inputs: dict) -> tuple[int, float]:
    """Distinct non-parameter storages saved for backward by one forward; and the loss."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with saved_for_backward(model.parameters()) as storages:
        loss = model(**inputs).loss
    total = sum(storages.values())
    loss.backward()
    return total, loss.item()


def peak_bytes(model: torch.nn.Module, inputs: dict) -> int:
    with PeakTensorBytes() as probe:
        step(model, inputs)
    return probe.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per variant")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, inputs = build(), batch(args.micro, args.seq)

    saved, peak, losses, times = {}, {}, {}, {v: [] for v in VARIANTS}
    for variant in VARIANTS:
        use(model, variant)
        saved[variant], losses[variant] = saved_bytes(model, inputs)
        peak[variant] = peak_bytes(model, inputs)
    for index in range(args.warmup + args.steps):
        order = VARIANTS if index % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            use(model, variant)
            start = time.perf_counter()
            step(model, inputs)
            if index >= args.warmup:
                times[variant].append(time.perf_counter() - start)
    use(model, "plain")

    median = {v: statistics.median(times[v]) for v in VARIANTS}
    psi = sum(p.numel() for p in model.parameters())
    print(f"GPT-2 {MODEL} ({psi / 1e6:.2f}M params), micro-batch {args.micro} x seq {args.seq}, fp32, 1 thread, "
          f"{args.steps} timed steps per variant (interleaved, after {args.warmup} warm-up)")
    print(f"{'variant':<14}{'saved for bwd MiB':>19}{'peak in step MiB':>18}{'step s (median)':>17}{'min':>8}{'max':>8}")
    for v in VARIANTS:
        print(f"{v:<14}{_mib(saved[v]):>19.1f}{_mib(peak[v]):>18.1f}{median[v]:>17.3f}{min(times[v]):>8.3f}"
              f"{max(times[v]):>8.3f}")
    saved_cut = 1 - saved["checkpointed"] / saved["plain"]
    peak_cut = 1 - peak["checkpointed"] / peak["plain"]
    overhead = median["checkpointed"] / median["plain"] - 1
    print(f"\nsaved-for-backward reduction {saved_cut:.1%} (target >= {MEMORY_TARGET:.0%}: "
          f"{'met' if saved_cut >= MEMORY_TARGET else 'MISSED'}); peak-in-step reduction {peak_cut:.1%}")
    print(f"step-time overhead {overhead:+.1%} (target <= {TIME_TARGET:.0%}: "
          f"{'met' if overhead <= TIME_TARGET else 'MISSED'})")
    print(f"losses equal: {losses['plain'] == losses['checkpointed']} ({losses['plain']:.6f})")


def _mib(n: int) -> float:
    return n / 2**20


if __name__ == "__main__":
    main()
