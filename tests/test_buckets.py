"""Gradient bucketing (pure assignment, in-order launching) and the stage-0 all-reduce sync.

AllReduceGradSync runs on 2 gloo ranks against a reference computed on every rank from all
ranks' data: after a boundary each rank must hold mean over ranks of the gradient summed over
the window's micro-steps, with communication only on the boundary.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tests.harness import run_distributed
from zerotune.distributed import comm
from zerotune.distributed.buckets import GradientBuckets, assign_buckets
from zerotune.zero.allreduce_sync import AllReduceGradSync

# ----------------------------------------------------------------------------- assign_buckets (pure)


def test_buckets_fill_from_the_last_parameter():
    assert assign_buckets([1, 1, 1, 1, 1], 2) == [[4, 3], [2, 1], [0]]


def test_cap_is_respected_exactly():
    assert assign_buckets([3, 2, 3, 2], 5) == [[3, 2], [1, 0]]
    assert assign_buckets([3, 2, 3, 2], 4) == [[3], [2], [1], [0]]


def test_oversize_parameter_gets_its_own_bucket():
    assert assign_buckets([2, 10, 3], 5) == [[2], [1], [0]]
    assert assign_buckets([1, 1, 100, 1, 1], 3) == [[4, 3], [2], [1, 0]]


def test_no_parameters_no_buckets():
    assert assign_buckets([], 10) == []


@pytest.mark.parametrize("cap", [0, -5])
def test_invalid_cap_is_a_value_error(cap):
    with pytest.raises(ValueError, match=rf"bucket size must be at least 1 element, got {cap}"):
        assign_buckets([1, 2], cap)


@settings(max_examples=300, deadline=None)
@given(numels=st.lists(st.integers(min_value=0, max_value=60), max_size=40),
       cap=st.integers(min_value=1, max_value=100))
def test_assignment_properties(numels, cap):
    buckets = assign_buckets(numels, cap)
    # Every index exactly once, in reverse registration order.
    assert [i for bucket in buckets for i in bucket] == list(reversed(range(len(numels))))
    for bucket in buckets:
        assert bucket, "no empty buckets"
        assert sum(numels[i] for i in bucket) <= cap or len(bucket) == 1
    # Greedy: a new bucket starts only when the next parameter would not fit.
    for bucket, following in zip(buckets, buckets[1:]):
        assert sum(numels[i] for i in bucket) + numels[following[0]] > cap


# ----------------------------------------------------------------------------- GradientBuckets launching


def _four_params_in_two_buckets() -> tuple[list[nn.Parameter], GradientBuckets, list[int]]:
    params = [nn.Parameter(torch.zeros(2, 2)) for _ in range(4)]
    launched: list[int] = []
    buckets = GradientBuckets.whole_params(params, bucket_numel=8, dtype=torch.float32, device=torch.device("cpu"),
                                    launch=lambda bucket: launched.append(bucket.index))
    return params, buckets, launched


def test_layout_views_write_into_the_flat_buffers():
    params, buckets, _ = _four_params_in_two_buckets()
    position = {id(p): k for k, p in enumerate(params)}
    assert [[position[id(p)] for p in b.params] for b in buckets.buckets] == [[3, 2], [1, 0]]
    assert [b.numel for b in buckets.buckets] == [8, 8]
    for k, p in enumerate(params):
        view = buckets.view_of(p)
        assert view.shape == p.shape and view.dtype == torch.float32
        view.fill_(k + 1)
    assert buckets.buckets[0].buffer.tolist() == [4.0] * 4 + [3.0] * 4
    assert buckets.buckets[1].buffer.tolist() == [2.0] * 4 + [1.0] * 4
    buckets.zero_()
    assert all(b.buffer.abs().sum() == 0 for b in buckets.buckets)


def test_buckets_launch_in_index_order_when_gradients_arrive_out_of_order():
    params, buckets, launched = _four_params_in_two_buckets()
    buckets.start_round()
    buckets.mark_ready(params[0])
    buckets.mark_ready(params[1])  # bucket 1 is complete, but bucket 0 is not: wait
    assert launched == []
    buckets.mark_ready(params[3])
    assert launched == []
    buckets.mark_ready(params[2])  # bucket 0 completes: both go, in order
    assert launched == [0, 1]
    assert all(b.launched for b in buckets.buckets)
    buckets.launch_remaining()
    assert launched == [0, 1], "nothing is launched twice"


def test_each_bucket_launches_as_soon_as_it_and_its_predecessors_are_complete():
    params, buckets, launched = _four_params_in_two_buckets()
    buckets.start_round()
    buckets.mark_ready(params[3])
    buckets.mark_ready(params[2])
    assert launched == [0]
    buckets.mark_ready(params[1])
    buckets.mark_ready(params[0])
    assert launched == [0, 1]


def test_launch_remaining_launches_buckets_with_missing_gradients():
    params, buckets, launched = _four_params_in_two_buckets()
    buckets.start_round()
    buckets.mark_ready(params[1])  # params 3, 2 and 0 got no gradient this step
    assert launched == []
    buckets.launch_remaining()
    assert launched == [0, 1]
    buckets.start_round()  # a new round re-arms every bucket
    assert not any(b.launched for b in buckets.buckets)
    buckets.mark_ready(params[3])
    buckets.mark_ready(params[2])
    buckets.launch_remaining()
    assert launched == [0, 1, 0, 1]


# ----------------------------------------------------------------------------- AllReduceGradSync


class _Net(nn.Module):
    """Two always-used layers, one used only on rank 0 and one nobody uses (32 + 6 + 6 trainable elements)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 4)        # 16
        self.rank0_only = nn.Linear(4, 4)  # 20
        self.b = nn.Linear(4, 2)        # 10
        self.unused = nn.Linear(2, 2)   # 6
        self.frozen = nn.Linear(2, 2)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        hidden = torch.tanh(self.a(x))
        if rank == 0:
            hidden = hidden + torch.tanh(self.rank0_only(hidden))
        return self.frozen(self.b(hidden)).pow(2).mean()


TRAINABLE_NUMEL = 16 + 20 + 10 + 6


def _batch(rank: int, step: int, micro: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(5, 3, generator=generator)


def _reference_grads(world: int, step: int, gas: int, dtype: torch.dtype = torch.float32) -> list[list[float]]:
    """mean over ranks of (sum over micro-steps of each rank's gradient, in fp32), without any sync."""
    model = _Net().to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    for rank in range(world):
        for micro in range(gas):
            loss = model(_batch(rank, step, micro).to(dtype), rank)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            for t, g in zip(total, grads):
                if g is not None:
                    t += g.float()
    return [(t / world).flatten().tolist() for t in total]


def _sync_on_rank(gas: int, steps: int, predivide: float, bucket_numel: int) -> dict:
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _Net()
    params = [p for p in model.parameters() if p.requires_grad]
    sync = AllReduceGradSync(params, dist.group.WORLD, bucket_numel=bucket_numel, device=torch.device("cpu"),
                             predivide_factor=predivide)
    out = {"buckets": len(sync.buckets.buckets), "buffer_bytes": sync.grad_bytes(), "steps": []}
    for step in range(steps):
        comm.reset_comm_stats()
        between_micro_steps = []
        for micro in range(gas):
            boundary = micro == gas - 1
            sync.begin_micro_step(boundary)
            model(_batch(rank, step, micro), rank).backward()
            if not boundary:
                between_micro_steps.append(comm.comm_stats())
        sync.finish()
        stats = comm.comm_stats()
        out["steps"].append({
            "silent_micro_steps": between_micro_steps,
            "all_reduce": (stats["all_reduce"].calls, stats["all_reduce"].bytes),
            "other_ops": sorted(set(stats) - {"all_reduce"}),
            "grads": [sync.grad_of(p).flatten().tolist() for p in params],
            # fp32 parameters: param.grad is the bucket slot itself (no copy), holding the mean.
            "param_grad_is_bucket": all(p.grad is not None and p.grad.data_ptr() == sync.grad_of(p).data_ptr()
                                        for p in params),
            "reference": _reference_grads(world, step, gas),
        })
        sync.zero_grad()
    sync.remove_hooks()
    return out


def _assert_close(actual: list[list[float]], expected: list[list[float]]) -> None:
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("gas, predivide, bucket_numel", [(3, 1.0, 24), (2, 2.0, 1000), (1, 1.0, 5)])
def test_allreduce_sync_on_two_ranks(gas, predivide, bucket_numel):
    per_rank = run_distributed(_sync_on_rank, 2, gas, 2, predivide, bucket_numel)
    for out in per_rank:
        assert out["buffer_bytes"] == 4 * TRAINABLE_NUMEL
        for step in out["steps"]:
            assert step["silent_micro_steps"] == [{}] * (gas - 1), "only the boundary communicates"
            # One all-reduce per bucket, carrying every trainable element once in fp32.
            assert step["all_reduce"] == (out["buckets"], 2 * 4 * TRAINABLE_NUMEL)  # all-reduce volume: 2 x payload
            assert step["other_ops"] == []
            assert step["param_grad_is_bucket"]
            _assert_close(step["grads"], step["reference"])
    # Identical on both ranks, including the layer only rank 0 used (half its gradient)
    # and the layer nobody used (zeros).
    for step0, step1 in zip(per_rank[0]["steps"], per_rank[1]["steps"]):
        assert step0["grads"] == step1["grads"]
        unused_weight, unused_bias = step0["grads"][6:8]
        assert not any(unused_weight) and not any(unused_bias)
        assert any(step0["grads"][2]), "rank 0's private layer still has (averaged) gradient"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_allreduce_sync_world_of_one_accumulates_without_communicating(dtype):
    """group None (data-parallel size 1): micro-step gradients are summed in fp32, nothing is sent.

    fp32 parameters' .grad is their bucket slot; low-precision parameters' .grad is dropped
    once added into the fp32 slot.
    """
    comm.reset_comm_stats()
    model = _Net().to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    sync = AllReduceGradSync(params, None, bucket_numel=16, device=torch.device("cpu"))
    try:
        for micro in range(2):
            sync.begin_micro_step(micro == 1)
            model(_batch(0, 0, micro).to(dtype), 0).backward()
        sync.finish()
        expected = _reference_grads(1, 0, 2, dtype)
        _assert_close([sync.grad_of(p).flatten().tolist() for p in params], expected)
        assert all(sync.grad_of(p).dtype == torch.float32 for p in params)
        if dtype == torch.float32:
            assert all(p.grad.data_ptr() == sync.grad_of(p).data_ptr() for p in params)
        else:
            assert all(p.grad is None for p in params)
        assert comm.comm_stats() == {}
        sync.zero_grad()
        assert all(p.grad is None for p in params)
        assert all(sync.grad_of(p).abs().sum() == 0 for p in params)
    finally:
        sync.remove_hooks()
