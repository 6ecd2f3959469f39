"""The ZeRO-3 names DeepSpeed's unit tests import from ``partition_parameters`` / ``parameter_offload``: the ones with
a zerotune counterpart behave as DeepSpeed's; the internals zerotune does differently refuse in one line."""

from __future__ import annotations

import pytest
import torch

from zerotune.compat import parameter_offload
from zerotune.compat import zero as compat_zero
from zerotune.compat.paths import DeepSpeedFeatureNotSupported
from zerotune.zero import Init


class _Handle:
    def __init__(self) -> None:
        self.seen: dict = {}

    def wait(self, *, handle_dependency: bool = True) -> None:  # keyword-only, as some handles take it
        self.seen = {"handle_dependency": handle_dependency}


def test_multiple_all_gather_handles_waits_each_with_the_flag_by_keyword() -> None:
    handles = [_Handle(), _Handle()]
    compat_zero.MultipleAllGatherHandles(handles).wait(handle_dependency=False)
    assert [h.seen for h in handles] == [{"handle_dependency": False}] * 2


@pytest.mark.parametrize(("size", "group", "env", "refused"), [
    (1, None, {"WORLD_SIZE": "8"}, True),
    (1, None, {"WORLD_SIZE": "1"}, False),
    (1, None, {}, False),
    (1, None, {"WORLD_SIZE": "eight"}, False),
    (8, None, {"WORLD_SIZE": "8"}, False),
    (1, object(), {"WORLD_SIZE": "8"}, False),
])
def test_single_rank_group_under_a_multi_rank_launcher(size: int, group: object, env: dict, refused: bool) -> None:
    message = compat_zero._contradicting_single_rank_pg_error(size, group, env=env)
    assert (message is not None) == refused
    if refused:
        assert "WORLD_SIZE=8" in message and "init_distributed" in message


def test_zero_init_refuses_to_build_unpartitioned_under_a_multi_rank_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")  # (no process group here: every rank would hold the whole model)
    with pytest.raises(RuntimeError, match="WORLD_SIZE=4"):
        Init()
    Init(enabled=False)  # a disabled context partitions nothing, so there is nothing to refuse
    monkeypatch.setenv("WORLD_SIZE", "1")
    with Init():
        layer = torch.nn.Linear(2, 2)
    assert layer.weight.ds_status == compat_zero.ZeroParamStatus.NOT_AVAILABLE


@pytest.mark.parametrize("make", [
    lambda: compat_zero.MiCS_Init(),
    lambda: compat_zero.InsertPostInitMethodToModuleSubClasses(),
    lambda: compat_zero.zero3_linear_wrap(torch.ones(1, 2), torch.ones(2, 2)),
    lambda: parameter_offload.ZeROOrderedDict(parent_module=torch.nn.Linear(2, 2)),
    lambda: parameter_offload.ensure_zero_ordered_dict(torch.nn.Linear(2, 2)),
    lambda: torch.Size(compat_zero.partitioned_param_data_shape),  # zerotune's sharded parameters keep their shape
])
def test_deepspeed_internals_zerotune_does_differently_refuse_in_one_line(make: object) -> None:
    with pytest.raises(DeepSpeedFeatureNotSupported) as refusal:
        make()  # type: ignore[operator]
    assert "\n" not in str(refusal.value)
