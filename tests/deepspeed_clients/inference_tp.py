"""A DeepSpeedExamples-style inference script (unmodified DeepSpeed API): tensor-parallel generation.

As DeepSpeedExamples' ``inference/huggingface/text-generation``: every rank builds the model, ``init_inference``
splits it over ``WORLD_SIZE`` ranks, then ``engine.generate`` and a transformers pipeline whose model was
replaced by the engine. A tiny randomly initialized GPT-2 / Llama and a word-level tokenizer: no downloads.
"""

import argparse
import copy
import json
import os

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                          pipeline)

import deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
args = parser.parse_args()

local_rank = int(os.getenv("LOCAL_RANK", "0"))
world_size = int(os.getenv("WORLD_SIZE", "1"))

torch.manual_seed(0)
if args.model == "gpt2":
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=64,
                                       bos_token_id=0, eos_token_id=0))
else:
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=96,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         bos_token_id=0, eos_token_id=0))
model.eval()
words = {f"w{i}": i for i in range(96)}
backend = Tokenizer(models.WordLevel(words, unk_token="w1"))
backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="w0", pad_token="w0", unk_token="w1")

prompt = torch.tensor([[5, 17, 42, 8, 77, 3]])
settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
unsplit = copy.deepcopy(model)
reference = unsplit.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
reference_text = pipeline("text-generation", model=unsplit, tokenizer=tokenizer)("w5 w17 w42", **settings)

generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
generator.model = deepspeed.init_inference(generator.model, tensor_parallel={"tp_size": world_size},
                                           dtype=torch.float32, replace_with_kernel_inject=True)
engine = generator.model
tokens = engine.generate(prompt, attention_mask=torch.ones_like(prompt), **settings)
text = generator("w5 w17 w42", **settings)
print(json.dumps({"rank": deepspeed.comm.get_rank(), "mp_world_size": engine.mp_world_size,
                  "vocab_rows": engine.module.lm_head.weight.shape[0], "tokens": tokens.tolist(),
                  "reference": reference.tolist(), "pipeline": text, "reference_text": reference_text}))
