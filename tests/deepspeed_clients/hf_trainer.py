"""Hugging Face Trainer with TrainingArguments(deepspeed=...): unmodified user code (run it with
``zerotune run --as-deepspeed``; without ``--stage`` it is the plain DDP baseline)."""

import argparse
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--stage", type=int, default=None)
parser.add_argument("--offload", action="store_true")
parser.add_argument("--config_optimizer", action="store_true")
parser.add_argument("--pretrained", default=None)
parser.add_argument("--out", required=True)
parser.add_argument("--max_steps", type=int, default=6)
parser.add_argument("--resume", default=None)
args = parser.parse_args()

ds_config = None
if args.stage is not None:
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                 "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                 "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
                 "zero_optimization": {"stage": args.stage, "reduce_bucket_size": "auto",
                                       "stage3_prefetch_bucket_size": "auto",
                                       "stage3_param_persistence_threshold": "auto",
                                       "stage3_gather_16bit_weights_on_model_save": True}}
    if args.offload:
        ds_config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if args.stage == 3:
            ds_config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if args.config_optimizer:
        ds_config["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                              "weight_decay": "auto"}}

training_args = TrainingArguments(
    output_dir=args.out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=args.max_steps,
    learning_rate=1e-3, weight_decay=0.0, warmup_steps=0, lr_scheduler_type="constant", logging_steps=1,
    save_steps=3, save_strategy="steps", use_cpu=True, deepspeed=ds_config, report_to=[], seed=0, data_seed=0,
    max_grad_norm=1.0, dataloader_drop_last=True, disable_tqdm=True)

if args.pretrained:  # under ZeRO-3 this goes through deepspeed.zero.Init (HfDeepSpeedConfig)
    model = GPT2LMHeadModel.from_pretrained(args.pretrained)
    zero_init = all(hasattr(p, "ds_id") for p in model.parameters())  # partitioned as it was built (ZeRO-3)
else:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    zero_init = False
generator = torch.Generator().manual_seed(1)
ids = torch.randint(0, 96, (64, 16), generator=generator)
dataset = [{"input_ids": row, "labels": row} for row in ids]
trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
trainer.train(resume_from_checkpoint=args.resume)
final = os.path.join(args.out, "final")
trainer.save_model(final)
rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
print(json.dumps({"rank": rank, "losses": losses, "deepspeed": trainer.is_deepspeed_enabled, "zero_init": zero_init,
                  "optimizer": type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                                    else trainer.optimizer).__name__,
                  "engine": type(trainer.model_wrapped).__module__ + "." + type(trainer.model_wrapped).__name__,
                  "saved": sorted(os.listdir(final)) if os.path.isdir(final) else [],
                  "checkpoints": sorted(d for d in os.listdir(args.out) if d.startswith("checkpoint"))}))
if torch.distributed.is_initialized():  # leave the process group as a well-behaved DDP script does: a gloo group
    torch.distributed.barrier()         # still alive at interpreter exit can abort the process (SIGABRT)
    torch.distributed.destroy_process_group()
