"""``engine.compile()`` and the ``compile`` config block: torch.compile of the engine's module reproduces
the eager run (losses and gradient norms to 1e-5) with the stage's hooks still working, and DeepCompile's
options are refused or reported as having no effect."""

from __future__ import annotations

import pytest
import torch

import zerotune
from tests.harness import run_distributed
from tests.models import assert_close_traces, engine_run, gpt2_batch, make_gpt2, reference_run
from zerotune.compat import install_deepspeed_alias
from zerotune.compat.alias import uninstall_deepspeed_alias
from zerotune.compat.paths import DeepSpeedFeatureNotSupported
from zerotune.config import ConfigError, load_config

STEPS, GAS, CLIP = 4, 2, 1.0


def _config(stage: int, **extra: object) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}, "steps_per_print": 1000,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **extra}


def _compiled_parity(stage: int, how: str) -> dict:
    torch._dynamo.reset()
    world = torch.distributed.get_world_size()
    reference_model = make_gpt2()
    reference = reference_run(reference_model, torch.optim.AdamW(reference_model.parameters(), lr=0.01, weight_decay=0.0),
                              gpt2_batch, steps=STEPS, gas=GAS, global_rows=2 * world, clip=CLIP)
    model = make_gpt2()
    extra = {"compile": {"enabled": True, "backend": "aot_eager"}} if how == "config" else {}
    engine, *_ = zerotune.initialize(model=model, config=_config(stage, **extra))
    try:
        if how == "method":
            engine.compile(backend="aot_eager", compile_kwargs={"dynamic": False})
            engine.compile(backend="aot_eager")  # a second call changes nothing
        trace = engine_run(engine, gpt2_batch, steps=STEPS, gas=GAS, global_rows=2 * world)
        return {"trace": trace, "reference": reference, "is_compiled": engine.is_compiled,
                "compiled_call": getattr(engine.module, "_compiled_call_impl", None) is not None}
    finally:
        engine.destroy()
        torch._dynamo.reset()


@pytest.mark.parametrize("stage, how", [(0, "method"), (1, "method"), (2, "config")])
def test_a_compiled_engine_reproduces_pytorch(stage: int, how: str) -> None:
    result = run_distributed(_compiled_parity, 2, stage, how, timeout=300)[0]
    assert result["is_compiled"] and result["compiled_call"]
    assert_close_traces(result["trace"], result["reference"], rel=1e-5)


def _refusals() -> list[str]:
    messages = []
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=_config(3))
    try:
        engine.compile(backend="aot_eager")
    except NotImplementedError as error:
        messages.append(str(error))
    finally:
        engine.destroy()
    engine, *_ = zerotune.initialize(model=make_gpt2(), config=_config(0))
    try:
        for kwargs in ({"schedule": [(0, ["z1"])]}, {"compiled_autograd_enabled": True},
                       {"compile_kwargs": {"modee": "max-autotune"}}):
            try:
                engine.compile(**kwargs)
            except (NotImplementedError, TypeError) as error:
                messages.append(str(error))
        messages.append(str(engine.is_compiled))
        return messages
    finally:
        engine.destroy()


def test_what_compile_refuses_is_one_line_naming_it() -> None:
    stage3, schedule, autograd, kwargs, compiled = run_distributed(_refusals, 1, timeout=120)[0]
    assert stage3.startswith("engine.compile at ZeRO stage 3 is not supported yet")
    assert schedule.startswith("engine.compile(schedule=...): a DeepCompile pass schedule")
    assert autograd.startswith("engine.compile(compiled_autograd_enabled=True)")
    assert "['modee'] are not torch.compile arguments; valid: mode, fullgraph" in kwargs
    assert compiled == "False"


def test_the_compile_block() -> None:
    config = load_config({"compile": {"deepcompile": False, "offload_activation": True}})
    assert not config.compile.enabled
    assert ("compile.offload_activation", "no effect here: a DeepCompile option; DeepCompile is off") in config.notes
    with pytest.raises(ConfigError, match="compile.deepcompile: 'deepcompile' is a DeepSpeed feature zerotune does "
                                          "not support; remove the key"):
        load_config({"compile": {"deepcompile": True}})
    with pytest.raises(ConfigError, match=r"compile.kwargs: .*\['modee'\] are not torch.compile arguments"):
        load_config({"compile": {"enabled": True, "kwargs": {"modee": 1}}})


def test_deepspeed_compile_names() -> None:
    install_deepspeed_alias()
    try:
        from deepspeed.runtime.compiler import disable, is_compile_supported, is_compiling

        assert is_compile_supported() and not is_compiling()
        assert disable(lambda: 3)() == 3
        with pytest.raises(DeepSpeedFeatureNotSupported, match="DeepCompile's graph passes"):
            import deepspeed.compile  # noqa: F401
    finally:
        uninstall_deepspeed_alias()
