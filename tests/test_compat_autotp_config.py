"""DeepSpeed's AutoTP partition config and Hugging Face tp-plan API on zerotune's tensor-parallel rules.

``deepspeed.module_inject.autotp_config`` parses and validates as DeepSpeed does and converts to zerotune's
``LayerRule``s (same matches, fused parts; layouts zerotune cannot record refused); ``TPPlanConverter`` and
``_get_hf_tp_plan`` read a model's own plan; a model with no built-in plan and no user rules trains split by
its own plan (tp 2, a gathered column head) with the losses of the unsplit model.
"""

from __future__ import annotations

import re

import pytest
import torch

import zerotune
from tests.harness import run_distributed
from tests.models import assert_close_traces, engine_run, mlp_batch, reference_run
from zerotune.compat.alias import install_deepspeed_alias
from zerotune.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from zerotune.parallel.tensor.plans import rules_from_config

install_deepspeed_alias()

from deepspeed.module_inject.autotp_config import AutoTPConfig, PartitionType, TPLayerSpec  # noqa: E402
from deepspeed.module_inject.tp_plan_converter import TPPlanConverter  # noqa: E402
from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan  # noqa: E402

from zerotune.compat.autotp_config import layer_rules  # noqa: E402


def test_from_dict_parses_and_converts_to_rules() -> None:
    config = AutoTPConfig.from_dict({"use_default_specs": False, "layer_specs": [
        {"patterns": [r".*\.q_proj"], "partition_type": "COLUMN", "gather_output": True},
        {"patterns": [r".*\.qkv\.weight$"], "partition_type": "column", "shape": [[8, 8, 8], -1], "partition_dim": 0},
        {"patterns": [r".*\.o_proj"], "partition_type": "row", "model_types": ["llama"]}]})
    assert not config.use_default_specs and config.layer_specs[0].partition_type is PartitionType.COLUMN
    assert config.layer_specs[1].shape == ((8, 8, 8), -1) and config.layer_specs[1].get_num_sub_params() == 3
    assert config.find_matching_spec("model.layers.0.q_proj.weight") is config.layer_specs[0]  # re.match: prefix
    assert config.find_matching_spec("layers.0.o_proj.weight", "gpt2") is None
    rules = layer_rules(config, "gpt2")  # the llama-only spec left out
    assert [(r.partition_type, r.parts, r.gather_output) for r in rules] == [("column", 1, True), ("column", 3, False)]
    assert rules[0].matches("model.layers.0.q_proj.weight") and not rules[0].matches("layers.0.k_proj.weight")
    section_rule = rules_from_config([{"patterns": [r".*\.q_proj"], "partition_type": "column"}])[0]
    assert section_rule.matches("model.layers.0.q_proj.weight")  # the engine's config matches as DeepSpeed's does


@pytest.mark.parametrize("spec, message", [
    ({"patterns": [".*"], "shape": [2, [1, 1]]}, "nested tuple only allowed at partition_dim"),
    ({"patterns": [".*"], "shape": [0, -1]}, "positive integers or -1"),
    ({"patterns": [".*"], "partition_type": "diagonal"}, "partition_type must be one of"),
])
def test_from_dict_refuses_bad_specs(spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AutoTPConfig.from_dict({"layer_specs": [spec]})


def test_layouts_zerotune_cannot_record_are_refused() -> None:
    uneven = AutoTPConfig(layer_specs=[TPLayerSpec([".*qkv.*"], PartitionType.COLUMN, shape=((8, 4, 4), -1))])
    with pytest.raises(ValueError, match=r"unequal sub-parameter sizes \(8, 4, 4\)"):
        layer_rules(uneven)
    moe = AutoTPConfig(layer_specs=[TPLayerSpec([".*w1.*"], "column", shape=(4, -1, 8), partition_dim=1)])
    with pytest.raises(ValueError, match="2-D shape split at partition_dim 0"):
        layer_rules(moe)


def test_hf_plan_converter_and_extraction() -> None:
    specs = TPPlanConverter.convert({"layers.*.q_proj": "colwise", "layers.*.o_proj.weight": "rowwise",
                                     "lm_head": "colwise_rep"})
    assert [(s.partition_type, s.gather_output) for s in specs] == [
        (PartitionType.COLUMN, False), (PartitionType.ROW, False), (PartitionType.COLUMN, True)]
    assert specs[0].patterns == [r".*layers\..*\.q_proj\.weight$"] and specs[1].patterns[0].endswith(r"\.weight$")
    assert re.match(specs[0].patterns[0], "model.layers.3.q_proj.weight")
    assert TPPlanConverter.convert({"layers.*.q_proj": "local_colwise"}) is None

    class Config:
        base_model_tp_plan = {"layers.*.q_proj": "colwise"}

    class Model:
        _tp_plan = {"lm_head": "colwise_gather_output"}

        def __init__(self) -> None:
            self.config = Config()
            self._tp_plan = {"model.layers.*.q_proj": "colwise", "extra": "rowwise"}

    assert _get_hf_tp_plan(Model()) == {"layers.*.q_proj": "colwise", "lm_head": "colwise_gather_output",
                                        "extra": "rowwise"}
    assert _get_hf_tp_plan(torch.nn.Linear(2, 2)) is None


class HFPlanMLP(torch.nn.Module):
    """No built-in plan and no user rules: split by its own Hugging Face plan (a gathered column head too)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.config = type("Config", (), {"base_model_tp_plan": {"up": "colwise", "down": "rowwise",
                                                                 "head": "colwise_gather_output"}})()
        self.up, self.down, self.head = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8), torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = self.down(torch.nn.functional.gelu(self.up(x)))
        return torch.nn.functional.mse_loss(self.head(hidden), y)


# SGD: Adam's first steps move every weight by about lr whatever its gradient's size, so a gradient near zero
# that differs in the last bits (the row split sums in another order) moves the weight another way.
_CONFIG = {"train_micro_batch_size_per_gpu": 4, "tensor_parallel": {"autotp_size": 2},
           "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, "zero_optimization": {"stage": 1}}


def _hf_plan_run():
    engine, *_ = zerotune.initialize(model=HFPlanMLP(), config=_CONFIG)
    module = engine.module
    kinds = (isinstance(module.up, ColumnParallelLinear), isinstance(module.down, RowParallelLinear),
             module.head.gather_output,
             tuple(module.up.weight.shape), tuple(module.head.weight.shape))
    return kinds, engine_run(engine, mlp_batch, steps=4, gas=1, global_rows=4)


def test_hf_plan_model_trains_as_the_unsplit_model() -> None:
    model = HFPlanMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference = reference_run(model, optimizer, mlp_batch, steps=4, gas=1, global_rows=4, clip=0.0)
    for kinds, trace in run_distributed(_hf_plan_run, 2, timeout=120):
        assert kinds == (True, True, True, (16, 8), (2, 8))
        assert_close_traces(trace, reference, rel=1e-5)


class _Head(torch.nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.ModuleDict({"q_proj": torch.nn.Linear(4, 4)})])
        self.embed_tokens, self.lm_head = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


def _autotp(model: torch.nn.Module, config: AutoTPConfig):
    from deepspeed.module_inject.auto_tp import AutoTP

    autotp = AutoTP(module=model, all_reduce_linears=[], prefix="", state_dict=None, linear_layer_setting=None,
                    orig_layer_impl=None, partition_config=config)
    autotp.set_tensor_parallel_config(1, None)
    autotp.update_linear_policies()
    return autotp._replace_module(model)


def test_autotp_driver_splits_by_full_names_and_keeps_tied_heads_whole() -> None:
    from deepspeed.module_inject.auto_tp import AutoTP
    from deepspeed.module_inject.layers import LinearLayer

    config = AutoTPConfig(layer_specs=[TPLayerSpec([r"layers\.\d+\.q_proj"], PartitionType.COLUMN),
                                       TPLayerSpec([r".*lm_head\.weight$"], "column", gather_output=True)])
    untied, tied = _autotp(_Head(tied=False), config), _autotp(_Head(tied=True), config)
    assert isinstance(untied.layers[0]["q_proj"], LinearLayer) and untied.lm_head.gather_output
    assert type(tied.lm_head) is torch.nn.Linear and tied.lm_head.weight is tied.embed_tokens.weight
    with pytest.raises(ValueError, match="strict_mode: no layer_specs entry matches lm_head.weight"):
        _autotp(_Head(tied=False), AutoTPConfig(layer_specs=config.layer_specs[:1], strict_mode=True))
    with pytest.raises(ValueError, match="partition_config=None"):
        AutoTP(module=_Head(tied=False), all_reduce_linears=[], prefix="", state_dict=None, linear_layer_setting=None,
               orig_layer_impl=None)
