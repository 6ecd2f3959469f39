"""``accelerate launch`` with a ``distributed_type: DEEPSPEED`` config file, on zerotune and on DeepSpeed.

    python scripts/ecosystem/accelerate_case.py [--workdir DIR] [--steps N] [--real-deepspeed PYTHON] [--line]

(a) The unchanged launch: ``accelerate launch --config_file <DEEPSPEED yaml> script.py`` on 2 processes, the
script a plain ``Accelerator()`` user. On a CPU-only host accelerate itself cannot run it: its
``AcceleratorState`` leaves ``num_processes`` at 1 under DEEPSPEED (accelerate/state.py: the DEEPSPEED branch
sets the process count only with an accelerator device), so the batch arithmetic handed to
``deepspeed.initialize`` (train_batch_size = micro x accumulation x 2 ranks, world counted as 1) fails. The
case runs it on zerotune and, where a Python with the real DeepSpeed is given (``--real-deepspeed``, default
$REAL_DEEPSPEED_PYTHON), on DeepSpeed, and reports whether both stop at the same place with the same cause.

(b) The closest equivalent that runs on CPU: the same script with accelerate's ``DeepSpeedPlugin`` under
``PartialState(cpu=True)`` (gloo, as ``TrainingArguments(use_cpu=True)`` sets it up) on 2 ranks at ZeRO 2
and 3, every logged loss compared with the same script's non-DeepSpeed (accelerate DDP) run at 1e-5.
The GPU form of (a) is benchmarks/gpu_ecosystem.py's accelerate section.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import case_parser, drive, failure_line, print_row, progress, summarize  # noqa: E402

METHODS = ("plugin",)
DEEPSPEED_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: {stage}
  gradient_accumulation_steps: 1
  gradient_clipping: 1.0
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
mixed_precision: 'no'
num_machines: 1
num_processes: {nproc}
machine_rank: 0
main_training_function: main
rdzv_backend: static
same_network: true
use_cpu: {use_cpu}
"""


def train(accelerator, steps: int) -> list[float]:
    """The user's training loop: a tiny GPT-2, AdamW, clipping at 1.0, the mean loss over ranks per step."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    ids = torch.randint(0, 96, (4 * steps, 16), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader([{"input_ids": r, "labels": r} for r in ids], batch_size=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)  # under DeepSpeed: the config's gradient_clipping
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    worker.engine = f"{type(model).__module__}.{type(model).__name__}"
    return losses


def worker(args: argparse.Namespace) -> None:
    from accelerate import Accelerator, PartialState

    if args.mode == "launch":  # (a): a plain Accelerator() user; accelerate launch's config picks DeepSpeed
        progress("launch: Accelerator() under accelerate launch --config_file (DEEPSPEED)")
        accelerator = Accelerator()
    else:
        from accelerate.utils import DeepSpeedPlugin

        PartialState(cpu=True)  # gloo on a CPU-only host
        plugin = None if args.mode == "ddp" else DeepSpeedPlugin(
            zero_stage=int(args.mode.removeprefix("zero")), gradient_accumulation_steps=1, gradient_clipping=1.0)
        progress(f"{args.mode}: Accelerator(deepspeed_plugin={'None' if plugin is None else 'DeepSpeedPlugin'})")
        accelerator = Accelerator(deepspeed_plugin=plugin)
    losses = train(accelerator, args.steps)
    print_row({"rank": accelerator.process_index, "losses": {"plugin": losses},
               "engines": {} if args.mode == "ddp" else {"plugin": worker.engine},
               "distributed_type": str(accelerator.distributed_type)})


def launch_unchanged(python: str, workdir: Path, steps: int, stage: int, timeout: int, nproc: int = 2,
                     use_cpu: bool = True) -> tuple[str, list[dict]]:
    """(a) with one Python: accelerate launch --config_file <DEEPSPEED yaml>; "ran" and the ranks' rows, or the
    failure line."""
    config = workdir / f"deepspeed_zero{stage}.yaml"
    config.write_text(DEEPSPEED_YAML.format(stage=stage, nproc=nproc, use_cpu=str(use_cpu).lower()))
    command = [python, "-m", "accelerate.commands.launch", "--config_file", str(config), "--main_process_port",
               str(common._free_port()), str(Path(__file__).resolve()), "--worker", "--mode", "launch",
               "--steps", str(steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if use_cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout}s", []
    if done.returncode == 0:
        return "ran", common.rank_rows(done.stdout)
    log = os.environ.get("ECOSYSTEM_LOG")
    if log:
        with open(log, "a") as handle:
            handle.write(f"==== launch ({python}): {' '.join(command)}\n{done.stdout}\n{done.stderr}\n")
    text = re.sub(r"^\[rank\d+\]:\s?", "", done.stdout + "\n" + done.stderr, flags=re.M)  # torchrun's rank prefix
    caller = re.findall(r'(accelerate/accelerator\.py)", line (\d+), in (\w+)', text)
    return failure_line(text, done.returncode) + (" <from {}:{} {}>".format(*caller[-1]) if caller else ""), []


BATCH_CHECK = re.compile(r"(\d+) != \D*?(\d+) \* \D*?(\d+) \* \D*?(\d+)")


def cause(line: str) -> str:
    """What a failure comes down to, without either side's wording, paths or line numbers: the batch check's
    numbers (train_batch_size != micro * accumulation * world, DeepSpeed's ``_batch_assertion`` and zerotune's
    config check word it differently), else the exception and its message."""
    text = re.sub(r" \[File .*?\]| <from .*?>", "", line).split(" (while:")[0].strip()
    found = BATCH_CHECK.search(text)
    if found and "train_batch_size" in text:
        tbs, micro, gas, world = found.groups()
        return f"the batch check train_batch_size {tbs} != micro {micro} * accumulation {gas} * world {world}"
    return text


def _caller(line: str) -> str:
    found = re.search(r" <from (.*?)>", line)
    return f" called from {found.group(1)}" if found else ""


def _kind(line: str) -> str:
    return line.split(":", 1)[0].rsplit(".", 1)[-1]


def line(summary: dict) -> str:
    a = summary["launch"]
    ours, real = a["zerotune"], a.get("deepspeed")
    if ours == "ran":
        head = "accelerate launch --config_file (DEEPSPEED) on CPU ran on zerotune"
    elif real is None:
        head = f"accelerate launch --config_file (DEEPSPEED) on CPU stops: {cause(ours)} (real DeepSpeed not checked)"
    elif cause(ours) == cause(real):
        head = (f"accelerate launch --config_file (DEEPSPEED) on CPU: accelerate limitation on CPU, same with DeepSpeed "
                f"{a['deepspeed_version']}: both stop at {cause(ours)} in deepspeed.initialize{_caller(ours)} (zerotune {_kind(ours)}, "
                f"DeepSpeed {_kind(real)}): accelerate's state counts 1 process under DEEPSPEED without an accelerator")
    else:
        head = (f"accelerate launch --config_file (DEEPSPEED) on CPU DIFFERS: zerotune {cause(ours)} | DeepSpeed "
                f"{a['deepspeed_version']} {cause(real)}")
    return (f"{summary['tool']} {summary['version']}: {head} | DeepSpeedPlugin under PartialState(cpu=True): "
            + summarize(summary).split(": ", 1)[1].replace("non-DeepSpeed", "accelerate DDP"))


def main() -> None:
    parser = case_parser(__doc__, METHODS)
    parser.add_argument("--real-deepspeed", default=os.environ.get("REAL_DEEPSPEED_PYTHON"),
                        help="a Python whose `import deepspeed` is DeepSpeed itself, for (a)")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    import accelerate

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="zerotune-accelerate-"))
    workdir.mkdir(parents=True, exist_ok=True)
    launch = {"zerotune": launch_unchanged(sys.executable, workdir, args.steps, 2, args.timeout)[0]}
    if args.real_deepspeed:
        launch["deepspeed"] = launch_unchanged(args.real_deepspeed, workdir, args.steps, 2, args.timeout)[0]
        launch["deepspeed_version"] = subprocess.run(
            [args.real_deepspeed, "-c", "import deepspeed; print(deepspeed.__version__)"], capture_output=True,
            text=True).stdout.strip().splitlines()[-1]
    summary = drive("accelerate", accelerate.__version__, Path(__file__).resolve(), METHODS,
                    lambda directory: ["--steps", str(args.steps)], workdir, args.timeout)
    summary["launch"] = launch
    (workdir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(line(summary) if args.line else json.dumps(summary))


if __name__ == "__main__":
    main()
