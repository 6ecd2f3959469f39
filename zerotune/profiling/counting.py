"""One profiled forward: FLOPs and MACs per module on torch's ``FlopCounterMode``, latency and parameters per
module from forward hooks.

The counts follow DeepSpeed's flops profiler, so its users read the same numbers:

* MACs are the multiply-accumulates of the matrix products (mm, addmm, bmm, baddbmm, convolutions, attention).
  ``FlopCounterMode`` counts exactly those ops, at two flops per MAC, so a module's MACs are its count / 2. What
  it lacks for that is CPU attention (``_scaled_dot_product_flash_attention_for_cpu``), added from torch's own
  attention formula.
* flops are 2 x MACs plus the elementwise work DeepSpeed counts: a convolution's bias and pooling (one per
  output / input element), the relu family, gelu and silu, softmax (one per element), and normalizations (4 per
  element, 5 with an affine transform; batch norm in eval 1 or 2). ``FlopCounterMode`` has no formula for them;
  a second ``FlopCounterMode`` whose ``custom_mapping`` holds only these (``ELEMENTWISE``) counts them alongside,
  which keeps each module's MACs exact (a single counter would mix a convolution's bias into its MACs).
* Not counted, as in DeepSpeed: tanh and sigmoid, log-softmax (cross-entropy), embedding lookups, dropout. Unlike
  DeepSpeed, explicit ``torch.add`` / ``torch.mul`` calls are not counted either: at the operator level they are
  the same op as ``+`` and ``*``, which DeepSpeed leaves out.

Counts are inclusive (a module's include its submodules' and the ops its own ``forward`` runs), as DeepSpeed's
``get_module_flops`` sums them; ``FlopCounterMode``'s module hierarchy attributes each op to every module on the
call stack, named ``Root.child.grandchild`` from the first module called (the profiled model).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterable, Optional

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

aten = torch.ops.aten


def _numel(shape: Optional[Iterable[int]]) -> int:
    return math.prod(shape) if shape is not None else 0


def _input_elements(input_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return _numel(input_shape)


def _output_elements(*args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    shape = out_shape[0] if isinstance(out_shape, (tuple, list)) and isinstance(out_shape[0], (tuple, list)) \
        else out_shape
    return _numel(shape)


def _conv_bias(x_shape: Any, w_shape: Any, bias: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return _numel(out_shape) if bias is not None else 0


def _affine_norm(input_shape: Any, weight: Any) -> int:
    return _numel(input_shape) * (5 if weight is not None else 4)


def _batch_norm(input_shape: Any, weight: Any, bias: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    # native_batch_norm / _native_batch_norm_legit take ``training`` as their first bool argument
    training = next((a for a in args if isinstance(a, bool)), kwargs.get("training", False))
    if training:
        return _affine_norm(input_shape, weight)
    return _numel(input_shape) * (2 if weight is not None else 1)


def _batch_norm_eval(input_shape: Any, weight: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return _numel(input_shape) * (2 if weight is not None else 1)


def _layer_norm(input_shape: Any, normalized_shape: Any, weight: Any = None, *args: Any, out_shape: Any = None,
                **kwargs: Any) -> int:
    return _affine_norm(input_shape, weight)


def _group_norm(input_shape: Any, weight: Any = None, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return _affine_norm(input_shape, weight)


def _cpu_attention(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(sdpa_flop_count(query, key, value))


# The attention kernel CPU runs, which FlopCounterMode's registry lacks (its formula is torch's): 2 flops per MAC.
MATMUL_EXTRAS: dict[Any, Callable[..., int]] = {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention}

_ACTIVATIONS = ("relu", "relu_", "hardtanh", "hardtanh_", "gelu", "gelu_", "silu", "silu_", "elu", "elu_",
                "leaky_relu", "leaky_relu_", "_prelu_kernel", "prelu")
_POOLS = ("avg_pool2d", "avg_pool3d", "max_pool2d_with_indices", "max_pool3d_with_indices", "max_pool2d",
          "max_pool3d", "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_max_pool2d", "adaptive_max_pool3d")
_UPSAMPLES = ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
              "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
              "upsample_bicubic2d", "upsample_trilinear3d")


def _ops(names: Iterable[str]) -> list[Any]:
    return [getattr(aten, name) for name in names if hasattr(aten, name)]


# The elementwise work DeepSpeed's profiler counts and FlopCounterMode does not (no MACs).
ELEMENTWISE: dict[Any, Callable[..., int]] = {
    **{op: _input_elements for op in _ops(_ACTIVATIONS + _POOLS + ("_softmax",))},
    **{op: _output_elements for op in _ops(_UPSAMPLES)},
    **{op: _conv_bias for op in _ops(("convolution", "_convolution"))},
    **{op: _batch_norm for op in _ops(("native_batch_norm", "_native_batch_norm_legit"))},
    aten._native_batch_norm_legit_no_training: _batch_norm_eval,
    aten.native_layer_norm: _layer_norm,
    aten.native_group_norm: _group_norm,
}


def module_params(module: torch.nn.Module) -> int:
    """The module's parameters (shared ones once); a ZeRO-3 parameter counts whole (``ds_numel``), as its forward
    sees it, not as the empty placeholder it is between forwards."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())


class ForwardCounts:
    """Counts the forwards of ``model`` between ``start()`` and ``stop()``; the counts stay readable until the
    next ``start()``. Modules whose type is in ``ignore`` get no entry of their own: their figures are their
    submodules' (their parents' totals still include them), as DeepSpeed's ``ignore_list`` has it."""

    def __init__(self, model: torch.nn.Module, ignore: Iterable[type] = ()) -> None:
        self.model = model
        self.ignore = tuple(ignore)
        self._matmuls: Optional[FlopCounterMode] = None
        self._elementwise: Optional[FlopCounterMode] = None
        self._names: dict[int, list[str]] = {}
        self._started_at: dict[int, list[float]] = {}
        self.durations: dict[int, float] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self.running = False

    def start(self) -> None:
        """Clear the counts and count from now on (FLOPs, MACs, latency of every module's forward)."""
        if self.running:
            self.stop()
        root = type(self.model).__name__
        self._names = {}
        for name, module in self.model.named_modules(remove_duplicate=False):
            self._names.setdefault(id(module), []).append(f"{root}.{name}" if name else root)
        self.durations = {id(m): 0.0 for m in self.model.modules()}
        self._started_at = {}
        synchronize = self._synchronize()
        for module in self.model.modules():
            if not isinstance(module, self.ignore):
                self._handles.append(module.register_forward_pre_hook(self._time_from(synchronize)))
                self._handles.append(module.register_forward_hook(self._time_to(synchronize)))
        self._matmuls = FlopCounterMode(display=False, custom_mapping=MATMUL_EXTRAS)
        self._elementwise = FlopCounterMode(display=False, custom_mapping=ELEMENTWISE)
        self._matmuls.__enter__()
        self._elementwise.__enter__()
        self.running = True

    def stop(self) -> None:
        """Stop counting (the model runs unobserved again); the counts are kept."""
        if not self.running:
            return
        self.running = False
        for handle in self._handles:
            handle.remove()
        self._handles = []
        assert self._elementwise is not None and self._matmuls is not None
        self._elementwise.__exit__(None, None, None)
        self._matmuls.__exit__(None, None, None)

    def _synchronize(self) -> Optional[Callable[[], None]]:
        """Device work is asynchronous: a CUDA model's module times wait for it (as DeepSpeed's hooks do)."""
        on_cuda = any(p.is_cuda for p in self.model.parameters())
        return torch.cuda.synchronize if on_cuda else None

    def _time_from(self, synchronize: Optional[Callable[[], None]]) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if synchronize is not None:
                synchronize()
            self._started_at.setdefault(id(module), []).append(time.perf_counter())
        return hook

    def _time_to(self, synchronize: Optional[Callable[[], None]]) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            starts = self._started_at.get(id(module))
            if starts:
                if synchronize is not None:
                    synchronize()
                self.durations[id(module)] = self.durations.get(id(module), 0.0) + time.perf_counter() - starts.pop()
        return hook

    def _count(self, counter: Optional[FlopCounterMode], module: torch.nn.Module,
               keys: Optional[dict[Any, Any]] = None) -> int:
        if counter is None:
            return 0
        if isinstance(module, self.ignore):
            return sum(self._count(counter, child, keys) for child in module.children())
        for name in self._names.get(id(module), ()):
            ops = counter.flop_counts.get(name)
            if ops:
                return sum(n for op, n in ops.items() if keys is None or op in keys)
        # no op ran inside it: a container never called itself (a ModuleList) holds what its children ran
        return sum(self._count(counter, child, keys) for child in module.children())

    def macs(self, module: torch.nn.Module) -> int:
        """Multiply-accumulates of ``module``'s counted forwards (its submodules' included)."""
        return self._count(self._matmuls, module) // 2

    def flops(self, module: torch.nn.Module) -> int:
        """Floating-point operations of ``module``'s counted forwards: 2 per MAC plus the elementwise work."""
        return self._count(self._matmuls, module) + self._count(self._elementwise, module, ELEMENTWISE)

    def duration(self, module: torch.nn.Module) -> float:
        """Seconds in ``module``'s forwards; a container never called itself (a ModuleList) sums its children's."""
        own = self.durations.get(id(module), 0.0)
        return own if own else sum(self.duration(child) for child in module.children())


__all__ = ["ForwardCounts", "ELEMENTWISE", "MATMUL_EXTRAS", "module_params"]
