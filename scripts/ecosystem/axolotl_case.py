"""axolotl on zerotune: ``axolotl train`` (LoRA SFT on the tiny Llama, a tiny local alpaca-format dataset) on 2
CPU ranks with ``deepspeed:`` ZeRO 2 and ZeRO 3 configs against axolotl's own non-DeepSpeed run, logged losses
compared to 1e-5.

    python scripts/ecosystem/axolotl_case.py [--workdir DIR] [--steps N]

prints one JSON summary line (scripts/ecosystem/common.py ``drive``); ``--line`` the one-line form.
axolotl launches its own torchrun (``--launcher torchrun -- --nproc_per_node 2``): the worker here is one
process per mode that runs the CLI and reads the losses from the last checkpoint's trainer_state.json; a
zerotune engine is recognised by the banner zerotune logs at ``initialize``.

Not run in this environment: axolotl 0.19.0 pins transformers==5.16.1, accelerate==1.13.0, peft==0.20.0,
datasets==4.8.4, trl==1.9.0 (and more; scripts/ecosystem_check.sh prints every pin this environment does
not meet) and requires triton, xformers, bitsandbytes and liger-kernel on Linux, none of which is installed
here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    ENGINE_BANNER, NPROC, _free_port, case_parser, deepspeed_config, drive_and_print, make_tiny_llama,
    one_process, print_mean_rows, run_cli)

METHODS = ("sft",)


def write_data(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    rows = [{"instruction": f"what color is the {thing}", "input": "", "output": f"the {thing} is {color}"}
            for thing, color in [("sky", "blue"), ("grass", "green"), ("snow", "white"), ("coal", "black"),
                                 ("sun", "yellow")] * 4]
    (directory / "tiny_sft.json").write_text(json.dumps(rows))
    for mode in ("zero2", "zero3"):
        (directory / f"{mode}.json").write_text(json.dumps(deepspeed_config(mode), indent=2))
    return directory


def train_config(mode: str, model: str, data: Path, out: Path, steps: int) -> dict:
    """The YAML an axolotl user writes for a LoRA run (fp32, CPU, a loss logged every step)."""
    config = {"base_model": model, "datasets": [{"path": str(data / "tiny_sft.json"), "ds_type": "json",
                                                 "type": "alpaca"}],
              "dataset_prepared_path": str(out / "prepared"), "val_set_size": 0.0, "output_dir": str(out),
              "adapter": "lora", "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "lora_target_linear": True,
              "sequence_len": 32, "sample_packing": False, "pad_to_sequence_len": False,
              "micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": steps, "num_epochs": 1,
              "optimizer": "adamw_torch", "lr_scheduler": "constant", "learning_rate": 1e-3, "warmup_steps": 0,
              "weight_decay": 0.0, "bf16": False, "fp16": False, "tf32": False, "seed": 0, "logging_steps": 1,
              "save_strategy": "steps", "save_steps": steps, "save_only_model": True, "flash_attention": False,
              "use_cpu": True, "special_tokens": {}}
    if mode != "ddp":
        config["deepspeed"] = str(data / f"{mode}.json")
    return config


def worker(args: argparse.Namespace) -> None:
    out = Path(args.out) / "sft"
    out.mkdir(parents=True, exist_ok=True)
    config = out / "train.yml"  # JSON is YAML
    config.write_text(json.dumps(train_config(args.mode, args.model, Path(args.data), out, args.steps)))
    output = run_cli(["axolotl", "train", str(config), "--launcher", "torchrun", "--",
                      "--nproc_per_node", str(NPROC), "--master_port", str(_free_port())],
                     {"CUDA_VISIBLE_DEVICES": "", "AXOLOTL_DO_NOT_TRACK": "1"}, f"{args.mode} sft: axolotl train")
    state = json.loads((out / f"checkpoint-{args.steps}" / "trainer_state.json").read_text())
    losses = {"sft": [entry["loss"] for entry in state["log_history"] if "loss" in entry]}
    engines = {"sft": "zerotune.engine.Engine (its initialize banner)"} if ENGINE_BANNER in output else {}
    print_mean_rows(args.mode, losses, engines)  # the HF Trainer logs the ranks' mean loss


def main() -> None:
    parser = case_parser(__doc__, METHODS)
    parser.add_argument("--data", default=None)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    import importlib.metadata

    def prepare(directory: Path) -> list[str]:
        model = make_tiny_llama(directory / "tiny-llama")
        return ["--model", str(model), "--data", str(write_data(directory / "data")), "--steps", str(args.steps)]

    drive_and_print("axolotl", importlib.metadata.version("axolotl"), args, Path(__file__).resolve(), METHODS, prepare,
                    launch=one_process)  # axolotl starts its own torchrun


if __name__ == "__main__":
    main()
