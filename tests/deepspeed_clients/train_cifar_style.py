"""A DeepSpeedExamples-CIFAR-style training script, unmodified DeepSpeed API; checks parity itself.

Ranks train a small conv net with ``deepspeed.initialize(args=..., training_data=...)`` and the
config from ``--deepspeed_config``; rank 0 also trains the same net in plain PyTorch on the
same global batches and prints both loss traces.
"""

import argparse
import json

import torch
from torch import nn

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.ops.adam import FusedAdam
from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES, WarmupLR
from deepspeed.runtime.utils import set_random_seed
from deepspeed.utils import RepeatingLoader, log_dist


def net() -> nn.Module:
    set_random_seed(42)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                         nn.Linear(16, 10))


class Cifar(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return torch.randn(3, 8, 8, generator=g), int(torch.randint(0, 10, (1,), generator=g))


parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--save_dir", type=str, required=True)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
deepspeed.init_distributed()

model = net()
optimizer = FusedAdam(model.parameters(), lr=0.01)
scheduler = WarmupLR(optimizer, warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=3)
assert "WarmupLR" in VALID_LR_SCHEDULES
engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=model, optimizer=optimizer,
                                                            lr_scheduler=scheduler, training_data=Cifar())
device = get_accelerator().current_device_name()
criterion = nn.CrossEntropyLoss()
losses = []
data = RepeatingLoader(loader)
for step in range(args.steps * engine.gradient_accumulation_steps()):
    inputs, labels = next(data)
    loss = criterion(engine(inputs.to(device)), labels.to(device))
    engine.backward(loss)
    engine.step()
    total = loss.detach().clone()
    deepspeed.comm.all_reduce(total)
    losses.append(total.item() / deepspeed.comm.get_world_size())
log_dist(f"trained {engine.global_steps} steps", ranks=[0])
engine.save_checkpoint(args.save_dir, tag="final")
state = clone_tensors_for_torch_save(engine.module.state_dict())
_, client = engine.load_checkpoint(args.save_dir, tag="final")

reference = []
if deepspeed.comm.get_rank() == 0:  # plain PyTorch on the same global batches
    ref = net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.0)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0)
    ref_wu = WarmupLR(ref_opt, warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=3)
    world, micro, gas = deepspeed.comm.get_world_size(), engine.train_micro_batch_size_per_gpu(), \
        engine.gradient_accumulation_steps()
    samplers = [torch.utils.data.DistributedSampler(Cifar(), num_replicas=world, rank=r) for r in range(world)]
    orders = [list(s) for s in samplers]
    dataset = Cifar()
    for step in range(args.steps):
        micro_losses = []
        for m in range(gas):
            index = (step * gas + m) * micro
            rows = [dataset[orders[r][(index + k) % len(orders[r])]] for r in range(world) for k in range(micro)]
            x = torch.stack([r[0] for r in rows])
            y = torch.tensor([r[1] for r in rows])
            per_rank = [criterion(ref(x[r * micro:(r + 1) * micro]), y[r * micro:(r + 1) * micro]) for r in range(world)]
            loss = sum(per_rank) / world
            (loss / gas).backward()
            micro_losses.append(loss.item())
        ref_opt.step()
        ref_wu.step()
        ref_opt.zero_grad()
        reference.extend(micro_losses)
print(json.dumps({"rank": deepspeed.comm.get_rank(), "losses": losses, "reference": reference,
                  "steps": engine.global_steps, "keys": sorted(state)[:2]}))
