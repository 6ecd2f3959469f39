"""A DeepSpeedExamples-style script with a seqlen curriculum (the legacy ``curriculum_learning`` block).

A Hugging Face GPT-2, whose forward has no ``curriculum_seqlen``, trains on 16-token rows from
``deepspeed.initialize(training_data=...)``; the engine cuts each batch to the scheduled length.
Each rank reports the lengths its model saw and the schedule ``CurriculumScheduler`` computes
from the same block, then saves, reloads and reports the difficulty it resumed at.
"""

import argparse
import json

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import deepspeed
from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 96, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "attention_mask": torch.ones(16, dtype=torch.long), "labels": ids}


parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--save_dir", type=str, required=True)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
deepspeed.init_distributed()

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=96, n_positions=16))
engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                            training_data=Tokens())
seen = []
model.register_forward_pre_hook(lambda module, a, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
data = iter(deepspeed.utils.RepeatingLoader(loader))
losses = []
for _ in range(args.steps * engine.gradient_accumulation_steps()):
    batch = {k: v.to(engine.device) for k, v in next(data).items()}
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())

with open(args.deepspeed_config) as file:
    block = json.load(file)["curriculum_learning"]
schedule = CurriculumScheduler(block)
expected = [schedule.update_difficulty(step) for step in range(1, args.steps + 1)
            for _ in range(engine.gradient_accumulation_steps())]
reached = engine.curriculum_scheduler_legacy.get_current_difficulty()
engine.save_checkpoint(args.save_dir, tag="end")
engine.curriculum_scheduler_legacy.set_current_difficulty(block["min_difficulty"])
engine.load_checkpoint(args.save_dir, tag="end")
print(json.dumps({"rank": deepspeed.comm.get_rank(), "enabled": engine.curriculum_enabled_legacy(),
                  "type": engine.curriculum_params_legacy()["curriculum_type"], "seen": seen, "expected": expected,
                  "reached": reached, "resumed": engine.curriculum_scheduler_legacy.get_current_difficulty(),
                  "finite": all(loss == loss for loss in losses)}))
