"""``deepspeed.accelerator``: ``get_accelerator()`` and the CPU and CUDA accelerators.

DeepSpeed scripts write device code against this object (``get_accelerator().device_name()``,
``.communication_backend_name()``, ``.manual_seed(...)``, memory queries) instead of naming
``torch.cuda``. One class serves both devices: CUDA delegates to ``torch.cuda``; the CPU
answers as DeepSpeed's CPU accelerator does (host memory for the memory queries, gloo for
communication, no-op synchronisation and streams). The choice is CUDA when it is available,
unless ``DS_ACCELERATOR`` (DeepSpeed's variable) says ``cpu`` or ``cuda``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import torch

from zerotune.offload.pinned import track_pinned

__all__ = ["get_accelerator", "set_accelerator", "is_current_accelerator_supported", "Accelerator"]

SUPPORTED = ("cpu", "cuda")


class _NoStream:
    """The CPU's stand-in for a CUDA stream: work is synchronous, so waiting is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_NoEvent":
        return event or _NoEvent()

    def query(self) -> bool:
        return True


class _NoEvent:
    """The CPU's stand-in for a CUDA event (timing falls back to the host clock)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self._time = 0.0

    def record(self, stream: Any = None) -> None:
        import time

        self._time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_NoEvent") -> float:
        return (end._time - self._time) * 1000.0


def _host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return vm.total, vm.available
    except ImportError:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        available = os.sysconf("SC_AVPHYS_PAGES") * page
        return pages * page, available


def _process_rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Accelerator:
    """DeepSpeed's accelerator interface for one torch device type ("cpu" or "cuda")."""

    def __init__(self, device_type: str) -> None:
        if device_type not in SUPPORTED:
            raise ValueError(f"accelerator {device_type!r} is not supported; valid: {', '.join(SUPPORTED)}")
        self._name = device_type
        self._cuda = device_type == "cuda"
        self._communication_backend_name = "nccl" if self._cuda else "gloo"
        self._compile_backend = "inductor"
        self._peak_rss = 0

    def __repr__(self) -> str:
        return f"<zerotune {self._name} accelerator>"

    # --- device --------------------------------------------------------------------------
    def is_synchronized_device(self) -> bool:
        return not self._cuda

    def use_host_timers(self) -> bool:
        return not self._cuda

    def resolves_data_dependency(self) -> bool:
        return not self._cuda

    def handles_memory_backpressure(self) -> bool:
        return not self._cuda

    def device_name(self, device_index: int | None = None) -> str:
        if device_index is None or not self._cuda:
            return self._name
        return f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        if self._cuda:
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_triton_supported(self) -> bool:
        return False

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"] if self._cuda else []

    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids: list[int]) -> None:
        for name in self.visible_devices_envs():
            current_env[name] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self._cuda else []

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        self._compile_backend = backend

    # --- random numbers ------------------------------------------------------------------
    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> None:
        (torch.cuda.manual_seed if self._cuda else torch.manual_seed)(seed)

    def manual_seed_all(self, seed: int) -> None:
        (torch.cuda.manual_seed_all if self._cuda else torch.manual_seed)(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def seed(self) -> None:
        (torch.cuda.seed if self._cuda else torch.seed)()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index] if self._cuda else torch.default_generator

    # --- streams and events --------------------------------------------------------------
    @property
    def Stream(self) -> Callable[..., Any]:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Stream if self._cuda else _NoStream

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index) if self._cuda else _NoStream()

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index) if self._cuda else _NoStream()

    @property
    def Event(self) -> Callable[..., Any]:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Event if self._cuda else _NoEvent

    # --- memory --------------------------------------------------------------------------
    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.memory_allocated(device_index)
        rss = _process_rss()
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        self._peak_rss = max(self._peak_rss, _process_rss())
        return self._peak_rss

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._peak_rss = _process_rss()

    def memory_cached(self, device_index: int | None = None) -> int:
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        self.reset_max_memory_allocated(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else self.memory_allocated()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else self.max_memory_allocated()

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self.reset_max_memory_allocated(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, int]:
        if self._cuda:
            return torch.cuda.memory_stats(device_index)
        return {"allocated_bytes.all.current": self.memory_allocated(),
                "allocated_bytes.all.peak": self.max_memory_allocated()}

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return _host_memory()[0]

    def available_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            free, _total = torch.cuda.mem_get_info(device_index)
            return free
        return _host_memory()[1]

    # --- data types ----------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float, torch.half, torch.bfloat16]

    def amp(self) -> Any:
        return torch.amp

    @property
    def BFloat16Tensor(self) -> Any:  # noqa: N802 - DeepSpeed's tensor-type properties
        return self._typed(torch.bfloat16)

    @property
    def HalfTensor(self) -> Any:  # noqa: N802
        return self._typed(torch.float16)

    @property
    def FloatTensor(self) -> Any:  # noqa: N802
        return self._typed(torch.float32)

    @property
    def LongTensor(self) -> Any:  # noqa: N802
        return self._typed(torch.int64)

    @property
    def IntTensor(self) -> Any:  # noqa: N802
        return self._typed(torch.int32)

    @property
    def ByteTensor(self) -> Any:  # noqa: N802
        return self._typed(torch.uint8)

    def _typed(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        device = self.current_device_name()

        def make(*args: Any) -> torch.Tensor:
            if len(args) == 1 and not isinstance(args[0], int):
                return torch.tensor(args[0], dtype=dtype, device=device)
            return torch.empty(*args, dtype=dtype, device=device)

        return make

    # --- tensors -------------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """Page-locked (and counted, ``offload/pinned.py``) copy with CUDA; on CPU the tensor itself."""
        return track_pinned(tensor.pin_memory()) if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def range_push(self, msg: str) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return torch.cuda._lazy_call(callback) if self._cuda else callback()

    # --- compiled ops: zerotune builds none; the builders say which capabilities exist (op_builder.py) ----
    def op_builder_dir(self) -> str:
        return "zerotune.compat.op_builder"

    def create_op_builder(self, class_name: str) -> Any:
        """An instance of the builder named ``class_name``; None for a name DeepSpeed has no builder of."""
        from zerotune.compat.op_builder import get_builder_class

        builder = get_builder_class(class_name)
        return builder() if builder is not None else None

    def get_op_builder(self, class_name: str) -> Any:
        from zerotune.compat.op_builder import get_builder_class

        return get_builder_class(class_name)

    def build_extension(self) -> Any:
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension


_current: Accelerator | None = None


def _detect() -> Accelerator:
    requested = os.environ.get("DS_ACCELERATOR")
    if requested:
        if requested not in SUPPORTED:
            raise ValueError(f"DS_ACCELERATOR={requested!r} is not supported by zerotune; "
                             f"valid: {', '.join(SUPPORTED)}")
        if requested == "cuda" and not torch.cuda.is_available():
            raise ValueError("DS_ACCELERATOR=cuda but torch sees no CUDA device")
        return Accelerator(requested)
    return Accelerator("cuda" if torch.cuda.is_available() else "cpu")


def get_accelerator() -> Accelerator:
    """The process's accelerator (created on first use)."""
    global _current
    if _current is None:
        _current = _detect()
    return _current


def set_accelerator(accelerator: Accelerator) -> None:
    global _current
    _current = accelerator


def is_current_accelerator_supported() -> bool:
    return get_accelerator()._name in SUPPORTED


DeepSpeedAccelerator = Accelerator  # the base class's name, for isinstance checks and type hints
