"""A DeepSpeed-style script (unmodified DeepSpeed API): accelerator queries and deepspeed.comm collectives."""

import argparse
import json

import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import groups, log_dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()

deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
accelerator = get_accelerator()
device = torch.device(accelerator.device_name(), 0) if accelerator.device_name() == "cuda" else torch.device("cpu")
accelerator.manual_seed(1234)
tensor = torch.ones(4, device=device) * (dist.get_rank() + 1)
dist.all_reduce(tensor)
gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, torch.tensor([float(dist.get_rank())]))
dist.barrier()
log_dist("collectives done", ranks=[0])
print(json.dumps({"rank": dist.get_rank(), "local_rank_arg": args.local_rank, "sum": tensor.tolist(),
                  "gathered": [g.item() for g in gathered], "backend": accelerator.communication_backend_name(),
                  "dp": groups._get_data_parallel_world_size(), "version": deepspeed.__version__}))
