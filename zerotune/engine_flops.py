"""The engine's side of the ``flops_profiler`` config block (``zerotune/config/flops_profiler_section.py``).

On rank 0, the forwards of global step ``profile_step`` run under ``engine.flops_profiler`` (a
``zerotune.profiling.FlopsProfiler``; each forward restarts it, so the profile is the last micro-batch's, per
GPU as DeepSpeed reports it), and the step's optimizer step prints the profile (or writes ``output_file``) and
ends it. With ``wall_clock_breakdown`` the profile adds that step's forward, backward and optimizer-step
latencies, measured here while the profile runs. Without the block the engine has no ``flops_profiler`` and each
hook costs one attribute test.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, ContextManager, Iterator, Optional

import torch

from zerotune.profiling import FlopsProfiler
from zerotune.profiling.report import Breakdown

_NO_OP = contextlib.nullcontext()


class EngineFlops:
    """Mixed into ``Engine``; relies on its ``module``, ``_config``, ``env``, ``mesh`` and ``global_steps``."""

    module: torch.nn.Module
    _config: Any
    env: Any
    mesh: Any
    global_steps: int
    _flops_phases: dict[str, float]

    def _flops_setup(self) -> None:
        cfg = self._config.flops_profiler
        self._flops_phases = {}
        if cfg.enabled:
            self.flops_profiler = FlopsProfiler(self.module, ds_engine=self,
                                                recompute_fwd_factor=cfg.recompute_fwd_factor)

    # DeepSpeed's queries of the block
    def flops_profiler_enabled(self) -> bool:
        """Whether the config's ``flops_profiler`` block is on."""
        return bool(self._config.flops_profiler.enabled)

    def flops_profiler_recompute_fwd_factor(self) -> float:
        return float(self._config.flops_profiler.recompute_fwd_factor)

    def flops_profiler_profile_step(self) -> int:
        return int(self._config.flops_profiler.profile_step)

    def flops_profiler_module_depth(self) -> int:
        return int(self._config.flops_profiler.module_depth)

    def flops_profiler_top_modules(self) -> int:
        return int(self._config.flops_profiler.top_modules)

    def flops_profiler_detailed(self) -> bool:
        return bool(self._config.flops_profiler.detailed)

    def flops_profiler_output_file(self) -> Optional[str]:
        return self._config.flops_profiler.output_file

    @property
    def mp_world_size(self) -> int:
        """The model-parallel (tensor-parallel) degree, as DeepSpeed's engine names it."""
        return int(self.mesh.size("tp"))

    @property
    def has_moe_layers(self) -> bool:
        """DeepSpeed's flag: zerotune builds no mixture-of-experts layers (``deepspeed.moe.layer.MoE`` is refused)."""
        return False

    def _flops_forward(self) -> ContextManager[None]:
        """Around the module's forward: profiled on rank 0 at ``profile_step``, else a shared no-op."""
        profiler: Optional[FlopsProfiler] = self.__dict__.get("flops_profiler")
        if profiler is None or self.env.rank != 0 or self.global_steps != self._config.flops_profiler.profile_step:
            return _NO_OP
        return self._profiled_forward(profiler)

    @contextlib.contextmanager
    def _profiled_forward(self, profiler: FlopsProfiler) -> Iterator[None]:
        profiler.start_profile(ignore_list=None)
        self._flops_phases = {}
        try:
            with self._timed("forward"):
                yield
        finally:
            profiler.stop_profile()

    def _flops_phase(self, name: str) -> ContextManager[None]:
        """Around the backward or optimizer step: timed while a profile is started, else a shared no-op."""
        profiler: Optional[FlopsProfiler] = self.__dict__.get("flops_profiler")
        if profiler is None or not profiler.started:
            return _NO_OP
        return self._timed(name)

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        synchronize = torch.cuda.synchronize if self.env.device.type == "cuda" else None
        if synchronize is not None:
            synchronize()
        started = time.perf_counter()
        yield
        if synchronize is not None:
            synchronize()
        self._flops_phases[name] = time.perf_counter() - started

    def flops_profile_breakdown(self) -> Optional[Breakdown]:
        """The profiled step's forward, backward and optimizer-step seconds (None until all three ran)."""
        phases = self._flops_phases
        if not all(name in phases for name in ("forward", "backward", "step")):
            return None
        return Breakdown(phases["forward"], phases["backward"], phases["step"])

    def _flops_report(self) -> None:
        """After an optimizer step: print the profile its forwards were measured for, and end it."""
        profiler: Optional[FlopsProfiler] = self.__dict__.get("flops_profiler")
        if profiler is None or not profiler.started:
            return
        cfg = self._config.flops_profiler
        profiler.print_model_profile(profile_step=cfg.profile_step, module_depth=cfg.module_depth,
                                     top_modules=cfg.top_modules, detailed=cfg.detailed,
                                     output_file=cfg.output_file)
        profiler.end_profile()


__all__ = ["EngineFlops"]
