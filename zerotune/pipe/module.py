"""DeepSpeed's pipeline model API: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``.

A model is a flat list of layers run in order; each layer takes what the previous one returned
(a tensor or a tuple of tensors). ``PipelineModule`` cuts the list into ``num_stages`` contiguous
stages (``partition.py``) and builds only this rank's stage: a ``LayerSpec`` is built on the stage
that owns it and nowhere else, so a model too big for one device never exists whole. Plain
``nn.Module`` layers are accepted too (already built; the others are dropped from this rank).

Ties: a ``TiedLayerSpec`` key names one module shared by several positions (GPT's embedding and
LM head). Each stage holding a position builds the module once; across stages the copies start
from the first holder's weights and their gradients are summed at every step, so they stay one
weight. Layers given as modules that share a parameter object are tied the same way.

The stage of this rank is derived from the global rank as in DeepSpeed's layout (pipeline
outermost): stage = rank // (world / num_stages).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from zerotune.parallel.activation_checkpointing import checkpoint as activation_checkpoint
from zerotune.pipe.partition import PartitionError, balanced_boundaries, layer_weights


class LayerSpec:
    """A layer to build later, on the stage that owns it: ``LayerSpec(nn.Linear, 8, 16)``."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec needs an nn.Module class, got {typename!r}")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module (or its ``tied_weight_attr`` weights) is shared by every spec with the same ``key``;
    ``forward_fn(module, inputs)`` lets a position use the shared module differently (an LM head reusing the
    embedding's weight)."""

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable | None = None,
                 tied_weight_attr: str | list[str] = "weight", **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


@dataclass
class Tie:
    """One weight shared across pipeline positions: which layers use it and under which names."""

    key: str
    layers: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # attribute path of the weight in each layer's module


def _meta_param_count(spec: LayerSpec) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in spec.build().parameters())


def _tied_shapes(spec: TiedLayerSpec) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        module = spec.build()
    return {attr: tuple(module.get_parameter(attr).shape) for attr in spec.tied_weight_attr}


def _stage_of_rank(num_stages: int) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        if num_stages != 1:
            raise RuntimeError("PipelineModule with num_stages > 1 needs torch.distributed initialized first "
                               "(zerotune.init_distributed())")
        return 0
    world = dist.get_world_size()
    if world % num_stages:
        raise PartitionError(f"num_stages={num_stages} does not divide the world size {world}")
    return dist.get_rank() // (world // num_stages)


class PipelineModule(nn.Module):
    """This rank's stage of a layer list (DeepSpeed's signature; see the module docstring)."""

    def __init__(self, layers: list, num_stages: int | None = None, topology: Any = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False, seed_fn: Callable | None = None,
                 base_seed: int = 1234, partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable = activation_checkpoint,
                 checkpointable_layers: list[str] | None = None, dynamic_shape: bool = False) -> None:
        super().__init__()
        # DeepSpeed's engine reuses the first micro-batch's shapes unless this is set; zerotune's stages send a
        # shape header with every message (p2p.py), so shapes may change between micro-batches either way
        self.dynamic_shape = dynamic_shape
        if topology is not None:
            num_stages = _stages_of_topology(topology, num_stages)
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"PipelineModule needs num_stages >= 1, got {num_stages!r}")
        self.layer_specs = list(layers)
        self.num_stages, self.loss_fn = num_stages, loss_fn
        self.partition_method = partition_method
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        # per block of ``activation_checkpoint_interval`` layers, whether forward checkpoints it (DeepSpeed's names)
        self.is_checkpointable_results: list[bool] = []
        self.is_checkpointable_results_interval: int | None = None
        self.stage_id = _stage_of_rank(num_stages)
        self.export_names: dict[int, list[str]] | None = None  # set for split HF models: tensor id -> HF names
        self._check_tied_shapes()
        counts = [_meta_param_count(s) if isinstance(s, LayerSpec) else
                  sum(p.numel() for p in s.parameters()) if isinstance(s, nn.Module) else 0 for s in self.layer_specs]
        names = [s.typename.__name__ if isinstance(s, LayerSpec) else type(s).__name__ for s in self.layer_specs]
        self.parts = balanced_boundaries(layer_weights(partition_method, counts, names), num_stages)
        self.param_counts = counts
        self._build_local_layers(seed_layers, seed_fn, base_seed)

    # ---- construction -------------------------------------------------------------------
    def _check_tied_shapes(self) -> None:
        first: dict[str, tuple[int, dict]] = {}
        for index, spec in enumerate(self.layer_specs):
            if isinstance(spec, TiedLayerSpec):
                shapes = _tied_shapes(spec)
                if spec.key in first and first[spec.key][1] != shapes:
                    other, other_shapes = first[spec.key]
                    raise ValueError(f"TiedLayerSpec key {spec.key!r}: layer {index} ({spec.typename.__name__}) has "
                                     f"tied weights of shapes {shapes}, layer {other} has {other_shapes}; tied "
                                     "layers must hold weights of the same shapes")
                first.setdefault(spec.key, (index, shapes))

    @property
    def local_range(self) -> range:
        return range(self.parts[self.stage_id], self.parts[self.stage_id + 1])

    def stage_of_layer(self, index: int) -> int:
        return next(s for s in range(self.num_stages) if self.parts[s] <= index < self.parts[s + 1])

    def _build_local_layers(self, seed_layers: bool, seed_fn: Callable | None, base_seed: int) -> None:
        self.tied_modules = nn.ModuleDict()
        self.ties: dict[str, Tie] = {}
        self.forward_funcs: list[Callable] = []
        self.local_layers = nn.ModuleDict()
        for index, spec in enumerate(self.layer_specs):
            if isinstance(spec, TiedLayerSpec):
                tie = self.ties.setdefault(spec.key, Tie(spec.key))
                tie.layers.append(index)
                tie.names.append(spec.tied_weight_attr[0])
            if index not in self.local_range:
                continue
            if seed_layers:
                (seed_fn or torch.manual_seed)(base_seed + index)
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                module = self.tied_modules[spec.key]
                self.forward_funcs.append(_tied_forward(module, spec.forward_fn))
            elif isinstance(spec, LayerSpec):
                module = spec.build()
                self.local_layers[str(index)] = module
                self.forward_funcs.append(module)
            elif isinstance(spec, nn.Module):
                self.local_layers[str(index)] = spec
                self.forward_funcs.append(spec)
            elif callable(spec):
                self.forward_funcs.append(spec)
            else:
                raise TypeError(f"pipeline layer {index} is {type(spec).__name__}; expected a LayerSpec, an "
                                "nn.Module or a callable")
        self._tie_shared_module_parameters()

    def _tie_shared_module_parameters(self) -> None:
        """Layers given as modules that share a parameter object (an HF model's tied embedding and head)."""
        owners: dict[int, list[tuple[int, str]]] = {}
        for index, spec in enumerate(self.layer_specs):
            if isinstance(spec, nn.Module):
                for name, param in spec.named_parameters(remove_duplicate=False):
                    owners.setdefault(id(param), []).append((index, name))
        for uses in owners.values():
            layers = sorted({index for index, _ in uses})
            if len(layers) > 1:
                key = f"shared.{uses[0][0]}.{uses[0][1]}"
                first_name = {index: name for index, name in reversed(uses)}
                self.ties[key] = Tie(key, layers, [first_name[i] for i in layers])

    def release_other_stages(self) -> int:
        """Put on the meta device every parameter and buffer of a module layer another stage owns that no layer
        of this stage uses; returns the bytes released.

        For layers cut from a model every rank built whole (an HF model with ``"pipeline": {"stages": N}``):
        the model, and ``layer_specs``, would otherwise keep the other stages' weights alive on every rank --
        the memory pipeline parallelism exists to save. Tensors are swapped in their owning module, so the
        model keeps its structure and shapes, and a weight shared with this stage (a tie, Llama's rotary
        buffers) stays."""
        local = [spec for index, spec in enumerate(self.layer_specs) if index in self.local_range]
        kept = {id(t) for layer in local if isinstance(layer, nn.Module)
                for t in (*layer.parameters(), *layer.buffers())}
        released: dict[int, int] = {}
        for index, layer in enumerate(self.layer_specs):
            if index in self.local_range or not isinstance(layer, nn.Module):
                continue
            for module in layer.modules():
                for name, param in module._parameters.items():
                    if param is not None and _release(param, kept, released):
                        module._parameters[name] = nn.Parameter(torch.empty_like(param, device="meta"),
                                                                param.requires_grad)
                for name, buffer in module._buffers.items():
                    if buffer is not None and _release(buffer, kept, released):
                        module._buffers[name] = _meta_like(buffer)
        return sum(released.values())

    def local_tied_parameters(self) -> dict[str, nn.Parameter]:
        """Tie key -> this stage's copy of the tied weight, for ties that span several stages."""
        found = {}
        for key, tie in self.ties.items():
            stages = {self.stage_of_layer(i) for i in tie.layers}
            local = [(i, name) for i, name in zip(tie.layers, tie.names) if i in self.local_range]
            if len(stages) > 1 and local:
                index, name = local[0]
                module = self.tied_modules[key] if key in self.tied_modules else self.local_layers[str(index)]
                found[key] = module.get_parameter(name)
        return found

    def tie_stages(self, key: str) -> list[int]:
        return sorted({self.stage_of_layer(i) for i in self.ties[key].layers})

    # ---- activation checkpointing ---------------------------------------------------------
    def set_checkpoint_interval(self, interval: int) -> None:
        """Checkpoint every ``interval`` layers from now on (0: none); DeepSpeed's setter."""
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"set_checkpoint_interval needs an integer >= 0, got {interval!r}")
        self.activation_checkpoint_interval = interval
        self._precompute_checkpointable_values()

    def _precompute_checkpointable_values(self) -> None:
        """Which blocks of ``activation_checkpoint_interval`` layers forward checkpoints, computed once per interval
        (the results belong to one interval: a new one recomputes them, never appends)."""
        interval = self.activation_checkpoint_interval
        if interval > 0 and self.is_checkpointable_results_interval != interval:
            funcs = self.forward_funcs
            self.is_checkpointable_results = [self._is_checkpointable(funcs[start:start + interval])
                                              for start in range(0, len(funcs), interval)]
            self.is_checkpointable_results_interval = interval

    def _is_checkpointable(self, chunk: list[Callable]) -> bool:
        """A block is worth checkpointing when it holds weights (a block of activations and reshapes recomputes
        for nothing), or a layer named in ``checkpointable_layers``."""
        if self.checkpointable_layers is None:
            return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in chunk)
        return any(type(f).__name__ in self.checkpointable_layers for f in chunk)

    # ---- running ------------------------------------------------------------------------
    def forward(self, inputs: Any) -> Any:
        funcs = self.forward_funcs
        interval = self.activation_checkpoint_interval
        if interval <= 0 or not torch.is_grad_enabled():
            for func in funcs:
                inputs = func(inputs)
            return inputs
        self._precompute_checkpointable_values()  # (the interval may have been assigned directly)
        for start, checkpointed in zip(range(0, len(funcs), interval), self.is_checkpointable_results):
            chunk = funcs[start:start + interval]
            if checkpointed:
                inputs = self.activation_checkpoint_func(_run_chunk(chunk), *_as_args(inputs))
            else:
                for func in chunk:
                    inputs = func(inputs)
        return inputs

    def partitions(self) -> list[int]:
        return list(self.parts)

    def describe_stages(self) -> str:
        loads = [sum(self.param_counts[self.parts[s]:self.parts[s + 1]]) for s in range(self.num_stages)]
        return ", ".join(f"stage {s}: layers {self.parts[s]}-{self.parts[s + 1] - 1} ({loads[s]:,} params)"
                         for s in range(self.num_stages))


def _release(tensor: torch.Tensor, kept: set[int], released: dict[int, int]) -> bool:
    """Whether ``tensor`` goes to the meta device (not ``kept``, not there yet); if so, its bytes go to ``released``."""
    if id(tensor) in kept or tensor.device.type == "meta":
        return False
    released[id(tensor)] = tensor.numel() * tensor.element_size()
    return True


def _meta_like(buffer: torch.Tensor) -> torch.Tensor:
    """An empty copy of ``buffer`` on the meta device (a parameter registered as a buffer stays a parameter)."""
    empty = torch.empty_like(buffer, device="meta")
    return nn.Parameter(empty, buffer.requires_grad) if isinstance(buffer, nn.Parameter) else empty


def _tied_forward(module: nn.Module, forward_fn: Callable | None) -> Callable:
    if forward_fn is None:
        return module
    return lambda inputs: forward_fn(module, inputs)


def _as_args(inputs: Any) -> tuple:
    return inputs if isinstance(inputs, tuple) else (inputs,)


def _run_chunk(chunk: list[Callable]) -> Callable:
    def run(*args: Any) -> Any:
        inputs = args if len(args) > 1 else args[0]
        for func in chunk:
            inputs = func(inputs)
        return inputs
    return run


def _stages_of_topology(topology: Any, num_stages: int | None) -> int:
    """``num_stages`` from DeepSpeed's ``ProcessTopology`` (axes pipe / data / model). The tensor- and
    data-parallel sizes come from the config, so a model axis must be 1 here."""
    axes = list(topology.get_axis_names())
    if "pipe" not in axes or set(axes) - {"pipe", "data", "model"}:
        raise ValueError("PipelineModule(topology=...) needs axes among pipe, data, model with a pipe axis; "
                         f"got {axes}")
    stages = topology.get_dim("pipe")
    if num_stages is not None and num_stages != stages:
        raise ValueError(f"PipelineModule(num_stages={num_stages}) contradicts the topology's pipe size {stages}")
    if "model" in axes and topology.get_dim("model") > 1:
        raise ValueError(f"PipelineModule(topology=...) with model-parallel size {topology.get_dim('model')}: set "
                         "tensor_parallel.autotp_size in the config instead (zerotune lays out the mesh itself)")
    return stages
