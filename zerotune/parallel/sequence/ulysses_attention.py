"""Ulysses sequence parallelism inside a Hugging Face model's attention (DeepSpeed-Ulysses / ALST).

Each of the P sequence-parallel ranks holds s/P consecutive tokens of every sequence. Everything
outside attention (embeddings, MLP, norms, LM head, loss) is per token and runs unchanged on the
local tokens. Attention is the one place that needs every token, so it is wrapped: an all-to-all
turns the sequence-split q, k, v [b, h, s/P, d] into head-split [b, h/P, s, d], the model's own
attention implementation (sdpa, eager, flash, ...) runs on the full sequence for h/P heads, and
an all-to-all turns its output [b, s, h/P, d] back into sequence-split [b, s/P, h, d].

How it plugs in: transformers' attention modules look their kernel up by name
(``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``), so the wrapper is
registered under ``ULYSSES_ATTENTION`` and the model is switched to that name. Nothing of the
model is monkey-patched. The wrapper is one function shared by every model; what differs per
model (the sp group, the original kernel, the current batch's padding) lives in small objects
attached to the attention modules at install time -- no module globals hold groups.

Masks: transformers builds no mask for an implementation it has no mask function for, and it
would build it for the local s/P tokens anyway. So the wrapper builds the full-sequence mask
itself with transformers' own mask builders for the original implementation (the same code the
single-process model runs, hence the same numbers): causal (or bidirectional), sliding window
when the layer passes one, padding from the full 2D attention mask and packed sequences from the
full position ids, both recorded by ``shard_sequence_batch`` for the current forward. The mask
is built once per forward and shared by the layers (and by activation-checkpoint recomputation).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerotune.parallel.sequence.all_to_all import seq_all_to_all

ULYSSES_ATTENTION = "zerotune_ulysses"
_BINDING_ATTRIBUTE = "zerotune_ulysses"  # on each wrapped attention module (and on the model: its context)
_INTERFACE_MARKER = "ALL_ATTENTION_FUNCTIONS"


@dataclass
class UlyssesContext:
    """One model's sequence-parallel state: the group, and what the current forward's batch needs
    for the full-sequence mask (recorded by ``record_sequence_batch``)."""

    group: dist.ProcessGroup | None
    size: int
    padding_mask: torch.Tensor | None = None  # full [b, s] bool, only when some token is padding
    position_ids: torch.Tensor | None = None  # full [b or 1, s]: what flash-style kernels read
    packed_sequence_ids: torch.Tensor | None = None  # full [b, s], only for packed sequences
    sequence_length: int | None = None  # full length of the recorded batch, to catch a stale record
    mask_cache: dict = field(default_factory=dict)  # built masks of the current forward, shared by layers


@dataclass
class _AttentionBinding:
    """What the wrapper needs for one attention module: the shared context and the kernel it replaces."""

    context: UlyssesContext
    inner_name: str
    inner: Callable[..., tuple[torch.Tensor, Any]]


def record_sequence_batch(context: UlyssesContext, *, sequence_length: int, padding_mask: torch.Tensor | None,
                          position_ids: torch.Tensor | None, packed_sequence_ids: torch.Tensor | None) -> None:
    """Remember the full-sequence facts of the batch about to run forward (called by shard_sequence_batch)."""
    context.sequence_length = sequence_length
    context.padding_mask = None if padding_mask is None else padding_mask.to(torch.bool)
    context.position_ids = position_ids
    context.packed_sequence_ids = packed_sequence_ids
    context.mask_cache = {}


def ulysses_context(model: nn.Module) -> UlyssesContext:
    """The context ``install_ulysses_attention`` attached to ``model``."""
    context = getattr(model, _BINDING_ATTRIBUTE, None)
    if not isinstance(context, UlyssesContext):
        raise ValueError(
            f"{type(model).__name__} has no Ulysses sequence parallelism installed; "
            "call install_ulysses_attention(model, group) first"
        )
    return context


# ----------------------------------------------------------------------------- install


def install_ulysses_attention(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Make every attention module of the HF ``model`` run Ulysses sequence parallelism over ``group``.

    Works for models whose attention modules call transformers' attention interface (GPT-2, Llama,
    Mistral, Qwen2, ...). Raises ValueError when the heads (or key/value heads) do not split over
    the group, when the attention bypasses the interface, or for cross-attention. Installing twice
    only replaces the group.
    """
    size = 1 if group is None else dist.get_world_size(group)
    modules = check_ulysses_split(model, size)
    existing = getattr(model, _BINDING_ATTRIBUTE, None)
    if isinstance(existing, UlyssesContext):
        existing.group, existing.size = group, size
        return

    context = UlyssesContext(group=group, size=size)
    bindings = [(module, _AttentionBinding(context, *_original_kernel(model, module))) for module in modules]

    _register_wrapper()
    for module, binding in bindings:
        setattr(module, _BINDING_ATTRIBUTE, binding)
    _switch_implementation(model, modules)
    setattr(model, _BINDING_ATTRIBUTE, context)


def check_ulysses_split(model: nn.Module, size: int) -> list[nn.Module]:
    """The attention modules Ulysses would wrap in ``model`` over ``size`` ranks; ValueError naming what stops it
    (not an HF model, attention bypassing the interface, cross-attention, heads the size does not divide).
    ``zerotune plan`` asks the same of a meta model before launch."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise ValueError(
            f"Ulysses sequence parallelism needs a Hugging Face PreTrainedModel; {type(model).__name__} has no config"
        )
    modules = _interface_attention_modules(model)
    _refuse_cross_attention(model, modules)
    _check_heads_divisible(model, _attention_configs(model, modules), size)
    return modules


def _uses_attention_interface(cls: type) -> bool:
    forward = getattr(cls, "forward", None)
    try:
        return forward is not None and _INTERFACE_MARKER in inspect.getsource(forward)
    except (OSError, TypeError):
        return False


def _interface_attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose forward dispatches through ALL_ATTENTION_FUNCTIONS: the ones to wrap."""
    verdicts: dict[type, bool] = {}
    modules = []
    for module in model.modules():
        cls = type(module)
        if cls not in verdicts:
            verdicts[cls] = _uses_attention_interface(cls) and hasattr(module, "config")
        if verdicts[cls]:
            modules.append(module)
    if not modules:
        raise ValueError(
            f"{type(model).__name__}: no attention module dispatches through transformers' attention interface "
            f"({_INTERFACE_MARKER}.get_interface), so Ulysses sequence parallelism cannot wrap its attention; "
            "supported are models like GPT-2, Llama, Mistral, Qwen2"
        )
    return modules


def _refuse_cross_attention(model: nn.Module, modules: list[nn.Module]) -> None:
    for module in modules:
        if getattr(module, "is_cross_attention", False) or getattr(module.config, "is_encoder_decoder", False):
            raise ValueError(
                f"{type(model).__name__}: {type(module).__name__} is cross-attention (or the model is an "
                "encoder-decoder); Ulysses sequence parallelism supports self-attention only"
            )


def _attention_configs(model: nn.Module, modules: list[nn.Module]) -> list[Any]:
    configs = {id(model.config): model.config}
    for module in modules:
        configs.setdefault(id(module.config), module.config)
    return list(configs.values())


def _config_attribute_name(config: Any, standard_name: str) -> str:
    """The name the config class itself uses (GPT-2 calls num_attention_heads ``n_head``)."""
    return getattr(type(config), "attribute_map", {}).get(standard_name, standard_name)


def _check_heads_divisible(model: nn.Module, configs: list[Any], size: int) -> None:
    for config in configs:
        for standard_name in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(config, standard_name, None)
            if heads is None or not isinstance(heads, int):
                continue
            if heads % size:
                raise ValueError(
                    f"{type(model).__name__}: config.{_config_attribute_name(config, standard_name)} = {heads} is not "
                    f"divisible by the sequence-parallel size {size}; Ulysses gives every sp rank an equal share "
                    f"of the heads, so the sp size must divide {heads}"
                )


def _original_kernel(model: nn.Module, module: nn.Module) -> tuple[str, Callable]:
    """The attention function the module ran before the switch: what the wrapper calls on the full sequence."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config: Any = module.config  # (a transformers attention module's config: nn.Module does not declare it)
    name = config._attn_implementation or "eager"
    if name == ULYSSES_ATTENTION:
        raise ValueError(f"{type(model).__name__}: attention already set to {ULYSSES_ATTENTION!r} by another install")
    if name not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"{type(model).__name__}: attention implementation {name!r} has no transformers mask builder, so Ulysses "
            f"cannot build its full-sequence mask; use one of {sorted(ALL_MASK_ATTENTION_FUNCTIONS)}"
        )
    if name == "eager":
        if getattr(config, "reorder_and_upcast_attn", False):
            raise ValueError(
                f"{type(model).__name__}: reorder_and_upcast_attn=True makes eager attention bypass the attention "
                "interface; set it to False or use attn_implementation='sdpa' with sequence parallelism"
            )
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise ValueError(
                f"{type(model).__name__}: eager attention requested but {type(module).__module__} defines no "
                "eager_attention_forward; use attn_implementation='sdpa'"
            )
        return name, eager
    return name, ALL_ATTENTION_FUNCTIONS[name]


def _register_wrapper() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention_forward)


def _switch_implementation(model: nn.Module, modules: list[nn.Module]) -> None:
    """Point the model at the wrapper: through set_attn_implementation when the model accepts a
    registered name, and directly on every config it missed (older models, sub-configs)."""
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        try:
            setter(ULYSSES_ATTENTION)
        except (ValueError, KeyError, ImportError):
            pass
    for config in _attention_configs(model, modules):
        if config._attn_implementation != ULYSSES_ATTENTION:
            config._attn_implementation = ULYSSES_ATTENTION


# ----------------------------------------------------------------------------- the wrapper


def ulysses_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The registered attention function: q, k, v [b, h, s/P, d] in, [b, s/P, h, d] out.

    ``attention_mask`` is whatever transformers passed for the local tokens (None for a custom
    implementation) and is replaced by the full-sequence mask; the remaining kwargs (scaling,
    dropout, sliding_window, ...) go to the original kernel unchanged.
    """
    binding = getattr(module, _BINDING_ATTRIBUTE, None)
    if not isinstance(binding, _AttentionBinding):
        raise RuntimeError(
            f"{type(module).__name__} runs attention {ULYSSES_ATTENTION!r} but was not prepared by "
            "install_ulysses_attention (is it a module created after the install?)"
        )
    context = binding.context
    group = context.group
    query, key, value = (seq_all_to_all(t, group, scatter_dim=1, gather_dim=2) for t in (query, key, value))
    if context.sequence_length is not None and context.sequence_length != query.shape[2]:
        raise RuntimeError(
            f"Ulysses attention sees a sequence of {query.shape[2]} tokens but the recorded batch has "
            f"{context.sequence_length}: call shard_sequence_batch on every forward's full-sequence inputs"
        )
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    mask = _full_sequence_mask(module, binding, query, is_causal, kwargs.get("sliding_window"))
    if "position_ids" in kwargs and context.position_ids is not None:
        kwargs["position_ids"] = context.position_ids  # kernels that read positions need the full sequence's
    output, _ = binding.inner(module, query, key, value, mask, **kwargs)
    # The kernels return [b, s, h/P, d]: scatter the sequence back, gather the heads.
    return seq_all_to_all(output, group, scatter_dim=1, gather_dim=2), None


def _full_sequence_mask(module: nn.Module, binding: _AttentionBinding, query: torch.Tensor, is_causal: bool,
                        sliding_window: int | None) -> Any:
    """The mask the original implementation would get for the whole sequence, built by transformers'
    own mask builder for it (None where sdpa/flash can use is_causal instead)."""
    from transformers import masking_utils as masks

    context = binding.context
    key = (binding.inner_name, is_causal, sliding_window, query.dtype, query.device, query.shape[0], query.shape[2])
    if key in context.mask_cache:
        return context.mask_cache[key]
    batch, length = query.shape[0], query.shape[2]
    allow_is_causal_skip, allow_is_bidirectional_skip = True, False
    if is_causal:
        mask_function = (masks.causal_mask_function if sliding_window is None
                         else masks.sliding_window_causal_mask_function(sliding_window))
    else:
        mask_function = (masks.bidirectional_mask_function if sliding_window is None
                         else masks.sliding_window_bidirectional_mask_function(sliding_window))
        allow_is_causal_skip = False
        allow_is_bidirectional_skip = sliding_window is None
    if context.packed_sequence_ids is not None:
        assert context.position_ids is not None  # (packed sequences are found from the positions, recorded with them)
        positions = context.position_ids.expand(batch, -1)
        mask_function = masks.and_masks(masks.remap_positions_for_packed_sequence(mask_function, positions),
                                        masks.packed_sequence_mask_function(context.packed_sequence_ids))
        allow_is_causal_skip = allow_is_bidirectional_skip = False
    padding = context.padding_mask
    if padding is not None:
        if padding.shape != (batch, length):
            raise RuntimeError(
                f"Ulysses attention: the recorded attention mask has shape {tuple(padding.shape)} but attention runs "
                f"on batch {batch} x {length} tokens; call shard_sequence_batch on every forward's inputs"
            )
        padding = padding.to(query.device)
    mask = masks.ALL_MASK_ATTENTION_FUNCTIONS[binding.inner_name](
        batch_size=batch, q_length=length, kv_length=length, q_offset=0, kv_offset=0, mask_function=mask_function,
        attention_mask=padding, allow_is_causal_skip=allow_is_causal_skip,
        allow_is_bidirectional_skip=allow_is_bidirectional_skip, local_size=sliding_window,
        dtype=query.dtype, config=module.config, use_vmap=False, device=query.device,
    )
    context.mask_cache[key] = mask
    return mask
