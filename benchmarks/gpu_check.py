"""One command for a GPU: zerotune's parity on CUDA + NCCL, then throughput, MFU and memory of a ~1B Llama.

    python benchmarks/gpu_check.py                     # one table on stdout, JSON in gpu_check.json
    python benchmarks/gpu_check.py --quick             # fewer steps, LoRA and checkpointing-off rows left out
    python benchmarks/gpu_check.py --peak-tflops 989   # the GPU's dense bf16 peak (default: known GPUs, else 989)

Needs nothing prepared (random weights, no hub): world size 1 with NCCL, then

1. parity -- ZeRO 0-3, CPU offload (optimizer at stage 2, parameters at stage 3), NVMe offload (parameters at
   stage 3, into a temporary directory), bf16 and fp16, each against single-process PyTorch (AdamW, the same
   batches) on a GPT-2 (124M) model: the largest relative difference of the losses over the steps (fp32 with
   TF32 off: held to 1e-5; bf16 / fp16 against the fp32 reference: 3e-2). Then 2 ranks on the one GPU: NCCL
   where it allows two ranks on a device, else gloo over CUDA tensors -- what happened is reported. Then
   ``engine.offload_states()`` at ZeRO 3: device memory drops by the model states, and after ``reload_states()``
   the losses equal, bit for bit, a run that never offloaded;
2. throughput -- full fine-tuning and LoRA of a Llama of ~1.1B parameters (2048 x 16 layers, random init,
   bf16, sequence 2048, activation checkpointing on and off) at ZeRO 0 and 3, and plain PyTorch (bf16 autocast,
   fp32 weights, fused AdamW) and FSDP2 (``fully_shard``, one rank) in the same run: tokens/s, model FLOPs
   utilization (6 x multiplied parameters + 12 x layers x hidden x sequence flops per token, recomputation not
   counted, over the peak) and ``torch.cuda.max_memory_allocated`` against what ``zerotune plan`` predicts;
3. ecosystem -- Lightning's DeepSpeedStrategy and ``accelerate launch`` with a DEEPSPEED config, which their own
   code keeps off CPU, unchanged on this GPU (benchmarks/gpu_ecosystem.py; skipped where not installed).

Targets (issue 19): bf16 MFU >= 45% for full fine-tuning at ZeRO 0, ZeRO 3 throughput >= 0.95 x ZeRO 0 at world
size 1. Without CUDA it says so and exits 2; its CUDA-free parts (benchmarks/gpu_report.py: the FLOP count, MFU,
the verdicts, the table) are tested in tests/test_gpu_check.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_report import (  # noqa: E402  (the repository root is on the path only now)
    FP32_TOLERANCE,
    MIXED_TOLERANCE,
    Row,
    flops_per_token,
    mfu,
    parity_row,
    peak_tflops_for,
    relative_difference,
    render,
    throughput_verdicts,
)

LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 32, "vocab_size": 32000}


def engine_config(stage: int, precision: str = "fp32", offload_optimizer: str = "none", offload_param: str = "none",
                  nvme_path: str | None = None, micro_batch: int = 2, lr: float = 1e-4) -> dict:
    zero: dict = {"stage": stage}
    if offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": offload_optimizer}
    if offload_param != "none":
        zero["offload_param"] = {"device": offload_param, **({"nvme_path": nvme_path} if nvme_path else {})}
    return {"train_micro_batch_size_per_gpu": micro_batch, "steps_per_print": 10**9, "zero_optimization": zero,
            "bf16": {"enabled": precision == "bf16"}, "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8},
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}}}


# ---- on the GPU ---------------------------------------------------------------------------------------
def _batches(steps: int, micro: int, seq: int, vocab: int, device: torch.device) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (micro, seq), generator=generator).to(device) for _ in range(steps)]


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=50304, n_positions=1024))


def _reference_losses(batches: list[torch.Tensor], device: torch.device) -> list[float]:
    model = _gpt2().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _engine_losses(config: dict, batches: list[torch.Tensor]) -> list[float]:
    import zerotune

    engine, *_ = zerotune.initialize(model=_gpt2(), config=config)
    losses = []
    for ids in batches:
        loss = engine(input_ids=ids.to(engine.device), labels=ids.to(engine.device)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    engine.destroy()
    return losses


def parity(steps: int, device: torch.device) -> list[Row]:
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    batches = _batches(steps, 2, 512, 50304, device)
    reference = _reference_losses(batches, device)
    rows = []
    with tempfile.TemporaryDirectory() as swap:
        runs = [(f"ZeRO {stage}, fp32", engine_config(stage), FP32_TOLERANCE) for stage in range(4)] + [
            ("ZeRO 2, optimizer on CPU", engine_config(2, offload_optimizer="cpu"), FP32_TOLERANCE),
            ("ZeRO 3, parameters + optimizer on CPU", engine_config(3, offload_optimizer="cpu", offload_param="cpu"),
             FP32_TOLERANCE),
            ("ZeRO 3, parameters on NVMe", engine_config(3, offload_optimizer="cpu", offload_param="nvme",
                                                          nvme_path=swap), FP32_TOLERANCE),
            ("ZeRO 2, bf16", engine_config(2, "bf16"), MIXED_TOLERANCE),
            ("ZeRO 3, bf16", engine_config(3, "bf16"), MIXED_TOLERANCE),
            ("ZeRO 2, fp16", engine_config(2, "fp16"), MIXED_TOLERANCE)]
        for name, config, tolerance in runs:
            try:
                rows.append(parity_row(name, _engine_losses(config, batches), reference, tolerance))
            except Exception as error:  # noqa: BLE001 - one failing mode must not hide the others
                rows.append(Row("parity", name, "ERROR", {"error": f"{type(error).__name__}: {error}"[:200]}))
    return rows


def offload_states_check(device: torch.device, steps: int = 3) -> Row:
    """ZeRO 3 in bf16 trains ``steps`` steps, moves every state to pinned host memory, reloads and trains on; the
    same run without the move is the reference (dropout draws the same numbers: the seed is reset per run; attention
    on the math kernel and deterministic algorithms, so that only the move could make the two runs differ)."""
    import zerotune
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batches, runs = _batches(2 * steps, 2, 256, 50304, device), {}
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        for offload in (False, True):
            engine, *_ = zerotune.initialize(model=_gpt2(), config=engine_config(3, "bf16"))
            losses, figures = [], {}
            for index, ids in enumerate(batches):
                if offload and index == steps:
                    states = sum(v for k, v in engine.memory_breakdown().items() if k != "comm_buffers")
                    before = torch.cuda.memory_allocated(device)
                    engine.offload_states()
                    figures["GiB freed"] = (before - torch.cuda.memory_allocated(device)) / 2**30
                    figures["GiB of states"] = states / 2**30
                    engine.reload_states()
                with sdpa_kernel(SDPBackend.MATH):
                    loss = engine(input_ids=ids, labels=ids).loss
                    engine.backward(loss)
                engine.step()
                losses.append(loss.float().item())
            engine.destroy()
            runs[offload] = (losses, figures)
    finally:
        torch.use_deterministic_algorithms(False)
    (reference, _), (ours, figures) = runs[False], runs[True]
    passed = ours == reference and figures["GiB freed"] >= 0.9 * figures["GiB of states"]
    return Row("parity", "ZeRO 3, bf16, offload_states + reload_states", "pass" if passed else "FAIL",
               {**figures, "max rel. loss difference": relative_difference(ours, reference), "losses": ours})


def _two_ranks_main(rank: int, port: int, backend: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=rank, world_size=2)
    batches = _batches(3, 2, 256, 50304, torch.device("cuda"))
    losses = _engine_losses(engine_config(2), batches)
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(losses, handle)
    dist.destroy_process_group()


def two_ranks_on_one_gpu() -> Row:
    """ZeRO 2 on 2 ranks sharing the GPU: NCCL refuses two ranks on one device on most versions; then gloo, with
    which zerotune keeps the ranks' engines on the host (the row says which backend ran)."""
    import socket

    import torch.multiprocessing as mp

    outcome = {}
    for backend in ("nccl", "gloo"):
        with socket.socket() as s, tempfile.TemporaryDirectory() as directory:
            s.bind(("127.0.0.1", 0))
            port, out = s.getsockname()[1], os.path.join(directory, "losses.json")
            try:
                mp.start_processes(_two_ranks_main, args=(port, backend, out), nprocs=2, start_method="spawn")
                with open(out) as handle:
                    losses = json.load(handle)
                where = "NCCL on the GPU" if backend == "nccl" else "gloo, engines on the host"
                return Row("parity", f"2 ranks, one GPU ({where})", "ran",
                           {"losses": losses, "backend": backend, **outcome})
            except Exception as error:  # noqa: BLE001 - report why, try the next backend
                outcome[f"{backend} failed"] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    return Row("parity", "2 ranks on one GPU", "ERROR", outcome)


def _llama(device: torch.device, lora: bool, checkpointing: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=4096, tie_word_embeddings=False, **LLAMA_1B))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                       "o_proj"]))
    return model


def _timed(step, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps


def throughput(args: argparse.Namespace, device: torch.device, peak_flops: float) -> list[Row]:
    seq, micro = 2048, args.micro_batch
    ids = _batches(1, micro, seq, LLAMA_1B["vocab_size"], device)[0]
    rows = []
    methods = ["full"] + ([] if args.quick else ["lora"])
    for method in methods:
        for checkpointing in (True,) if args.quick else (True, False):
            ckpt = "ckpt on" if checkpointing else "ckpt off"
            for runner in ("pytorch", "fsdp2", "ZeRO 0", "ZeRO 3"):
                name = f"{method}, {runner}, {ckpt}"
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                try:
                    model = _llama(device, method == "lora", checkpointing)
                    multiplied = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
                    per_token = flops_per_token(multiplied, LLAMA_1B["num_hidden_layers"], LLAMA_1B["hidden_size"], seq)
                    step, planned = _runner(runner, model, ids, device, method, checkpointing)
                    seconds = _timed(step, args.steps, 3)
                    tokens = micro * seq / seconds
                    figures = {"tokens/s": tokens, "MFU": mfu(tokens, per_token, peak_flops),
                               "peak GiB": torch.cuda.max_memory_allocated() / 2**30}
                    if planned is not None:
                        figures["planned GiB"] = planned / 2**30
                    rows.append(Row("throughput", name, "ran", figures))
                except Exception as error:  # noqa: BLE001 - e.g. FSDP2 unavailable: report and go on
                    rows.append(Row("throughput", name, "ERROR", {"error": f"{type(error).__name__}: {error}"[:200]}))
                finally:
                    model = step = None
    return rows


def _runner(runner: str, model: torch.nn.Module, ids: torch.Tensor, device: torch.device, method: str,
            checkpointing: bool) -> tuple:
    """(one training step, the plan's predicted peak or None) for ``runner``: pytorch, fsdp2, ZeRO 0, ZeRO 3."""
    import zerotune
    from zerotune.plan.memory import Layout, plan_rank

    if runner in ("pytorch", "fsdp2"):
        model = model.to(device)
        if runner == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in model.base_model.model.model.layers if method == "lora" else model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-5, fused=True)

        def step() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return step, None
    stage = int(runner.split()[-1])
    engine, *_ = zerotune.initialize(model=model, config=engine_config(stage, "bf16", micro_batch=ids.shape[0], lr=1e-5))
    planned = None
    if method == "full":
        meta = _llama(torch.device("meta"), False, False)
        plan = plan_rank(meta, Layout(stage=stage, dp=1, precision="bf16", micro_batch=ids.shape[0]), ids.shape[1])
        planned = plan.total("device", checkpointing)

    def step() -> None:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    return step, planned


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per throughput run")
    parser.add_argument("--parity-steps", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--out", default="gpu_check.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a GPU machine (its CUDA-free parts are tested in "
              "tests/test_gpu_check.py)", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import zerotune

    started = time.time()
    env = zerotune.init_distributed()  # world of one: NCCL on this GPU
    device = env.device
    name = torch.cuda.get_device_name(device)
    peak = peak_tflops_for(name, args.peak_tflops) * 1e12
    rows = parity(args.parity_steps, device)
    try:
        rows.append(offload_states_check(device))
    except Exception as error:  # noqa: BLE001 - reported, the other checks still run
        rows.append(Row("parity", "offload_states", "ERROR", {"error": f"{type(error).__name__}: {error}"[:200]}))
    rows += [two_ranks_on_one_gpu()] + throughput(args, device, peak)
    from benchmarks.gpu_ecosystem import ecosystem_rows  # Lightning's and accelerate launch's DeepSpeed paths

    rows += ecosystem_rows()
    table = render(rows)
    header = (f"gpu_check on {name} (peak {peak / 1e12:.0f} TFLOP/s bf16), torch {torch.__version__}, "
              f"backend {env.backend}, {time.strftime('%Y-%m-%d')}, {time.time() - started:.0f} s")
    print(header + "\n" + table)
    with open(args.out, "w") as handle:
        json.dump({"header": header, "rows": [asdict(row) for row in rows],
                   "verdicts": throughput_verdicts(rows)}, handle, indent=1, default=str)
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()
    return 0 if all(row.verdict in ("pass", "ran", "skipped") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
