"""LLaMA-Factory on zerotune: ``llamafactory-cli train`` (LoRA SFT and LoRA DPO on the tiny Llama, a tiny local
dataset registered through a dataset_info.json) on 2 CPU ranks with LLaMA-Factory's shipped DeepSpeed configs
(examples/deepspeed/ds_z2_config.json / ds_z3_config.json, written out below as shipped) against its own
non-DeepSpeed run, logged losses compared to 1e-5.

    python scripts/ecosystem/llamafactory_case.py [--workdir DIR] [--methods sft,dpo] [--steps N]

prints one JSON summary line (scripts/ecosystem/common.py ``drive``); ``--line`` the one-line form.
LLaMA-Factory launches its own torchrun (FORCE_TORCHRUN=1, NPROC_PER_NODE=2): the worker here is one
process per mode that runs the CLI once per method and reads the losses from LLaMA-Factory's
trainer_log.jsonl; a zerotune engine is recognised by the banner zerotune logs at ``initialize``.

Stops on CPU torch 2.13 before training: llamafactory/data/mm_plugin.py:30 imports torchaudio unconditionally
(every stage's template imports mm_plugin), and torchaudio has no release for torch 2.13 (its newest, 2.11.1,
installs but its _torchaudio.so does not load); scripts/ecosystem_check.sh prints it as NOT INSTALLABLE.
LLaMA-Factory launches `torchrun` from PATH: the venv that scripts/ecosystem_check.sh builds has one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    ENGINE_BANNER, NPROC, _free_port, case_parser, drive_and_print, make_tiny_llama, one_process,
    print_mean_rows, run_cli)

METHODS = ("sft", "dpo")


def shipped_config(stage: int) -> dict:
    """examples/deepspeed/ds_z{2,3}_config.json of LLaMA-Factory 0.9.5 ("auto"s filled in by the HF Trainer)."""
    zero = ({"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 5e8, "overlap_comm": False,
             "reduce_scatter": True, "reduce_bucket_size": 5e8, "contiguous_gradients": True,
             "round_robin_gradients": True} if stage == 2 else
            {"stage": 3, "overlap_comm": False, "contiguous_gradients": True, "sub_group_size": 1e9,
             "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
             "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
             "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True})
    return {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
            "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                     "hysteresis": 2, "min_loss_scale": 1},
            "bf16": {"enabled": "auto"}, "zero_optimization": zero, "comms_config": {"verbose": False},
            "monitor_config": {"enabled": True, "tag": "DeepSpeedMonitor", "csv_monitor": {"enabled": False}}}


def write_data(directory: Path) -> Path:
    """A tiny alpaca-format SFT set and a ranking (DPO) set, registered in DIRECTORY/dataset_info.json."""
    directory.mkdir(parents=True, exist_ok=True)
    pairs = [("sky", "blue", "green"), ("grass", "green", "white"), ("snow", "white", "black"),
             ("coal", "black", "yellow"), ("sun", "yellow", "blue")] * 4
    sft = [{"instruction": f"what color is the {thing}", "input": "", "output": f"the {thing} is {good}"}
           for thing, good, _ in pairs]
    dpo = [{"instruction": f"what color is the {thing}", "input": "", "chosen": f"the {thing} is {good}",
            "rejected": f"the {thing} is {bad}"} for thing, good, bad in pairs]
    (directory / "tiny_sft.json").write_text(json.dumps(sft))
    (directory / "tiny_dpo.json").write_text(json.dumps(dpo))
    (directory / "dataset_info.json").write_text(json.dumps({
        "tiny_sft": {"file_name": "tiny_sft.json"},
        "tiny_dpo": {"file_name": "tiny_dpo.json", "ranking": True,
                     "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen",
                                 "rejected": "rejected"}}}))
    for stage in (2, 3):
        (directory / f"ds_z{stage}_config.json").write_text(json.dumps(shipped_config(stage), indent=2))
    return directory


def train_args(method: str, mode: str, model: str, data: Path, out: Path, steps: int) -> dict:
    """The YAML a LLaMA-Factory user writes for a LoRA run (fp32, CPU, a loss logged every step)."""
    args = {"model_name_or_path": model, "stage": method, "do_train": True, "finetuning_type": "lora",
            "lora_rank": 8, "lora_target": "all", "dataset": f"tiny_{method}", "dataset_dir": str(data),
            "template": "default", "cutoff_len": 32, "overwrite_cache": True, "output_dir": str(out),
            "overwrite_output_dir": True, "logging_steps": 1, "save_strategy": "no", "plot_loss": False,
            "report_to": "none", "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
            "learning_rate": 1e-3, "max_steps": steps, "lr_scheduler_type": "constant", "warmup_ratio": 0.0,
            "bf16": False, "fp16": False, "seed": 0, "data_seed": 0, "ddp_timeout": 600, "use_cpu": True,
            "dataloader_drop_last": True}
    if method == "dpo":
        args.update(pref_beta=0.1, pref_loss="sigmoid")
    if mode != "ddp":
        args["deepspeed"] = str(data / f"ds_z{mode.removeprefix('zero')}_config.json")
    return args


def worker(args: argparse.Namespace) -> None:
    losses, engines = {}, {}
    for method in args.methods.split(","):
        out = Path(args.out) / method
        out.mkdir(parents=True, exist_ok=True)
        config = out / "train.json"  # llamafactory-cli train reads .yaml and .json files alike
        config.write_text(json.dumps(train_args(method, args.mode, args.model, Path(args.data), out, args.steps)))
        env = {"FORCE_TORCHRUN": "1", "NNODES": "1", "NPROC_PER_NODE": str(NPROC), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(_free_port()), "CUDA_VISIBLE_DEVICES": ""}
        output = run_cli(["llamafactory-cli", "train", str(config)], env,
                         f"{args.mode} {method}: llamafactory-cli train")
        log = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines() if line.strip()]
        losses[method] = [entry["loss"] for entry in log if "loss" in entry]
        if ENGINE_BANNER in output:
            engines[method] = "zerotune.engine.Engine (its initialize banner)"
    print_mean_rows(args.mode, losses, engines)  # LLaMA-Factory logs the ranks' mean loss


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
        data = write_data(directory / "data")
        return ["--model", str(model), "--data", str(data), "--methods", args.methods, "--steps", str(args.steps)]

    drive_and_print("llamafactory", importlib.metadata.version("llamafactory"), args, Path(__file__).resolve(),
                    tuple(args.methods.split(",")), prepare, launch=one_process)  # its CLI starts its torchrun


if __name__ == "__main__":
    main()
