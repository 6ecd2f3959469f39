"""accelerate with a DeepSpeedPlugin: unmodified user code (``--plain`` runs it as accelerate's DDP). Each rank
also trains the same model in plain single-process PyTorch on the same global batches, for comparison."""

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
def new_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def plain_pytorch_losses(batches: list[dict], world: int) -> list[float]:
    """One process, plain PyTorch: step i averages the losses of batches i*world .. i*world+world-1
    (accelerate hands process r every world-th batch starting at r), clips at 1.0, AdamW."""
    reference = new_model()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)
    losses = []
    for step in range(len(batches) // world):
        loss = sum(reference(**b).loss for b in batches[step * world:(step + 1) * world]) / world
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        losses.append(loss.item())
    return losses


model = new_model()
ids = torch.randint(0, 96, (32, 16), generator=torch.Generator().manual_seed(1))
samples = [{"input_ids": r, "labels": r} for r in ids]
loader = torch.utils.data.DataLoader(samples, batch_size=2)
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
reference = plain_pytorch_losses(list(torch.utils.data.DataLoader(samples, batch_size=2)), accelerator.num_processes)
print(json.dumps({"rank": accelerator.process_index, "losses": losses, "reference": reference,
                  "engine": type(model).__module__ + "." + type(model).__name__,
                  "distributed_type": str(accelerator.distributed_type)}))
