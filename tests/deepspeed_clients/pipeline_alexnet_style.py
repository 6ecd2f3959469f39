"""A DeepSpeedExamples-pipeline-style script: PipelineModule over a topology, train_batch on a RepeatingLoader."""

import argparse
import json

import torch
from torch import nn

import deepspeed
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
from deepspeed.utils import RepeatingLoader

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
deepspeed.init_distributed()

torch.manual_seed(0)
layers = [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)]
topology = PipeDataParallelTopology(num_pp=2, num_dp=deepspeed.comm.get_world_size() // 2)
model = PipelineModule(layers=layers, topology=topology, loss_fn=nn.CrossEntropyLoss(), partition_method="uniform")
data = [(torch.randn(8, generator=torch.Generator().manual_seed(i)), i % 4) for i in range(64)]
engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                            training_data=data)
losses = [engine.train_batch(data_iter=RepeatingLoader(loader)).item() for _ in range(4)]
print(json.dumps({"rank": deepspeed.comm.get_rank(), "losses": losses, "stages": engine.mpu.get_pipe_parallel_world_size()}))
