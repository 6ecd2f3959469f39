"""How close ``zerotune plan``'s per-rank peak is to the measured peak of the same run (issue 18 item 3).

    python benchmarks/bench_plan_accuracy.py [--cases all|NAME,...]

Data parallel over 2 ranks, or tensor parallel (``tp``), two pipeline stages (``pp``) or sequence parallel
(``sp``, Ulysses) over both; the fullest rank is compared. For each case, the prediction is ``plan_rank`` on the model built on the meta device: model state, buckets,
activations (checkpointed or not, as the case trains), the largest stage-3 unit's gather and the loss
logits peak. The measurement is an actual 2-rank CPU run of two optimizer steps on the same model and
config, under ``tests/memory_probe.PeakTensorBytes``: the most bytes of tensor storage alive at once,
model construction included (torch's allocator reports, independent of zerotune's own accounting). On
CPU the offloaded state lives in the same memory, so the prediction counts device + host there.
Prints one table; the acceptance is |predicted / measured - 1| <= 10% for every case. ``tp2 x pp2`` runs
on 4 ranks.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.harness import run_distributed  # noqa: E402
from tests.memory_probe import PeakTensorBytes  # noqa: E402

WORLD = 2


def llama(hidden: int, layers: int, vocab: int = 32000) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.6875),
                                        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                                        num_key_value_heads=max(1, hidden // 64), max_position_embeddings=1024,
                                        tie_word_embeddings=False))


def gpt2(hidden: int, layers: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=hidden, n_layer=layers, n_head=max(1, hidden // 64), n_positions=1024,
                                      vocab_size=50304))  # padded to a multiple of 64 (nanoGPT's), so it splits


@dataclass(frozen=True)
class Case:
    name: str
    family: str  # llama | gpt2
    hidden: int
    layers: int
    stage: int
    precision: str
    checkpointing: bool = False
    offload: str = "none"
    micro: int = 4
    seq: int = 128
    bucket: int | None = None  # reduce / all-gather / prefetch bucket elements; None: the config defaults
    tp: int = 1  # tensor-parallel size (of the 2 ranks)
    pp: int = 1  # pipeline stages (of the 2 ranks); trained with train_batch over ``gas`` micro-batches
    sp: int = 1  # sequence-parallel (Ulysses) size: each rank runs seq / sp tokens of every sequence
    gas: int = 1
    world: int = WORLD  # ranks (4 for tensor parallelism and pipeline stages composed)

    def model(self) -> torch.nn.Module:
        return (llama if self.family == "llama" else gpt2)(self.hidden, self.layers)

    def config(self) -> dict:
        return {"train_micro_batch_size_per_gpu": self.micro, "steps_per_print": 1000,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "bf16": {"enabled": self.precision == "bf16"},
                "tensor_parallel": {"autotp_size": self.tp}, "pipeline": {"stages": self.pp},
                "sequence_parallel_size": self.sp,
                "gradient_accumulation_steps": self.gas,
                "zero_optimization": {"stage": self.stage, "offload_optimizer": {"device": self.offload},
                                      **({"reduce_bucket_size": self.bucket, "allgather_bucket_size": self.bucket,
                                          "stage3_prefetch_bucket_size": self.bucket} if self.bucket else {})}}


CASES = [
    Case("llama-20M z0 fp32", "llama", 256, 4, 0, "fp32"),
    Case("llama-20M z1 bf16 ckpt", "llama", 256, 4, 1, "bf16", checkpointing=True),
    Case("llama-20M z2 fp32", "llama", 256, 4, 2, "fp32"),
    Case("llama-20M z3 bf16", "llama", 256, 4, 3, "bf16"),
    Case("gpt2-30M z2 bf16 cpu-offload", "gpt2", 384, 6, 2, "bf16", offload="cpu"),
    Case("gpt2-30M z3 fp32 ckpt", "gpt2", 384, 6, 3, "fp32", checkpointing=True),
    Case("llama-60M z1 fp32", "llama", 512, 8, 1, "fp32"),
    Case("gpt2-124M z2 bf16", "gpt2", 768, 12, 2, "bf16", micro=2),
    Case("llama-20M tp2 fp32", "llama", 256, 4, 0, "fp32", tp=2),
    Case("gpt2-30M tp2 z1 bf16", "gpt2", 384, 6, 1, "bf16", tp=2),
    Case("llama-20M pp2 fp32", "llama", 256, 4, 0, "fp32", pp=2, gas=4),
    Case("gpt2-30M pp2 z1 bf16", "gpt2", 384, 6, 1, "bf16", pp=2, gas=4, micro=2),
    Case("llama-20M tp2 x pp2 fp32", "llama", 256, 4, 0, "fp32", tp=2, pp=2, gas=4, world=4),
    Case("llama-20M sp2 fp32 seq512", "llama", 256, 4, 0, "fp32", sp=2, micro=2, seq=512),
    Case("gpt2-30M sp2 z3 bf16 seq512", "gpt2", 384, 6, 3, "bf16", sp=2, micro=2, seq=512),
]


def measure(case: Case) -> int:
    import zerotune
    from zerotune.parallel.block_checkpointing import apply_activation_checkpointing

    torch.manual_seed(0)
    vocab = 32000 if case.family == "llama" else 50257
    ids = torch.randint(0, vocab, (case.micro, case.seq))
    with PeakTensorBytes() as probe:
        model = case.model()
        if case.checkpointing:
            apply_activation_checkpointing(model)
        engine, *_ = zerotune.initialize(model=model, config=case.config())
        for _ in range(2):  # two optimizer steps (the first allocates the optimizer state)
            if case.pp > 1:
                engine.train_batch(iter([{"input_ids": ids, "labels": ids}] * case.gas))
                continue
            for _ in range(case.gas):
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
    engine.destroy()
    return probe.peak


def predict(case: Case) -> int:
    from zerotune.plan.memory import Layout, plan_rank

    with torch.device("meta"):
        model = case.model()
    layout = Layout(stage=case.stage, dp=case.world // (case.tp * case.pp * case.sp), tp=case.tp, pp=case.pp,
                    sp=case.sp, gas=case.gas,
                    precision=case.precision, micro_batch=case.micro, offload_optimizer=case.offload)
    plan = plan_rank(model, layout, case.seq)  # the fullest rank's
    return plan.total("device", case.checkpointing) + plan.total("host")  # one memory on CPU


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="all", help="comma-separated case names, or all")
    args = parser.parse_args()
    cases = CASES if args.cases == "all" else [c for c in CASES if c.name in args.cases.split(",")]
    print(f"{'case':<32} {'predicted MiB':>14} {'measured MiB':>13} {'ratio':>7}  within 10%")
    worst = 0.0
    for case in cases:
        measured = max(run_distributed(measure, case.world, case, timeout=600))  # the fullest rank (pipeline stages differ)
        predicted = predict(case)
        ratio = predicted / measured
        worst = max(worst, abs(ratio - 1))
        print(f"{case.name:<32} {predicted / 2**20:>14.1f} {measured / 2**20:>13.1f} {ratio:>7.3f}  "
              f"{'yes' if abs(ratio - 1) <= 0.10 else 'NO'}", flush=True)
    print(f"worst |predicted / measured - 1| = {worst:.1%} over {len(cases)} cases")


if __name__ == "__main__":
    main()
