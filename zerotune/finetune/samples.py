"""Generated answers at each evaluation of a causal-LM run: what the loss curve cannot show.

A few fixed prompts (``train.sample_prompts``, else the first ``train.eval_samples`` conversations of the
eval set, cut before their last answer) are answered greedily at every evaluation; rank 0 prints them and
appends them to ``OUTPUT/samples.jsonl``. Decoding calls the engine's own forward, token by token, on
every rank: under ZeRO 3 each forward gathers the partitioned weights, so every rank must run the same
forwards. The ranks agree to stop through one tiny all-reduce per token, so a numerical difference
between ranks can never leave one rank decoding alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerotune.distributed import comm
from zerotune.finetune.generation import encode_prompt
from zerotune.monitor.logging import log_rank0


def sample_conversations(rows: Any, prompts: list[str] | None, count: int) -> list[list[dict[str, str]]]:
    """The conversations to answer: ``prompts`` as single user turns, else the first ``count`` eval rows
    that hold a question (prompt/response pairs, chat messages); plain-text and token rows hold none."""
    if prompts is not None:
        return [[{"role": "user", "content": prompt}] for prompt in prompts]
    conversations: list[list[dict[str, str]]] = []
    columns = set(getattr(rows, "column_names", []) or [])
    for index in range(len(rows) if columns & {"prompt", "messages"} else 0):
        if len(conversations) == count:
            break
        row = rows[index]
        if "prompt" in columns:
            conversations.append([{"role": "user", "content": row["prompt"]}])
            continue
        turns = [{"role": turn["role"], "content": turn["content"]} for turn in row["messages"]]
        last_answer = max((i for i, turn in enumerate(turns) if turn["role"] == "assistant"), default=0)
        if last_answer > 0:
            conversations.append(turns[:last_answer])
    return conversations


@torch.no_grad()
def greedy_answer(engine: Any, tokenizer: Any, conversation: list[dict[str, str]], max_new_tokens: int) -> str:
    """Greedy decoding through ``engine(...)`` (no cache: every step re-runs the prompt, which for a few short
    samples per evaluation costs less than a second path through the model would)."""
    encoded = encode_prompt(tokenizer, conversation)
    ids = encoded["input_ids"].to(engine.device)
    prompt_length = ids.shape[1]
    eos = tokenizer.eos_token_id
    group = engine.mesh.group("dp")
    for _ in range(max_new_tokens):
        logits = engine(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        next_id = logits[:, -1].float().argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_id.to(ids.dtype)], dim=1)
        going = torch.tensor([0.0 if eos is not None and next_id.item() == eos else 1.0], device=engine.device)
        comm.all_reduce(going, group)  # every rank stops when all do (they decode the same tokens)
        if going.item() == 0.0:
            break
    return tokenizer.decode(ids[0, prompt_length:], skip_special_tokens=True).strip()


@dataclass
class EvalSamples:
    """Answers every rank computes at each evaluation; rank 0 prints and records them."""

    conversations: list[list[dict[str, str]]]
    tokenizer: Any
    max_new_tokens: int
    path: Path | None  # OUTPUT/samples.jsonl on rank 0

    def __call__(self, engine: Any, step: int) -> list[dict[str, str]]:
        if not self.conversations:
            return []
        was_training = engine.module.training
        engine.eval()
        answers = [{"prompt": conversation[-1]["content"],
                    "answer": greedy_answer(engine, self.tokenizer, conversation, self.max_new_tokens)}
                   for conversation in self.conversations]
        if was_training:
            engine.train()
        for sample in answers:
            log_rank0("sample at step %d: %r -> %r", step, sample["prompt"], sample["answer"], rank=engine.global_rank)
        if self.path is not None:
            with open(self.path, "a") as handle:
                for sample in answers:
                    handle.write(json.dumps({"step": step, **sample}) + "\n")
        return answers
