"""The rest of the DeepSpeed surface clients use, through ``import deepspeed`` paths: groups, ZeRO-3 leaf
modules and external parameters, the RNG tracker, DeepSpeedConfig, the engine's members, refusals."""

import argparse
import json

import torch
from torch import nn

import deepspeed
from deepspeed.checkpointing import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.zero.partition_parameters import register_external_parameter
from deepspeed.utils import groups, set_z3_leaf_modules

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
deepspeed.init_distributed()
out = {"rank": deepspeed.comm.get_rank()}

config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": float("inf"),
          "wall_clock_breakdown": False, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                                "max_live_parameters": 1e9, "cpu_offload": False},
          "checkpoint": {"tag_validation": "Fail"}}
out["ds_config"] = [DeepSpeedConfig(config).train_batch_size, DeepSpeedConfig(config).zero_optimization_stage]


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts[int(x.sum() > 0)](x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.moe, self.out = nn.Linear(4, 4), Experts(), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = self.moe(torch.tanh(self.inp(x))) @ self.inp.weight
        return nn.functional.mse_loss(self.out(hidden), y)


torch.manual_seed(0)
net = Net()
out["leaves"] = len(set_z3_leaf_modules(net, [Experts]))
register_external_parameter(net.moe, net.inp.weight)
engine, optimizer, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
out["groups"] = [groups._get_data_parallel_world_size(), groups._get_model_parallel_world_size()]
out["members"] = [engine.optimizer_name(), engine.wall_clock_breakdown(), engine.get_loss_scale(),
                  engine.zero_optimization_partition_gradients(), engine.zero_gather_16bit_weights_on_model_save(),
                  torch.distributed.get_world_size(engine.get_data_parallel_group())]
hooked = []
engine.register_post_step_hook(lambda e: hooked.append(e.global_steps))
for micro in range(4):
    g = torch.Generator().manual_seed(micro + 10 * out["rank"])
    engine.set_gradient_accumulation_boundary(micro % 2 == 1)
    loss = engine(torch.randn(2, 4, generator=g), torch.randn(2, 1, generator=g))
    returned = engine.backward(loss)
    engine.step()
out["backward_returns"] = abs(returned.item() - loss.item() / 2) < 1e-7
out["steps"], out["hooked"] = engine.global_steps, hooked
out["samples_per_sec"] = engine.tput_timer.avg_samples_per_sec() >= 0
engine.set_train_batch_size(16)
out["gas"] = engine.gradient_accumulation_steps()
evals = iter([(torch.ones(2, 4), torch.zeros(2, 1))] * 4)
out["eval"] = engine.eval_batch(evals).item() > 0
try:
    with engine.no_sync():
        pass
except RuntimeError as error:
    out["no_sync"] = str(error).split(",")[0]
model_parallel_cuda_manual_seed(5)
with get_cuda_rng_tracker().fork():
    torch.rand(1)
try:
    deepspeed.DeepSpeedTransformerLayer(net)
except ImportError as error:
    out["refused"] = str(error)
print(json.dumps(out))
