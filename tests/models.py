"""Tiny models, deterministic data and the single-process PyTorch reference loop for parity tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


class FrozenLayerMLP(nn.Module):
    """An MLP whose middle layer is frozen: it must receive no gradient sync and no optimizer state."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.frozen = nn.Linear(width, width)
        self.out = nn.Linear(width, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.frozen(torch.tanh(self.inp(x))))
        return nn.functional.mse_loss(self.out(hidden).float(), y.float())


def make_mlp(seed: int = 0) -> FrozenLayerMLP:
    torch.manual_seed(seed)
    return FrozenLayerMLP()


def mlp_param_groups(model: FrozenLayerMLP) -> list[dict]:
    """Two groups with their own hyperparameters; the frozen layer is omitted entirely."""
    return [
        {"params": list(model.inp.parameters()), "lr": 0.02, "weight_decay": 0.1},
        {"params": list(model.out.parameters()), "lr": 0.005, "weight_decay": 0.0},
    ]


def mlp_batch(step: int, micro: int, rows: int) -> dict:
    generator = torch.Generator().manual_seed(1000 + 31 * step + micro)
    return {"x": torch.randn(rows, 8, generator=generator), "y": torch.randn(rows, 4, generator=generator)}


def make_gpt2(seed: int = 0, *, heads: int = 2, vocab: int = 96, positions: int = 32, width: int = 32):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=positions, resid_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    return GPT2LMHeadModel(config)


def make_llama(seed: int = 0, *, heads: int = 4, kv_heads: int = 2, positions: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, vocab_size=96, max_position_embeddings=positions,
                         tie_word_embeddings=False, attention_dropout=0.0)
    return LlamaForCausalLM(config)


def make_bert(seed: int = 0):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    return BertForMaskedLM(BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0))


def gpt2_batch(step: int, micro: int, rows: int, seq: int = 16) -> dict:
    generator = torch.Generator().manual_seed(5000 + 31 * step + micro)
    ids = torch.randint(0, 96, (rows, seq), generator=generator)
    return {"input_ids": ids, "labels": ids}


def loss_of(model: nn.Module, batch: dict) -> torch.Tensor:
    out = model(**batch)
    return out if isinstance(out, torch.Tensor) else out.loss


def rank_slice(batch: dict, rank: int, world: int) -> dict:
    """This rank's contiguous share of a global micro-batch."""
    rows = next(iter(batch.values())).shape[0] // world
    return {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()}


@dataclass
class Trace:
    losses: list[float]
    grad_norms: list[float]


def reference_run(model: nn.Module, optimizer: torch.optim.Optimizer, batch_fn, *, steps: int, gas: int,
                  global_rows: int, clip: float) -> Trace:
    """Single-process PyTorch: the numbers every parallel mode must reproduce."""
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for micro in range(gas):
            loss = loss_of(model, batch_fn(step, micro, global_rows))
            (loss / gas).backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(
            [p for p in model.parameters() if p.grad is not None], clip if clip > 0 else float("inf")).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / gas)
    return Trace(losses, norms)


def engine_run(engine, batch_fn, *, steps: int, gas: int, global_rows: int) -> Trace:
    """The same loop through a zerotune engine; losses averaged over the data-parallel ranks.

    Each data-parallel rank takes its slice of the global batch; tensor- and sequence-parallel ranks
    of one replica see the same rows (and report the same loss, so averaging over the world is the
    average over dp)."""
    world = dist.get_world_size()
    dp_rank, dp_world = engine.mesh.rank("dp"), engine.mesh.size("dp")
    losses, norms = [], []
    for step in range(steps):
        total = torch.zeros(())
        for micro in range(gas):
            loss = loss_of(engine, rank_slice(batch_fn(step, micro, global_rows), dp_rank, dp_world))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / gas / world)
        norms.append(engine.get_global_grad_norm())
    return Trace(losses, norms)


def assert_close_traces(actual: Trace, expected: Trace, rel: float) -> None:
    for name in ("losses", "grad_norms"):
        got, want = getattr(actual, name), getattr(expected, name)
        assert len(got) == len(want)
        for step, (g, w) in enumerate(zip(got, want)):
            assert abs(g - w) <= rel * abs(w), f"{name}[{step}]: {g!r} vs reference {w!r} (rel {abs(g - w) / abs(w):.2e})"


def gpt2_traces_across_resume(config: dict, directory: str, *, warm_steps: int,
                              on_saved=None) -> tuple[list[float], list[float]]:
    """A GPT-2 engine trains ``warm_steps`` steps (GAS 2, 4 global rows) and saves; then 3 more steps are
    run by that engine and by a fresh one (other initial weights) loaded from the checkpoint.

    Returns both runs' losses + grad norms: equal lists mean the resume is bit-identical. ``on_saved``
    gets the first engine right after the save (to check what the checkpoint should hold)."""
    import zerotune

    engine, *_ = zerotune.initialize(model=make_gpt2(), config=config)
    engine_run(engine, gpt2_batch, steps=warm_steps, gas=2, global_rows=4)
    engine.save_checkpoint(directory, tag="t")
    if on_saved is not None:
        on_saved(engine)
    later = lambda step, micro, rows: gpt2_batch(step + warm_steps, micro, rows)  # noqa: E731
    first = engine_run(engine, later, steps=3, gas=2, global_rows=4)
    resumed, *_ = zerotune.initialize(model=make_gpt2(seed=3), config=config)
    resumed.load_checkpoint(directory, tag="t")
    second = engine_run(resumed, later, steps=3, gas=2, global_rows=4)
    return first.losses + first.grad_norms, second.losses + second.grad_norms


# ---- a pipeline model: a tied input projection, 3 hidden Linear + Tanh pairs, the projection reused ----------
def _transposed(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight


def pipeline_layers(width: int) -> list:
    """8 layers: a tied input projection, 6 hidden layers, the tied projection reused (transposed) at the end."""
    from zerotune.pipe import LayerSpec, TiedLayerSpec

    hidden = [LayerSpec(nn.Linear, width, width) if i % 2 == 0 else LayerSpec(nn.Tanh) for i in range(6)]
    return ([TiedLayerSpec("proj", nn.Linear, width, width, bias=False)] + hidden
            + [TiedLayerSpec("proj", nn.Linear, width, width, bias=False, forward_fn=_transposed)])


def mse(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(outputs, labels)
