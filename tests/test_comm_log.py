"""The comms log (``zerotune.distributed.comm_log``; DeepSpeed's ``comms_logger`` / ``utils.comms_logging``): the
collective layer times a call when the log wants its op, recording latency and bandwidth by message size beside
the call and byte counts of ``comm_stats()``; switches from the config block, ``configure`` or the profiling
methods; summaries that leave the records as they were."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from zerotune.distributed.comm_log import CommsLogger, calc_bw_log, convert_size
from zerotune.monitor.timers import trim_mean


def test_profiling_switches_and_op_names() -> None:
    log = CommsLogger()
    assert not log.enabled and not log.wants("all_reduce")  # off until enabled
    log.enabled = True
    assert log.wants("broadcast")  # prof_all by default
    log.stop_profiling_comms()
    assert log.prof_all is False and not log.wants("all_reduce")
    log.start_profiling_op(["all_gather_into_tensor", "all_reduce"])  # DeepSpeed's call names map to the op
    assert log.wants("all_gather") and log.wants("all_reduce") and not log.wants("broadcast")
    log.stop_profiling_op(["all_reduce"])
    assert not log.wants("all_reduce")
    log.start_profiling_comms()
    assert log.prof_all is True


def test_configure_from_a_block_dict_or_section() -> None:
    from zerotune.config.comms_logger_section import CommsLoggerConfig

    log = CommsLogger()
    log.configure({"enabled": True, "prof_all": False, "prof_ops": ["reduce_scatter"], "verbose": True})
    assert (log.enabled, log.prof_all, log.prof_ops, log.verbose) == (True, False, ["reduce_scatter"], True)
    log.configure(CommsLoggerConfig(enabled=True, debug=True))
    assert (log.enabled, log.prof_all, log.prof_ops, log.debug) == (True, True, [], True)
    log.configure({"enabled": False})
    assert not log.enabled


def test_config_block_is_validated() -> None:
    from zerotune.config import ZeroTuneConfig

    config = ZeroTuneConfig.model_validate({"train_batch_size": 2, "comms_logger": {"enabled": True,
                                                                                   "prof_ops": ["all_reduce"]}})
    assert config.comms_logger.enabled and config.comms_logger.prof_ops == ["all_reduce"]
    with pytest.raises(Exception, match="prof_al"):
        ZeroTuneConfig.model_validate({"train_batch_size": 2, "comms_logger": {"prof_al": True}})


def test_summary_keeps_the_parallel_lists_in_call_order() -> None:
    log = CommsLogger()
    latencies = [3.0, 1.0, 2.0]
    algbws = [10.0 / latency for latency in latencies]
    log.comms_dict = {"all_reduce": {1024: [3, list(latencies), list(algbws), [2 * a for a in algbws]]}}
    summary = log.get_operation_summary("all_reduce")
    assert summary is not None and summary[1024]["avg_latency_ms"] == 2.0 and summary[1024]["count"] == 3
    assert log.get_raw_data()["all_reduce"][1024][1] == latencies
    assert log.get_raw_data()["all_reduce"][1024][2] == algbws
    assert log.get_operation_summary("broadcast") is None
    assert log.get_total_operations() == 3 and log.get_operation_names() == ["all_reduce"] and log.has_data()
    log.reset_data()
    assert not log.has_data()


def test_trim_mean_does_not_reorder_and_checks_its_fraction() -> None:
    data = [5.0, 1.0, 100.0, 2.0, 3.0, 4.0, 0.0, 6.0, 7.0, 8.0]
    assert trim_mean(data, 0.1) == pytest.approx(sum(sorted(data)[1:9]) / 8)
    assert data[:3] == [5.0, 1.0, 100.0]
    assert trim_mean([], 0.1) == 0
    with pytest.raises(ValueError, match="trim_percent"):
        trim_mean([1.0], 1.5)


def test_bandwidth_formulas_and_sizes() -> None:
    # 1 MB in 1 ms over 4 ranks: an all-reduce's algorithm bandwidth counts the message twice
    algbw, busbw = calc_bw_log("all_reduce", 1e6, 1.0, world=4)
    assert (algbw, busbw) == pytest.approx((16.0, 12.0))
    algbw, busbw = calc_bw_log("all_gather_into_tensor", 1e6, 1.0, world=4)  # DeepSpeed's name of all_gather
    assert (algbw, busbw) == pytest.approx((32.0, 24.0))
    assert calc_bw_log("broadcast", 1e6, 1.0, world=4) == pytest.approx((8.0, 8.0))
    assert convert_size(0) == "0B" and convert_size(1536) == "1.5 KB"


def _logged_collectives() -> dict:
    import zerotune.comm as zcomm
    from zerotune.distributed.comm_log import COMMS_LOGGER

    rank = zcomm.get_rank()
    zcomm.reset_comm_stats()
    COMMS_LOGGER.reset_data()
    zcomm.configure(enabled=True, prof_all=True)
    try:
        for _ in range(3):
            zcomm.all_reduce(torch.ones(256))  # 1 KB message
        zcomm.all_gather_into_tensor(torch.empty(8 * zcomm.get_world_size()), torch.ones(8))
        handle = zcomm.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * zcomm.get_world_size()), async_op=True)
        handle.wait()  # an asynchronous call is recorded once it is waited for
        zcomm.configure(prof_all=False, prof_ops=["broadcast"])
        zcomm.all_reduce(torch.ones(2))  # not wanted now: counted, not timed
        raw = COMMS_LOGGER.get_raw_data()
        records = {op: {size: vals[0] for size, vals in sizes.items()} for op, sizes in raw.items()}
        parallel = all(len(vals[1]) == len(vals[2]) == len(vals[3]) == vals[0]
                       for sizes in raw.values() for vals in sizes.values())
        summary = zcomm.log_summary(show_straggler=True, return_dict=True)
        calls = {op: s.calls for op, s in zcomm.comm_stats().items()}
    finally:
        zcomm.configure(enabled=False, prof_all=True, prof_ops=[])
        COMMS_LOGGER.reset_data()
    return {"rank": rank, "records": records, "parallel": parallel, "calls": calls,
            "summary_ops": sorted(summary["summary"]), "straggler_ops": sorted(summary["straggler_analysis"]),
            "world": summary["metadata"]["world_size"]}


def test_the_collective_layer_writes_timed_calls_into_the_process_log() -> None:
    results = run_distributed(_logged_collectives, 2)
    for result in results:
        # message bytes as DeepSpeed's: the tensor handed in (an all-gather's input, a reduce-scatter's full input)
        assert result["records"] == {"all_reduce": {1024: 3}, "all_gather": {32: 1}, "reduce_scatter": {32: 1}}
        assert result["parallel"]
        # the counters count every call, timed or not (the straggler report's all-reduces included)
        assert result["calls"]["all_reduce"] == 4 + 3
        assert result["summary_ops"] == result["straggler_ops"] == ["all_gather", "all_reduce", "reduce_scatter"]
        assert result["world"] == 2


def _engine_with_comms_logger(enabled: bool) -> dict:
    from torch import nn

    import zerotune
    from zerotune.distributed.comm_log import COMMS_LOGGER

    COMMS_LOGGER.reset_data()
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "comms_logger": {"enabled": enabled, "prof_all": False, "prof_ops": ["all_reduce"]}}
    engine, *_ = zerotune.initialize(model=nn.Linear(4, 2), config=config)
    try:
        loss = engine(torch.ones(2, 4)).sum()
        engine.backward(loss)
        engine.step()
        return {"ops": sorted(COMMS_LOGGER.get_operation_names()), "enabled": COMMS_LOGGER.enabled}
    finally:
        engine.destroy()
        COMMS_LOGGER.enabled, COMMS_LOGGER.prof_all, COMMS_LOGGER.prof_ops = False, True, []
        COMMS_LOGGER.reset_data()


def test_the_engine_applies_the_config_block() -> None:
    on = run_distributed(_engine_with_comms_logger, 2, True, timeout=120)
    assert all(r == {"ops": ["all_reduce"], "enabled": True} for r in on)  # data-parallel gradient all-reduce
    off = run_distributed(_engine_with_comms_logger, 2, False, timeout=120)
    assert all(r == {"ops": [], "enabled": False} for r in off)
