"""A HelloDeepSpeed-BERT-style script: grouped parameters with their own weight decay, the config
from a dict, ``model.backward`` / ``model.step``, checkpoints with client state and a reload."""

import argparse
import json

import torch
from transformers import BertConfig, BertForMaskedLM

import deepspeed
from deepspeed.utils import log_dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--checkpoint_dir", required=True)
args = parser.parse_args()

torch.manual_seed(0)
model = BertForMaskedLM(BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=32))
no_decay = ["bias", "LayerNorm.weight"]
grouped = [{"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
            "weight_decay": 0.01},
           {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0}]
ds_config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 2,
             "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2},
             "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                          "warmup_num_steps": 2}}}
model, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=grouped, config=ds_config)
losses = []
for step in range(8):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 96, (4, 16), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    model.backward(loss)
    model.step()
    losses.append(loss.item())
    if step % 4 == 3:
        log_dist(f"step {step}: loss {loss.item():.4f}", ranks=[0])
model.save_checkpoint(args.checkpoint_dir, client_state={"last_step": 8, "data_position": 64})
_, client_state = model.load_checkpoint(args.checkpoint_dir)
print(json.dumps({"rank": deepspeed.comm.get_rank(), "losses": losses, "client_state": client_state,
                  "lr": scheduler.get_last_lr(), "global_steps": model.global_steps,
                  "groups": [g["weight_decay"] for g in optimizer.param_groups]}))
