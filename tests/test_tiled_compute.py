"""Tiled compute along the sequence (zerotune.parallel.sequence.tiled): the tiled MLP, the generic
sequence_tiled_compute and the tiled logits loss give the untiled loss and exactly its gradients (input
and parameters, float64), with tiles that do not divide the sequence; each parameter's gradient is
accumulated once per backward (what ZeRO's gradient hooks need); ZeRO-2 and ZeRO-3 engines on 2 ranks
train a tiled model (MLP and logits loss) to the untiled model's weights; bad arguments fail with a clear error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.harness import run_distributed
from zerotune.parallel.sequence.tiled import sequence_tiled_compute, tiled_fused_logits_loss, tiled_mlp
from zerotune.zero import GatheredParameters

HIDDEN, VOCAB = 8, 11


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _mlp_forward(module: MLP, x: torch.Tensor) -> torch.Tensor:
    return MLP.forward(module, x)


def _setup(batch: int = 2, seq: int = 13):
    torch.manual_seed(0)
    mlp, head = MLP().double(), nn.Linear(HIDDEN, VOCAB, bias=False).double()
    x = torch.randn(batch, seq, HIDDEN, dtype=torch.float64)
    y = torch.randint(0, VOCAB, (batch, seq))
    return mlp, head, x, y


def _grads(*modules: nn.Module) -> list[torch.Tensor]:
    out = [p.grad.clone() for m in modules for p in m.parameters()]
    for m in modules:
        m.zero_grad(set_to_none=True)
    return out


def _reference(mlp, head, x, y):
    xr = x.clone().requires_grad_(True)
    loss = nn.functional.cross_entropy(head(mlp(xr)).reshape(-1, VOCAB), y.reshape(-1))
    loss.backward()
    return loss.detach(), xr.grad, _grads(mlp, head)


@pytest.mark.parametrize("shards", [1, 3, 4, 13, 20])
def test_tiled_mlp_exact(shards):
    mlp, head, x, y = _setup()
    want_loss, want_x, want = _reference(mlp, head, x, y)
    xt = x.clone().requires_grad_(True)
    hidden = tiled_mlp(_mlp_forward, mlp, xt, shards)
    loss = nn.functional.cross_entropy(head(hidden).reshape(-1, VOCAB), y.reshape(-1))
    loss.backward()
    assert torch.allclose(loss, want_loss, atol=1e-13)
    assert torch.allclose(xt.grad, want_x, atol=1e-13)
    assert all(torch.allclose(g, w, atol=1e-13) for g, w in zip(_grads(mlp, head), want, strict=True))


@pytest.mark.parametrize("reduction", [None, "sum", "mean"])
def test_sequence_tiled_compute_exact(reduction):
    mlp, _, x, _ = _setup()
    weight = torch.randn(x.shape, dtype=torch.float64)

    def fn(x: torch.Tensor, w: torch.Tensor, self: MLP) -> torch.Tensor:
        return MLP.forward(self, x) * w

    xr = x.clone().requires_grad_(True)
    full = fn(xr, weight, mlp)
    want_out = full if reduction is None else (full.mean() if reduction == "mean" else full.sum())
    probe = torch.randn(want_out.shape, dtype=torch.float64)
    (want_out * probe).sum().backward()
    want = _grads(mlp)
    xt = x.clone().requires_grad_(True)
    out = sequence_tiled_compute(fn, x.shape[1], 4, {"x": xt, "w": weight}, {"self": mlp}, "x",
                                 output_unshard_dimension=1, output_reduction=reduction)
    (out * probe).sum().backward()
    assert torch.allclose(out, want_out.detach(), atol=1e-13)
    assert torch.allclose(xt.grad, xr.grad, atol=1e-13)
    assert all(torch.allclose(g, w, atol=1e-13) for g, w in zip(_grads(mlp), want, strict=True))


def test_tiled_fused_logits_loss_exact_with_equal_tiles():
    mlp, head, x, y = _setup(batch=2, seq=12)  # 24 tokens in 4 equal tiles: mean of tile means = mean
    want_loss, want_x, want = _reference(mlp, head, x, y)

    def loss_fn(self: nn.Linear, h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self(h).reshape(-1, VOCAB), target.reshape(-1))

    xt = x.clone().requires_grad_(True)
    loss = tiled_fused_logits_loss(loss_fn, head, mlp(xt), y, None, 4, [head.weight], "mean")
    (loss * 3.0).backward()  # the incoming gradient scales what forward computed
    assert torch.allclose(loss, want_loss, atol=1e-13)
    assert torch.allclose(xt.grad, 3.0 * want_x, atol=1e-13)
    assert all(torch.allclose(g, 3.0 * w, atol=1e-13) for g, w in zip(_grads(mlp, head), want, strict=True))


def test_each_parameter_gradient_is_accumulated_once():
    mlp, head, x, _ = _setup()
    counts: dict[int, int] = {}
    for p in mlp.parameters():
        p.register_post_accumulate_grad_hook(lambda p: counts.__setitem__(id(p), counts.get(id(p), 0) + 1))
    tiled_mlp(_mlp_forward, mlp, x.clone().requires_grad_(True), 5).sum().backward()
    assert sorted(counts.values()) == [1, 1, 1, 1]


def test_unlisted_trainable_tensor_is_refused():
    mlp, _, x, _ = _setup()
    stray = torch.ones(HIDDEN, dtype=torch.float64, requires_grad=True)
    out = tiled_mlp(lambda m, t: MLP.forward(m, t) * stray, mlp, x, 2)
    with pytest.raises(ValueError, match="compute_params"):
        out.sum().backward()


def test_bad_arguments():
    mlp, head, x, y = _setup()
    with pytest.raises(ValueError, match="shards"):
        tiled_mlp(_mlp_forward, mlp, x, 0)
    with pytest.raises(ValueError, match="output_reduction"):
        sequence_tiled_compute(_mlp_forward, x.shape[1], 2, {"x": x}, {}, "x", output_reduction="max")
    with pytest.raises(ValueError, match="grad_requiring_tensor_key"):
        sequence_tiled_compute(_mlp_forward, x.shape[1], 2, {"x": x}, {}, "h")
    with pytest.raises(ValueError, match="seqlen=99"):
        sequence_tiled_compute(_mlp_forward, 99, 2, {"x": x}, {}, "x")
    with pytest.raises(ValueError, match="mask"):
        tiled_fused_logits_loss(lambda *a: a[1].sum(), head, x, y, torch.ones(3), 2, None)


def _sum_loss(self: nn.Linear, h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(self(h).reshape(-1, VOCAB), target.reshape(-1), reduction="sum")


def _zero_tiled(stage: int, tiled: bool) -> list[torch.Tensor]:
    import zerotune

    mlp, head, x, y = _setup()
    model = nn.ModuleDict({"mlp": mlp, "head": head}).float()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if not tiled:
                return nn.functional.cross_entropy(self.inner["head"](self.inner["mlp"](x)).reshape(-1, VOCAB),
                                                   y.reshape(-1))
            h = tiled_mlp(_mlp_forward, self.inner["mlp"], x, 3)
            return tiled_fused_logits_loss(_sum_loss, self.inner["head"], h, y, None, 4, None, "sum") / y.numel()

    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage, "reduce_bucket_size": 64},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = zerotune.initialize(model=Net(), config=config)
    rank = torch.distributed.get_rank()
    engine.backward(engine(x[rank:rank + 1].float(), y[rank:rank + 1]))
    engine.step()
    params = list(engine.module.parameters())
    with GatheredParameters(params, enabled=stage == 3):
        return [p.detach().clone() for p in params]


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_engine_trains_tiled_like_untiled(stage):
    tiled = run_distributed(_zero_tiled, 2, stage, True, timeout=90)
    untiled = run_distributed(_zero_tiled, 2, stage, False, timeout=90)
    for got, want in zip(tiled[0], untiled[0], strict=True):
        assert torch.allclose(got, want, atol=1e-6)
