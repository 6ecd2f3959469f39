"""Build a torch optimizer from a DeepSpeed ``optimizer`` config section.

DeepSpeed resolves ``{"type": ..., "params": {...}}`` in ``engine._configure_basic_optimizer``:
"Adam"/"AdamW" go to its FusedAdam (or CPUAdam), "Lamb" to FusedLamb, and any other name
to ``getattr(torch.optim, type)(params, **params)``. Here every type maps to a torch
optimizer (or to ``zerotune.optim.lamb.Lamb``), with DeepSpeed's spellings translated:

- "Adam" / "AdamW" build ``FusedAdam`` (``deepspeed_adam.py``: torch's Adam kernels under DeepSpeed's
  class name, as DeepSpeed builds its own FusedAdam), with ``torch_adam: true`` torch's own class.
  "Adam" means *decoupled* weight decay (as torch AdamW) because DeepSpeed's ``adam_w_mode``
  defaults to true; ``adam_w_mode: false`` gives classic L2-coupled Adam. "AdamW" is always
  decoupled. FusedAdam's ``bias_correction: true`` and ``set_grad_none`` are accepted.
- DeepSpeed's FusedAdam defaults ``weight_decay`` to 0, torch's AdamW to 0.01; unless
  ``torch_adam`` is set (where DeepSpeed itself builds torch's class), 0 is used.
- ``betas`` given as a JSON list becomes a tuple (OneCycle and checkpoints compare them).

Type names are case-insensitive. DeepSpeed-only optimizers with no torch counterpart
(1-bit Adam, MuP variants, ...) fail with the nearest supported type.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from zerotune.config.errors import ConfigError, NotSupportedYetError
from zerotune.optim.deepspeed_adam import FusedAdam
from zerotune.optim.lamb import Lamb
from zerotune.optim.onebit_adam import OneBitAdam
from zerotune.optim.validation import check_known_keys, did_you_mean, reject_auto_values

# Canonical spellings (DeepSpeed's, or torch.optim's class name for the pass-through ones).
OPTIMIZER_NAMES: tuple[str, ...] = (
    "Adam", "AdamW", "SGD", "Adagrad", "Lamb", "OneBitAdam",
    "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop", "Adafactor",
)  # fmt: skip
_CANONICAL = {name.lower(): name for name in OPTIMIZER_NAMES}

# lowercase name -> (display name, nearest supported type, why it is not supported).
_UNSUPPORTED: dict[str, tuple[str, str, str]] = {
    "zerooneadam": ("ZeroOneAdam", "Adam", "0/1 Adam's compressed communication is not implemented"),
    "onebitlamb": ("OneBitLamb", "Lamb", "1-bit compressed communication is not implemented"),
    "muadam": ("MuAdam", "Adam", "muP width-scaled learning rates are not implemented"),
    "muadamw": ("MuAdamW", "AdamW", "muP width-scaled learning rates are not implemented"),
    "musgd": ("MuSGD", "SGD", "muP width-scaled learning rates are not implemented"),
    "lion": ("Lion", "AdamW", "torch has no Lion optimizer"),
    "muon": ("Muon", "AdamW", "DeepSpeed's Muon pairs with Adam for non-matrix parameters; torch.optim.Muon does not"),
    "cpuadam": ("CPUAdam", "Adam", "DeepSpeed's C++ kernels are not used; 'Adam' runs torch's on any device"),
    "deepspeedcpuadam": ("DeepSpeedCPUAdam", "Adam", "DeepSpeed's C++ kernels are not used"),
    "fusedadam": ("FusedAdam", "Adam", "DeepSpeed's CUDA kernels are not used; 'Adam' runs torch's"),
    "fusedlamb": ("FusedLamb", "Lamb", "DeepSpeed's CUDA kernels are not used; 'Lamb' is a torch port"),
    "cpuadagrad": ("CPUAdagrad", "Adagrad", "DeepSpeed's C++ kernels are not used"),
    "lbfgs": ("LBFGS", "SGD", "LBFGS needs a closure, which the engine's step() does not pass"),
    "sparseadam": ("SparseAdam", "Adam", "sparse gradients are not supported"),
}

# Keys DeepSpeed accepts for Adam/AdamW that torch's constructors do not take.
_ADAM_DEEPSPEED_KEYS = ("adam_w_mode", "torch_adam", "bias_correction", "set_grad_none")
# Constructor arguments that pick an implementation, not a hyperparameter.
_IMPLEMENTATION_KNOBS = frozenset({"foreach", "capturable", "differentiable", "fused", "maximize"})


def build_optimizer(opt_type: str, params: Mapping[str, Any], param_groups: Iterable) -> torch.optim.Optimizer:
    """Build the optimizer DeepSpeed would build for ``{"type": opt_type, "params": params}``.

    ``param_groups`` is what torch optimizers take: tensors, or dicts with ``"params"``
    and per-group hyperparameters, which win over ``params`` (torch's rule).
    Raises ``zerotune.config.ConfigError`` naming ``optimizer.type`` or ``optimizer.params.<key>``.
    """
    canonical = check_optimizer_section(opt_type, params)
    params = dict(params or {})
    reject_auto_values(params, "optimizer.params")
    optimizer_class, kwargs = _translate(canonical, params)
    groups = [_translate_group(group) for group in param_groups]
    if not groups:
        raise ValueError("build_optimizer got no parameters to optimize (param_groups is empty)")
    if _can_fuse(optimizer_class, kwargs, groups):
        try:
            return optimizer_class(groups, **{**kwargs, "fused": True})
        except (RuntimeError, ValueError, TypeError):
            pass  # an unusual setting the fused kernel refuses: the default implementation takes it
    try:
        return optimizer_class(groups, **kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigError("optimizer.params", f"{optimizer_class.__name__} rejected the values: {exc}") from exc


def check_optimizer_section(opt_type: Any, params: Mapping[str, Any] | None) -> str:
    """The canonical name of ``opt_type`` once every key of ``params`` is one it takes; a ConfigError naming
    ``optimizer.type`` or ``optimizer.params.<key>`` otherwise. Config validation calls this too, so a typo is
    reported by ``zerotune check`` and ``initialize`` before any model is built."""
    canonical = canonical_optimizer_name(opt_type)
    params = dict(params or {})
    if "max_grad_norm" in params:
        raise ConfigError(
            "optimizer.params.max_grad_norm",
            "not an optimizer parameter; set the top-level 'gradient_clipping' instead (as DeepSpeed requires)",
        )
    check_known_keys(params, valid_optimizer_keys(canonical), "optimizer.params")
    return canonical


_FUSABLE = (torch.optim.Adam, torch.optim.AdamW, FusedAdam, torch.optim.SGD, torch.optim.Adagrad)


def _can_fuse(optimizer_class: type, kwargs: dict[str, Any], groups: list) -> bool:
    """Use torch's fused kernel (one pass per tensor; ~6x faster than the default on CPU) unless the user chose.

    Like DeepSpeed, which runs its FusedAdam for "Adam"; the user can still pick with ``fused``/``foreach``.
    """
    if optimizer_class not in _FUSABLE or "fused" in kwargs or "foreach" in kwargs:
        return False
    tensors = [t for g in groups for t in (g["params"] if isinstance(g, Mapping) else [g])]
    return bool(tensors) and all(t.is_floating_point() and t.device.type in ("cpu", "cuda") for t in tensors)


def optimizer_defaults(opt_type: str) -> dict[str, Any]:
    """Hyperparameter defaults ``build_optimizer`` uses for ``opt_type`` when ``params`` omits them.

    Used to resolve HF "auto" values and to show the effective config. Implementation
    switches (``foreach``, ``fused``, ...) are left out.
    """
    canonical = canonical_optimizer_name(opt_type)
    optimizer_class, overrides = _translate(canonical, {})
    deepspeed_switches = frozenset(_ADAM_DEEPSPEED_KEYS) if optimizer_class is FusedAdam else frozenset()
    switches = _IMPLEMENTATION_KNOBS | deepspeed_switches
    defaults = {
        name: parameter.default
        for name, parameter in _constructor_parameters(optimizer_class).items()
        if parameter.default is not inspect.Parameter.empty and name not in switches
    }
    defaults.update({name: value for name, value in overrides.items() if name not in switches})
    return defaults


def canonical_optimizer_name(opt_type: str) -> str:
    """Map a case-insensitive DeepSpeed type name to its canonical spelling, or raise."""
    if not isinstance(opt_type, str):
        raise ConfigError("optimizer.type", f"must be a string naming the optimizer, got {opt_type!r}")
    key = opt_type.lower()
    if key in _CANONICAL:
        return _CANONICAL[key]
    if key in _UNSUPPORTED:
        display, nearest, why = _UNSUPPORTED[key]
        raise NotSupportedYetError("optimizer.type", f"{display} is not supported yet; use {nearest} ({why})")
    raise ConfigError(
        "optimizer.type",
        f"unknown optimizer '{opt_type}'.{did_you_mean(opt_type, OPTIMIZER_NAMES)} "
        f"Valid types: {', '.join(OPTIMIZER_NAMES)}",
    )


def valid_optimizer_keys(canonical: str) -> tuple[str, ...]:
    """The ``optimizer.params`` keys accepted for a canonical type name."""
    if canonical in ("Adam", "AdamW"):
        keys = set(_constructor_parameters(torch.optim.Adam)) | set(_constructor_parameters(torch.optim.AdamW))
        return tuple(sorted(keys | set(_ADAM_DEEPSPEED_KEYS)))
    return tuple(sorted(_constructor_parameters(_optimizer_class(canonical))))


def _translate(canonical: str, params: dict[str, Any]) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """Turn DeepSpeed's params for ``canonical`` into a torch class and its constructor kwargs."""
    kwargs = dict(params)
    if "betas" in kwargs:
        kwargs["betas"] = _betas_tuple(kwargs["betas"], "optimizer.params.betas")
    if canonical not in ("Adam", "AdamW"):
        return _optimizer_class(canonical), kwargs

    torch_adam = bool(kwargs.pop("torch_adam", False))
    adam_w_mode = bool(kwargs.pop("adam_w_mode", True))
    if "decoupled_weight_decay" in kwargs:  # torch Adam's spelling of the same switch
        torch_spelling = bool(kwargs.pop("decoupled_weight_decay"))
        if "adam_w_mode" in params and bool(params["adam_w_mode"]) != torch_spelling:
            raise ConfigError(
                "optimizer.params.decoupled_weight_decay", "contradicts adam_w_mode; set only one of the two"
            )
        adam_w_mode = torch_spelling
    kwargs.pop("set_grad_none", None)  # FusedAdam's zero_grad flag; torch already sets grads to None.
    if not kwargs.pop("bias_correction", True):
        raise ConfigError(
            "optimizer.params.bias_correction",
            "false is not supported: torch's Adam/AdamW always correct the moment bias; remove the key or set true",
        )
    # As in DeepSpeed: the name "AdamW" forces decoupled decay; "Adam" follows adam_w_mode (default true).
    decoupled = canonical == "AdamW" or adam_w_mode
    if torch_adam:  # DeepSpeed builds torch's own class then
        return (torch.optim.AdamW if decoupled else torch.optim.Adam), kwargs
    kwargs.setdefault("weight_decay", 0.0)  # FusedAdam / CPUAdam default, unlike torch AdamW's 0.01
    return FusedAdam, {**kwargs, "adam_w_mode": decoupled}


def _translate_group(group: Any) -> Any:
    """Copy a param-group dict with JSON-style ``betas`` made a tuple; pass tensors through."""
    if isinstance(group, Mapping):
        group = dict(group)
        if "betas" in group:
            group["betas"] = _betas_tuple(group["betas"], "param_groups[].betas")
    return group


def _betas_tuple(betas: Any, path: str) -> tuple[float, float]:
    if not isinstance(betas, (list, tuple)) or len(betas) != 2:
        raise ConfigError(path, f"must be a list of two numbers [beta1, beta2], got {betas!r}")
    return (betas[0], betas[1])


def _optimizer_class(canonical: str) -> type[torch.optim.Optimizer]:
    return {"Lamb": Lamb, "OneBitAdam": OneBitAdam}.get(canonical) or getattr(torch.optim, canonical)


def _constructor_parameters(optimizer_class: type[torch.optim.Optimizer]) -> dict[str, inspect.Parameter]:
    """Keyword parameters of an optimizer's constructor, without ``self`` and ``params``."""
    signature = inspect.signature(optimizer_class.__init__)
    return {name: p for name, p in signature.parameters.items() if name not in ("self", "params")}
