"""Ulysses sequence parallelism: the all-to-all, parity with a single process for GPT-2 (sdpa and
eager) and Llama (MHA and GQA, with and without padding), sp x dp gradient averaging, the
all-to-all volume of one forward, and the errors for heads / lengths that do not split."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.harness import run_distributed
from zerotune.distributed import comm
from zerotune.parallel.sequence import (
    combine_sequence_parallel_loss,
    install_ulysses_attention,
    seq_all_to_all,
    shard_sequence_batch,
)

SEQ, BATCH, VOCAB, LAYERS, HIDDEN = 256, 2, 96, 2, 32


def _gpt2(attn: str, heads: int = 2, hidden: int = HIDDEN):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=LAYERS, n_embd=hidden, n_head=heads, vocab_size=VOCAB, n_positions=SEQ,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                        attn_implementation=attn)
    return GPT2LMHeadModel(config)


def _llama(attn: str, heads: int = 2, kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, vocab_size=VOCAB, max_position_embeddings=SEQ,
                         attn_implementation=attn, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(config)


def _mistral(attn: str, sliding_window: int = 48):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=2,
                           num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
                           sliding_window=sliding_window, attn_implementation=attn, pad_token_id=0)
    return MistralForCausalLM(config)


def _make(kind: str, attn: str, **sizes: int) -> nn.Module:
    return {"gpt2": _gpt2, "llama": _llama, "mistral": _mistral}[kind](attn, **sizes)


def _batch(padded: bool | str, seed: int = 7, seq: int = SEQ) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (BATCH, seq), generator=generator)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if padded == "packed":  # no mask; positions restart where a new sequence begins (one crosses the ranks)
        starts = [0, 100, 140, 230]
        positions = torch.cat([torch.arange(end - start) for start, end in zip(starts, starts[1:] + [seq], strict=True)])
        batch["position_ids"] = positions.unsqueeze(0).expand(BATCH, -1).clone()
        return batch
    if padded:
        # Right padding (row 0: the last 57 tokens, across the rank boundary) cannot change a causal
        # model's loss, so row 1 is also padded on the left, where a lost mask changes every later token.
        mask = torch.ones(BATCH, seq, dtype=torch.long)
        mask[0, seq - 57:] = 0
        mask[1, :5] = 0
        mask[1, seq - 3:] = 0
        batch["attention_mask"] = mask
        batch["labels"][mask == 0] = -100
    return batch


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _reference(kind: str, attn: str, batches: list[dict], sizes: dict) -> tuple[float, dict]:
    """Single process, full sequences: mean over the batches of the HF loss, and its gradients."""
    model = _make(kind, attn, **sizes)
    # use_cache=False as shard_sequence_batch sets it (with a cache, HF ignores packed positions)
    loss = sum(model(**batch, use_cache=False).loss for batch in batches) / len(batches)
    loss.backward()
    return loss.item(), _grads(model)


def _compare(got: dict, want: dict) -> float:
    """Largest violation of |g - w| <= atol + rtol |w| (negative or 0 = within tolerance)."""
    assert got.keys() == want.keys()
    return max(((got[n] - want[n]).abs() - (1e-6 + 1e-5 * want[n].abs())).max().item() for n in want)


# ----------------------------------------------------------------------------- the all-to-all


def _all_to_all_layout() -> dict:
    rank, size = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(3)
    full = torch.randn(2, 4, 6, 3, generator=generator, dtype=torch.float64)  # [b, h, s, d]
    weight = torch.randn(2, 4, 6, 3, generator=generator, dtype=torch.float64)
    s_local, h_local = 6 // size, 4 // size
    local = full[:, :, rank * s_local:(rank + 1) * s_local].clone().requires_grad_(True)
    head_split = seq_all_to_all(local, dist.group.WORLD, scatter_dim=1, gather_dim=2)
    layout_ok = torch.equal(head_split, full[:, rank * h_local:(rank + 1) * h_local])
    back = seq_all_to_all(head_split, dist.group.WORLD, scatter_dim=2, gather_dim=1)
    roundtrip_ok = torch.equal(back, local)
    # sum over ranks of <head_split_r, weight_r> is <full, weight>: its gradient wrt this rank's
    # tokens is weight at those tokens (what a single process computes for the same function).
    (head_split * weight[:, rank * h_local:(rank + 1) * h_local]).sum().backward()
    grad_ok = torch.allclose(local.grad, weight[:, :, rank * s_local:(rank + 1) * s_local])
    # through both exchanges and back: gradient of <back, w> is w on this rank's tokens
    local.grad = None
    w_local = weight[:, :, rank * s_local:(rank + 1) * s_local]
    twice = seq_all_to_all(seq_all_to_all(local, dist.group.WORLD, 1, 2), dist.group.WORLD, 2, 1)
    (twice * w_local).sum().backward()
    return {"layout": layout_ok, "roundtrip": roundtrip_ok, "grad": grad_ok,
            "grad_twice": torch.allclose(local.grad, w_local)}


def test_seq_all_to_all_layout_and_gradient():
    for result in run_distributed(_all_to_all_layout, 2, timeout=60):
        assert result == {"layout": True, "roundtrip": True, "grad": True, "grad_twice": True}


def test_seq_all_to_all_group_of_one_is_identity_and_checks_split():
    x = torch.randn(2, 3, 4, 5)
    assert torch.equal(seq_all_to_all(x, None, 1, 2), x)
    with pytest.raises(ValueError, match="must differ"):
        seq_all_to_all(x, None, 1, 1)


# ----------------------------------------------------------------------------- parity


def _sp_parity(kind: str, attn: str, padded: bool, sizes: dict, checkpointing: bool = False) -> dict:
    size = dist.get_world_size()
    batch = _batch(padded)
    want_loss, want_grads = _reference(kind, attn, [batch], sizes)

    model = _make(kind, attn, **sizes)
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    group = dist.group.WORLD
    install_ulysses_attention(model, group)
    comm.reset_comm_stats()
    local_loss = model(**shard_sequence_batch(batch, group, model)).loss
    forward_bytes = comm.comm_stats()["all_to_all"].bytes
    loss = combine_sequence_parallel_loss(local_loss, group)
    loss.backward()
    grads = _grads(model)
    for grad in grads.values():
        dist.all_reduce(grad)
        grad /= size
    return {"loss": loss.item(), "want_loss": want_loss, "grad_violation": _compare(grads, want_grads),
            "forward_bytes": forward_bytes}


CASES = [
    ("gpt2", "sdpa", False, {}),
    ("gpt2", "sdpa", True, {}),
    ("gpt2", "eager", False, {}),
    ("gpt2", "eager", True, {}),
    ("llama", "sdpa", False, {}),
    ("llama", "sdpa", True, {}),
    ("llama", "eager", True, {"heads": 4, "kv_heads": 2}),  # grouped-query attention
    ("llama", "sdpa", "packed", {}),  # packed sequences: the mask comes from the full position ids
    ("mistral", "sdpa", True, {}),  # sliding window of 48 tokens, across the rank boundary
    ("mistral", "eager", False, {}),
]


@pytest.mark.parametrize("kind,attn,padded,sizes", CASES, ids=[f"{k}-{a}-{p if isinstance(p, str) else 'pad' if p else 'full'}-{s or ''}"
                                                                 for k, a, p, s in CASES])
def test_ulysses_matches_single_process(kind, attn, padded, sizes):
    for result in run_distributed(_sp_parity, 2, kind, attn, padded, sizes, timeout=60):
        assert abs(result["loss"] - result["want_loss"]) <= 1e-5 * abs(result["want_loss"]), result
        assert result["grad_violation"] <= 0, result
        heads = sizes.get("heads", 2)
        kv_heads = sizes.get("kv_heads", heads)
        # per layer: q (heads), k and v (kv heads) in, the output (heads) back; each rank sends its
        # whole input: batch x seq/P tokens x head_dim x 4 bytes per head
        head_dim = HIDDEN // heads
        per_layer = (2 * heads + 2 * kv_heads) * BATCH * (SEQ // 2) * head_dim * 4
        assert result["forward_bytes"] == LAYERS * per_layer
        if kv_heads == heads:  # the brief's formula: 4 x layers x b x s/P x hidden x 4 bytes
            assert result["forward_bytes"] == 4 * LAYERS * BATCH * (SEQ // 2) * HIDDEN * 4


def test_ulysses_with_activation_checkpointing():
    """Recomputation in backward runs the all-to-alls again, in the same order on every rank."""
    for result in run_distributed(_sp_parity, 2, "llama", "sdpa", True, {}, True, timeout=60):
        assert abs(result["loss"] - result["want_loss"]) <= 1e-5 * abs(result["want_loss"]), result
        assert result["grad_violation"] <= 0, result


def test_group_of_one_is_the_same_code_path():
    batch = _batch(padded=True)
    want_loss, want_grads = _reference("gpt2", "sdpa", [batch], {})
    model = _gpt2("sdpa")
    install_ulysses_attention(model, None)
    assert model.config._attn_implementation == "zerotune_ulysses"
    loss = combine_sequence_parallel_loss(model(**shard_sequence_batch(batch, None, model)).loss, None)
    loss.backward()
    assert abs(loss.item() - want_loss) <= 1e-5 * abs(want_loss)
    assert _compare(_grads(model), want_grads) <= 0


def _sp_times_dp() -> dict:
    """4 ranks = 2 dp x 2 sp: averaging the gradients over all 4 ranks (what ZeRO / DP sync does)
    equals the single-process gradient of the mean loss over the dp batches."""
    rank = dist.get_rank()
    sp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = sp_groups[rank // 2]
    batches = [_batch(padded=True, seed=11), _batch(padded=False, seed=12)]
    want_loss, want_grads = _reference("gpt2", "sdpa", batches, {"heads": 4})
    model = _gpt2("sdpa", heads=4)
    install_ulysses_attention(model, group)
    loss = combine_sequence_parallel_loss(model(**shard_sequence_batch(batches[rank // 2], group, model)).loss, group)
    loss.backward()
    grads = _grads(model)
    for grad in grads.values():
        dist.all_reduce(grad)
        grad /= 4
    total = loss.detach().clone()
    dist.all_reduce(total)
    return {"loss": total.item() / 4, "want_loss": want_loss, "grad_violation": _compare(grads, want_grads)}


def test_sequence_parallel_times_data_parallel_gradient_average():
    for result in run_distributed(_sp_times_dp, 4, timeout=90):
        assert abs(result["loss"] - result["want_loss"]) <= 1e-5 * abs(result["want_loss"]), result
        assert result["grad_violation"] <= 0, result


# ----------------------------------------------------------------------------- errors


def _errors() -> dict:
    group = dist.group.WORLD
    messages = {}
    try:
        install_ulysses_attention(_gpt2("sdpa", heads=3, hidden=24), group)
    except ValueError as error:
        messages["heads"] = str(error)
    try:
        install_ulysses_attention(_llama("sdpa", heads=4, kv_heads=1), group)
    except ValueError as error:
        messages["kv_heads"] = str(error)
    model = _gpt2("sdpa")
    install_ulysses_attention(model, group)
    try:
        shard_sequence_batch(_batch(padded=False, seq=255), group, model)
    except ValueError as error:
        messages["seq"] = str(error)
    try:
        shard_sequence_batch({"labels": torch.zeros(2, 4, dtype=torch.long)}, group, model)
    except ValueError as error:
        messages["no_ids"] = str(error)
    return messages


def test_errors_name_the_numbers():
    messages = run_distributed(_errors, 2, timeout=60)[0]
    assert "GPT2LMHeadModel" in messages["heads"] and "n_head = 3" in messages["heads"]
    assert "sequence-parallel size 2" in messages["heads"]
    assert "num_key_value_heads = 1" in messages["kv_heads"] and "LlamaForCausalLM" in messages["kv_heads"]
    assert "sequence length 255" in messages["seq"] and "sequence-parallel size 2" in messages["seq"]
    assert "keyword Hugging Face inputs" in messages["no_ids"]


def test_refuses_models_without_the_attention_interface():
    class NoInterface(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = types.SimpleNamespace(_attn_implementation="sdpa", num_attention_heads=2)
            self.attn = nn.MultiheadAttention(8, 2)

    with pytest.raises(ValueError, match="no attention module dispatches through transformers' attention interface"):
        install_ulysses_attention(NoInterface(), None)
    with pytest.raises(ValueError, match="needs a Hugging Face PreTrainedModel"):
        install_ulysses_attention(nn.Linear(2, 2), None)
    with pytest.raises(ValueError, match="install_ulysses_attention"):
        shard_sequence_batch(_batch(padded=False), None, _gpt2("sdpa"))
