"""DistributedAttention (Ulysses around any attention callable) and DeepSpeed's ``deepspeed.sequence.layer``
names: on 2 gloo ranks the wrapped attention equals single-process attention (output and q/k/v gradients)
in both layouts, with and without rotary tables; the all-to-all names keep DeepSpeed's layout; the rotary
helpers match the textbook formula; what zerotune refuses fails with a clear error."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.harness import run_distributed
from zerotune.compat.sequence_layer import _rotate_half, _SeqAllToAll, apply_rotary_pos_emb, single_all_to_all
from zerotune.parallel.sequence.distributed_attention import DistributedAttention

B, S, H, D = 2, 8, 4, 6


def _sdpa_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch_dim_idx: int) -> torch.Tensor:
    """Causal attention on [b, s, h, d] (batch_dim_idx 0) or [s, b, h, d] (1) tensors, same layout out."""
    if batch_dim_idx == 1:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
    return out.transpose(0, 1) if batch_dim_idx == 1 else out


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables [b, s, 1, D] (Megatron's layout for sequence-first q)."""
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = torch.outer(torch.arange(S, dtype=torch.float64), inv)
    emb = torch.cat((angles, angles), dim=-1)[None, :, None, :].expand(B, S, 1, D)
    return emb.cos(), emb.sin()


def _parity(batch_dim_idx: int, rotary: bool) -> dict:
    rank, size = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(11)
    shape = (B, S, H, D) if batch_dim_idx == 0 else (S, B, H, D)
    full = [torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(3)]
    weight = torch.randn(shape, generator=generator, dtype=torch.float64)
    seq_dim = 1 - batch_dim_idx
    cos, sin = _tables()

    # single process: rotary on the whole sequence, then attention
    ref_in = [t.clone().requires_grad_(True) for t in full]
    q, k, v = ref_in
    if rotary:
        tcos, tsin = cos.permute(1, 0, 2, 3), sin.permute(1, 0, 2, 3)
        if batch_dim_idx == 0:  # the tables' first two dims are swapped relative to q: here q is [b, s, ...]
            tcos, tsin = cos, sin
        q, k = apply_rotary_pos_emb(q, tcos, tsin), apply_rotary_pos_emb(k, tcos, tsin)
    ref = _sdpa_bshd(q, k, v, batch_dim_idx)
    (ref * weight).sum().backward()

    local = slice(rank * S // size, (rank + 1) * S // size)
    idx = (slice(None), local) if seq_dim == 1 else (local,)
    mine = [t[idx].clone().requires_grad_(True) for t in full]
    attention = DistributedAttention(lambda q, k, v: _sdpa_bshd(q, k, v, batch_dim_idx), dist.group.WORLD)
    tables = None
    if rotary:  # DeepSpeed swaps the tables' first two dims: give [s, b, ..] for batch-first q
        tables = (cos, sin) if batch_dim_idx == 1 else (cos.permute(1, 0, 2, 3), sin.permute(1, 0, 2, 3))
    out = attention(*mine, batch_dim_idx, tables)
    (out * weight[idx]).sum().backward()
    return {
        "shape": tuple(out.shape) == tuple(mine[0].shape),
        "output": torch.allclose(out, ref[idx], atol=1e-12),
        "grads": all(torch.allclose(m.grad, r.grad[idx], atol=1e-12) for m, r in zip(mine, ref_in, strict=True)),
    }


@pytest.mark.parametrize("batch_dim_idx", [0, 1])
@pytest.mark.parametrize("rotary", [False, True])
def test_distributed_attention_equals_single_process(batch_dim_idx, rotary):
    for result in run_distributed(_parity, 2, batch_dim_idx, rotary, timeout=60):
        assert result == {"shape": True, "output": True, "grads": True}


def _deepspeed_layout() -> dict:
    """DeepSpeed's _SeqAllToAll: [b, s/P, h, d] -> [b, s, h/P, d] (rank r holds heads chunk r), and back."""
    rank, size = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(5)
    full = torch.randn(B, S, H, D, generator=generator)
    s_local, h_local = S // size, H // size
    mine = full[:, rank * s_local:(rank + 1) * s_local].clone().requires_grad_(True)
    heads = _SeqAllToAll.apply(dist.group.WORLD, mine, 2, 0, 0)
    back = _SeqAllToAll.apply(dist.group.WORLD, heads, 0, 2, 0)
    back.sum().backward()
    seq_first = full.transpose(0, 1).contiguous()[rank * s_local:(rank + 1) * s_local]
    heads_sb = single_all_to_all(seq_first, 2, 0, 1, dist.group.WORLD)
    return {
        "heads": torch.equal(heads, full[:, :, rank * h_local:(rank + 1) * h_local]),
        "back": torch.equal(back, mine),
        "grad": torch.equal(mine.grad, torch.ones_like(mine)),
        "seq_first": torch.equal(heads_sb, full.transpose(0, 1)[:, :, rank * h_local:(rank + 1) * h_local]),
    }


def test_seq_all_to_all_keeps_deepspeed_layout():
    for result in run_distributed(_deepspeed_layout, 2, timeout=60):
        assert result == {"heads": True, "back": True, "grad": True, "seq_first": True}


@pytest.mark.parametrize("rot_dim", [8, 16])
def test_apply_rotary_pos_emb_rotates_pairs(rot_dim):
    """Feature i and i + rot_dim/2 form a pair rotated by the position's angle; the rest pass through."""
    t = torch.randn(5, 3, 16, dtype=torch.float64)
    angles = torch.rand(5, 1, rot_dim // 2, dtype=torch.float64)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    out = apply_rotary_pos_emb(t, cos, sin)
    half = rot_dim // 2
    x1, x2 = t[..., :half], t[..., half:rot_dim]
    c, s = angles.cos(), angles.sin()
    assert torch.allclose(out[..., :half], x1 * c - x2 * s)
    assert torch.allclose(out[..., half:rot_dim], x2 * c + x1 * s)
    assert torch.equal(out[..., rot_dim:], t[..., rot_dim:])
    assert torch.equal(_rotate_half(torch.arange(4.0)), torch.tensor([-2.0, -3.0, 0.0, 1.0]))


def test_refusals_are_clear():
    with pytest.raises(ValueError, match="sp_stream"):
        DistributedAttention(lambda q, k, v: q, None, sp_stream=object())
    with pytest.raises(ValueError, match="scatter_idx"):
        DistributedAttention(lambda q, k, v: q, None, scatter_idx=0)
    with pytest.raises(ValueError, match="async_op"):
        single_all_to_all(torch.zeros(1, 2, 2, 1), 2, 0, 0, None, async_op=True)
    with pytest.raises(ValueError, match="batch_dim_idx"):
        single_all_to_all(torch.zeros(1, 2, 2, 1), 2, 0, 2, None)
    with pytest.raises(ValueError, match="4D"):
        single_all_to_all(torch.zeros(2, 2, 2), 2, 0, 0, None)
    with pytest.raises(ValueError, match="rotate"):
        apply_rotary_pos_emb(torch.zeros(2, 4), torch.zeros(2, 8), torch.zeros(2, 8))


def test_deepspeed_import_paths(alias):
    from deepspeed.sequence.layer import DistributedAttention as Aliased

    assert Aliased is DistributedAttention
    with pytest.raises(ImportError, match="FPDT"):
        import deepspeed.sequence.fpdt_layer  # noqa: F401
