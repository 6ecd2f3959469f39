"""``deepspeed.runtime.utils`` (``zerotune/compat/runtime_utils.py``) over zerotune's partition and norm code,
and DeepSpeed's expert groups (``zerotune/compat/groups.py``): single-process checks, then 2 gloo ranks."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed
from zerotune.compat import groups
from zerotune.compat import runtime_utils as ds_utils
from zerotune.compat.paths import DeepSpeedFeatureNotSupported
from zerotune.pipe.partition import PartitionError, balanced_boundaries
from zerotune.zero.grad_norm import clip_grads_to_norm_


def test_call_to_str_writes_the_call_with_reprs() -> None:
    assert ds_utils.call_to_str("int") == "int()"
    assert ds_utils.call_to_str("f", 3, "jeff") == "f(3, 'jeff')"
    assert ds_utils.call_to_str("f", 1138, val=3, name="x") == "f(1138, val=3, name='x')"


# ---- partitioning ----------------------------------------------------------------------------------
def _loads(weights: list, bounds: list[int]) -> list:
    prefix = list(itertools.accumulate(weights, initial=0))  # weighed as the partition weighs (floats)
    return [prefix[bounds[s + 1]] - prefix[bounds[s]] for s in range(len(bounds) - 1)]


def _best_by_brute_force(weights: list, parts: int) -> tuple:
    """(heaviest, -lightest) of the best split, over every split into non-empty parts."""
    n = len(weights)
    return min((max(loads), -min(loads)) for cuts in itertools.combinations(range(1, n), parts - 1)
               for loads in [_loads(weights, [0, *cuts, n])])


def test_balanced_boundaries_minimise_the_heaviest_then_maximise_the_lightest_stage() -> None:
    rng = random.Random(0)
    for trial in range(400):
        n = rng.randint(1, 8)
        parts = rng.randint(1, n)
        weights = ([rng.choice([0, 0, 1, 2, 3, 5, 8]) for _ in range(n)] if trial % 2
                   else [round(rng.uniform(0, 5), 1) for _ in range(n)])
        bounds = balanced_boundaries(weights, parts)
        assert bounds[0] == 0 and bounds[-1] == n and all(a < b for a, b in zip(bounds, bounds[1:]))
        loads = _loads(weights, bounds)
        assert (max(loads), -min(loads)) == _best_by_brute_force(weights, parts), (weights, parts, bounds)


def test_uniform_partition_puts_the_larger_parts_first_as_deepspeed() -> None:
    for items, parts in itertools.product(range(1, 30), range(1, 9)):
        chunk, extra = divmod(items, parts)
        sizes = [chunk + 1] * extra + [chunk] * (parts - extra) if items > parts else [1] * items + [0] * (
            parts - items)
        assert ds_utils.partition_uniform(items, parts) == [0, *itertools.accumulate(sizes)], (items, parts)


def test_partition_balanced_answers_deepspeeds_cases() -> None:
    assert ds_utils.partition_balanced([0, 1, 2, 3, 3, 3], 4) == [0, 3, 4, 5, 6]
    assert ds_utils.partition_balanced([0.0, 1.1, 1.9, 3.0, 3.0, 3.0], 4) == [0, 3, 4, 5, 6]
    assert ds_utils.partition_balanced([0.0, 1.1, 30, 3.0], 3) == [0, 2, 3, 4]
    assert ds_utils.partition_balanced([1, 2, 1], 4) == [0, 1, 2, 3, 3]  # more parts than items: some empty
    spread = _loads([1, 1, 1, 1, 0, 1], ds_utils.partition_balanced([1, 1, 1, 1, 0, 1], 4))
    assert max(spread) - min(spread) == 1
    assert ds_utils.prefix_sum_inc([3, 4, 5]) == [3, 7, 12]


def test_partition_refuses_what_cannot_be_split() -> None:
    with pytest.raises(PartitionError, match="num_parts must be >= 1"):
        ds_utils.partition_uniform(3, 0)
    with pytest.raises(PartitionError, match="weights must be >= 0"):
        balanced_boundaries([1, -2, 3], 2)
    with pytest.raises(PartitionError, match="5 pipeline stages but only 4 layer"):
        balanced_boundaries([1, 1, 1, 1], 5)


# ---- clipping and norms, one process ------------------------------------------------------------------
def _params_with_grads(*grads: list[float]) -> list[torch.nn.Parameter]:
    params = []
    for grad in grads:
        param = torch.nn.Parameter(torch.zeros(len(grad)))
        param.grad = torch.tensor(grad)
        params.append(param)
    return params


def test_clipping_matches_torch_exactly_on_one_process() -> None:
    expected, actual = _params_with_grads([1.0], [1.0]), _params_with_grads([1.0], [1.0])
    expected_norm = torch.nn.utils.clip_grad_norm_(expected, 0.1)
    norm = ds_utils.clip_grad_norm_(actual, max_norm=0.1)
    assert norm.dtype == torch.float32 and torch.equal(norm, expected_norm)
    assert all(torch.equal(e.grad, a.grad) for e, a in zip(expected, actual))


def test_clipping_leaves_gradients_within_the_bound_and_skips_params_without_one() -> None:
    params = _params_with_grads([3.0, 4.0])
    params.append(torch.nn.Parameter(torch.zeros(2)))  # no gradient: neither counted nor touched
    norm = clip_grads_to_norm_(params, 10.0)
    assert norm.item() == 5.0 and params[0].grad.tolist() == [3.0, 4.0] and params[1].grad is None
    rng = torch.Generator().manual_seed(0)
    grads = [torch.randn(7, generator=rng).tolist(), torch.randn(3, generator=rng).tolist()]
    expected, actual = _params_with_grads(*grads), _params_with_grads(*grads)
    torch.testing.assert_close(ds_utils.clip_grad_norm_(actual, 0.5), torch.nn.utils.clip_grad_norm_(expected, 0.5))
    assert all(torch.allclose(e.grad, a.grad) for e, a in zip(expected, actual))


def test_a_non_finite_norm_is_inf_for_clipping_and_minus_one_for_the_weight_norm() -> None:
    assert math.isinf(clip_grads_to_norm_(_params_with_grads([1.0, float("nan")]), 1.0).item())
    assert ds_utils.get_weight_norm([torch.tensor([1.0, float("inf")])]) == -1
    assert ds_utils.get_weight_norm(torch.tensor([3.0, 4.0])) == 5.0


def test_only_the_l2_norm_is_computed() -> None:
    with pytest.raises(ValueError, match="norm_type=inf; zerotune computes the L2 norm only"):
        ds_utils.clip_grad_norm_(_params_with_grads([1.0]), 1.0, norm_type=float("inf"))


def test_check_overflow_on_one_process_looks_at_this_ranks_gradients() -> None:
    finite, infinite = _params_with_grads([1.0]), _params_with_grads([float("inf")])
    assert not ds_utils.CheckOverflow([finite]).check()
    assert ds_utils.CheckOverflow([finite]).check([infinite])
    assert ds_utils.CheckOverflow().has_overflow_serial(infinite)
    assert ds_utils.CheckOverflow().check_using_norm([1.0, -1], reduce_overflow=False)
    assert not ds_utils.CheckOverflow().check_using_norm([torch.tensor(2.0)], reduce_overflow=False)
    with pytest.raises(ValueError, match="no parameters"):
        ds_utils.CheckOverflow().check()


def test_count_used_parameters_counts_what_this_backward_reaches() -> None:
    used, unused, frozen = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    frozen.requires_grad_(False)
    seen = {}

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen["count"] = ds_utils.count_used_parameters_in_backward([used, unused, frozen, used])
        return grad

    used.register_hook(hook)
    ((used * frozen).sum() + 0 * unused.detach().sum()).backward()
    assert seen["count"] == 1
    with pytest.raises(RuntimeError, match="during backward"):
        ds_utils.count_used_parameters_in_backward([used])


def test_expert_rank_lists_with_tensor_parallelism_follow_deepspeeds_layout() -> None:
    # DeepSpeed's docstring example: 16 ranks, tensor parallel 2, 4 experts per group
    experts, data = groups._get_expert_parallel_ranks(world_size=16, tensor_parallel_size_=2, expert_parallel_size_=4)
    assert experts == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert data == [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11], [5, 13], [7, 15]]
    assert groups._get_expert_parallel_ranks(8, 1, 2, 2, True) == groups.expert_rank_lists(8, 2, 2, True)
    with pytest.raises(ValueError, match="does not divide"):
        groups._get_expert_parallel_ranks(16, 2, 3)


def test_expert_rank_lists_follow_deepspeeds_layout() -> None:
    assert groups.expert_rank_lists(8, 2) == ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]])
    assert groups.expert_rank_lists(8, 2, data_before_expert=True) == ([[0, 4], [1, 5], [2, 6], [3, 7]],
                                                                       [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert groups.expert_rank_lists(8, 2, pipe_size=2) == ([[0, 1], [2, 3], [4, 5], [6, 7]],
                                                           [[0, 2], [1, 3], [4, 6], [5, 7]])
    with pytest.raises(ValueError, match="expert parallel size 3 does not divide the 4 ranks"):
        groups.expert_rank_lists(4, 3)


# ---- two ranks --------------------------------------------------------------------------------------
class _WorldMpu:
    """A Megatron mpu whose model-parallel group is the whole world."""

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return dist.group.WORLD

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank()


def _forget_expert_groups() -> None:
    # the harness destroys a task's subgroups after it; the registry must not hand them to the next task
    groups._expert_groups.clear()
    groups._expert_data_groups.clear()


def _norms_and_overflow_on_two_ranks() -> dict:
    rank = dist.get_rank()
    try:
        out: dict = {}
        params = _params_with_grads([1.0], [float(rank + 1)])
        out["norm"] = ds_utils.clip_grad_norm_(params, max_norm=0.1).item()
        # model parallel: the replicated parameter counted on rank 0 only, the split one on both
        replicated, split = _params_with_grads([3.0], [float(4 * rank)])
        split.model_parallel = True
        out["mp_norm"] = ds_utils.clip_grad_norm_([replicated, split], max_norm=100.0, mpu=_WorldMpu()).item()
        weights = [torch.tensor([3.0]), torch.tensor([4.0 * rank])]
        weights[1].model_parallel = True
        out["weight_norm"] = ds_utils.get_weight_norm(weights, mpu=_WorldMpu())

        with pytest.raises(RuntimeError, match="no expert groups exist"):
            groups._get_max_expert_parallel_group()
        groups._create_expert_and_data_parallel(2)
        groups._create_expert_and_data_parallel(2)  # once per size
        out["expert"] = (groups._get_expert_parallel_world_size("ep_size_2"),
                         groups._get_expert_parallel_rank("ep_size_2"),
                         groups._get_expert_data_parallel_world_size("ep_size_2"), groups._get_max_expert_size())
        expert = _params_with_grads([float("inf") if rank == 1 else 1.0])[0]
        expert.allreduce = False  # DeepSpeed's mark of an expert's parameter
        dense = _params_with_grads([1.0])
        out["overflow_check"] = ds_utils.CheckOverflow([[*dense, expert]]).check()
        norm = ds_utils.get_weight_norm([expert.grad])
        out["overflow_norm"] = ds_utils.CheckOverflow([[*dense, expert]]).check_using_norm([norm], False)
        local = _params_with_grads([float("inf") if rank == 1 else 1.0])
        out["alone"] = ds_utils.CheckOverflow([local]).check()
        out["zero_reduce_scatter"] = ds_utils.CheckOverflow([local], zero_reduce_scatter=True).check()
        out["world_by_norm"] = ds_utils.CheckOverflow().check_using_norm([-1 if rank == 1 else 1.0])
        with pytest.raises(DeepSpeedFeatureNotSupported, match="model parallelism"):
            groups._create_expert_and_data_parallel(2, mp_size=2)
        return out
    finally:
        _forget_expert_groups()


def test_norms_and_overflow_agree_across_two_ranks() -> None:
    results = run_distributed(_norms_and_overflow_on_two_ranks, 2)
    for rank, out in enumerate(results):
        # the ranks' norms sqrt(2) and sqrt(5) shared as their root mean square
        assert out["norm"] == pytest.approx(math.sqrt(3.5), rel=1e-6)
        assert out["mp_norm"] == pytest.approx(5.0) and out["weight_norm"] == pytest.approx(5.0)
        assert out["expert"] == (2, rank, 1, 2)
        assert out["overflow_check"] and out["overflow_norm"]  # rank 0 learns of rank 1's expert overflow
        assert out["alone"] == (rank == 1)  # no expert parameter, no mpu, no engine: each rank answers for itself
        assert out["zero_reduce_scatter"] and out["world_by_norm"]
    assert results[0]["norm"] == results[1]["norm"]


def test_move_to_device_nested_and_in_place():
    a, b, c = torch.zeros(2), torch.ones(3, dtype=torch.float64), torch.arange(4)
    moved = ds_utils.move_to_device({"x": [a, (b,)], "y": c}, "cpu")
    assert isinstance(moved["x"], list) and isinstance(moved["x"][1], tuple)
    assert torch.equal(moved["x"][1][0], b) and torch.equal(moved["y"], c)
    kept = ds_utils.move_to_device([a, c], torch.device("cpu"), criterion_func=lambda t: isinstance(t, torch.Tensor))
    assert kept[0] is a and kept[1] is c  # accepted tensors are moved in place: the same objects come back
    with pytest.raises(TypeError, match="str"):
        ds_utils.move_to_device({"x": "text"}, "cpu")
