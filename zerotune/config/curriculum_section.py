"""DeepSpeed's curriculum learning blocks: the legacy ``curriculum_learning`` and ``data_efficiency``.

A curriculum starts training on easy samples and makes them harder with the step; zerotune implements
the ``seqlen`` kind (difficulty = sequence length), the one that needs nothing but the batch:

* ``curriculum_learning`` (DeepSpeed's legacy form): every training forward gets the difficulty of step
  ``global_steps + 1`` -- as ``curriculum_seqlen=`` when the model's forward takes it (Megatron-style models),
  else as a cut of the batch's sequence tensors (``zerotune/engine_curriculum.py``);
* ``data_efficiency.data_sampling.curriculum_learning``: one schedule per named metric, advanced once per
  global batch of the engine's data loader and handed to ``set_data_post_process_func``'s function; the
  metric named ``seqlen`` cuts the batch itself when no such function is set
  (``zerotune/curriculum/data_sampling.py``).

What needs DeepSpeed's offline data analyzer (``clustering_type: schedule_based`` picks samples from its index
files), random-LTD (``data_routing.random_ltd``, layers that drop tokens) and dynamic batching are refused by
name; the analyzer's file paths are accepted with ``single_cluster`` (DeepSpeed does not read them then).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Optional

from pydantic import Field, StrictBool, ValidationInfo, field_validator

from .errors import ConfigError, NotSupportedError
from .normalize import normalize_keys
from .section import NoEffect, Section
from .types import Int, PosFloat, PosInt, Str

# The schedule_config keys each schedule type reads (the others have no effect there).
SCHEDULE_KEYS: dict[str, tuple[str, ...]] = {
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_discrete": ("difficulty", "max_step"),
    "custom": (),
}
SCHEDULE_FIELDS = ("min_difficulty", "max_difficulty", "schedule_type", "schedule_config")


def _path(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _disabled(block: Any) -> bool:
    return isinstance(block, Mapping) and block.get("enabled", False) is False


class CurriculumScheduleConfig(Section):
    """``schedule_config``: the parameters of the schedule type; each type reads its own keys
    (``SCHEDULE_KEYS``), and a key its type does not read is reported as having no effect."""

    total_curriculum_step: Optional[PosInt] = None
    """fixed_linear / fixed_root: the step at which the difficulty reaches max_difficulty."""
    difficulty_step: Optional[PosInt] = None
    """fixed_linear / fixed_root: every difficulty is a multiple of this (8 or 16 keep sequence lengths
    friendly to tensor cores)."""
    root_degree: Optional[PosFloat] = None
    """fixed_root: the difficulty grows as (step / total_curriculum_step) ** (1 / root_degree); 2 is a square root."""
    difficulty: Optional[list[Int]] = None
    """fixed_discrete: the difficulties in order; the last one holds after the last max_step."""
    max_step: Optional[list[PosInt]] = None
    """fixed_discrete: the last step of each difficulty but the last (one value fewer than difficulty)."""

    @field_validator("difficulty", "max_step")
    @classmethod
    def _not_empty(cls, value: Optional[list[int]]) -> Optional[list[int]]:
        if value is not None and not value:
            raise ValueError("an empty list schedules nothing; list at least one value (as DeepSpeed requires), or "
                             "leave the key out")
        return value


class CurriculumSchedule(Section):
    """What every curriculum has: a difficulty range and the schedule that walks it (DeepSpeed's
    ``CurriculumScheduler`` config). Each schedule type's keys are required; the checks that compare
    keys run before typing (``translate_legacy``) so the error names the exact key."""

    min_difficulty: Optional[Int] = None
    """The difficulty at the start (for seqlen: the first sequence length, in tokens)."""
    max_difficulty: Optional[Int] = None
    """The difficulty the schedule ends at; once reached it no longer changes."""
    schedule_type: Optional[Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"]] = None
    """How the difficulty grows: linearly, as a root of the step, in listed steps, or by a function the
    script sets (``engine.set_custom_curriculum_learning_schedule``)."""
    schedule_config: CurriculumScheduleConfig = Field(default_factory=CurriculumScheduleConfig)
    """The schedule type's parameters."""

    @classmethod
    def translate_legacy(cls, raw: dict[str, Any], prefix: str, notes: list[tuple[str, str]]) -> dict[str, Any]:
        """Before typing: the schedule's required keys are present, and schedule_config keys the type does
        not read are dropped with a note (DeepSpeed ignores them too)."""
        return check_schedule_keys(raw, prefix, notes, required=True)

    @field_validator("max_difficulty")
    @classmethod
    def _max_not_below_min(cls, value: Optional[int], info: ValidationInfo) -> Optional[int]:
        low = info.data.get("min_difficulty")
        if value is not None and low is not None and value < low:
            raise ValueError(f"must be at least min_difficulty ({low})")
        return value

    @field_validator("schedule_config")
    @classmethod
    def _discrete_steps_fit(cls, value: CurriculumScheduleConfig, info: ValidationInfo) -> CurriculumScheduleConfig:
        if info.data.get("schedule_type") != "fixed_discrete" or value.difficulty is None or value.max_step is None:
            return value
        if len(value.difficulty) != len(value.max_step) + 1:
            raise ValueError(f"difficulty needs exactly one value more than max_step (the last difficulty holds "
                             f"after the last max_step); got {len(value.difficulty)} and {len(value.max_step)}")
        if any(a >= b for a, b in zip(value.max_step, value.max_step[1:])):
            raise ValueError(f"max_step must increase strictly, got {value.max_step}")
        return value


def check_schedule_keys(raw: dict[str, Any], prefix: str, notes: list[tuple[str, str]], *,
                        required: bool) -> dict[str, Any]:
    """The pre-typing checks of a schedule block (``raw``, at ``prefix``): required keys present (when
    ``required``), the schedule type's keys present and the others dropped with a note."""
    if required:
        for key in ("min_difficulty", "max_difficulty", "schedule_type"):
            if key not in raw:
                raise ConfigError(_path(prefix, key), "required key is missing (a curriculum needs min_difficulty, "
                                                      "max_difficulty and schedule_type)")
    kind, schedule = raw.get("schedule_type"), raw.get("schedule_config", {})
    if not isinstance(kind, str) or kind not in SCHEDULE_KEYS or not isinstance(schedule, Mapping):
        return raw  # typing names the bad value
    if required:
        for key in SCHEDULE_KEYS[kind]:
            if key not in schedule:
                raise ConfigError(_path(prefix, f"schedule_config.{key}"),
                                  f"required key is missing (schedule_type {kind} reads "
                                  f"{', '.join(SCHEDULE_KEYS[kind])})")
    unread = [key for key in schedule
              if key in CurriculumScheduleConfig.model_fields and key not in SCHEDULE_KEYS[kind]]
    for key in unread:
        notes.append((_path(prefix, f"schedule_config.{key}"),
                      f"no effect here: schedule_type {kind} does not read it"))
    if not unread:
        return raw
    return {**raw, "schedule_config": {k: v for k, v in schedule.items() if k not in unread}}


class CurriculumLearningConfig(CurriculumSchedule):
    """``curriculum_learning``: DeepSpeed's legacy curriculum, applied by the engine's forward.

    ``seqlen`` is the only kind: each training forward gets the difficulty of the coming step as
    ``curriculum_seqlen=`` when the model's forward has that parameter, and otherwise the batch's
    sequence tensors (those as long as ``input_ids``) are cut to that many tokens, so a Hugging Face model
    trains on the scheduled lengths unchanged."""

    enabled: StrictBool = False
    """Apply the curriculum to every training forward."""
    curriculum_type: Str = "seqlen"
    """What the difficulty measures: "seqlen" (the sequence length), the only kind zerotune applies."""

    @classmethod
    def translate_legacy(cls, raw: dict[str, Any], prefix: str, notes: list[tuple[str, str]]) -> dict[str, Any]:
        """Keys are required only while enabled; a curriculum kind other than seqlen is refused by name."""
        enabled = raw.get("enabled") is True
        kind = raw.get("curriculum_type", "seqlen")
        if enabled and isinstance(kind, str) and kind != "seqlen":
            raise NotSupportedError(_path(prefix, "curriculum_type"),
                                    f"'{kind}' curricula are not supported: zerotune applies 'seqlen' only (it "
                                    "needs nothing but the batch; other kinds need the model or the data to act "
                                    "on the difficulty)")
        return check_schedule_keys(raw, prefix, notes, required=enabled)

    @field_validator("min_difficulty")
    @classmethod
    def _at_least_one_token(cls, value: Optional[int]) -> Optional[int]:
        if value is not None and value < 1:
            raise ValueError("a seqlen curriculum starts at 1 token or more")
        return value


class CurriculumMetricConfig(CurriculumSchedule):
    """One entry of ``curriculum_metrics``: a named difficulty with its schedule.

    Only ``single_cluster`` clustering exists here (every sample stays eligible; nothing is selected by
    difficulty), so the analyzer's index files and the difficulty type are read by nothing."""

    NO_EFFECT: ClassVar[dict[str, NoEffect]] = {
        "index_to_sample_path": (None, "", "read only for clustering_type schedule_based (the data analyzer's "
                                           "index files); single_cluster selects no samples"),
        "index_to_metric_path": (None, "", "read only for clustering_type schedule_based (the data analyzer's "
                                           "index files); single_cluster selects no samples"),
        "difficulty_type": (lambda v: v in ("value", "percentile"), '"value" or "percentile"',
                            "single_cluster selects no samples by difficulty"),
    }

    clustering_type: Literal["single_cluster"] = "single_cluster"
    """"single_cluster": every sample stays eligible (schedule_based, which picks samples from the data
    analyzer's index files, is refused)."""

    @classmethod
    def translate_legacy(cls, raw: dict[str, Any], prefix: str, notes: list[tuple[str, str]]) -> dict[str, Any]:
        """schedule_based clustering is refused by name (it needs the offline data analyzer's output)."""
        clustering = raw.get("clustering_type")
        if isinstance(clustering, str) and clustering != "single_cluster":
            raise NotSupportedError(_path(prefix, "clustering_type"),
                                    f"'{clustering}' is not supported: it selects samples by difficulty from "
                                    "DeepSpeed's offline data analyzer index files, which zerotune does not build; "
                                    "use \"single_cluster\"")
        return super().translate_legacy(raw, prefix, notes)


class DataCurriculumConfig(Section):
    """``data_efficiency.data_sampling.curriculum_learning``: per-metric schedules over the engine's data
    loader (``initialize(training_data=...)``), advanced once per global batch."""

    NO_EFFECT: ClassVar[dict[str, NoEffect]] = {
        "data_cluster_path": (None, "", "no cluster files are written: every metric is single_cluster"),
    }

    enabled: StrictBool = False
    """Schedule the metrics below."""
    curriculum_metrics: dict[str, CurriculumMetricConfig] = Field(default_factory=dict)
    """Metric name -> its schedule. The metric "seqlen" cuts each batch's sequence tensors to its difficulty
    unless a post-process function is set; every metric's difficulty is handed to that function
    (``engine.set_data_post_process_func``) as ``state["current_difficulties"][name]``."""

    @classmethod
    def translate_legacy(cls, raw: dict[str, Any], prefix: str, notes: list[tuple[str, str]]) -> dict[str, Any]:
        """An enabled curriculum names at least one metric."""
        metrics = raw.get("curriculum_metrics")
        if raw.get("enabled") is True and (metrics is None or (isinstance(metrics, Mapping) and not metrics)):
            raise ConfigError(_path(prefix, "curriculum_metrics"), "an enabled curriculum needs at least one metric "
                                                                   "(e.g. {\"seqlen\": {...}})")
        return raw

    @field_validator("curriculum_metrics")
    @classmethod
    def _seqlen_at_least_one_token(cls, value: dict[str, CurriculumMetricConfig]) -> dict[str, CurriculumMetricConfig]:
        seqlen = value.get("seqlen")
        if seqlen is not None and seqlen.min_difficulty is not None and seqlen.min_difficulty < 1:
            raise ValueError("the seqlen metric starts at 1 token or more (min_difficulty)")
        return value


class DataSamplingConfig(Section):
    """``data_efficiency.data_sampling``."""

    NO_EFFECT: ClassVar[dict[str, NoEffect]] = {
        "num_epochs": (None, "", "the engine's data loader runs one epoch per iteration, as without data_efficiency"),
        "num_workers": (None, "", "the engine's data loader reads in the main process"),
        "pin_memory": (None, "", "the engine's data loader does not pin batches"),
        "dynamic_batching": (_disabled, '{"enabled": false}', "dynamic batching is off"),
    }

    enabled: StrictBool = False
    """Turn on data sampling (the curriculum below)."""
    curriculum_learning: DataCurriculumConfig = Field(default_factory=DataCurriculumConfig)
    """Curriculum learning over the data loader's batches."""


class DataEfficiencyConfig(Section):
    """``data_efficiency``: DeepSpeed's data efficiency library; zerotune models its analyzer-free curriculum."""

    NO_EFFECT: ClassVar[dict[str, NoEffect]] = {
        "seed": (None, "", "the engine's data loader keeps its DistributedSampler order (single_cluster selects "
                           "no samples)"),
        "data_routing": (lambda v: isinstance(v, Mapping) and _disabled(v.get("random_ltd", {})),
                         'a block without random_ltd enabled', "random-LTD is off"),
    }

    enabled: StrictBool = False
    """Turn on the data efficiency features below."""
    data_sampling: DataSamplingConfig = Field(default_factory=DataSamplingConfig)
    """Data sampling (curriculum learning)."""

    @classmethod
    def translate_legacy(cls, raw: dict[str, Any], prefix: str, notes: list[tuple[str, str]]) -> dict[str, Any]:
        """Refuse random-LTD and dynamic batching by name; refuse a curriculum switched on inside a block switched
        off (DeepSpeed reads only the innermost flag, which would surprise either way)."""
        routing = raw.get("data_routing")
        ltd = routing.get("random_ltd") if isinstance(routing, Mapping) else None
        if isinstance(ltd, Mapping) and not _disabled(ltd):
            raise NotSupportedError(_path(prefix, "data_routing.random_ltd"),
                                    "random layerwise token dropping (random-LTD) is not supported: it needs "
                                    "DeepSpeed's token-dropping layers in the model; remove the block")
        sampling = raw.get("data_sampling")
        if not isinstance(sampling, Mapping):
            return raw
        batching = sampling.get("dynamic_batching")
        if isinstance(batching, Mapping) and not _disabled(batching):
            raise NotSupportedError(_path(prefix, "data_sampling.dynamic_batching"),
                                    "dynamic batching (variable batch size and LR by sequence length) is not "
                                    "supported: it needs the data analyzer's metrics files; remove the block")
        curriculum = sampling.get("curriculum_learning")
        if isinstance(curriculum, Mapping) and curriculum.get("enabled") is True:
            for key, block in (("enabled", raw), ("data_sampling.enabled", sampling)):
                if block.get("enabled") is not True:
                    raise ConfigError(_path(prefix, key), "must be true when data_sampling.curriculum_learning is "
                                                          "enabled (or switch the curriculum off)")
        return raw


def validated_schedule(raw: Mapping[str, Any], prefix: str) -> CurriculumSchedule:
    """A schedule given as DeepSpeed's plain dict (what ``CurriculumScheduler(config)`` takes; other keys of the
    block, such as ``enabled``, are not its business), checked like the config file's, errors naming ``prefix``."""
    from pydantic import ValidationError

    from .pydantic_errors import translate

    if not isinstance(raw, Mapping):
        raise ConfigError(prefix, f"expected a mapping with {', '.join(SCHEDULE_FIELDS)}, got {type(raw).__name__}")
    normalized = normalize_keys({k: raw[k] for k in SCHEDULE_FIELDS if k in raw}, CurriculumSchedule, prefix, [])
    try:
        return CurriculumSchedule.model_validate(normalized)
    except ValidationError as exc:
        raise translate(exc, normalized, prefix) from None


__all__ = ["CurriculumLearningConfig", "CurriculumMetricConfig", "CurriculumSchedule", "CurriculumScheduleConfig",
           "DataCurriculumConfig", "DataEfficiencyConfig", "DataSamplingConfig", "SCHEDULE_FIELDS", "SCHEDULE_KEYS",
           "check_schedule_keys", "validated_schedule"]
