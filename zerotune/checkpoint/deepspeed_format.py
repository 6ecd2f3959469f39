"""Read checkpoints written by DeepSpeed's ``engine.save_checkpoint`` (ZeRO stages 1-3), without DeepSpeed.

Why: users migrating from DeepSpeed have checkpoints in its layout; zerotune must take over their full
fp32 weights and Adam state without importing DeepSpeed and without unpickling arbitrary objects.

Layout of a tag directory (world size N, no model parallelism):
* stage 1/2: ``mp_rank_00_model_states.pt`` -- ``module`` (full weights and buffers), ``buffer_names``,
  ``param_shapes`` (one OrderedDict name -> shape per param group, in flat order), ``frozen_param_*``,
  ``shared_params``, ``global_steps``, ``global_samples``, ``skipped_steps``, ``lr_scheduler``,
  ``dp_world_size``, ``mp_world_size``, ``ds_config``, ``ds_version`` and the client state.
  ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` -- ``optimizer_state_dict``: per group the rank's
  slice of the flat fp32 group (``single_partition_of_fp32_groups``, tail padding already removed),
  ``group_paddings`` (that rank's tail padding), ``partition_count``, ``zero_stage`` and
  ``base_optimizer_state`` (torch's optimizer state_dict over the *padded* slices).
* stage 3: ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` per rank (weights there are empty; frozen
  parameters come as ``frozen_param_fragments``), and ``..._optim_states.pt`` holding
  ``fp32_flat_groups`` (one flat tensor per sub-group) and ``optimizer_state_dict`` laid out like them.
  Every parameter is split over the ranks on its own: rank r holds elements [r*k, (r+1)*k) with
  k = ceil(numel / N), concatenated in ``param_shapes`` order (cf. ``zero_to_fp32.py``). Padding slots hold
  uninitialised memory (not zeros), so they are always cut off, never read.

Trust: files are read with ``torch.load(weights_only=True)``; the only non-container globals admitted
are DeepSpeed's few record types, each mapped to an inert local stand-in that only stores attributes.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from zerotune.checkpoint.atomic import CheckpointError, check_tag


class _Record:
    """Inert stand-in for a DeepSpeed record class: unpickling only fills ``__dict__`` (no ``__setstate__``)."""


class LossScaler(_Record):
    """Stands in for ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (cur_scale, dynamic)."""


class DynamicLossScaler(_Record):
    """Stands in for DeepSpeed's fp16 ``DynamicLossScaler`` (same module; pickled by fp16 runs)."""


class FragmentAddress(_Record):
    """Stands in for ``deepspeed.utils.tensor_fragment.fragment_address`` (numel, start)."""


class ZeroStageEnum(enum.IntEnum):
    """Stands in for ``deepspeed.runtime.zero.config.ZeroStageEnum``, pickled by value."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


# Each class with the name DeepSpeed pickles it under, in the type torch.serialization.safe_globals takes.
SAFE_GLOBALS: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]
_MODEL_GLOB = "*mp_rank_*_model_states.pt"


@dataclass
class DeepSpeedCheckpoint:
    """Everything zerotune takes over from a DeepSpeed checkpoint, as full (unpartitioned) tensors."""

    weights: dict[str, torch.Tensor]
    optimizer_state: dict[str, dict[str, torch.Tensor]]
    step: int | float | None
    param_groups: list[dict]
    global_steps: int
    global_samples: int
    skipped_steps: int
    lr_scheduler: dict | None
    client_state: dict
    zero_stage: int
    dp_world_size: int
    ds_version: str | None = None
    ds_config: dict = field(default_factory=dict)
    frozen_names: list[str] = field(default_factory=list)
    """Parameters saved frozen (``frozen_param_shapes``): what ``exclude_frozen_parameters`` leaves out."""
    buffer_names: list[str] = field(default_factory=list)
    shared_params: dict[str, str] = field(default_factory=dict)
    """Tied parameters: the name not stored -> the name holding the values (``weights`` has both, one tensor)."""


def _load(path: Path) -> dict:
    """One file, through the restricted unpickler; any failure becomes a one-line CheckpointError."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: DeepSpeed writes this file with every checkpoint of this stage")
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- every reason to refuse is reported the same way
        # torch's message advises weights_only=False; keep only its reason ("Unsupported global: ...").
        found = re.search(r"WeightsUnpickler error:\s*(.+)", str(e))
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.strip().startswith(
            ("Weights only load failed", "Check the documentation", "(1)", "(2)"))]
        reason = (found.group(1) if found else " ".join(lines) or "unreadable").split(". Please use", 1)[0][:200]
        raise CheckpointError(f"{path} cannot be loaded safely ({type(e).__name__}: {reason}); a valid file holds only "
                              "tensors, containers, numbers and DeepSpeed's LossScaler/ZeroStageEnum/fragment_address "
                              "records") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a {type(data).__name__}, not the dict DeepSpeed writes")
    return data


def _resolve(directory: Path, tag: str | None) -> Path:
    """The tag directory: ``directory/tag``, ``directory`` itself, or what ``directory/latest`` names."""
    directory = Path(directory)
    if tag is not None:
        return directory / check_tag(tag)
    if any(directory.glob(_MODEL_GLOB)):
        return directory
    latest = directory / "latest"
    if latest.is_file():
        return directory / check_tag(latest.read_text(errors="replace").strip(), source=f"{latest} entry")
    raise CheckpointError(f"{directory} is not a DeepSpeed checkpoint: it has no {_MODEL_GLOB} and no 'latest' file")


def is_deepspeed_checkpoint(directory: Path) -> bool:
    """True for a DeepSpeed tag directory, or a save directory whose ``latest`` names one."""
    try:
        return any(_resolve(Path(directory), None).glob(_MODEL_GLOB))
    except (CheckpointError, OSError):
        return False


def _state_tensors(optim: dict, group_keys: list[int], rank_file: Path) -> tuple[list[dict[str, torch.Tensor]], Any]:
    """Per flat group, the tensor entries of torch's optimizer state (exp_avg, ...), and the Adam step."""
    state = optim.get("state", {})
    groups, step = [], None
    for key in group_keys:
        if key not in state:
            raise CheckpointError(f"{rank_file} has no optimizer state for flat group {key}")
        entry = state[key]
        step = entry.get("step", step)
        groups.append({k: v for k, v in entry.items() if k != "step" and torch.is_tensor(v) and v.dim() == 1})
    return groups, step


def _split_flat(flat: torch.Tensor, shapes: dict[str, torch.Size], source: Path, slack: int) -> dict[str, torch.Tensor]:
    """Cut a full flat group into named tensors; ``slack`` is the alignment padding allowed at its end."""
    out, offset = {}, 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        if offset + numel > flat.numel():
            raise CheckpointError(f"{source}: the flat partitions hold {flat.numel()} elements, too few for "
                                  f"'{name}' at offset {offset} (param_shapes does not match the optimizer files)")
        out[name] = flat[offset:offset + numel].view(shape).clone()
        offset += numel
    if flat.numel() - offset > slack:
        raise CheckpointError(f"{source}: {flat.numel() - offset} elements of the flat partitions belong to no "
                              "parameter")
    return out


def _merge_stage12(model: dict, optims: list[dict], files: list[Path]) -> tuple[dict, dict, Any]:
    """Stage 1/2: per group, concatenate the ranks' slices (trimming each rank's tail padding), then cut."""
    weights: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    base = [o["base_optimizer_state"] for o in optims]
    elastic = isinstance(base[0], list)  # elastic checkpoints store lean per-group state lists
    step = optims[0].get("base_optimizer_state_step")
    for g, shapes in enumerate(model["param_shapes"]):
        flat = torch.cat([o["single_partition_of_fp32_groups"][g].float() for o in optims])
        weights.update(_split_flat(flat, shapes, files[0], slack=2 * len(optims)))
        pieces: dict[str, list[torch.Tensor]] = {}
        for rank, (o, b) in enumerate(zip(optims, base)):
            if elastic:
                tensors = {k: v for k, v in b[g].items() if torch.is_tensor(v) and v.dim() == 1}
            else:
                [tensors], step = _state_tensors(b, [b["param_groups"][g]["params"][0]], files[rank])
                tensors = {k: v[:v.numel() - o["group_paddings"][g]] for k, v in tensors.items()}
            for k, v in tensors.items():
                pieces.setdefault(k, []).append(v)
        for k, parts in pieces.items():
            for name, t in _split_flat(torch.cat(parts), shapes, files[0], slack=2 * len(optims)).items():
                states.setdefault(name, {})[k] = t
    # Frozen parameters (and, at stage 1, anything outside the flat groups) are whole in ``module``.
    for name, t in (model.get("frozen_param_fragments") or {}).items():
        weights.setdefault(name, t.clone())
    for name, t in model["module"].items():
        weights.setdefault(name, t.clone())
    return weights, states, step


def _gather(per_rank: list[torch.Tensor], offset: int, part: int, shape: torch.Size) -> torch.Tensor:
    """One stage-3 parameter: ``part`` elements from each rank at ``offset``, tail padding dropped."""
    return torch.cat([t[offset:offset + part] for t in per_rank])[:math.prod(shape)].view(shape).clone()


def _merge_stage3(models: list[dict], optims: list[dict], files: list[Path]) -> tuple[dict, dict, Any]:
    """Stage 3: each parameter is split over the ranks individually; rebuild it rank by rank."""
    world = len(optims)
    flats = [torch.cat([t.float() for t in o["fp32_flat_groups"]]) for o in optims]
    state_flats: list[dict[str, torch.Tensor]] = []
    step = None
    for rank, o in enumerate(optims):
        inner = o["optimizer_state_dict"]
        keys = [k for group in inner["param_groups"] for k in group["params"]]
        groups, step = _state_tensors(inner, keys, files[rank])
        state_flats.append({k: torch.cat([g[k] for g in groups]) for k in groups[0]} if groups else {})
    shapes = {name: shape for group in models[0]["param_shapes"] for name, shape in group.items()}
    weights: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    offset = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        if offset + part > flats[0].numel():
            raise CheckpointError(f"{files[0]}: fp32_flat_groups are too short for '{name}' (param_shapes does not "
                                  "match)")
        weights[name] = _gather(flats, offset, part, shape)
        for k in state_flats[0]:
            states.setdefault(name, {})[k] = _gather([s[k] for s in state_flats], offset, part, shape)
        offset += part
    if offset != flats[0].numel():
        raise CheckpointError(f"{files[0]}: {flats[0].numel() - offset} elements per rank belong to no parameter")
    for name, shape in (models[0].get("frozen_param_shapes") or {}).items():
        frags = torch.cat([m["frozen_param_fragments"][name] for m in models])
        weights[name] = frags[:math.prod(shape)].view(shape).float().clone()
    return weights, states, step


_MODEL_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
               "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
               "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
               "ds_version"}


def read_deepspeed_checkpoint(directory: Path, tag: str | None = None) -> DeepSpeedCheckpoint:
    """Full fp32 weights, Adam state and counters of a DeepSpeed ZeRO 1/2/3 checkpoint (see the module doc)."""
    tag_dir = _resolve(Path(directory), tag)
    stage3_model = tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    model0 = _load(stage3_model if stage3_model.is_file() else tag_dir / "mp_rank_00_model_states.pt")
    if model0.get("mp_world_size", 1) != 1 or model0.get("param_shapes") is None:
        raise CheckpointError(f"{tag_dir} is not a ZeRO stage 1-3 checkpoint with mp_world_size 1 (mp_world_size="
                              f"{model0.get('mp_world_size')}, "
                              f"param_shapes={type(model0.get('param_shapes')).__name__})")
    prefix = "bf16_zero" if (tag_dir / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file() else "zero"
    name = prefix + "_pp_rank_{}_mp_rank_00_optim_states.pt"
    first = _load(tag_dir / name.format(0))
    try:
        count = first["optimizer_state_dict"].get("partition_count", model0.get("dp_world_size", 1))
        world = max(count) if isinstance(count, list) else int(count)
        optim_files = [tag_dir / name.format(r) for r in range(world)]
        for path in optim_files:
            if not path.is_file():
                raise CheckpointError(f"{path} is missing: this checkpoint has {world} data-parallel ranks and needs "
                                      f"{name.format('{0..' + str(world - 1) + '}')}")
        optims = [first["optimizer_state_dict"]] + [_load(p)["optimizer_state_dict"] for p in optim_files[1:]]
        zero_stage = int(optims[0].get("zero_stage", 0))
        if zero_stage == 3:
            models = [model0] + [_load(tag_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
                                 for r in range(1, world)]
            weights, states, step = _merge_stage3(models, optims, optim_files)
            groups = optims[0]["optimizer_state_dict"]["param_groups"]
        else:
            weights, states, step = _merge_stage12(model0, optims, optim_files)
            base = optims[0]["base_optimizer_state"]
            groups = base["param_groups"] if isinstance(base, dict) else []
        buffers = set(model0.get("buffer_names") or [])
        weights.update({k: v.clone() for k, v in model0["module"].items() if k in buffers})
        for alias, owner in (model0.get("shared_params") or {}).items():
            weights[alias] = weights[owner]
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, RuntimeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{tag_dir} does not have the layout of a DeepSpeed ZeRO checkpoint "
                              f"({type(e).__name__}: {e}); see zerotune.checkpoint.deepspeed_format") from None
    if torch.is_tensor(step):
        step = step.item()
    if isinstance(step, float) and step.is_integer():
        step = int(step)
    return DeepSpeedCheckpoint(
        weights=weights, optimizer_state=states, step=step,
        param_groups=[{k: v for k, v in g.items() if k != "params"} for g in groups],
        global_steps=int(model0.get("global_steps", 0)), global_samples=int(model0.get("global_samples", 0)),
        skipped_steps=int(model0.get("skipped_steps", 0)), lr_scheduler=model0.get("lr_scheduler"),
        client_state={k: v for k, v in model0.items() if k not in _MODEL_KEYS},
        zero_stage=zero_stage, dp_world_size=int(model0.get("dp_world_size", world)),
        ds_version=model0.get("ds_version"), ds_config=model0.get("ds_config") or {},
        frozen_names=_frozen_names(model0), buffer_names=list(model0.get("buffer_names") or []),
        shared_params=dict(model0.get("shared_params") or {}))


def _frozen_names(model: dict) -> list[str]:
    """The frozen parameters: ``frozen_param_shapes`` (stages 2 and 3); stage 1 records none, so there they are the
    module's tensors outside the flat groups, the buffers and the tied names."""
    if model.get("frozen_param_shapes"):
        return list(model["frozen_param_shapes"])
    known = {name for group in model["param_shapes"] for name in group}
    known |= set(model.get("buffer_names") or []) | set(model.get("shared_params") or {})
    return [name for name in model["module"] if name not in known]


def as_piece_reader(checkpoint: DeepSpeedCheckpoint, directory: Path) -> Any:
    """The checkpoint as a ``PieceReader``: whole fp32 weights, and each parameter's optimizer state as one piece
    covering it -- so ``engine.load_checkpoint`` loads it at any zerotune layout like one of its own."""
    from zerotune.checkpoint.logical import OPTIM, PieceReader

    entries: list[dict[str, Any]] = []
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, torch.Tensor]] = {}
    for name, states in checkpoint.optimizer_state.items():
        for key, tensor in states.items():
            tensors[f"t{len(entries)}"] = tensor.reshape(-1)
            entries.append({"key": f"t{len(entries)}", "name": name, "kind": OPTIM + key, "shape": list(tensor.shape),
                            "tp": None, "start": 0, "stop": tensor.numel()})
        if checkpoint.step is not None and states:
            scalars[name] = {"step": torch.tensor(float(checkpoint.step))}
    return PieceReader(directory, checkpoint.weights,
                       {"deepspeed": {"entries": entries, "scalars": scalars, "tensors": tensors}})
