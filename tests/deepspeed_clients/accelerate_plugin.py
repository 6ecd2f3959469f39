"""accelerate with a DeepSpeedPlugin: unmodified user code (``--plain`` is the DDP baseline)."""

import argparse
import json

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DeepSpeedPlugin
from transformers import GPT2Config, GPT2LMHeadModel

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--stage", type=int, default=2)
parser.add_argument("--plain", action="store_true")
args = parser.parse_args()

PartialState(cpu=True)  # gloo on a CPU-only host, as TrainingArguments(use_cpu=True) sets it up
plugin = None if args.plain else DeepSpeedPlugin(zero_stage=args.stage, gradient_accumulation_steps=1,
                                                 gradient_clipping=1.0)
accelerator = Accelerator(deepspeed_plugin=plugin)
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0))
ids = torch.randint(0, 96, (32, 16), generator=torch.Generator().manual_seed(1))
loader = torch.utils.data.DataLoader([{"input_ids": r, "labels": r} for r in ids], batch_size=2)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
losses = []
for batch in loader:
    loss = model(**batch).loss
    accelerator.backward(loss)
    if args.plain:
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
print(json.dumps({"rank": accelerator.process_index, "losses": losses,
                  "engine": type(model).__module__ + "." + type(model).__name__,
                  "distributed_type": str(accelerator.distributed_type)}))
