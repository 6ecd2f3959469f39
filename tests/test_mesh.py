"""ParallelDims arithmetic (pure) and ProcessMesh axes on 2 and 4 gloo ranks.

Rank layout under test (DeepSpeed/Megatron): pipeline outermost, data, sequence, tensor innermost,
so consecutive ranks share a tensor-parallel group; ``dp_sp`` joins the data and sequence ranks.
"""

from __future__ import annotations

import pytest

from tests.harness import run_distributed
from zerotune.distributed.mesh import AXES, ParallelDims, build_mesh

# ----------------------------------------------------------------------------- ParallelDims (pure)


def test_defaults_are_pure_data_parallel():
    dims = ParallelDims(dp=4)
    assert (dims.pp, dims.dp, dims.sp, dims.tp) == (1, 4, 1, 1)
    assert dims.world_size == 4
    assert dims.shape() == (1, 4, 1, 1)


def test_shape_follows_axis_order_pp_dp_sp_tp():
    assert AXES == ("pp", "dp", "sp", "tp")
    dims = ParallelDims(dp=3, tp=2, pp=5, sp=7)
    assert dims.shape() == (5, 3, 7, 2)
    assert dims.world_size == 210


def test_from_world_with_sequence_parallel_leaves_the_rest_to_data_parallel():
    dims = ParallelDims.from_world(8, tp=2, sp=2)
    assert (dims.pp, dims.dp, dims.sp, dims.tp) == (1, 2, 2, 2)
    with pytest.raises(ValueError, match="world size 6 is not divisible by tensor parallel 1 x pipeline parallel 1 "
                                         "x sequence parallel 4"):
        ParallelDims.from_world(6, sp=4)


@pytest.mark.parametrize("world, tp, pp, dp", [(8, 1, 1, 8), (8, 2, 1, 4), (8, 2, 2, 2), (8, 8, 1, 1),
                                               (12, 3, 2, 2), (1, 1, 1, 1)])
def test_from_world_leaves_the_rest_to_data_parallel(world, tp, pp, dp):
    dims = ParallelDims.from_world(world, tp=tp, pp=pp)
    assert (dims.pp, dims.dp, dims.tp) == (pp, dp, tp)
    assert dims.world_size == world


@pytest.mark.parametrize("world, tp, pp", [(8, 3, 1), (6, 2, 2), (2, 4, 1)])
def test_from_world_indivisible_names_the_sizes(world, tp, pp):
    with pytest.raises(ValueError, match=rf"world size {world} is not divisible by tensor parallel {tp} "
                                         rf"x pipeline parallel {pp}"):
        ParallelDims.from_world(world, tp=tp, pp=pp)


@pytest.mark.parametrize("kwargs, bad", [({"dp": 0}, "dp=0"), ({"dp": -2}, "dp=-2"), ({"dp": 2, "tp": 0}, "tp=0"),
                                         ({"dp": 2, "pp": -1}, "pp=-1"), ({"dp": 2.0}, "dp=2.0"),
                                         ({"dp": "2"}, "dp='2'")])
def test_invalid_sizes_are_named(kwargs, bad):
    with pytest.raises(ValueError, match=rf"parallel size {bad} must be a positive integer"):
        ParallelDims(**kwargs)


@pytest.mark.parametrize("kwargs, bad", [({"tp": 0}, "tp=0"), ({"pp": 0}, "pp=0"), ({"tp": -1}, "tp=-1")])
def test_from_world_with_invalid_model_parallel_size_is_named(kwargs, bad):
    # Checked before the divisibility arithmetic (tp=0 would otherwise divide by zero).
    with pytest.raises(ValueError, match=rf"parallel size {bad} must be a positive integer"):
        ParallelDims.from_world(8, **kwargs)


def test_dims_are_immutable():
    dims = ParallelDims(dp=2)
    with pytest.raises(AttributeError):
        dims.dp = 4  # type: ignore[misc]


# ----------------------------------------------------------------------------- ProcessMesh on gloo ranks


def _describe(mesh) -> dict:
    import torch.distributed as dist
    out = {}
    for axis in AXES + ("dp_sp",):
        group = mesh.group(axis)
        members = None if group is None else dist.get_process_group_ranks(group)
        out[axis] = (mesh.size(axis), mesh.rank(axis), members)
    return out


def _meshes_on_rank(layouts: list[dict]) -> list[dict]:
    return [_describe(build_mesh(ParallelDims(**dims), "cpu")) for dims in layouts]


def _without_sp(described: dict) -> dict:
    """The pp/dp/tp view of a mesh without sequence parallelism (and checks the sp axes are trivial)."""
    assert described["sp"] == (1, 0, None)
    assert described["dp_sp"] == described["dp"]
    return {axis: described[axis] for axis in ("pp", "dp", "tp")}


def test_mesh_on_two_ranks():
    layouts = [{"dp": 2}, {"dp": 1, "tp": 2}, {"dp": 1, "pp": 2}]
    per_rank = [[_without_sp(d) for d in meshes] for meshes in run_distributed(_meshes_on_rank, 2, layouts)]
    for rank, (dp_only, tp_only, pp_only) in enumerate(per_rank):
        assert dp_only == {"pp": (1, 0, None), "dp": (2, rank, [0, 1]), "tp": (1, 0, None)}
        # The data-parallel axis is always a real group, even of one rank.
        assert tp_only == {"pp": (1, 0, None), "dp": (1, 0, [rank]), "tp": (2, rank, [0, 1])}
        assert pp_only == {"pp": (2, rank, [0, 1]), "dp": (1, 0, [rank]), "tp": (1, 0, None)}


def test_mesh_on_four_ranks():
    layouts = [{"dp": 4}, {"dp": 2, "tp": 2}, {"dp": 2, "pp": 2}, {"dp": 1, "tp": 2, "pp": 2}]
    per_rank = [[_without_sp(d) for d in meshes] for meshes in run_distributed(_meshes_on_rank, 4, layouts)]
    for rank, (dp_only, dp_tp, pp_dp, pp_tp) in enumerate(per_rank):
        assert dp_only == {"pp": (1, 0, None), "dp": (4, rank, [0, 1, 2, 3]), "tp": (1, 0, None)}
        # tp innermost: {0,1} and {2,3} share tensor parallelism; dp groups are {0,2} and {1,3}.
        assert dp_tp == {"pp": (1, 0, None), "dp": (2, rank // 2, [rank % 2, rank % 2 + 2]),
                         "tp": (2, rank % 2, [rank - rank % 2, rank - rank % 2 + 1])}
        # pp outermost: stages {0,1} and {2,3}; dp groups {0,1} and {2,3}, pp groups {0,2} and {1,3}.
        assert pp_dp == {"pp": (2, rank // 2, [rank % 2, rank % 2 + 2]),
                         "dp": (2, rank % 2, [rank - rank % 2, rank - rank % 2 + 1]), "tp": (1, 0, None)}
        assert pp_tp == {"pp": (2, rank // 2, [rank % 2, rank % 2 + 2]), "dp": (1, 0, [rank]),
                         "tp": (2, rank % 2, [rank - rank % 2, rank - rank % 2 + 1])}


def test_sequence_axis_sits_between_data_and_tensor_and_dp_sp_joins_them():
    layouts = [{"dp": 1, "sp": 2}, {"dp": 2, "sp": 2}, {"dp": 1, "sp": 2, "tp": 2}]
    per_rank = run_distributed(_meshes_on_rank, 4, [{"dp": 2, "sp": 2}, {"dp": 1, "sp": 2, "tp": 2}])
    for rank, (dp_sp, sp_tp) in enumerate(per_rank):
        # dp 2 x sp 2: sp groups {0,1}, {2,3}; dp groups {0,2}, {1,3}; dp_sp = everyone, in dp-major order.
        assert dp_sp["sp"] == (2, rank % 2, [rank - rank % 2, rank - rank % 2 + 1])
        assert dp_sp["dp"] == (2, rank // 2, [rank % 2, rank % 2 + 2])
        assert dp_sp["dp_sp"] == (4, rank, [0, 1, 2, 3])
        # sp 2 x tp 2: tp groups {0,1}, {2,3}; sp groups {0,2}, {1,3}; dp_sp is the sp group.
        assert sp_tp["tp"] == (2, rank % 2, [rank - rank % 2, rank - rank % 2 + 1])
        assert sp_tp["sp"] == (2, rank // 2, [rank % 2, rank % 2 + 2])
        assert sp_tp["dp_sp"] == sp_tp["sp"]
        assert sp_tp["dp"] == (1, 0, [rank])
    two = run_distributed(_meshes_on_rank, 2, layouts[:1])
    for rank, (sp_only,) in enumerate(two):
        assert sp_only["dp_sp"] == sp_only["sp"] == (2, rank, [0, 1])


def _mismatched_world(dims: dict) -> str:
    try:
        build_mesh(ParallelDims(**dims), "cpu")
    except ValueError as error:
        return str(error)
    return "no error"


def test_mesh_that_does_not_match_the_world_is_refused():
    messages = run_distributed(_mismatched_world, 2, {"dp": 2, "tp": 2})
    for message in messages:
        assert "pp=1 x dp=2 x tp=2 = 4 do not match the world size 2" in message


def _unknown_axis_errors() -> list[bool]:
    mesh = build_mesh(ParallelDims(dp=2), "cpu")
    refused = []
    for ask in (mesh.size, mesh.rank, mesh.group):
        try:
            ask("pd")  # a typo of "dp"
            refused.append(False)
        except ValueError as error:
            refused.append("pd" in str(error) and "dp" in str(error))
        except Exception:  # noqa: BLE001 - any other error is not the clear ValueError wanted
            refused.append(False)
    return refused


def test_unknown_axis_is_a_clear_error():
    assert run_distributed(_unknown_axis_errors, 2) == [[True, True, True]] * 2
