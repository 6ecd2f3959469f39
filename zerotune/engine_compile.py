"""``engine.compile()``: DeepSpeed's way to run the engine's module under ``torch.compile``.

The module is compiled in place (``nn.Module.compile``), so the engine, its hooks (stage 3's gathers,
the gradient buckets' post-accumulate hooks) and every reference the script holds keep working: the
hooks are ordinary Python that dynamo runs around the graphs it captures. Only the computation is
compiled; zerotune's collectives stay outside any graph, which is why DeepSpeed's DeepCompile options
(graph passes that move the collectives into the graph: ``schedule``, ``"compile": {"deepcompile": true}``)
are refused rather than emulated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from zerotune.config.sections import TORCH_COMPILE_KWARGS
from zerotune.monitor.logging import log_rank0

DEFAULT_BACKEND = "inductor"  # torch.compile's default, and DeepSpeed's accelerator default


class EngineCompile:
    """Mixed into ``Engine``; relies on the engine's attributes declared below."""

    _compiled_with: dict[str, Any] | None = None

    if TYPE_CHECKING:  # set by EngineCore.__init__, or EngineQueries' queries
        module: torch.nn.Module

        @property
        def global_rank(self) -> int: ...

        def zero_optimization_partition_weights(self) -> bool: ...

    def compile(self, backend: str | Any = DEFAULT_BACKEND, compile_kwargs: dict[str, Any] | None = None,
                schedule: Any = None, compiled_autograd_enabled: bool = False) -> None:
        """Compile the module with ``torch.compile(backend=backend, **compile_kwargs)``; a second call is a no-op.

        ``compile_kwargs`` are torch.compile's own (``mode``, ``fullgraph``, ``dynamic``, ``options``);
        a ``backend`` inside them is overridden by the argument, as in DeepSpeed."""
        if schedule is not None:
            raise NotImplementedError("engine.compile(schedule=...): a DeepCompile pass schedule; zerotune compiles "
                                      "with torch.compile and has no DeepCompile passes (leave schedule=None)")
        if compiled_autograd_enabled:
            raise NotImplementedError("engine.compile(compiled_autograd_enabled=True): zerotune's gradient hooks "
                                      "reduce buckets during backward, which compiled autograd would trace; leave it "
                                      "False (the forward and backward graphs are still compiled)")
        if self._compiled_with is not None:
            return
        if self.zero_optimization_partition_weights():
            raise NotImplementedError("engine.compile at ZeRO stage 3 is not supported yet: a compiled graph saves the "
                                      "gathered parameters for its backward, and stage 3 frees and refills them in "
                                      "between (DeepSpeed needs DeepCompile for the same reason); compile at "
                                      "stages 0-2")
        kwargs = dict(compile_kwargs or {})
        if "backend" in kwargs:
            log_rank0("engine.compile: the backend in compile_kwargs (%r) is overridden by backend=%r",
                      kwargs.pop("backend"), backend, rank=self.global_rank)
        unknown = sorted(set(kwargs) - set(TORCH_COMPILE_KWARGS))
        if unknown:
            raise TypeError(f"engine.compile: compile_kwargs {unknown} are not torch.compile arguments; valid: "
                            f"{', '.join(TORCH_COMPILE_KWARGS)}")
        self.module.compile(backend=backend, **kwargs)
        self._compiled_with = {"backend": backend, **kwargs}
        log_rank0("engine.compile: module compiled with torch.compile(%s)",
                  ", ".join(f"{k}={v!r}" for k, v in self._compiled_with.items()), rank=self.global_rank)

    @property
    def is_compiled(self) -> bool:
        return self._compiled_with is not None

    def is_deepcompile_enabled(self) -> bool:
        """DeepSpeed's query; always False: zerotune has no DeepCompile (``"compile": {"deepcompile": true}`` is
        refused)."""
        return False

    def is_deepcompile_active(self) -> bool:
        return False

