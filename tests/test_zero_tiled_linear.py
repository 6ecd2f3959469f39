"""``TiledLinear`` (``zero/tiled_linear.py``, DeepSpeed's ``runtime.zero.tiling``): tiles hold ``nn.Linear``'s
weight blocks, compute its outputs and gradients, and under ZeRO-3 on 2 ranks each tile is its own unit (gathered
alone) while training reproduces single-process ``nn.Linear`` training."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zerotune
from tests.harness import run_distributed
from tests.models import Trace, assert_close_traces, engine_run, mlp_batch, reference_run
from zerotune.zero.stage3.wrap import unit_module_names
from zerotune.zero.tiled_linear import TiledLinear, TiledLinearReturnBias, uniform_boundaries


def test_uniform_boundaries_put_the_larger_runs_first() -> None:
    assert uniform_boundaries(10, 4) == [0, 3, 6, 8, 10]
    assert uniform_boundaries(32, 32) == list(range(33))
    assert uniform_boundaries(40, 1) == [0, 40]


@pytest.mark.parametrize("splits", [(0, 1), (1, 0), (33, 1), (1, 41)])
def test_splits_outside_the_features_are_refused_naming_the_value(splits: tuple[int, int]) -> None:
    with pytest.raises(RuntimeError, match=r"splits must be in \[1, (in|out)_features=\d+\], got \d+"):
        TiledLinear(32, 40, in_splits=splits[0], out_splits=splits[1])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("splits", [(1, 1), (2, 3), (5, 5), (23, 29)])
@pytest.mark.parametrize("shape", [(23,), (4, 23), (2, 3, 23)])
def test_tiles_hold_the_blocks_and_compute_like_the_whole_layer(bias: bool, splits: tuple[int, int],
                                                                shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    base = nn.Linear(23, 29, bias=bias)
    tiled = TiledLinear(23, 29, bias=bias, in_splits=splits[0], out_splits=splits[1], init_linear=copy.deepcopy(base))
    for o in range(splits[1]):
        for i in range(splits[0]):
            tile = tiled.linears[o][i]
            rows = slice(tiled.out_parts[o], tiled.out_parts[o + 1])
            cols = slice(tiled.in_parts[i], tiled.in_parts[i + 1])
            assert torch.equal(tile.weight, base.weight[rows, cols])
            assert (tile.bias is not None) == (bias and i == splits[0] - 1)
    x = torch.randn(*shape)
    x_tiled = x.clone().requires_grad_()
    x.requires_grad_()
    torch.testing.assert_close(tiled(x_tiled), base(x))
    (base(x) ** 2).sum().backward()
    (tiled(x_tiled) ** 2).sum().backward()
    torch.testing.assert_close(x_tiled.grad, x.grad)
    for o in range(splits[1]):
        rows = slice(tiled.out_parts[o], tiled.out_parts[o + 1])
        for i in range(splits[0]):
            tile = tiled.linears[o][i]
            cols = slice(tiled.in_parts[i], tiled.in_parts[i + 1])
            torch.testing.assert_close(tile.weight.grad, base.weight.grad[rows, cols])
            if tile.bias is not None:
                torch.testing.assert_close(tile.bias.grad, base.bias.grad[rows])


def test_split_input_and_uncombined_output() -> None:
    torch.manual_seed(0)
    base = nn.Linear(10, 6)
    tiled = TiledLinear(10, 6, in_splits=3, out_splits=2, input_is_already_split=True, combine_out_splits=False,
                        init_linear=base)
    x = torch.randn(5, 10)
    chunks = torch.split(x, [tiled.in_parts[i + 1] - tiled.in_parts[i] for i in range(3)], dim=-1)
    outputs = tiled(chunks)
    assert isinstance(outputs, list) and len(outputs) == 2
    torch.testing.assert_close(torch.cat(outputs, dim=-1), base(x))
    with pytest.raises(ValueError, match="in_splits=3.*got 2 input chunks"):
        tiled(chunks[:2])


class _ReturnsBias(nn.Linear):
    """Megatron-LM's style: the bias is returned, not added."""

    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # type: ignore[override]
        return nn.functional.linear(input, self.weight), self.bias


@pytest.mark.parametrize("bias", [False, True])
def test_return_bias_tiles_return_the_output_and_the_whole_bias(bias: bool) -> None:
    torch.manual_seed(0)
    base = _ReturnsBias(12, 9, bias=bias)
    tiled = TiledLinearReturnBias(12, 9, bias=bias, in_splits=2, out_splits=3, linear_cls=_ReturnsBias,
                                  init_linear=copy.deepcopy(base))
    x = torch.randn(4, 12)
    (out, out_bias), (want, want_bias) = tiled(x), base(x)
    torch.testing.assert_close(out, want)
    if bias:
        torch.testing.assert_close(out_bias, want_bias)
    else:
        assert out_bias is None


def test_copy_params_from_checks_the_shapes() -> None:
    tiled = TiledLinear(4, 6, in_splits=2, out_splits=2)
    with pytest.raises(ValueError, match=r"weight of shape \(6, 5\), expected \(6, 4\)"):
        tiled.copy_params_from(nn.Linear(5, 6))
    with pytest.raises(ValueError, match="bias None, expected"):
        tiled.copy_params_from(nn.Linear(4, 6, bias=False))


# ---- ZeRO-3 on 2 ranks ----------------------------------------------------------------------------------------
class _Net(nn.Module):
    """8 -> 16 -> 12 -> 4 with the middle layer ``nn.Linear`` or tiled (2 input x 3 output tiles)."""

    def __init__(self, tiled_from: nn.Linear | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mid = (nn.Linear(16, 12) if tiled_from is None else
                    TiledLinear(16, 12, in_splits=2, out_splits=3, init_linear=tiled_from))
        self.out = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        return nn.functional.mse_loss(self.out(hidden), y)


def _tiled_stage3(use_zero_init: bool) -> dict:
    world = torch.distributed.get_world_size()
    torch.manual_seed(0)
    reference_model = _Net()
    start = copy.deepcopy(reference_model)
    optimizer = torch.optim.AdamW(reference_model.parameters(), lr=0.01, weight_decay=0.0)
    reference = reference_run(reference_model, optimizer, mlp_batch, steps=6, gas=1, global_rows=2 * world, clip=0.0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if use_zero_init:  # tiles partitioned as built; copy_params_from writes rank 0's blocks through the shards
        with zerotune.zero.Init(config_dict_or_path=config):
            model = _Net(tiled_from=start.mid)
    else:
        model = _Net(tiled_from=start.mid)
    with torch.no_grad(), zerotune.zero.GatheredParameters(list(model.inp.parameters()) + list(model.out.parameters()),
                                                           modifier_rank=0):
        for name in ("inp", "out"):
            for mine, theirs in zip(getattr(model, name).parameters(), getattr(start, name).parameters()):
                mine.copy_(theirs)
    units = unit_module_names(model)
    tiles = [tile for row in model.mid.linears for tile in row]
    most_gathered = 0

    def count_gathered(*_: object) -> None:
        nonlocal most_gathered
        most_gathered = max(most_gathered, sum(t.weight.ds_status.name == "AVAILABLE" for t in tiles))

    engine, *_ = zerotune.initialize(model=model, config=config)
    hooks = [tile.register_forward_pre_hook(count_gathered) for tile in tiles]
    trace: Trace = engine_run(engine, mlp_batch, steps=6, gas=1, global_rows=2 * world)
    for hook in hooks:
        hook.remove()
    engine.destroy()
    return {"trace": trace, "reference": reference, "units": units, "most_gathered": most_gathered,
            "tiles": len(tiles)}


@pytest.mark.parametrize("use_zero_init", [False, True])
def test_tiled_layer_trains_like_nn_linear_at_zero3_on_two_ranks(use_zero_init: bool) -> None:
    for result in run_distributed(_tiled_stage3, 2, use_zero_init, timeout=120):
        assert {f"mid.linears.{o}.{i}" for o in range(3) for i in range(2)} <= set(result["units"])
        assert 1 <= result["most_gathered"] < result["tiles"]  # tiles gathered a few at a time, never all at once
        assert_close_traces(result["trace"], result["reference"], rel=1e-5)
