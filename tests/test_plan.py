"""Preflight planning (issue 18): the ZeRO paper's table, DeepSpeed's estimators under their DeepSpeed names,
zerotune's model-state accounting against the engine's, and ``zerotune plan`` on a 70B config in seconds
without allocating weights."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import time
from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed
from tests.memory_probe import PeakTensorBytes
from zerotune.compat import install_deepspeed_alias
from zerotune.compat.alias import uninstall_deepspeed_alias
from zerotune.plan import estimators
from zerotune.plan.states import zero_paper_model_states, zerotune_model_states

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "plan"
FIXTURE = json.loads((Path(__file__).parent / "data" / "deepspeed_estimates" / "estimates.json").read_text())


def test_the_zero_papers_table_for_7_5b_parameters_on_64_devices() -> None:
    """Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, N = 64, mixed-precision Adam (K = 12), in GB."""
    per_stage = [round(zero_paper_model_states(7.5e9, 64, stage, k=12) / 1e9, 1) for stage in range(4)]
    assert per_stage == [120.0, 31.4, 16.6, 1.9]


def _figures(text: str) -> list[str]:
    return re.findall(r"[0-9]+\.[0-9]+GB", text)


def _printed(function, *args) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        function(*args)
    return out.getvalue()


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda case: f"{case['total']:.3g}")
def test_deepspeed_estimators_give_deepspeeds_figures(case) -> None:
    """Against tests/data/deepspeed_estimates/estimates.json, written by DeepSpeed 0.19.8 itself."""
    total, largest, gpus, nodes, factor = (case[k] for k in ("total", "largest", "gpus_per_node", "nodes", "factor"))
    for offload, expected in case["zero2"].items():
        assert list(estimators.estimate_zero2_model_states_mem_needs(
            total, gpus, nodes, cpu_offload=offload == "True", additional_buffer_factor=factor)) == expected
    for offload, offload_params, zero_init, *expected in case["zero3"]:
        assert list(estimators.estimate_zero3_model_states_mem_needs(
            total, largest, gpus, nodes, offload, offload_params, zero_init, factor)) == expected
    zero2 = _printed(estimators.estimate_zero2_model_states_mem_needs_all_cold, total, gpus, nodes, factor)
    zero3 = _printed(estimators.estimate_zero3_model_states_mem_needs_all_cold, total, largest, gpus, nodes, factor)
    assert _figures(zero2) == _figures(case["zero2_printed"]) and len(_figures(zero2)) == 4
    assert _figures(zero3) == _figures(case["zero3_printed"]) and len(_figures(zero3)) == 12
    assert zero2.splitlines()[:3] == case["zero2_printed"].splitlines()[:3]


def test_the_estimators_answer_under_their_deepspeed_paths_for_a_live_model() -> None:
    install_deepspeed_alias()
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live, model_to_params
        from deepspeed.runtime.zero.stage_1_and_2 import (
            estimate_zero2_model_states_mem_needs_all_live,
        )
        from deepspeed.runtime.zero.stage_1_and_2 import model_to_params as zero2_params
    finally:
        uninstall_deepspeed_alias()
    tied = torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 256), torch.nn.Linear(256, 64),
                               torch.nn.Linear(64, 1000, bias=False))
    tied[3].weight = tied[0].weight
    live = FIXTURE["tied_model"]
    assert zero2_params(tied) == live["zero2_params"] and list(model_to_params(tied)) == live["zero3_params"]
    assert _figures(_printed(estimate_zero2_model_states_mem_needs_all_live, tied, 4, 2)) == _figures(live["zero2_printed"])
    assert _figures(_printed(estimate_zero3_model_states_mem_needs_all_live, tied, 4, 2)) == _figures(live["zero3_printed"])


def _engine_breakdown(stage: int, precision: str, offload: str) -> dict:
    import zerotune

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 256))
    model[0].weight.requires_grad_(False)  # a frozen piece, as with adapters
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage, "offload_optimizer": {"device": offload}},
              "bf16": {"enabled": precision == "bf16"}}
    engine, *_ = zerotune.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                     config=config)
    loss = engine(torch.randn(2, 256)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    breakdown = engine.memory_breakdown()
    engine.destroy()
    return breakdown


@pytest.mark.parametrize("stage, precision, offload", [(0, "fp32", "none"), (1, "bf16", "none"), (2, "bf16", "none"),
                                                        (3, "bf16", "none"), (2, "fp32", "none"), (2, "bf16", "cpu")])
def test_the_plans_model_state_is_what_the_engine_holds(stage, precision, offload) -> None:
    breakdown = run_distributed(_engine_breakdown, 2, stage, precision, offload, timeout=120)[0]
    trainable, frozen = 512 + 512 * 256 + 256, 256 * 512
    planned = zerotune_model_states(trainable, frozen, stage=stage, dp=2, precision=precision, offload_optimizer=offload)
    assert breakdown["params"] == pytest.approx(planned.params, rel=0.01), breakdown
    assert breakdown["grads"] == pytest.approx(planned.grads, rel=0.01), breakdown
    if offload == "none":
        assert breakdown["master_weights"] == pytest.approx(planned.master_weights, rel=0.01), breakdown
        assert breakdown["optimizer_state"] == pytest.approx(planned.optimizer_state, rel=0.01), breakdown


def test_plan_of_a_70b_llama_takes_seconds_and_allocates_no_weights(capsys) -> None:
    from zerotune.cli.main import main

    path = Path(__file__).parent / "data" / "plan_zero3_bf16.json"
    started = time.perf_counter()
    with PeakTensorBytes() as probe:
        status = main(["plan", str(path), "--model", str(EXAMPLES / "llama-3-70b"), "--world-size", "64",
                       "--nodes", "8", "--seq-len", "4096", "--device-memory", "80GiB"])
    seconds = time.perf_counter() - started
    out = capsys.readouterr().out
    assert status == 0, out
    assert "70,553,706,496 parameters" in out and "device total with activation checkpointing" in out
    assert seconds < 30, seconds
    assert probe.peak < 64 * 2**20, probe.summary()  # 70B bf16 weights alone would be 131 GiB
    print(out)


def test_plan_rows_follow_the_layout(capsys) -> None:
    from zerotune.cli.main import main

    path = Path(__file__).parent / "data" / "plan_zero3_bf16.json"
    assert main(["plan", str(path), "--model", str(EXAMPLES / "llama-2-7b"), "--world-size", "8",
                 "--seq-len", "1024", "--device-memory", "10GiB"]) == 1  # does not fit without checkpointing
    out = capsys.readouterr().out
    rows = {line[:48].strip(): line for line in out.splitlines()[1:]}
    assert "6,738,415,616 x 2 B / 8" in rows["parameters"]
    assert float(rows["parameters"].split()[1]) == pytest.approx(6_738_415_616 * 2 / 8 / 2**30, abs=0.01)
    assert float(rows["optimizer state"].split()[2]) == pytest.approx(6_738_415_616 * 8 / 8 / 2**30, abs=0.01)
    assert "does NOT fit" in out


def test_plan_input_errors_are_one_line(capsys, tmp_path) -> None:
    from zerotune.cli.main import main

    path = Path(__file__).parent / "data" / "plan_zero3_bf16.json"
    assert main(["plan", str(path), "--model", str(tmp_path), "--world-size", "8"]) == 2
    assert "no model config found there" in capsys.readouterr().err
    assert main(["plan", str(path), "--model", str(EXAMPLES / "llama-2-7b"), "--world-size", "8",
                 "--device-memory", "80 apples"]) == 2
    assert "--device-memory: '80 apples' is not a size" in capsys.readouterr().err
    assert main(["plan", str(path), "--model", str(EXAMPLES / "llama-2-7b"), "--world-size", "8",
                 "--seq-len", "100000"]) == 2
    assert "--seq-len 100000: LlamaForCausalLM takes at most 4096 positions" in capsys.readouterr().err
    assert main(["plan", str(path), "--model", "torch.nn:Identity", "--world-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "Identity cannot be planned this way" in err and "model(input_ids=..., labels=...)" in err
    assert err.count("\n") == 1


def _tiny_llama_profile(seq: int = 128, precision: str = "fp32"):
    from benchmarks.bench_plan_accuracy import llama
    from zerotune.plan.memory import profile_model

    with torch.device("meta"):
        model = llama(256, 4)
    return profile_model(model, seq, precision)


def test_a_larger_budget_never_picks_a_layout_with_more_communication() -> None:
    from zerotune.plan.auto import Hardware, NoLayoutFits, choose
    from zerotune.plan.memory import Layout

    profile = _tiny_llama_profile()
    base = Layout(stage=0, dp=4, precision="fp32", micro_batch=4, gas=2, reduce_bucket=2**18, allgather_bucket=2**18,
                  prefetch_bucket=2**18)
    previous = None
    chosen = []
    for mib in range(150, 2000, 25):
        try:
            choice = choose(profile, base, 8, Hardware(device_memory=mib * 2**20, bandwidth=5e9, flops=50e9))
        except NoLayoutFits:
            continue
        assert choice.best.device_bytes <= 0.9 * mib * 2**20
        if previous is not None:
            assert choice.best.comm_bytes <= previous.comm_bytes + 1, (mib, choice.explain(), previous.describe())
        previous = choice.best
        chosen.append(choice.best.layout.stage)
    # the budget matters: ZeRO 3 when memory is tight; with room, a stage whose gradient reduction hides under the
    # backward (stage 0 is DDP's all-reduce)
    assert chosen[0] == 3 and chosen[-1] in (0, 1, 2) and len(set(chosen)) >= 2, chosen


def _train_chosen(stage: int, offload: str, micro: int, checkpointing: bool) -> int:
    from benchmarks.bench_plan_accuracy import Case, measure

    return measure(Case("chosen", "llama", 256, 4, stage, "fp32", checkpointing=checkpointing, offload=offload,
                        micro=micro, bucket=2**18))


@pytest.mark.slow
@pytest.mark.parametrize("budget_mib", [290, 330, 460, 700])
def test_the_auto_layout_fits_its_budget_when_it_runs(budget_mib) -> None:
    """Two ranks, the tiny Llama at 128 tokens, 8 examples per rank: the chosen layout's measured peak is
    within the budget (the plan keeps 10% headroom). The run uses the buckets the plan assumed."""
    from zerotune.plan.auto import Hardware, choose
    from zerotune.plan.memory import Layout

    profile = _tiny_llama_profile()
    choice = choose(profile, Layout(stage=0, dp=2, precision="fp32", micro_batch=8, reduce_bucket=2**18,
                                    allgather_bucket=2**18, prefetch_bucket=2**18), 8,
                    Hardware(device_memory=budget_mib * 2**20, bandwidth=5e9, flops=50e9),
                    vary_offload=False)  # on CPU the host is the device: offload saves nothing here
    best = choice.best
    measured = run_distributed(_train_chosen, 2, best.layout.stage, best.layout.offload_optimizer,
                               best.layout.micro_batch, best.checkpointing, timeout=300)[0]
    print(f"{budget_mib} MiB: {choice.explain()}\n  measured peak {measured / 2**20:.1f} MiB")
    assert measured <= budget_mib * 2**20, (measured / 2**20, choice.explain())


def _tiny_llama_splits(world: int, ranks_per_node: int, seq: int = 128):
    from benchmarks.bench_plan_accuracy import llama
    from zerotune.plan.splits import split_profiles

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return llama(256, 4)
    return split_profiles(build, seq, "fp32", "causal-lm", world, ranks_per_node)


def test_the_auto_layout_weighs_tensor_and_pipeline_splits_the_model_allows() -> None:
    profiles, left_out = _tiny_llama_splits(8, 8)
    assert sorted(profiles) == [(1, 1, 1), (1, 1, 2), (1, 1, 4), (1, 2, 1), (1, 4, 1), (2, 1, 1), (2, 2, 1), (2, 4, 1),
                                (4, 1, 1), (4, 2, 1)]  # tp x pp <= 8; sp alone, up to the 4 heads
    assert any(reason.startswith("sequence parallel 8:") and "divisible" in reason for reason in left_out), left_out
    assert any(reason.startswith("pipeline stages 8: 8 pipeline stages but only 6 layer(s)") for reason in left_out)
    assert any(reason.startswith("tensor parallel 8:") for reason in left_out), left_out  # 4 heads
    assert profiles[(2, 1, 1)].trainable < 0.6 * profiles[(1, 1, 1)].trainable  # one rank's shard
    assert [len(profiles[(1, pp, 1)].stages) for pp in (2, 4)] == [2, 4]
    # composed: each stage holds its tensor-parallel shard of the stage's layers
    whole, split = profiles[(1, 2, 1)].stages, profiles[(2, 2, 1)].stages
    assert [s.blocks for s in split] == [s.blocks for s in whole]
    assert all(0.4 * w.trainable < s.trainable < 0.6 * w.trainable for w, s in zip(whole, split))
    two_nodes, _ = _tiny_llama_splits(8, 4)
    assert (4, 1, 1) in two_nodes and (8, 1, 1) not in two_nodes  # tensor parallelism stays inside a node
    assert (1, 1, 4) in two_nodes and (1, 1, 8) not in two_nodes  # so does sequence parallelism


def test_the_cost_model_charges_tensor_parallel_all_reduces_and_the_pipeline_bubble() -> None:
    import dataclasses

    from zerotune.plan.auto import Hardware, step_seconds
    from zerotune.plan.memory import Layout

    profiles, _ = _tiny_llama_splits(2, 2)
    hardware = Hardware(device_memory=2**30, flops=50e9, bandwidth=5e9, intra_node_bandwidth=10e9)
    tp = profiles[(2, 1, 1)]
    layout = Layout(stage=0, dp=1, tp=2, precision="fp32", micro_batch=2, gas=4)
    seconds, sent, communicating = step_seconds(layout, tp, 4, False, hardware)
    block_input = 2 * tp.per_example.block_inputs[0]  # micro-batch 2: (2, 128, 256) fp32
    assert block_input == 2 * 128 * 256 * 4
    assert sent == 4 * 4 * 4 * block_input  # 4 micro-steps x 4 blocks x 4 all-reduces (2 forward, 2 backward)
    assert communicating == pytest.approx(sent / 10e9)  # over the node's links; dp 1: no gradient traffic
    assert step_seconds(layout, tp, 4, True, hardware)[1] == 1.5 * sent  # the recomputed forward all-reduces too
    unsplit = profiles[(1, 1, 1)]
    half = dataclasses.replace(unsplit, trainable=unsplit.trainable // 2)
    piped = Layout(stage=0, dp=1, pp=2, precision="fp32", micro_batch=2, gas=4)
    one_stage = Layout(stage=0, dp=1, precision="fp32", micro_batch=2, gas=4)
    bubble = step_seconds(piped, half, 4, False, hardware)
    flat = step_seconds(one_stage, half, 4, False, hardware)
    assert bubble[0] - bubble[2] == pytest.approx(5 / 4 * (flat[0] - flat[2]))  # 4 + 2 - 1 micro-batch slots
    assert bubble[1] == 4 * 2 * block_input  # each micro-batch's activations out, their gradients back


def test_a_pipeline_step_takes_the_slowest_stage_and_each_stage_all_reduces_its_own_blocks() -> None:
    """The tiny Llama's 2 stages hold about the same parameters, but the first only looks its embedding up while
    the last multiplies by its head: the last sets the step time. Under TP 2 x PP 2, a rank all-reduces its own
    stage's 2 blocks, not the model's 4."""
    from zerotune.plan.auto import Hardware, candidates, step_seconds
    from zerotune.plan.memory import Layout, stage_profiles

    profiles, _ = _tiny_llama_splits(4, 4)
    hardware = Hardware(device_memory=2**30, flops=50e9, bandwidth=5e9, intra_node_bandwidth=10e9)
    piped = Layout(stage=1, dp=2, pp=2, precision="fp32", micro_batch=2, gas=4)
    first, last = stage_profiles(profiles[(1, 2, 1)], piped)
    assert first.lookup == first.embedding > 0 and last.lookup == 0
    first_s, last_s = (step_seconds(piped, held, 4, False, hardware)[0] for held in (first, last))
    assert last_s > 2 * first_s
    chosen = next(c for c in candidates(profiles[(1, 2, 1)], piped, 8, hardware, micro_batches=[2], checkpointing=(False,),
                                        vary_offload=False) if c.layout.stage == 1)
    assert chosen.seconds == last_s
    composed = Layout(stage=0, dp=1, tp=2, pp=2, precision="fp32", micro_batch=2, gas=4)
    shares = stage_profiles(profiles[(2, 2, 1)], composed)
    assert [len(held.stages[0].blocks) for held in shares] == [2, 2]
    block_input = 2 * profiles[(2, 2, 1)].per_example.block_inputs[0]
    tensor_parallel = 4 * 2 * 4 * 2 * (2 - 1) / 2 * block_input  # 4 micro-steps x 2 blocks x 4 all-reduces
    pipeline = 4 * 2 * block_input
    assert step_seconds(composed, shares[0], 4, False, hardware)[1] == tensor_parallel + pipeline


def test_the_auto_layout_never_weighs_a_layout_the_engine_refuses() -> None:
    """Tensor parallelism composes with ZeRO 0-3, pipelines with ZeRO 0-2 and offload at ZeRO 1 only: the plan
    weighs what parallel/composition.py (the engine's rule) allows, so it cannot choose what initialize refuses."""
    from zerotune.parallel.composition import refusal
    from zerotune.plan.auto import Hardware, candidates
    from zerotune.plan.memory import Layout

    profiles, _ = _tiny_llama_splits(4, 4)
    hardware = Hardware(device_memory=2**30, flops=50e9, bandwidth=5e9)
    weighed = {}
    for (tp, pp, sp), profile in profiles.items():
        base = Layout(stage=0, dp=4 // (tp * pp * sp), tp=tp, pp=pp, sp=sp, precision="fp32", micro_batch=1)
        for candidate in candidates(profile, base, 4, hardware):
            layout = candidate.layout
            assert refusal(layout.stage, layout.offload_optimizer, tp, pp, sp) is None, candidate.describe()
            weighed.setdefault((tp, pp, sp), set()).add((layout.stage, layout.offload_optimizer))
    assert weighed[(2, 1, 1)] == {(0, "none"), (1, "none"), (1, "cpu"), (2, "none"), (2, "cpu"), (3, "none"),
                                  (3, "cpu")}
    assert weighed[(1, 2, 1)] == {(0, "none"), (1, "none"), (1, "cpu"), (2, "none")}
    assert (3, "cpu") in weighed[(1, 1, 1)] and (3, "cpu") in weighed[(1, 1, 2)]


def test_across_splits_a_larger_budget_never_picks_a_slower_layout_and_the_budget_decides_the_split() -> None:
    """Over splits (tensor-parallel size, pipeline stages, sequence-parallel size) the chooser trades
    communication for time, so the data-parallel property of
    test_a_larger_budget_never_picks_a_layout_with_more_communication is not a law here: a pipeline that fits a
    tight budget has a bubble but sends little, and with more room ZeRO-3 without the bubble is faster though
    it sends more (140 -> 160 MiB, one rank per node); tensor parallelism over 4 ranks fits where data
    parallelism does not, and with room data parallelism is faster and sends more (120 -> 400 MiB, 4 ranks
    per node). What holds is time: more room never gives a slower layout."""
    from zerotune.plan.auto import Hardware, NoLayoutFits, choose_layout
    from zerotune.plan.memory import Layout

    base = Layout(stage=0, dp=4, precision="fp32", micro_batch=4, reduce_bucket=2**18, allgather_bucket=2**18,
                  prefetch_bucket=2**18)
    for ranks_per_node in (4, 1):  # tensor parallelism allowed, then not (one rank per node)
        profiles, _ = _tiny_llama_splits(4, ranks_per_node)
        previous, splits_chosen, by_budget = None, [], {}
        for mib in range(100, 1000, 20):
            hardware = Hardware(device_memory=mib * 2**20, bandwidth=5e9, intra_node_bandwidth=20e9, flops=50e9,
                                ranks_per_node=ranks_per_node)
            try:
                best = choose_layout(profiles, base, 4, 16, hardware).best
            except NoLayoutFits:
                continue
            assert best.device_bytes <= 0.9 * mib * 2**20
            assert previous is None or best.seconds <= previous.seconds, (mib, best.describe(), previous.describe())
            previous = by_budget[mib] = best
            splits_chosen.append((best.layout.tp, best.layout.pp, best.layout.sp))
        assert splits_chosen[0] != (1, 1, 1) and splits_chosen[-1] == (1, 1, 1), splits_chosen  # the budget decides
        # counterexamples to "never more communication" across splits: a pipeline (one rank per node) or tensor
        # parallelism over 4 ranks when memory is tight, data parallelism sending more when there is room
        tight, roomier = (by_budget[140], by_budget[160]) if ranks_per_node == 1 else (by_budget[120], by_budget[400])
        assert (tight.layout.pp, tight.layout.tp) == ((2, 1) if ranks_per_node == 1 else (1, 4)), tight.describe()
        assert (roomier.layout.pp, roomier.layout.tp, roomier.layout.sp) == (1, 1, 1), roomier.describe()
        assert roomier.comm_bytes > 2 * tight.comm_bytes and roomier.seconds < tight.seconds


def _train_chosen_split(stage: int, tp: int, pp: int, sp: int, micro: int, gas: int, checkpointing: bool,
                        seq: int) -> int:
    from benchmarks.bench_plan_accuracy import Case, measure

    return measure(Case("chosen", "llama", 256, 4, stage, "fp32", checkpointing=checkpointing, micro=micro,
                        bucket=2**18, tp=tp, pp=pp, sp=sp, gas=gas, seq=seq))


@pytest.mark.slow
@pytest.mark.parametrize("budget_mib, ranks_per_node, seq, global_batch, split", [
    (250, 1, 128, 16, (1, 2, 1)), (260, 2, 128, 16, (2, 1, 1)), (500, 2, 512, 4, (1, 1, 2))])
def test_a_model_parallel_auto_layout_fits_its_budget_when_it_runs(budget_mib, ranks_per_node, seq, global_batch,
                                                                   split) -> None:
    """Two ranks, the tiny Llama: budgets no data-parallel layout fits in. At 128 tokens with one rank per node
    (no tensor parallelism across nodes) the plan cuts the model into 2 pipeline stages, with both on a node
    it splits it over 2 tensor-parallel ranks; at 512 tokens it runs half of each sequence on each rank
    (Ulysses). The measured peak stays within the budget."""
    from zerotune.plan.auto import Hardware, choose_layout
    from zerotune.plan.memory import Layout

    profiles, _ = _tiny_llama_splits(2, ranks_per_node, seq)
    choice = choose_layout(profiles, Layout(stage=0, dp=2, precision="fp32", micro_batch=8, reduce_bucket=2**18,
                                            allgather_bucket=2**18, prefetch_bucket=2**18), 2, global_batch,
                           Hardware(device_memory=budget_mib * 2**20, bandwidth=5e9, flops=50e9,
                                    ranks_per_node=ranks_per_node), vary_offload=False)
    layout = choice.best.layout
    assert (layout.tp, layout.pp, layout.sp) == split, choice.explain()
    measured = run_distributed(_train_chosen_split, 2, layout.stage, layout.tp, layout.pp, layout.sp,
                               layout.micro_batch, layout.gas, choice.best.checkpointing, seq, timeout=300)[0]
    print(f"{budget_mib} MiB, {ranks_per_node} rank(s) per node, {seq} tokens: {choice.explain()}\n  measured peak "
          f"{measured / 2**20:.1f} MiB")
    assert measured <= budget_mib * 2**20, (measured / 2**20, choice.explain())


def _auto_engine() -> tuple[int, float, object, int]:
    import sys

    import zerotune

    initialize_module = sys.modules["zerotune.initialize_phases"]  # (configure_run asks the plan)
    seen = []
    choose_at_initialize = initialize_module.choose_stage_at_initialize

    def spy(model, config, dp, device, measured, **split):  # what initialize measured on the ranks, as passed on
        seen.append(measured)
        return choose_at_initialize(model, config, dp, device, measured, **split)

    initialize_module.choose_stage_at_initialize = spy
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    engine, *_ = zerotune.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "zero_optimization": {"stage": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    loss = engine(torch.randn(2, 64)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    stage = engine.zero_optimization_stage()
    engine.destroy()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return stage, loss.item(), seen[0], memory


def test_initialize_with_stage_auto_takes_the_plans_choice_for_the_measured_link_and_device() -> None:
    from zerotune.plan.activations import ActivationProfile
    from zerotune.plan.auto import Hardware, choose
    from zerotune.plan.memory import Layout, ModelProfile

    results = run_distributed(_auto_engine, 2, timeout=120)
    measured = [result[2] for result in results]
    assert measured[0] == measured[1]  # every rank plans with the slowest rank's figures: the same choice
    assert measured[0].group_size == 2 and measured[0].bandwidth > 1e6 and measured[0].flops > 1e8
    stage, loss, figures, memory = results[0]
    profile = ModelProfile(64 * 64 + 64 + 64 + 1, 0, 64 * 64 + 64, ActivationProfile(0), 1, 4)
    expected = choose(profile, Layout(stage=0, dp=2, precision="fp32", micro_batch=2), 2,
                      Hardware(device_memory=memory, flops=figures.flops, bandwidth=figures.bandwidth),
                      micro_batches=[2], checkpointing=(False,), vary_offload=False)
    # plenty of memory for a tiny model: stage 0 all-reduces fp32 gradients, 1 and 2 half of that both ways
    assert stage == expected.best.layout.stage and loss == loss


def test_a_tensor_parallel_plan_splits_the_model_as_autotp_does(capsys, tmp_path) -> None:
    """zerotune's own apply_autotp splits the meta model over a fake 2-rank group (no process group is left
    behind); norms stay whole, so a rank holds a little more than half."""
    from zerotune.cli.main import main

    config = tmp_path / "tp2.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                                  "tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 1},
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}}))
    assert main(["plan", str(config), "--model", str(EXAMPLES / "llama-2-7b"), "--world-size", "8",
                 "--seq-len", "1024"]) == 0
    out = capsys.readouterr().out
    assert "3,369,340,928 parameters" in out and "(dp 4 x tp 2 x pp 1)" in out
    assert not torch.distributed.is_initialized()
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
                                  "bf16": {"enabled": True}, "tensor_parallel": {"autotp_size": 2},
                                  "pipeline": {"stages": 2}, "zero_optimization": {"stage": 1},
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}}))
    assert main(["plan", str(config), "--model", str(EXAMPLES / "llama-2-7b"), "--world-size", "8",
                 "--seq-len", "1024"]) == 0
    out = capsys.readouterr().out  # composed (3D): the fullest stage's tensor-parallel shard
    assert "(dp 2 x tp 2 x pp 2)" in out and "pipeline stage" in out and "1,684,6" in out, out


def test_a_pipeline_plan_takes_the_fullest_stage_with_its_micro_batches_in_flight(capsys, tmp_path) -> None:
    from zerotune.cli.main import main
    from zerotune.plan.pipeline import in_flight

    assert [in_flight(stage, 4, 8) for stage in range(4)] == [4, 3, 2, 1]
    assert [in_flight(stage, 4, 2) for stage in range(4)] == [2, 2, 2, 1]
    config = tmp_path / "pp2.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8,
                                  "bf16": {"enabled": True}, "pipeline": {"stages": 2}, "zero_optimization": {"stage": 1},
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}}))
    assert main(["plan", str(config), "--model", str(EXAMPLES / "llama-2-7b"), "--world-size", "8",
                 "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "3,369,205,760 parameters" in out and "pipeline stage 0 (the fullest)" in out and "pp 2)" in out
    assert "16 blocks" in out  # stage 0 holds half of the 32 blocks (and the embedding)


def test_a_sequence_parallel_plan_runs_a_share_of_each_sequence_and_shards_zero_over_dp_x_sp(capsys, tmp_path) -> None:
    """Ulysses over 4 of 8 ranks: a rank runs 1024 of the 4096 tokens (its activations a quarter of the sp 1
    plan's), and ZeRO 3 shards over all 8 (dp 2 x sp 4 hold the same parameters). Sizes the heads or the
    sequence do not split, and sequence parallelism with pipelines, are refused as initialize refuses them."""
    from zerotune.cli.main import main

    def plan(sp: int, seq: int = 4096, **extra) -> tuple[int, str, str]:
        config = tmp_path / f"sp{sp}.json"
        config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                                      "sequence_parallel_size": sp, "zero_optimization": {"stage": 3},
                                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}, **extra}))
        code = main(["plan", str(config), "--model", str(EXAMPLES / "llama-2-7b"), "--world-size", "8",
                     "--seq-len", str(seq)])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    def gib(out: str, row: str) -> float:
        return float(re.search(rf"{re.escape(row)}\s+([0-9.,]+) GiB", out).group(1).replace(",", ""))

    code, whole, _ = plan(1)
    assert code == 0
    code, split, _ = plan(4)
    assert code == 0 and "(dp 2 x tp 1 x pp 1 x sp 4)" in split and "x 1024 tokens (1/4 of each sequence)" in split
    for row in ("activations (no checkpointing)", "activations (checkpointing every block)"):
        assert gib(split, row) == pytest.approx(gib(whole, row) / 4, rel=0.02), row
    assert gib(split, "parameters") == gib(whole, "parameters")  # ZeRO 3 over dp x sp = 8 ranks either way
    code, _, err = plan(3)
    assert code == 2 and "sequence_parallel_size: 3 model- and sequence-parallel ranks" in err, err
    code, _, err = plan(4, seq=4094)
    assert code == 2 and "--seq-len 4094: sequence parallelism over 4 ranks needs a length it divides" in err, err
    code, _, err = plan(2, **{"pipeline": {"stages": 2}, "zero_optimization": {"stage": 1}})
    assert code == 2 and "sequence_parallel_size: sequence parallelism together with pipeline" in err, err
    pipelined = tmp_path / "pp2.json"
    pipelined.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                                     "pipeline": {"stages": 2}, "zero_optimization": {"stage": 1}}))
    assert main(["plan", str(pipelined), "--model", str(EXAMPLES / "llama-2-7b"), "--world-size", "8",
                 "--zero-stage", "3"]) == 2  # the override is checked too
    assert "zero_optimization.stage: 3 with pipeline parallelism is not supported yet" in capsys.readouterr().err
