"""What the instrumentation costs: the test-side memory probe and the engine's disabled timers.

    python benchmarks/bench_instrumentation_overhead.py             # 5 timed repeats
    python benchmarks/bench_instrumentation_overhead.py --repeats 1 # smoke test

Two measurements, each against a baseline timed in the same run:

- **memory probe** (``tests/memory_probe.PeakTensorBytes``): a forward + backward of a random-init
  GPT-2 (10 layers, width 256, 4 heads, vocab 8192, 10.2M parameters; batch 4 x 64 tokens, fp32,
  one thread), plain vs inside the probe. The probe sees every allocation through torch's
  profiler-memory callbacks, so it is only meant for tests and benchmarks; target slowdown < 3x.
- **disabled timers** (``zerotune.monitor.timers.WallClockTimers(enabled=False)``): what a
  ``with timers("forward"):`` costs when ``wall_clock_breakdown`` is off, vs a bare
  ``with contextlib.nullcontext():``. The engine wraps every forward, backward and step in one,
  so it must stay at the cost of a no-op context; target < 5 us per call.

Steps of the two variants are interleaved, so machine noise hits both alike; minima are compared.
These are timings: they live here, not as assertions in the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from tests.memory_probe import PeakTensorBytes
from zerotune.monitor.timers import WallClockTimers

PROBE_SLOWDOWN_TARGET = 3.0
TIMER_COST_TARGET_S = 5e-6


def probe_slowdown(repeats: int) -> tuple[float, float, int]:
    """(plain step s, probed step s, parameters): minima over `repeats` interleaved steps."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=10, n_embd=256, n_head=4, vocab_size=8192, n_positions=64,
                        bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 8192, (4, 64), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    step()  # lazy initialisation outside the timings
    plain, probed = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        with PeakTensorBytes():
            step()
        probed.append(time.perf_counter() - start)
    return min(plain), min(probed), sum(p.numel() for p in model.parameters())


def disabled_timer_cost(repeats: int, calls: int = 20000) -> tuple[float, float]:
    """(bare nullcontext s/call, disabled-timer s/call): minima over `repeats` loops of `calls`."""
    timers = WallClockTimers(enabled=False)
    bare, timed = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            with contextlib.nullcontext():
                pass
        bare.append((time.perf_counter() - start) / calls)
        start = time.perf_counter()
        for _ in range(calls):
            with timers("forward"):
                pass
        timed.append((time.perf_counter() - start) / calls)
    return min(bare), min(timed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)

    plain_s, probed_s, numel = probe_slowdown(args.repeats)
    slowdown = probed_s / plain_s
    bare_s, timer_s = disabled_timer_cost(args.repeats)
    print(f"memory probe, GPT-2 {numel / 1e6:.1f}M forward+backward: plain {plain_s * 1e3:.0f} ms, "
          f"probed {probed_s * 1e3:.0f} ms -> {slowdown:.2f}x (target < {PROBE_SLOWDOWN_TARGET:g}x)")
    print(f"disabled timer: {timer_s * 1e9:.0f} ns/call vs bare nullcontext {bare_s * 1e9:.0f} ns/call "
          f"-> {timer_s / bare_s:.2f}x (target < {TIMER_COST_TARGET_S * 1e6:g} us/call)")
    met = slowdown < PROBE_SLOWDOWN_TARGET and timer_s < TIMER_COST_TARGET_S
    print("targets met" if met else "TARGET MISSED")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
