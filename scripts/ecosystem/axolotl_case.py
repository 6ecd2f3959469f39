"""axolotl on zerotune: ``axolotl train`` (LoRA SFT on the tiny Llama, a tiny local alpaca-format dataset) on 2
CPU ranks with axolotl's shipped DeepSpeed configs (deepspeed_configs/zero2.json / zero3.json, written out below
as shipped) against axolotl's own non-DeepSpeed run, logged losses compared to 1e-5.

    python scripts/ecosystem/axolotl_case.py [--workdir DIR] [--steps N]

prints one JSON summary line (scripts/ecosystem/common.py ``drive``); ``--line`` the one-line form.
axolotl launches its own torchrun (``--launcher torchrun -- --nproc_per_node 2``): the worker here is one
process per mode that runs the CLI and reads the losses from the last checkpoint's trainer_state.json; a
zerotune engine is recognised by the banner zerotune logs at ``initialize``. axolotl's LoRA kernels (Triton,
switched on by default) are switched off, as its own warning says to where Triton is missing (a CPU machine);
triton itself is installed (scripts/ecosystem_check.sh's IMPORT_ONLY: axolotl imports it on this path).

``axolotl train`` stops on a CPU machine in axolotl's own code, at one of two CUDA assumptions (CPU_STOPS below):
its device map, and its TrainingArguments never asking for the CPU. Where it does, the run is repeated past both
(``past_cpu_stop``: the two values put back to the CPU, nothing else changed) and the line says where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    ENGINE_BANNER, MODES, NPROC, _free_port, case_parser, drive, make_tiny_llama, one_process,
    print_row, progress, run_cli, summarize)

METHODS = ("sft",)


def shipped_config(stage: int) -> dict:
    """deepspeed_configs/zero2.json / zero3.json of axolotl (not in its wheel: `axolotl fetch deepspeed_configs`
    downloads them); "auto"s filled in by the HF Trainer, fp16 / bf16 "auto" off in this fp32 run."""
    zero = ({"stage": 2, "offload_optimizer": {"device": "cpu"}, "contiguous_gradients": True, "overlap_comm": True}
            if stage == 2 else
            {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 0,
             "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
             "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 0,
             "stage3_max_reuse_distance": 0, "stage3_gather_16bit_weights_on_model_save": True})
    return {"zero_optimization": zero, "bf16": {"enabled": "auto"},
            "fp16": {"enabled": "auto", "auto_cast": False, "loss_scale": 0, "initial_scale_power": 32,
                     "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}


def write_data(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    rows = [{"instruction": f"what color is the {thing}", "input": "", "output": f"the {thing} is {color}"}
            for thing, color in [("sky", "blue"), ("grass", "green"), ("snow", "white"), ("coal", "black"),
                                 ("sun", "yellow")] * 4]
    (directory / "tiny_sft.json").write_text(json.dumps(rows))
    for stage in (2, 3):
        (directory / f"zero{stage}.json").write_text(json.dumps(shipped_config(stage), indent=2))
    return directory


def train_config(mode: str, model: str, data: Path, out: Path, steps: int) -> dict:
    """The YAML an axolotl user writes for a LoRA run (fp32, CPU, a loss logged every step)."""
    config = {"base_model": model, "datasets": [{"path": str(data / "tiny_sft.json"), "ds_type": "json",
                                                 "type": "alpaca"}],
              "dataset_prepared_path": str(out / "prepared"), "val_set_size": 0.0, "output_dir": str(out),
              "adapter": "lora", "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "lora_target_linear": True,
              "sequence_len": 64, "sample_packing": False, "pad_to_sequence_len": False,
              "micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": steps, "num_epochs": 1,
              "optimizer": "adamw_torch", "lr_scheduler": "constant", "learning_rate": 1e-3, "warmup_steps": 0,
              "weight_decay": 0.0, "bf16": False, "fp16": False, "tf32": False, "seed": 0, "logging_steps": 1,
              "save_strategy": "steps", "save_steps": steps, "save_only_model": True, "flash_attention": False,
              "lora_mlp_kernel": False, "lora_qkv_kernel": False, "lora_o_kernel": False,
              "lora_embedding_kernel": False, "dataloader_num_workers": 0, "special_tokens": {}}
    if mode != "ddp":
        config["deepspeed"] = str(data / f"{mode}.json")
    return config


CPU_STOPS = {
    "Cannot access accelerator device when none is available":
        "its device map (device_map {\"\": LOCAL_RANK} over the \"cpu\" it chose;"
        " axolotl/utils/config/__init__.py:230)",
    "data-parallel size 2":
        "its TrainingArguments without use_cpu (accelerate then sees 1 process, the HF Trainer fills train_batch_size"
        " for 1; axolotl/core/builders/base.py _set_base_training_args)",
}
"""axolotl's two CUDA assumptions on a multi-rank CPU run, as they show (text in the ranks' output -> what).

1. normalize_config sets ``device_map = {"": LOCAL_RANK}`` (a CUDA index) for every world size above 1, over the
   ``{"": "cpu"}`` its own choose_device picked (axolotl/utils/config/__init__.py:230 in 0.19.0, ``if
   cfg.world_size != 1``; not where a ZeRO-3 config is given), and ``from_pretrained(device_map={"": 0})`` asks
   for CUDA device 0 (transformers: "Cannot access accelerator device when none is available").
2. axolotl builds its TrainingArguments without ``use_cpu`` (no config key for it), so on a machine without CUDA
   accelerate's PartialState finds no backend and reports one process: the non-DeepSpeed run trains each rank
   alone on all the data (no DistributedSampler; silently), and the HF Trainer fills DeepSpeed's "auto"
   train_batch_size for world size 1, which the engine refuses on 2 ranks (zerotune, as DeepSpeed's own batch
   check: "train_batch_size 2 != ... * data-parallel size 2 = 4")."""


def past_cpu_stop(config: str) -> None:
    """A rank of ``axolotl train`` (what its torchrun launcher runs: ``-m axolotl.cli.train CONFIG``) with the two
    steps axolotl does not take on CPU: normalize_config's device map put back to the device it chose, and
    ``use_cpu=True`` in the TrainingArguments its trainer builder makes (as axolotl's device is the CPU); and, for
    the comparison, the LoRA weights drawn from the config's seed (below)."""
    import fire
    from axolotl.cli import config as cli_config
    from axolotl.cli.train import do_cli
    import transformers
    from axolotl.core.builders.base import TrainerBuilderBase
    from axolotl.loaders import model as model_loader

    load_adapter = model_loader.load_adapter

    normalize = cli_config.normalize_config

    def normalize_on_cpu(cfg) -> None:
        normalize(cfg)
        if str(cfg.device) == "cpu":
            cfg.device_map = {"": "cpu"}

    pre_create = TrainerBuilderBase.hook_pre_create_training_args

    def training_args_on_cpu(self, training_arguments_kwargs):
        training_arguments_kwargs = pre_create(self, training_arguments_kwargs)
        if str(self.cfg.device) == "cpu":
            training_arguments_kwargs["use_cpu"] = True
        return training_arguments_kwargs

    def seeded_load_adapter(model, cfg, *args, **kwargs):
        # not a CPU step: axolotl seeds nothing before the LoRA weights are drawn (its `seed` reaches the HF
        # Trainer, built after them) and torch's default generator starts from a random seed in every process,
        # so two runs of one config, any mode, start from different lora_A; every mode here draws them from `seed`
        transformers.set_seed(cfg.seed)
        return load_adapter(model, cfg, *args, **kwargs)

    cli_config.normalize_config = normalize_on_cpu
    TrainerBuilderBase.hook_pre_create_training_args = training_args_on_cpu
    model_loader.load_adapter = seeded_load_adapter
    sys.argv = ["axolotl.cli.train", config]
    fire.Fire(do_cli)


def worker(args: argparse.Namespace) -> None:
    out = Path(args.out) / "sft"
    out.mkdir(parents=True, exist_ok=True)
    config = out / "train.yml"  # JSON is YAML
    config.write_text(json.dumps(train_config(args.mode, args.model, Path(args.data), out, args.steps)))
    # the engine's initialize banner (INFO) shown: axolotl's logger class drops other libraries' records below
    # LOG_LEVEL (WARNING by default), and the HF Trainer sets deepspeed.utils.logger to its own verbosity
    env = {"CUDA_VISIBLE_DEVICES": "", "AXOLOTL_DO_NOT_TRACK": "1", "LOG_LEVEL": "INFO",
           "TRANSFORMERS_VERBOSITY": "info"}
    port = ["--nproc_per_node", str(NPROC), "--master_port", str(_free_port())]
    stopped = ""
    progress(f"{args.mode} sft: axolotl train")  # unchanged first
    done = subprocess.run(["axolotl", "train", str(config), "--launcher", "torchrun", "--", *port],
                          capture_output=True, text=True, env={**os.environ, **env, "PATH": os.pathsep.join(
                              [str(Path(sys.executable).parent), os.environ.get("PATH", "")])})
    output = done.stdout + done.stderr
    stop_text, stop = next(((text, what) for text, what in CPU_STOPS.items() if text in output), ("", None))
    if done.returncode != 0 and stop:  # axolotl's own CPU stop: where, then past it
        raised = next((line.split("]: ", 1)[-1].strip() for line in output.splitlines() if stop_text in line), "")
        stopped = f"{args.mode}: {stop}: {raised}"
        output = run_cli(["torchrun", *port, str(Path(__file__).resolve()), "--past-cpu-stop", str(config)], env,
                         f"{args.mode} sft: axolotl.cli.train past its CPU stops (device map, use_cpu)")
    elif done.returncode != 0:
        sys.stderr.write(output[-20000:])
        raise SystemExit(f"{args.mode} sft: axolotl train: exited {done.returncode}")
    state = json.loads((out / f"checkpoint-{args.steps}" / "trainer_state.json").read_text())
    losses = {"sft": [entry["loss"] for entry in state["log_history"] if "loss" in entry]}
    engines = {"sft": "zerotune.engine.Engine (its initialize banner)"} if ENGINE_BANNER in output else {}
    for rank in range(NPROC):  # the HF Trainer logs the ranks' mean loss
        print_row({"rank": rank, "mode": args.mode, "losses": losses, "engines": engines, "stopped": stopped})


def main() -> None:
    parser = case_parser(__doc__, METHODS)
    parser.add_argument("--data", default=None)
    parser.add_argument("--past-cpu-stop", default=None, metavar="CONFIG", help="(internal) one rank, past it")
    args = parser.parse_args()
    if args.past_cpu_stop:
        past_cpu_stop(args.past_cpu_stop)
        return
    if args.worker:
        worker(args)
        return

    import importlib.metadata
    import tempfile

    def prepare(directory: Path) -> list[str]:
        model = make_tiny_llama(directory / "tiny-llama")
        return ["--model", str(model), "--data", str(write_data(directory / "data")), "--steps", str(args.steps)]

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="zerotune-axolotl-"))
    summary = drive("axolotl", importlib.metadata.version("axolotl"), Path(__file__).resolve(), METHODS, prepare,
                    workdir, args.timeout, launch=one_process)  # axolotl starts its own torchrun
    stops = sorted({stop for mode in MODES for stop in [summary.get(f"{mode}_stopped")] if stop})
    print(line(summary, stops) if args.line else json.dumps({**summary, "stopped": stops}))


def line(summary: dict, stops: list[str]) -> str:
    """scripts/ecosystem_check.sh's line: where axolotl stops on CPU, then its runs past that point."""
    text = summarize(summary)
    if not stops:
        return text
    head, _, rest = text.partition(": ")
    return (f"{head}: `axolotl train` on 2 CPU ranks stops in axolotl's own code, at a CUDA assumption: "
            f"{' / '.join(stops)}; past them (device_map {{\"\": \"cpu\"}}, TrainingArguments use_cpu=True;"
            f" every mode, its non-DeepSpeed run too): {rest}")


if __name__ == "__main__":
    main()
