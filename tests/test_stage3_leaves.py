"""ZeRO-3 leaf modules chosen by name, by name suffix, by ``module.qualname`` and from the config's
``zero_optimization.leaf_module`` block (``zero/stage3/leaves.py``): each marks what DeepSpeed's does, and a
config-chosen leaf with data-dependent experts trains on 2 ranks to single-process PyTorch's numbers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerotune
from tests.harness import run_distributed
from tests.logs import recorded_messages
from tests.models import Trace, assert_close_traces, loss_of, rank_slice, reference_run
from tests.test_compat_runtime import _Experts, _moe_batch, _MoEModel
from zerotune.config import load_config
from zerotune.config.errors import ConfigError
from zerotune.config.leaf_module_section import DEFAULT_LEAF_MODULE_CLASSES, LeafModuleConfig
from zerotune.zero.stage3.leaves import (
    apply_leaf_config,
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    z3_leaf_module,
)
from zerotune.zero.stage3.wrap import unit_module_names


def test_by_qualified_class_name_marks_the_instances_only() -> None:
    model = _MoEModel()
    marked = set_z3_leaf_modules(model, [f"{_Experts.__module__}.{_Experts.__qualname__}"])
    assert marked == [model.moe] and z3_leaf_module(model.moe) and not z3_leaf_module(model)
    assert set_z3_leaf_modules(model, ["NoSuchClass"], raise_if_not_found=False) == []


def test_by_name_returns_the_marked_and_the_missing() -> None:
    model = _MoEModel()
    assert set_z3_leaf_modules_by_name(model, ["moe", "nope"], raise_if_not_found=False) == ([model.moe], ["nope"])
    assert get_z3_leaf_modules(model) == [model.moe]
    assert unit_module_names(model) == ["inp", "moe", "out"]  # the leaf's experts are no units of their own
    with pytest.raises(ValueError, match=r"no module named \['nope'\]"):
        set_z3_leaf_modules_by_name(model, ["nope"])
    set_z3_leaf_modules_by_name(model, ["moe"], flag=False)
    assert not z3_leaf_module(model.moe)


def test_by_suffix_marks_each_module_once() -> None:
    model = _MoEModel()
    marked, missing = set_z3_leaf_modules_by_suffix(model, ["experts", "s", "zzz"], raise_if_not_found=False)
    assert missing == ["zzz"]
    assert [id(m) for m in marked] == [id(model.moe.experts)]  # "s" ends only "moe.experts" too
    with pytest.raises(ValueError, match="ends with"):
        set_z3_leaf_modules_by_suffix(model, ["zzz"])


def test_config_block_defaults_coercion_and_typos() -> None:
    assert load_config({}).zero_optimization.leaf_module.classes == DEFAULT_LEAF_MODULE_CLASSES
    block = load_config({"zero_optimization": {"leaf_module": {"classes": "a.B", "names": ["x", "x"],
                                                               "name_suffixes": "moe"}}}).zero_optimization.leaf_module
    assert (block.classes, block.names, block.name_suffixes) == (["a.B"], ["x"], ["moe"])
    with pytest.raises(ConfigError, match="leaf_module.suffixes"):
        load_config({"zero_optimization": {"leaf_module": {"suffixes": ["moe"]}}})


def test_apply_leaf_config_marks_and_warns_only_when_customized() -> None:
    model = _MoEModel()
    with recorded_messages() as messages:
        assert apply_leaf_config(model, LeafModuleConfig()) == []  # the defaults name HF MoE blocks: silent
    assert not messages
    with recorded_messages() as messages:
        marked = apply_leaf_config(model, LeafModuleConfig(classes=["_Experts"], names=["moe", "ghost"]))
    assert marked == [model.moe] and any("ghost" in m for m in messages)


def _config_leaf_stage3() -> Trace:
    """Four SGD steps at ZeRO-3 with the MoE block made a leaf by the config alone (no set_z3_leaf_modules)."""
    torch.manual_seed(0)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "leaf_module": {"name_suffixes": ["moe"]}}}
    engine, *_ = zerotune.initialize(model=_MoEModel(), config=config)
    losses, norms = [], []
    for step in range(4):
        loss = loss_of(engine, rank_slice(_moe_batch(step, 0, world), rank, world))
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
        norms.append(engine.get_global_grad_norm())
    engine.destroy()
    return Trace(losses, norms)


def test_config_chosen_leaf_trains_like_single_process_on_two_ranks() -> None:
    torch.manual_seed(0)
    reference_model = _MoEModel()
    reference = reference_run(reference_model, torch.optim.SGD(reference_model.parameters(), lr=0.1), _moe_batch,
                              steps=4, gas=1, global_rows=2, clip=0.0)
    for trace in run_distributed(_config_leaf_stage3, 2):
        assert_close_traces(trace, reference, rel=1e-5)


def test_initialize_marks_the_configured_leaves() -> None:
    run_distributed(_configured_leaves_marked, 1)  # (initialize makes a process group: never in the pytest process)


def _configured_leaves_marked() -> None:
    model = nn.Sequential(nn.Linear(4, 4), _Experts())
    zerotune.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                             "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                             "zero_optimization": {"stage": 3, "leaf_module": {"names": "1"}}})
    assert z3_leaf_module(model[1]) and not z3_leaf_module(model[0])


class _ByRank(nn.Module):
    """Each rank runs a different layer (DeepSpeed's ChooseModuleByRankModel): only a whole-model leaf keeps the ranks'
    gathers the same."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.linears[torch.distributed.get_rank() % 2](x), y[:, :1].expand(-1, 4))


def test_a_leaf_root_is_one_unit() -> None:
    model = _ByRank()
    assert unit_module_names(model) == ["linears.0", "linears.1"]
    set_z3_leaf_modules(model, [_ByRank])
    assert unit_module_names(model) == []


def _leaf_root_steps() -> list[float]:
    torch.manual_seed(0)
    model = _ByRank()
    set_z3_leaf_modules(model, [_ByRank])
    engine, *_ = zerotune.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    losses = []
    for step in range(2):
        loss = loss_of(engine, _moe_batch(step, torch.distributed.get_rank(), 1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses


def test_ranks_running_different_layers_of_a_leaf_root_do_not_hang() -> None:
    first, second = run_distributed(_leaf_root_steps, 2, timeout=120)
    assert len(first) == len(second) == 2
