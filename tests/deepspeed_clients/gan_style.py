"""A DeepSpeedExamples-GAN-style script: two engines (generator and discriminator) in one process,
trained alternately, unmodified DeepSpeed API."""

import argparse
import json

import torch
from torch import nn

import deepspeed
from deepspeed.accelerator import get_accelerator

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--stage", type=int, default=1)
args = parser.parse_args()
deepspeed.init_distributed()
config = {"train_batch_size": 8, "steps_per_print": 100, "zero_optimization": {"stage": args.stage},
          "optimizer": {"type": "Adam", "params": {"lr": 2e-3, "betas": [0.5, 0.999]}}}
torch.manual_seed(0)
generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
gen_engine, _, _, _ = deepspeed.initialize(model=generator, model_parameters=generator.parameters(), config=config)
disc_engine, _, _, _ = deepspeed.initialize(model=discriminator, model_parameters=discriminator.parameters(),
                                            config=config)
device = get_accelerator().current_device_name()
criterion = nn.BCEWithLogitsLoss()
rows = gen_engine.train_micro_batch_size_per_gpu()
g_losses, d_losses = [], []
for step in range(5):
    g = torch.Generator().manual_seed(step * 10 + deepspeed.comm.get_rank())
    real = torch.randn(rows, 8, generator=g).to(device) + 2.0
    noise = torch.randn(rows, 4, generator=g).to(device)
    fake = gen_engine(noise)
    d_loss = criterion(disc_engine(real), torch.ones(rows, 1)) + criterion(disc_engine(fake.detach()),
                                                                           torch.zeros(rows, 1))
    disc_engine.backward(d_loss)
    disc_engine.step()
    g_loss = criterion(disc_engine(fake), torch.ones(rows, 1))
    gen_engine.backward(g_loss)
    gen_engine.step()
    disc_engine.zero_grad()  # the generator's backward also reached the discriminator's parameters
    g_losses.append(g_loss.item())
    d_losses.append(d_loss.item())
print(json.dumps({"rank": deepspeed.comm.get_rank(), "g": g_losses, "d": d_losses,
                  "steps": [gen_engine.global_steps, disc_engine.global_steps]}))
