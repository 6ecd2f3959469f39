"""An RLHF-shaped DeepSpeed script (DeepSpeed-Chat step 3 / TRL style) using the names added for tools built on
DeepSpeed: a policy engine trained at ZeRO 2 whose optimizer state leaves the device while it "generates"
(offload_states / reload_states), a frozen reference engine at ZeRO 3 configured the way TRL does (dotted
top-level keys, no optimizer, empty_partition_cache between phases), full gradients read through
deepspeed.utils.safe_get_full_grad, the logger level set as Lightning does, and get_accelerator from the top
level. The same loop without offloading runs first; each rank prints one JSON row."""

import argparse
import json
import logging

import torch
from torch import nn

import deepspeed
from deepspeed import get_accelerator
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from deepspeed.utils import safe_get_full_grad

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
deepspeed.init_distributed()
deepspeed.utils.logging.logger.setLevel(logging.WARNING)
rank, device = deepspeed.comm.get_rank(), get_accelerator().current_device_name()


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))


def run(offload: bool) -> dict:
    policy_config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                     "zero_optimization": {"stage": 2}, "steps_per_print": 1000}
    reference_config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
                        "zero_optimization.stage3_param_persistence_threshold": 0,
                        "zero_optimization.reduce_bucket_size": 64, "steps_per_print": 1000}
    policy_model, reference_model = net(0), net(1)
    policy, *_ = deepspeed.initialize(model=policy_model, model_parameters=policy_model.parameters(),
                                      config=policy_config)
    reference, *_ = deepspeed.initialize(model=reference_model, config=reference_config)
    reference.eval()
    losses, grad_norms = [], []
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + rank)
        prompts = torch.randn(2, 8, generator=g).to(device)
        if offload:  # generation: the optimizer side of the policy is not needed
            policy.offload_states(include=[OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params],
                                  device=OffloadDeviceEnum.cpu)
        with torch.no_grad():
            responses = torch.tanh(policy(prompts))
            target = reference(responses)
        reference.empty_partition_cache()
        if offload:
            policy.reload_states()
        loss = nn.functional.mse_loss(policy(responses), target)
        policy.backward(loss)
        grad_norms.append(float(safe_get_full_grad(policy_model[0].weight).norm()))
        policy.step()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": grad_norms}


plain, offloaded = run(False), run(True)
print(json.dumps({"rank": rank, "plain": plain, "offloaded": offloaded, "equal": plain == offloaded}), flush=True)
