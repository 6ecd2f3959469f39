"""A ZeRO-3 DeepSpeed script: zero.Init, GatheredParameters, ds_* attributes, save_16bit_model."""

import argparse
import json

import torch
from torch import nn

import deepspeed
from deepspeed.runtime.zero.partition_parameters import GatheredParameters

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--out", required=True)
args = parser.parse_args()
config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                "stage3_gather_16bit_weights_on_model_save": True}, "steps_per_print": 100}
deepspeed.init_distributed()
torch.manual_seed(0)
with deepspeed.zero.Init(config_dict_or_path=config):
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
has_ds = all(hasattr(p, "ds_id") and p.ds_numel == p.numel() for p in model.parameters())
with GatheredParameters(model[0].weight, modifier_rank=0):
    if deepspeed.comm.get_rank() == 0:
        with torch.no_grad():
            model[0].weight.mul_(0.5)
engine, *_ = deepspeed.initialize(model=model, config=config)
losses = []
for step in range(3):
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(step + deepspeed.comm.get_rank()))
    loss = engine(x).square().mean()
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
saved = engine.save_16bit_model(args.out, "model.safetensors")
print(json.dumps({"rank": deepspeed.comm.get_rank(), "has_ds": has_ds, "saved": saved, "losses": losses,
                  "stage": engine.zero_optimization_stage()}))
