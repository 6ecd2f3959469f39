"""DeepSpeed's tensor-parallel layer names (``deepspeed.module_inject.layers``) on zerotune's layers, and the
engine surface DeepSpeed's AutoTP training tests use: skip-only partition configs, script-split models,
the tp data-consistency check, ``tp_model_init``'s merge into the config, ``deepspeed.utils.groups``.

One 2-rank world runs the layer and engine checks together (the suite is near its time limit).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.harness import run_distributed
from zerotune.compat.alias import install_deepspeed_alias

install_deepspeed_alias()

import deepspeed  # noqa: E402
from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer, LmHeadLinearAllreduce  # noqa: E402
from deepspeed.runtime.utils import is_model_parallel_parameter  # noqa: E402
from deepspeed.utils import groups  # noqa: E402

from zerotune.compat.tp_model_init import TPModelInitArgs, merge_tp_model_init, record_tp_model_init  # noqa: E402
from zerotune.parallel.tensor.consistency import INCONSISTENT_MESSAGE, TensorParallelDataMismatch  # noqa: E402
from zerotune.parallel.tensor.layers import RowParallelLinear  # noqa: E402

HIDDEN = 8
SKIP_ALL = {"use_default_specs": False, "layer_specs": [{"patterns": [r".*\.weight$"], "partition_type": "skip"}]}


class Stack(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(layers))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.linears:
            x = layer(x)
        return nn.functional.cross_entropy(x, y)


def _config(**tensor_parallel: object) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "tensor_parallel": {"autotp_size": 2, **tensor_parallel}, "steps_per_print": 1000}


def _check_layers(group: torch.distributed.ProcessGroup) -> None:
    """Forward and backward of each DeepSpeed layer name equal nn.Linear's (fp32), sliced where split."""
    rank = torch.distributed.get_rank(group)
    torch.manual_seed(0)
    x = torch.randn(3, HIDDEN, requires_grad=True)
    for make, sliced_input in ((lambda m: LinearLayer(m, group), False),
                               (lambda m: LinearLayer(m, group, gather_output=True), False),
                               (lambda m: LinearAllreduce(m, group), True),
                               (lambda m: LmHeadLinearAllreduce(m, group), False)):
        reference = nn.Linear(HIDDEN, HIDDEN)
        layer = make(copy.deepcopy(reference))
        assert isinstance(layer, (LinearLayer, LinearAllreduce))
        ref_out = reference(x)
        ref_out.square().sum().backward()
        ref_in_grad, x.grad = x.grad, None
        own = x.detach().chunk(2, dim=-1)[rank].requires_grad_() if sliced_input else x
        out = layer(own)
        whole = out.shape == ref_out.shape  # else a column split: this rank's output columns
        torch.testing.assert_close(out, ref_out if whole else ref_out.chunk(2, dim=-1)[rank], rtol=1e-6, atol=1e-6)
        out.square().sum().backward()
        dim = 1 if isinstance(layer, RowParallelLinear) else 0
        torch.testing.assert_close(layer.weight.grad, reference.weight.grad.chunk(2, dim=dim)[rank])
        if not sliced_input:  # the input gradient is whole again (summed over the ranks)
            torch.testing.assert_close(x.grad, ref_in_grad, rtol=1e-6, atol=1e-6)
        x.grad = None

    reference = nn.Linear(HIDDEN, HIDDEN)
    for layer in (LinearLayer(copy.deepcopy(reference), group), LinearAllreduce(copy.deepcopy(reference), group)):
        split = sum(p.numel() for p in layer.parameters())
        for param in layer.parameters():
            if is_model_parallel_parameter(param):
                param.gather_params([param])
        assert all(torch.equal(a, b) for a, b in zip(layer.parameters(), reference.parameters()))
        for param in layer.parameters():
            if is_model_parallel_parameter(param):
                param._tp_partition([param])
        assert sum(p.numel() for p in layer.parameters()) == split < sum(p.numel() for p in reference.parameters())


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(2, HIDDEN, generator=generator), torch.randint(0, HIDDEN, (2,), generator=generator))
            for _ in range(steps)]


def _train(engine: deepspeed.DeepSpeedEngine, steps: int) -> list[tuple[float, float]]:
    trace = []
    for x, y in _batches(steps):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        trace.append((loss.item(), engine.get_global_grad_norm()))
    return trace


def _world_checks() -> dict:
    _check_layers(torch.distributed.group.WORLD)
    # a skip-only partition config: tp groups, nothing split
    torch.manual_seed(2)
    base = Stack()
    script_split = copy.deepcopy(base)
    engine, *_ = deepspeed.initialize(model=base, config=_config(partition_config=SKIP_ALL))
    assert groups.get_tensor_model_parallel_world_size() == 2 and groups.get_data_parallel_world_size() == 1
    assert engine.autotp_size() == 2 and not any(is_model_parallel_parameter(p) for p in base.parameters())
    base_trace = _train(engine, 4)
    # the same model split by the script (column then row), trained as it is
    tp_group = groups.get_tensor_model_parallel_group()
    script_split.linears[1] = LinearLayer(script_split.linears[1], tp_group)
    script_split.linears[2] = LinearAllreduce(script_split.linears[2], tp_group)
    split_engine, *_ = deepspeed.initialize(model=script_split, config=_config())
    split_trace = _train(split_engine, 4)
    assert isinstance(split_engine.module.linears[1], LinearLayer)
    first_column = {"use_default_specs": False,
                    "layer_specs": [{"patterns": [r"linears\.0\.weight$"], "partition_type": "column"}]}
    column, *_ = deepspeed.initialize(model=Stack(), config={**_config(partition_config=first_column),
                                                             "zero_optimization": {"stage": 2}})
    weight = column.module.linears[0].weight  # the engine's own split: DeepSpeed's per-parameter hooks too
    shard_storage, shard_values = weight.data_ptr(), weight.detach().clone()
    weight.gather_params([weight])
    whole = tuple(weight.shape)
    weight._tp_partition([weight])
    assert whole == (HIDDEN, HIDDEN) and tuple(weight.shape) == (HIDDEN // 2, HIDDEN)
    # back in its own storage (a view of ZeRO's flat buffer at stages 1-2), with its values
    assert weight.data_ptr() == shard_storage and torch.equal(weight.detach(), shard_values)
    state = split_engine._consolidated_16bit_state_dict()
    # every rank of a tp group must run the same batch
    fresh, *_ = deepspeed.initialize(model=Stack(), config=_config(partition_config=SKIP_ALL))
    x, y = _batches(1)[0]
    with pytest.raises(TensorParallelDataMismatch) as raised:
        fresh(x + torch.distributed.get_rank(), y)
    return {"base": base_trace, "split": split_trace, "message": str(raised.value),
            "state_shapes": None if state is None else {k: tuple(v.shape) for k, v in state.items()}}


def test_deepspeed_tp_layers_and_engine_on_two_ranks() -> None:
    results = run_distributed(_world_checks, 2, timeout=120)
    for result in results:
        for (base_loss, base_norm), (loss, norm) in zip(result["base"], result["split"]):
            assert loss == pytest.approx(base_loss, rel=1e-5) and norm == pytest.approx(base_norm, rel=1e-5)
        assert result["message"] == INCONSISTENT_MESSAGE
    assert results[0]["state_shapes"]["linears.1.weight"] == (HIDDEN, HIDDEN)
    assert results[1]["state_shapes"] is None


def test_tp_model_init_merge_fills_and_refuses_conflicts() -> None:
    recorded = record_tp_model_init(None, 2, torch.float32)
    assert record_tp_model_init(recorded, 2, torch.float32) is recorded
    with pytest.raises(ValueError, match="Conflicting tp_model_init"):
        record_tp_model_init(recorded, 4, torch.float32)
    assert merge_tp_model_init(recorded, {}, None)["tensor_parallel"]["autotp_size"] == 2
    with pytest.raises(ValueError, match="tensor_parallel.autotp_size"):
        merge_tp_model_init(recorded, {"tensor_parallel": {"autotp_size": 4}}, None)
    with pytest.raises(ValueError, match="Conflicting dtype"):
        merge_tp_model_init(recorded, {"bf16": {"enabled": True}}, None)
    with pytest.raises(ValueError, match="tp_model_init provided tp_group"):
        merge_tp_model_init(TPModelInitArgs(2, torch.float32, tp_group=object()), {}, mpu=object())
