"""Tensor-parallel layers, collectives and the vocab-parallel loss against their single-process originals.

Every multi-rank case builds the FULL reference module on every rank from the same seed, the tp
layer from the same tensors, and checks: the output equals the reference (or its shard), the
input gradient equals the reference's, and each parameter gradient equals the matching shard of
the full gradient (cut with ``shard_tensor``). fp32, rtol 1e-5 / atol 1e-6. Checks run inside the
ranks (a failed assert_close comes back as that rank's traceback); ranks return small summaries.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from tests.harness import run_distributed
from zerotune.distributed import comm
from zerotune.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPLayout,
    VocabParallelEmbedding,
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    mark_tensor_parallel,
    reduce_from_tensor_parallel,
    scatter_to_tensor_parallel,
    shard_tensor,
    tp_layout_of,
    unshard_tensor,
    vocab_parallel_causal_lm_loss,
    vocab_parallel_cross_entropy,
)

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, **TOL)


def _tp_group(mode: str) -> dist.ProcessGroup | None:
    """'world': the whole world is one tp group; 'pairs': tp groups {0,1}, {2,3}, ... (tp 2 inside a larger world)."""
    if mode == "world":
        return dist.group.WORLD
    world, rank = dist.get_world_size(), dist.get_rank()
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]  # every rank creates every group
    return pairs[rank // 2]


def _layout(param: torch.Tensor) -> TPLayout:
    layout = tp_layout_of(param)
    assert layout is not None, "a sharded parameter must carry its TPLayout"
    return layout


def _check_param_grads(tp_layer: nn.Module, full_weight: torch.Tensor, full_bias: torch.Tensor | None,
                       bias_replicated: bool = False) -> None:
    _close(tp_layer.weight.grad, shard_tensor(full_weight.grad, _layout(tp_layer.weight)))
    if full_bias is not None:
        if bias_replicated:
            assert tp_layout_of(tp_layer.bias) is None
            _close(tp_layer.bias.grad, full_bias.grad)
        else:
            _close(tp_layer.bias.grad, shard_tensor(full_bias.grad, _layout(tp_layer.bias)))


# ---- layout: pure shard math ------------------------------------------------------------------
@pytest.mark.parametrize("shape,dim,parts", [((8, 6), 0, 1), ((8, 6), 1, 1), ((4, 12), 1, 3), ((12, 5), 0, 3),
                                             ((2, 3, 12), -1, 3), ((2, 8, 3), 1, 2)])
@pytest.mark.parametrize("world", [1, 2])
def test_shard_unshard_round_trip(shape: tuple, dim: int, parts: int, world: int) -> None:
    full = torch.randn(shape)
    layouts = [TPLayout(dim, world, rank, shape[dim], parts) for rank in range(world)]
    shards = [shard_tensor(full, layout) for layout in layouts]
    for shard, layout in zip(shards, layouts):
        assert shard.is_contiguous() and shard.shape[dim] == layout.local_size
        assert shard.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
    assert torch.equal(unshard_tensor(shards, layouts[0]), full)


def test_fused_parts_keep_each_ranks_slice_of_every_part() -> None:
    q, k, v = torch.arange(8.0), torch.arange(8.0) + 100, torch.arange(8.0) + 200
    fused = torch.cat([q, k, v])  # GPT-2 c_attn order along the output dim
    shard = shard_tensor(fused, TPLayout(0, 2, 1, 24, parts=3))
    assert torch.equal(shard, torch.cat([q[4:], k[4:], v[4:]]))


def test_mark_and_read_layout() -> None:
    param = nn.Parameter(torch.zeros(3, 4))
    assert tp_layout_of(param) is None
    layout = TPLayout(0, 2, 0, 6)
    mark_tensor_parallel(param, layout)
    assert tp_layout_of(param) is layout
    with pytest.raises(ValueError, match="size 4 along dim 1"):
        mark_tensor_parallel(nn.Parameter(torch.zeros(3, 4)), TPLayout(1, 2, 0, 6))


def test_layout_errors_name_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"10.*3 part\(s\) x tp size 2.*divisible by 3 \* 2 = 6"):
        TPLayout(0, 2, 0, 10, parts=3)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        TPLayout(0, 2, 2, 8)
    with pytest.raises(ValueError, match="world .* >= 1"):
        TPLayout(0, 0, 0, 8)
    with pytest.raises(ValueError, match="full size is 9"):
        shard_tensor(torch.zeros(8, 2), TPLayout(0, 1, 0, 9))
    with pytest.raises(ValueError, match="one shard per tp rank \\(2\\), got 1"):
        unshard_tensor([torch.zeros(4)], TPLayout(0, 2, 0, 8))


# ---- tp size 1 (group None): the same code, no communication -----------------------------------
def test_group_none_layers_equal_torch_modules() -> None:
    torch.manual_seed(0)
    reference = nn.Linear(5, 6)
    torch.manual_seed(0)
    column = ColumnParallelLinear(5, 6, None)
    torch.manual_seed(0)
    row = RowParallelLinear(5, 6, None)
    torch.manual_seed(0)
    embedding_ref = nn.Embedding(7, 3, padding_idx=2)
    torch.manual_seed(0)
    embedding = VocabParallelEmbedding(7, 3, None, padding_idx=2)
    for layer in (column, row):
        assert torch.equal(layer.weight, reference.weight) and torch.equal(layer.bias, reference.bias)
    assert torch.equal(embedding.weight, embedding_ref.weight)
    x, ids = torch.randn(2, 3, 5), torch.tensor([[0, 2, 6], [1, 2, 3]])
    comm.reset_comm_stats()
    _close(column(x), reference(x))
    _close(row(x), reference(x))
    _close(embedding(ids), embedding_ref(ids))
    assert comm.total_comm_bytes() == 0


def test_state_dict_keys_match_the_replaced_module() -> None:
    assert set(ColumnParallelLinear(4, 4, None).state_dict()) == set(nn.Linear(4, 4).state_dict())
    assert set(RowParallelLinear(4, 4, None, bias=False).state_dict()) == {"weight"}
    assert set(VocabParallelEmbedding(4, 2, None).state_dict()) == set(nn.Embedding(4, 2).state_dict())


def test_from_full_keeps_frozen_weights_frozen() -> None:
    linear = nn.Linear(4, 6)
    linear.weight.requires_grad_(False)
    layer = ColumnParallelLinear.from_full(linear.weight, linear.bias, None)
    assert not layer.weight.requires_grad and layer.bias.requires_grad


def test_argument_errors() -> None:
    with pytest.raises(ValueError, match="weight_layout must be one of"):
        ColumnParallelLinear(4, 4, None, weight_layout="in-out")
    with pytest.raises(ValueError, match="gather_output=True with parts=3"):
        ColumnParallelLinear(4, 6, None, parts=3, gather_output=True)
    with pytest.raises(ValueError, match=r"bias must have shape \(6,\)"):
        ColumnParallelLinear.from_full(torch.zeros(6, 4), torch.zeros(4), None)
    with pytest.raises(ValueError, match="padding_idx must be within"):
        VocabParallelEmbedding(4, 2, None, padding_idx=4)
    with pytest.raises(ValueError, match="reduction must be one of"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), None, reduction="avg")
    with pytest.raises(IndexError, match=r"target id 11 is outside the vocabulary \[0, 11\)"):
        vocab_parallel_cross_entropy(torch.zeros(2, 11), torch.tensor([3, 11]), None)
    with pytest.raises(ValueError, match="target shape"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long), None)
    with pytest.raises(ValueError, match="vocab_size=8"):
        vocab_parallel_causal_lm_loss(None)(torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long), 8)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_group_none_cross_entropy_matches_torch(reduction: str) -> None:
    logits, target = torch.randn(3, 5, 11), torch.randint(0, 11, (3, 5))
    target[0, :2] = -100
    weights = torch.randn(15)
    ours_in, ref_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ours = vocab_parallel_cross_entropy(ours_in, target, None, reduction=reduction)
    ref = F.cross_entropy(ref_in.view(-1, 11), target.view(-1), reduction=reduction)
    _close(ours, ref)
    (ours * weights if reduction == "none" else ours).sum().backward()
    (ref * weights if reduction == "none" else ref).sum().backward()
    _close(ours_in.grad, ref_in.grad)


def test_low_precision_logits_get_a_gradient_of_their_own_dtype() -> None:
    logits = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits, torch.randint(0, 8, (4,)), None)
    assert loss.dtype == torch.float32
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16


# ---- multi-rank ----------------------------------------------------------------------------------
def _mappings(mode: str) -> dict:
    group = _tp_group(mode)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(0)
    full = torch.randn(3, 4 * world, requires_grad=True)
    upstream = torch.randn(3, 4 * world)

    mine = scatter_to_tensor_parallel(full, group, dim=-1)
    _close(mine, full[:, 4 * rank:4 * (rank + 1)])
    (mine * upstream[:, 4 * rank:4 * (rank + 1)]).sum().backward()
    # every rank's chunk gradient, gathered: the full upstream
    _close(full.grad, upstream)

    own = full.detach()[:, 4 * rank:4 * (rank + 1)].clone().requires_grad_()
    gathered = gather_from_tensor_parallel(own, group, dim=1)
    _close(gathered, full.detach())
    (gathered * upstream).sum().backward()
    _close(own.grad, upstream[:, 4 * rank:4 * (rank + 1)])

    x = torch.full((2, 2), float(rank + 1), requires_grad=True)
    summed = reduce_from_tensor_parallel(x, group)
    assert torch.equal(x.detach(), torch.full((2, 2), float(rank + 1))), "reduce must not write into its input"
    _close(summed, torch.full((2, 2), world * (world + 1) / 2))
    summed.sum().backward()
    _close(x.grad, torch.ones(2, 2))

    y = torch.ones(2, 3, requires_grad=True)
    copied = copy_to_tensor_parallel(y, group)
    (copied * (rank + 1)).sum().backward()
    _close(y.grad, torch.full((2, 3), world * (world + 1) / 2))
    return {"ok": True}


@pytest.mark.parametrize("world,mode", [(2, "world"), (4, "pairs")])
def test_mappings_forward_and_backward(world: int, mode: str) -> None:
    assert all(r["ok"] for r in run_distributed(_mappings, world, mode))


def _column(mode: str, weight_layout: str, parts: int, gather_output: bool, bias: bool) -> dict:
    group = _tp_group(mode)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    in_features, out_features = 6, 4 * parts * world
    torch.manual_seed(1)
    reference = nn.Linear(in_features, out_features, bias=bias)
    torch.manual_seed(1)
    layer = ColumnParallelLinear(in_features, out_features, group, bias=bias, gather_output=gather_output,
                                 weight_layout=weight_layout, parts=parts)
    full_weight = reference.weight if weight_layout == "out_in" else reference.weight.detach().t().contiguous()
    full_weight = full_weight.detach().requires_grad_()
    full_bias = reference.bias.detach().clone().requires_grad_() if bias else None
    # __init__ with the same seed builds the same full model as nn.Linear, then keeps this rank's shard
    assert torch.equal(layer.weight, shard_tensor(full_weight.detach(), _layout(layer.weight)))
    assert _layout(layer.weight) == TPLayout(0 if weight_layout == "out_in" else 1, world, rank, out_features, parts)

    torch.manual_seed(2)
    x_ref = torch.randn(2, 3, in_features, requires_grad=True)
    upstream = torch.randn(2, 3, out_features)
    x = x_ref.detach().clone().requires_grad_()
    expected = x_ref @ (full_weight.t() if weight_layout == "out_in" else full_weight)
    if bias:
        expected = expected + full_bias
    out = layer(x)
    output_layout = TPLayout(-1, world, rank, out_features, parts)
    if gather_output:
        _close(out, expected)
        (out * upstream).sum().backward()
    else:
        _close(out, shard_tensor(expected.detach(), output_layout))
        (out * shard_tensor(upstream, output_layout)).sum().backward()
    (expected * upstream).sum().backward()
    _close(x.grad, x_ref.grad)
    _check_param_grads(layer, full_weight, full_bias)
    return {"repr": repr(layer)}


@pytest.mark.parametrize("weight_layout,parts,gather_output,bias", [
    ("out_in", 1, False, True), ("in_out", 1, False, True), ("out_in", 1, True, False), ("in_out", 1, True, True),
    ("in_out", 3, False, True), ("out_in", 3, False, False),
])
def test_column_parallel_matches_full_linear(weight_layout: str, parts: int, gather_output: bool, bias: bool) -> None:
    results = run_distributed(_column, 2, "world", weight_layout, parts, gather_output, bias)
    assert "tp=2" in results[0]["repr"] and "of (" in results[0]["repr"]


def test_column_parallel_on_tp_pairs_inside_four_ranks() -> None:
    run_distributed(_column, 4, "pairs", "in_out", 3, False, True)


def _row(mode: str, weight_layout: str, input_is_parallel: bool, bias: bool) -> dict:
    group = _tp_group(mode)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    in_features, out_features = 4 * world, 5
    torch.manual_seed(3)
    reference = nn.Linear(in_features, out_features, bias=bias)
    full_weight = reference.weight if weight_layout == "out_in" else reference.weight.t()
    full_weight = full_weight.detach().contiguous().requires_grad_()
    full_bias = reference.bias.detach().clone().requires_grad_() if bias else None
    layer = RowParallelLinear.from_full(full_weight, full_bias, group, weight_layout=weight_layout,
                                        input_is_parallel=input_is_parallel)
    assert _layout(layer.weight) == TPLayout(1 if weight_layout == "out_in" else 0, world, rank, in_features)

    torch.manual_seed(4)
    x_ref = torch.randn(2, 3, in_features, requires_grad=True)
    upstream = torch.randn(2, 3, out_features)
    input_layout = TPLayout(-1, world, rank, in_features)
    x = (x_ref.detach().clone() if not input_is_parallel else shard_tensor(x_ref.detach(), input_layout))
    x.requires_grad_()
    expected = x_ref @ (full_weight.t() if weight_layout == "out_in" else full_weight)
    if bias:
        expected = expected + full_bias
    out = layer(x)
    _close(out, expected)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    _close(x.grad, x_ref.grad if not input_is_parallel else shard_tensor(x_ref.grad, input_layout))
    _check_param_grads(layer, full_weight, full_bias, bias_replicated=True)
    return {"repr": repr(layer)}


@pytest.mark.parametrize("weight_layout,input_is_parallel,bias", [
    ("out_in", True, True), ("in_out", True, True), ("out_in", False, False), ("in_out", False, True),
])
def test_row_parallel_matches_full_linear(weight_layout: str, input_is_parallel: bool, bias: bool) -> None:
    results = run_distributed(_row, 2, "world", weight_layout, input_is_parallel, bias)
    assert "tp=2" in results[0]["repr"] and "replicated" in results[0]["repr"]


def _mlp_pair(mode: str) -> dict:
    """Column -> gelu -> row: the Megatron MLP, with exactly one all-reduce each way."""
    group = _tp_group(mode)
    batch, seq, hidden = 2, 3, 8
    torch.manual_seed(5)
    fc, proj = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
    column = ColumnParallelLinear.from_full(fc.weight, fc.bias, group)
    row = RowParallelLinear.from_full(proj.weight, proj.bias, group)
    torch.manual_seed(6)
    x_ref = torch.randn(batch, seq, hidden, requires_grad=True)
    x = x_ref.detach().clone().requires_grad_()
    comm.reset_comm_stats()
    out = row(F.gelu(column(x)))
    forward_stats = comm.comm_stats()
    out.square().sum().backward()
    backward_stats = comm.comm_stats()
    expected = proj(F.gelu(fc(x_ref)))
    expected.square().sum().backward()
    _close(out, expected)
    _close(x.grad, x_ref.grad)
    _check_param_grads(column, fc.weight, fc.bias)
    _check_param_grads(row, proj.weight, proj.bias, bias_replicated=True)
    element_bytes = 4
    return {
        "forward": {op: (s.calls, s.bytes) for op, s in forward_stats.items()},
        "total": {op: (s.calls, s.bytes) for op, s in backward_stats.items()},
        "activation_bytes": batch * seq * hidden * element_bytes,
    }


@pytest.mark.parametrize("world,mode", [(2, "world"), (4, "world"), (4, "pairs")])
def test_column_row_mlp_pair_needs_one_all_reduce_each_way(world: int, mode: str) -> None:
    for result in run_distributed(_mlp_pair, world, mode):
        size = result["activation_bytes"]
        # an all-reduce of S bytes is accounted as 2S (reduce-scatter + all-gather)
        assert result["forward"] == {"all_reduce": (1, 2 * size)}
        assert result["total"] == {"all_reduce": (2, 4 * size)}


def _embedding(mode: str, padding_idx: int | None) -> dict:
    group = _tp_group(mode)
    world = dist.get_world_size(group)
    vocab, dim = 5 * world, 3
    torch.manual_seed(7)
    reference = nn.Embedding(vocab, dim, padding_idx=padding_idx)
    torch.manual_seed(7)
    layer = VocabParallelEmbedding(vocab, dim, group, padding_idx=padding_idx)
    assert torch.equal(layer.weight, shard_tensor(reference.weight.detach(), _layout(layer.weight)))
    assert (layer.num_embeddings, layer.embedding_dim) == (vocab, dim)
    torch.manual_seed(8)
    ids = torch.randint(0, vocab, (3, 7))
    ids[0, :3] = torch.tensor([0, vocab - 1, padding_idx % vocab if padding_idx is not None else 1])
    assert layer.padding_idx == (None if padding_idx is None else padding_idx % vocab)
    upstream = torch.randn(3, 7, dim)
    out = layer(ids)
    expected = reference(ids)
    _close(out, expected)
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    _close(layer.weight.grad, shard_tensor(reference.weight.grad, _layout(layer.weight)))
    return {"repr": repr(layer)}


@pytest.mark.parametrize("world,mode,padding_idx", [(2, "world", None), (2, "world", 7), (4, "world", 0),
                                                    (4, "pairs", -1)])
def test_vocab_parallel_embedding_matches_embedding(world: int, mode: str, padding_idx: int | None) -> None:
    results = run_distributed(_embedding, world, mode, padding_idx)
    assert "rows=[0, " in results[0]["repr"]


def _cross_entropy(mode: str, reduction: str, ignore_index: int) -> dict:
    group = _tp_group(mode)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    vocab = 6 * world
    torch.manual_seed(9)
    full_logits = (3 * torch.randn(2, 5, vocab)).requires_grad_()
    target = torch.randint(0, vocab, (2, 5))
    target[0, 1], target[1, 4] = ignore_index, ignore_index
    target[1, 0], target[1, 1] = 0, vocab - 1  # first and last id of the vocabulary
    weights = torch.randn(10)
    layout = TPLayout(-1, world, rank, vocab)
    local = shard_tensor(full_logits.detach(), layout).requires_grad_()
    comm.reset_comm_stats()
    ours = vocab_parallel_cross_entropy(local, target, group, ignore_index=ignore_index, reduction=reduction)
    calls = {op: s.calls for op, s in comm.comm_stats().items()}
    ref = F.cross_entropy(full_logits.view(-1, vocab), target.view(-1), ignore_index=ignore_index, reduction=reduction)
    _close(ours, ref)
    (ours * weights if reduction == "none" else ours).sum().backward()
    (ref * weights if reduction == "none" else ref).sum().backward()
    _close(local.grad, shard_tensor(full_logits.grad, layout))
    return {"calls": calls}


@pytest.mark.parametrize("world,mode,reduction,ignore_index", [
    (2, "world", "mean", -100), (2, "world", "sum", -100), (2, "world", "none", 3), (4, "world", "mean", 0),
    (4, "pairs", "sum", -1),
])
def test_vocab_parallel_cross_entropy_matches_cross_entropy(world: int, mode: str, reduction: str,
                                                            ignore_index: int) -> None:
    for result in run_distributed(_cross_entropy, world, mode, reduction, ignore_index):
        assert result["calls"] == {"all_reduce": 2}  # the max, then target logit + sum of exp together


def _causal_lm_loss(mode: str) -> dict:
    group = _tp_group(mode)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    vocab = 5 * world
    loss_function = vocab_parallel_causal_lm_loss(group)
    torch.manual_seed(10)
    labels = torch.randint(0, vocab, (2, 6))
    labels[0, :2] = -100  # e.g. a masked prompt
    shifted = torch.randint(0, vocab, (2, 6))
    shifted[1, 3] = -100
    cases = {
        "plain": {},
        "num_items_in_batch": {"num_items_in_batch": torch.tensor(17)},
        "int_num_items_in_batch": {"num_items_in_batch": 9},
        "shift_labels": {"shift_labels": shifted},
        "shift_labels_and_num_items": {"shift_labels": shifted, "num_items_in_batch": torch.tensor(5)},
        "ignore_index": {"ignore_index": 2},
    }
    for name, kwargs in cases.items():
        case_labels = labels.masked_fill(labels == -100, 2) if "ignore_index" in kwargs else labels
        full_logits = torch.randn(2, 6, vocab, requires_grad=True)
        layout = TPLayout(-1, world, rank, vocab)
        local = shard_tensor(full_logits.detach(), layout).requires_grad_()
        ours = loss_function(local, case_labels, vocab, **kwargs)
        ref = ForCausalLMLoss(full_logits, case_labels, vocab, **kwargs)
        try:
            _close(ours, ref)
            ours.backward()
            ref.backward()
            _close(local.grad, shard_tensor(full_logits.grad, layout))
        except AssertionError as error:
            raise AssertionError(f"case {name!r}: {error}") from error
    return {"name": loss_function.__name__}


@pytest.mark.parametrize("world,mode", [(2, "world"), (4, "pairs")])
def test_causal_lm_loss_matches_transformers(world: int, mode: str) -> None:
    assert run_distributed(_causal_lm_loss, world, mode)[0]["name"] == "vocab_parallel_causal_lm_loss"


def _indivisible_errors() -> list[str]:
    group = dist.group.WORLD
    messages = []
    for build in (lambda: ColumnParallelLinear(4, 5, group), lambda: ColumnParallelLinear(4, 8, group, parts=3),
                  lambda: RowParallelLinear(7, 4, group), lambda: VocabParallelEmbedding(9, 2, group),
                  lambda: scatter_to_tensor_parallel(torch.zeros(3, 5), group)):
        try:
            build()
        except ValueError as error:
            messages.append(str(error))
        else:
            messages.append("no error")
    return messages


def test_indivisible_sizes_name_the_size_and_tp_size() -> None:
    messages = run_distributed(_indivisible_errors, 2)[0]
    assert "out_features=5 is not divisible by tp size 2" in messages[0]
    assert "out_features=8 is not divisible by tp size 2 x 3 fused parts" in messages[1]
    assert "in_features=7 is not divisible by tp size 2" in messages[2]
    assert "num_embeddings=9 is not divisible by tp size 2" in messages[3]
    assert "size 5" in messages[4] and "tp size 2" in messages[4]
