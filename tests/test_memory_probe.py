"""The test-side memory probe: peaks of known allocation sequences, resize_, gloo collectives, a 10M-parameter step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed
from tests.memory_probe import PeakTensorBytes

KiB, MiB = 1 << 10, 1 << 20
SLACK = 16 * KiB  # stray small allocations (Python-side tensors, profiler bookkeeping)


def block(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def test_sequence_of_known_sizes_gives_the_expected_peak():
    with PeakTensorBytes() as probe:
        a = block(1 * MiB)
        b = block(2 * MiB)  # live: 3 MiB
        del a  # live: 2 MiB
        c = block(MiB // 2)
        d = block(3 * MiB // 2)  # live: 4 MiB  <- peak
        del b, c  # live: 1.5 MiB
        e = block(2 * MiB)  # live: 3.5 MiB
        del d, e
    assert 4 * MiB <= probe.peak <= 4 * MiB + SLACK, probe.summary()
    assert 7 * MiB <= probe.allocated <= 7 * MiB + SLACK
    assert probe.live_at_exit <= SLACK and probe.peak_by_device.keys() == {"cpu"}


def test_only_allocations_made_during_the_block_count():
    before = block(8 * MiB)
    with PeakTensorBytes() as probe:
        del before  # freeing older storage does not lower the baseline below the start
        kept = block(1 * MiB)
    assert 1 * MiB <= probe.peak <= 1 * MiB + SLACK, probe.summary()
    assert 1 * MiB <= probe.live_at_exit <= 1 * MiB + SLACK
    del kept


def test_storage_resize_growth_and_release_are_seen():
    # The stage-3 pattern: a full buffer whose storage is resized to 0 when released, regrown to gather.
    full = torch.zeros(MiB, dtype=torch.float32)  # 4 MiB
    view = full[: MiB // 2]  # a view made while gathered (as autograd saves them) sees the regrown storage
    full.untyped_storage().resize_(0)
    with PeakTensorBytes() as probe:
        full.untyped_storage().resize_(4 * MiB)
        view.fill_(1.0)
        full.untyped_storage().resize_(0)
        scratch = block(1 * MiB)
        del scratch
    assert 4 * MiB <= probe.peak <= 4 * MiB + SLACK, probe.summary()
    assert probe.live_at_exit <= SLACK
    with PeakTensorBytes() as regrown:
        full.untyped_storage().resize_(4 * MiB)
    assert 4 * MiB <= regrown.live_at_exit <= 4 * MiB + SLACK, regrown.summary()


def test_reallocating_one_buffer_in_a_loop_does_not_accumulate():
    with PeakTensorBytes() as probe:
        for _ in range(200):
            buffer = block(1 * MiB)
            buffer.fill_(1)
            del buffer
    assert 1 * MiB <= probe.peak <= 1 * MiB + SLACK, probe.summary()
    assert probe.allocated >= 200 * MiB and probe.live_at_exit <= SLACK


def test_nothing_allocated_reads_zero():
    x, y = torch.ones(1000), torch.ones(1000)
    with PeakTensorBytes() as probe:
        x.add_(y)
    assert probe.peak == probe.allocated == probe.freed == 0, probe.summary()


def test_results_are_independent_across_consecutive_probes():
    for size in (3 * MiB, 1 * MiB, 2 * MiB):
        with PeakTensorBytes() as probe:
            held = block(size)
            del held
        assert size <= probe.peak <= size + SLACK, (size, probe.summary())


def _gather_under_probe(numel: int) -> dict:
    """On each rank: collective outputs and a resized-storage gather, each measured by the probe."""
    world = dist.get_world_size()
    local = torch.full((numel,), float(dist.get_rank()))
    with PeakTensorBytes() as outputs:
        gathered = [torch.empty(numel) for _ in range(world)]
        dist.all_gather(gathered, local)
    full = torch.empty(world * numel)
    full.untyped_storage().resize_(0)
    with PeakTensorBytes() as regather:
        full.untyped_storage().resize_(world * numel * 4)
        dist.all_gather_into_tensor(full, local)
        correct = bool(torch.equal(full, torch.arange(world).repeat_interleave(numel).float()))
        full.untyped_storage().resize_(0)
    return {"outputs_peak": outputs.peak, "outputs_live": outputs.live_at_exit,
            "regather_peak": regather.peak, "regather_live": regather.live_at_exit, "correct": correct}


def test_gloo_collective_outputs_and_gathers_into_resized_storage_are_seen():
    numel = 256 * 1024  # 1 MiB of fp32 per rank
    for result in run_distributed(_gather_under_probe, 2, numel, timeout=120.0):
        full_bytes = 2 * numel * 4
        assert result["correct"]
        assert full_bytes <= result["outputs_live"] <= full_bytes + SLACK, result
        assert result["outputs_peak"] >= full_bytes, result  # gloo's own staging buffer comes on top
        assert result["regather_peak"] >= full_bytes and result["regather_live"] <= SLACK, result


def _gpt2_10m():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=10, n_embd=256, n_head=4, vocab_size=8192, n_positions=64, bos_token_id=0,
                        eos_token_id=0, tie_word_embeddings=True)
    return GPT2LMHeadModel(config)


def test_forward_backward_of_a_10m_model_is_measured_correctly():
    """The probe's slowdown of this step is measured by benchmarks/bench_instrumentation_overhead.py."""
    model = _gpt2_10m()
    numel = sum(p.numel() for p in model.parameters())
    assert 9_000_000 < numel < 11_000_000
    ids = torch.randint(0, 8192, (4, 64), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    step()  # warm-up: lazy initialisation outside the probe
    with PeakTensorBytes() as probe:
        step()
    # What is left alive is exactly the new fp32 gradients: an independent check of the bookkeeping.
    assert 4 * numel <= probe.live_at_exit <= 4 * numel + SLACK, probe.summary()
    assert probe.peak > 4 * numel  # activations saved for backward come on top


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_allocations_are_seen():
    with PeakTensorBytes() as probe:
        x = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        del x
    assert probe.peak_by_device.get("cuda:0", 0) >= 4 * MiB, probe.summary()
