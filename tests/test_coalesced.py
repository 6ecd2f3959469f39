"""``zerotune.zero.coalesced.reduce_scatter_coalesced`` (DeepSpeed's ``runtime.comm.coalesced_collectives``): several
tensors averaged in one counted reduce-scatter, each rank keeping its ``ceil(n / world)`` partition of each."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed


def _coalesced(sizes: list[int]) -> dict:
    import torch.distributed as dist

    import zerotune.comm as zcomm
    from zerotune.compat.coalesced_collectives import reduce_scatter_coalesced

    rank = dist.get_rank()
    inputs = [torch.arange(float(n)) * (rank + 1) for n in sizes]
    before = [t.clone() for t in inputs]
    zcomm.reset_comm_stats()
    outputs = reduce_scatter_coalesced(inputs)
    stats = zcomm.comm_stats()
    return {"outputs": [o.tolist() for o in outputs], "calls": {op: s.calls for op, s in stats.items()},
            "inputs_kept": all(torch.equal(a, b) for a, b in zip(inputs, before))}


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_gets_the_mean_of_its_partition_of_each_tensor_in_one_collective(world: int) -> None:
    sizes = [6, 3, 1, 7]
    results = run_distributed(_coalesced, world, sizes)
    mean_factor = sum(r + 1 for r in range(world)) / world
    for rank, result in enumerate(results):
        assert result["calls"] == {"reduce_scatter": 1}  # one collective for all four tensors, counted
        assert result["inputs_kept"]
        for n, got in zip(sizes, result["outputs"]):
            shard = -(-n // world)
            lo, hi = min(n, rank * shard), min(n, (rank + 1) * shard)
            assert got == pytest.approx([i * mean_factor for i in range(lo, hi)])


def test_single_process_group_none_returns_each_tensor_whole() -> None:
    from zerotune.zero.coalesced import reduce_scatter_coalesced

    a, b = torch.arange(4.0).view(2, 2), torch.ones(3)
    out = reduce_scatter_coalesced([a, b], None)
    assert [o.tolist() for o in out] == [[0.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0]]


def test_mixed_dtypes_are_a_clear_error() -> None:
    from zerotune.zero.coalesced import reduce_scatter_coalesced

    with pytest.raises(ValueError, match="one dtype and device"):
        reduce_scatter_coalesced([torch.ones(2), torch.ones(2, dtype=torch.float16)], None)


def test_quantized_all_to_all_is_refused_in_one_line() -> None:
    from zerotune.compat.coalesced_collectives import all_to_all_quant_reduce
    from zerotune.compat.paths import DeepSpeedFeatureNotSupported

    with pytest.raises(DeepSpeedFeatureNotSupported, match="qgZ"):
        all_to_all_quant_reduce([torch.zeros(4)], {})
