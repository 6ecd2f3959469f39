"""The ``init_inference`` config: DeepSpeed's ``DeepSpeedInferenceConfig`` keys, checked like the training config.

What is modelled is what zerotune acts on: ``dtype`` (the model is cast), ``tensor_parallel`` (AutoTP over
``tp_size`` ranks, or the ranks of a given ``tp_group``), ``injection_policy`` (the row-parallel linears of
each block), ``keep_module_on_host``, ``max_out_tokens`` (``generate`` refuses longer prompts) and
``replace_with_kernel_inject`` (accepted, with a note: zerotune has no fused kernels, the model's own
modules run). Every other DeepSpeed key is in ``NO_EFFECT``: accepted with a note saying why it changes
nothing here, or refused for the values that would need a feature zerotune lacks (checkpoint loading
through DeepSpeed's description files, int8 kernels). Unknown keys are errors with a did-you-mean, as in
the training config; DeepSpeed's deprecated ``mp_size`` is ``tensor_parallel.tp_size``.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, Callable, ClassVar, Optional

import torch
import torch.distributed as dist
from pydantic import Field, PrivateAttr, StrictBool, ValidationError, field_validator

from zerotune.config.errors import ConfigError, NotSupportedError
from zerotune.config.normalize import normalize_keys
from zerotune.config.pydantic_errors import show_value, translate
from zerotune.config.section import NoEffect, Section
from zerotune.config.types import PosInt

# DeepSpeed's DtypeEnum spellings
DTYPE_NAMES: dict[torch.dtype, tuple[str, ...]] = {
    torch.float16: ("torch.float16", "fp16", "float16", "half"),
    torch.float32: ("torch.float32", "fp32", "float32", "float"),
    torch.bfloat16: ("torch.bfloat16", "bf16", "bfloat16", "bfloat"),
}
_INT8 = ("torch.int8", "int8")

_KERNEL_ONLY = "an option of DeepSpeed's fused inference kernels, which zerotune does not have"
_NO_MOE = "zerotune has no DeepSpeed MoE layers to run (deepspeed.moe is refused)"
_CHECKPOINT = ("loading a DeepSpeed inference checkpoint (a checkpoints.json load policy) is not supported; load "
               "the weights into the model (e.g. from_pretrained) before init_inference, which splits them")
_NOTHING_TO_LOAD = "no checkpoint to load: the model's own weights are split"


def _empty(value: Any) -> bool:
    return value is None or value == "" or (isinstance(value, Mapping) and not any(v for v in value.values()))


# Keys accepted only for the values that change nothing (then noted): key -> (accepted?, refusal, note)
_REFUSED: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "checkpoint": (lambda v: v is None, _CHECKPOINT, _NOTHING_TO_LOAD),
    "base_dir": (_empty, _CHECKPOINT, _NOTHING_TO_LOAD),
    "checkpoint_config": (_empty, _CHECKPOINT, _NOTHING_TO_LOAD),
    "ckpt_config": (_empty, _CHECKPOINT, _NOTHING_TO_LOAD),
    "save_mp_checkpoint_path": (lambda v: v is None, "saving a re-sharded checkpoint is not supported; save the "
                                "model before init_inference", "nothing to save"),
    "set_empty_params": (lambda v: v is False, "building the model without weights is not supported: init_inference "
                         "splits the weights the model holds", "the model's weights are real"),
    "mpu": (lambda v: v is None, "a Megatron mpu is not supported: zerotune builds the tensor-parallel group from "
            "tensor_parallel.tp_size, or takes tensor_parallel.tp_group", "no Megatron mpu given"),
}


class InferenceTPSection(Section):
    """``tensor_parallel`` (alias ``tp``): how many ranks each model is split over."""

    NO_EFFECT: ClassVar[dict[str, NoEffect]] = {
        "enabled": (None, "", "tp_size decides, as in DeepSpeed's InferenceEngine, which does not read it"),
        "tp_grain_size": (None, "", "zerotune splits evenly and refuses sizes that do not divide"),
        "mpu": (None, "", "no Megatron mpu given"),
    }

    tp_size: PosInt = 1
    """Ranks each model is split over (AutoTP); the world is ``dp x tp``, each dp replica a separate model."""
    tp_group: Any = None
    """A process group to split over instead of the consecutive ranks zerotune would group (its size is tp)."""

    @field_validator("tp_group")
    @classmethod
    def _is_group(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, dist.ProcessGroup):
            raise ValueError(f"expected a torch.distributed ProcessGroup or null, got {type(value).__name__}")
        return value


class InferenceConfig(Section):
    """DeepSpeed's inference config. ``InferenceConfig(**kwargs)`` and ``from_source`` both check every key."""

    ALIASES: ClassVar[dict[str, str]] = {"kernel_inject": "replace_with_kernel_inject", "tp": "tensor_parallel",
                                         "max_tokens": "max_out_tokens", "injection_dict": "injection_policy"}
    NO_EFFECT: ClassVar[dict[str, NoEffect]] = {
        "enable_cuda_graph": (None, "", "zerotune does not capture CUDA graphs; every forward runs eagerly"),
        "use_triton": (None, "", "zerotune has no Triton inference kernels"),
        "triton_autotune": (None, "", "zerotune has no Triton inference kernels"),
        "zero": (None, "", "DeepSpeed's InferenceEngine does not read it either; ZeRO-Inference is initialize() "
                           "with ZeRO stage 3"),
        **{key: (None, "", _KERNEL_ONLY) for key in (
            "triangular_masking", "tm", "return_tuple", "min_out_tokens", "min_tokens", "transposed_mode")},
        "quant": (None, "", "weight quantization applies to dtype int8, which zerotune refuses"),
        "replace_method": (None, "", "deprecated by DeepSpeed; AutoTP picks its plan from the model's model_type"),
        "injection_policy_tuple": (None, "", "DeepSpeed fills it from injection_policy; give injection_policy"),
        "config": (None, "", "the model config for fused kernels; the model's own config is used"),
        "args": (None, "", "the model config for fused kernels; the model's own config is used"),
        "training_mp_size": (None, "", "it describes a checkpoint to load, and init_inference loads none"),
        "moe": (None, "", _NO_MOE),
        **{key: (None, "", _NO_MOE) for key in (
            "ep_size", "ep_group", "expert_group", "ep_mp_group", "expert_mp_group", "moe_experts", "moe_type")},
        **{key: (None, "", why) for key, (_, _, why) in _REFUSED.items()},
    }
    NO_EFFECT_FIELDS: ClassVar[dict[str, str]] = {
        "replace_with_kernel_inject": "zerotune has no fused inference kernels: the model's own modules run, split "
                                      "by AutoTP when tensor_parallel.tp_size > 1",
    }

    replace_with_kernel_inject: StrictBool = False
    """DeepSpeed's fused-kernel injection; accepted, noted: the model's own modules run (split when tp > 1)."""
    dtype: Any = torch.float16
    """The model is cast to it (DeepSpeed's default: fp16); a torch dtype or fp16 / bf16 / fp32 and their aliases."""
    tensor_parallel: InferenceTPSection = Field(default_factory=InferenceTPSection)
    """Tensor parallelism: ``{"tp_size": N}`` (DeepSpeed's deprecated ``mp_size`` means the same)."""
    keep_module_on_host: StrictBool = False
    """Leave the (split) model where it is instead of moving it to this rank's device."""
    max_out_tokens: PosInt = 1024
    """``generate`` refuses a prompt longer than this (DeepSpeed's check, on the prompt's length)."""
    injection_policy: Optional[dict] = None
    """``{BlockClass: ("self_attn.o_proj", "mlp.down_proj")}``: in each block those linears are row-parallel and
    its other linears column-parallel (DeepSpeed's user-specified tensor parallelism); else the built-in plan."""

    _notes: list[tuple[str, str]] = PrivateAttr(default_factory=list)

    def __init__(self, **data: Any) -> None:
        notes: list[tuple[str, str]] = []
        normalized = normalize_keys(_checked_keys(data), InferenceConfig, "", notes)
        try:
            super().__init__(**normalized)
        except ValidationError as exc:
            raise translate(exc, normalized) from None
        self._notes = notes + [(key, f"no effect here: {why}") for key, why in self.NO_EFFECT_FIELDS.items()
                               if key in self.model_fields_set and getattr(self, key)]

    @property
    def notes(self) -> list[tuple[str, str]]:
        """``(key, note)`` for each accepted key that changes nothing here, and each legacy spelling."""
        return list(self._notes)

    @property
    def tp_size(self) -> int:
        """The tensor-parallel size: the given group's size, else ``tensor_parallel.tp_size``."""
        group = self.tensor_parallel.tp_group
        return dist.get_world_size(group) if group is not None else self.tensor_parallel.tp_size

    @classmethod
    def translate_legacy(cls, raw: dict[str, Any], prefix: str, notes: list[tuple[str, str]]) -> dict[str, Any]:
        """DeepSpeed's deprecated ``mp_size`` is ``tensor_parallel.tp_size`` (both given: they must agree)."""
        if "mp_size" not in raw:
            return raw
        raw = dict(raw)
        mp_size = raw.pop("mp_size")
        key = "tp" if "tp" in raw and "tensor_parallel" not in raw else "tensor_parallel"
        block = raw.get(key) or {}
        if isinstance(block, Section):
            block = block.model_dump(exclude_unset=True)
        if not isinstance(block, Mapping):
            return raw  # the block's own validation names the problem
        if "tp_size" in block and block["tp_size"] != mp_size:
            raise ConfigError("mp_size", f"{show_value(mp_size)} disagrees with {key}.tp_size "
                                         f"{show_value(block['tp_size'])}; mp_size is DeepSpeed's deprecated spelling "
                                         "of tensor_parallel.tp_size: give only tensor_parallel.tp_size")
        raw[key] = {**block, "tp_size": mp_size}
        notes.append(("mp_size", "DeepSpeed's deprecated spelling of tensor_parallel.tp_size"))
        return raw

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> torch.dtype:
        if value is torch.int8 or value in _INT8:
            raise ValueError("int8 inference is DeepSpeed's quantized kernels, which zerotune does not have; "
                             "use fp16, bf16 or fp32")
        for dtype, names in DTYPE_NAMES.items():
            if value is dtype or (isinstance(value, str) and value in names):
                return dtype
        valid = ", ".join(names[1] for names in DTYPE_NAMES.values())
        raise ValueError(f"expected a floating torch dtype or one of {valid} (or torch.float16, half, bfloat16, "
                         "float32, ...)")

    @field_validator("injection_policy")
    @classmethod
    def _policy(cls, value: Optional[dict]) -> Optional[dict]:
        for block, names in (value or {}).items():
            if not (isinstance(block, str) or (isinstance(block, type) and issubclass(block, torch.nn.Module))):
                raise ValueError(f"keys must be nn.Module classes (or class names), got {show_value(block)}")
            names = (names,) if isinstance(names, str) else names
            if not isinstance(names, (tuple, list)) or not names or not all(isinstance(n, str) for n in names):
                raise ValueError(f"{getattr(block, '__name__', block)}: expected the names of its row-parallel "
                                 f"linears, e.g. ('self_attn.o_proj', 'mlp.down_proj'), got {show_value(names)}")
        return value

    @classmethod
    def from_source(cls, config: Any = None, **kwargs: Any) -> InferenceConfig:
        """DeepSpeed's ``init_inference(model, config, **kwargs)`` merge: ``config`` is a dict, a JSON file path
        or an ``InferenceConfig``; a key given in both places must have the same value."""
        if isinstance(config, InferenceConfig):
            if kwargs:
                raise ConfigError(next(iter(kwargs)), "given beside a DeepSpeedInferenceConfig object; pass the "
                                                      "config as a dict to add keyword arguments to it")
            return config
        if config is None:
            config = {}
        elif isinstance(config, str):
            import json

            try:
                with open(config) as handle:
                    config = json.load(handle)
            except (OSError, ValueError) as error:
                raise ConfigError("", f"cannot read the inference config file {config!r}: {error}") from None
        if not isinstance(config, Mapping):
            raise ConfigError("", f"config must be a dict, a JSON file path or a DeepSpeedInferenceConfig, got "
                                  f"{type(config).__name__}")
        for key in set(config) & set(kwargs):
            if config[key] != kwargs[key]:
                raise ConfigError(str(key), f"given twice with different values: {show_value(config[key])} in "
                                            f"config, {show_value(kwargs[key])} as a keyword argument")
        return cls(**{**config, **kwargs})


def _checked_keys(data: dict[str, Any]) -> dict[str, Any]:
    """Unknown keys refused with a did-you-mean over every accepted spelling (no-effect keys included); a
    tensor-parallel key at the top level is pointed to its block."""
    valid = set(InferenceConfig.model_fields) | set(InferenceConfig.ALIASES) | set(InferenceConfig.NO_EFFECT)
    valid.add("mp_size")
    tp_block = data.get("tensor_parallel", data.get("tp"))
    given = [*data.items()] + ([("tensor_parallel.mpu", tp_block["mpu"])] if isinstance(tp_block, Mapping)
                               and "mpu" in tp_block else [])
    for path, value in given:
        key = path.rsplit(".", 1)[-1]
        if key in _REFUSED and not _REFUSED[key][0](value):
            raise NotSupportedError(path, _REFUSED[key][1])
    for key in data:
        if key in valid or not isinstance(key, str) or key.startswith("_"):
            continue
        tp_keys = sorted({*InferenceTPSection.model_fields, *InferenceTPSection.NO_EFFECT})
        tp_key = key if key in tp_keys else next(iter(difflib.get_close_matches(key, tp_keys, n=1, cutoff=0.8)), None)
        if tp_key is not None:
            raise ConfigError(key, f"unknown key; did you mean tensor_parallel={{'{tp_key}': {show_value(data[key])}}}?"
                                   " (it belongs in the tensor_parallel block)")
        close = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else "valid keys are: " + ", ".join(sorted(valid))
        raise ConfigError(key, f"unknown key; {hint}")
    return data
