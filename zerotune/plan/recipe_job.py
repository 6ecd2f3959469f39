"""The job a fine-tuning recipe runs, as ``zerotune plan`` sees it: model, layout, sequence length, method.

``zerotune plan RECIPE`` plans what ``zerotune finetune RECIPE`` will hold per rank, so everything here is
taken from the same functions the worker calls (``finetune/worker.py``): the model directory from
``resolve_model_path``, the head from the task and objective (a reward model is the body under a
one-output classification head), the peft wrapping from ``apply_method`` -- run on the meta device, where
peft builds its adapters with their real shapes, so adapter and frozen counts are exact rather than
re-derived from the peft config -- and the engine config from ``recipe_engine_config``. Only QLoRA's
quantized base cannot be built on meta (bitsandbytes packs real weights); its packed size is computed
from the linear layers bitsandbytes replaces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerotune.config.files import read_config_file
from zerotune.finetune.recipe_checks import RecipeError

PAIRED_OBJECTIVES = ("dpo", "orpo", "simpo", "reward")
"""Objectives whose micro-batch is micro_batch_size pairs: chosen and rejected run as one forward of 2x rows."""


def is_recipe(source: str) -> bool:
    """A bundled recipe name, or a YAML/JSON file with ``model:`` and ``task:`` sections (a DeepSpeed config has
    neither)."""
    from zerotune.finetune.recipe import BUNDLED_RECIPES

    if source in BUNDLED_RECIPES:
        return True
    path = Path(source)
    if not path.is_file():
        return False
    try:
        raw = read_config_file(path)
    except Exception:  # noqa: BLE001 - not readable as a recipe: the DeepSpeed-config path reports it
        return False
    return isinstance(raw, dict) and "model" in raw and "task" in raw


@dataclass
class RecipeJob:
    """What one rank of the recipe's job trains: the meta-device model (peft-wrapped as in training), the
    engine config, and the assumptions ``zerotune plan`` prints."""

    model: torch.nn.Module
    task: str  # the head the job builds: causal-lm, or sequence-classification (also a reward model)
    engine_config: dict[str, Any]
    world_size: int
    micro_batch: int  # sequences per forward: 2 x train.micro_batch_size for a paired objective
    seq_len: int
    quantized_bytes: int = 0  # QLoRA: the packed frozen linear weights (and their quantization statistics)
    quantized_params: int = 0
    notes: list[str] = field(default_factory=list)


def recipe_job(source: str, overrides: list[str], world_size: int | None = None,
               seq_len: int | None = None) -> RecipeJob:
    """Load ``source`` (a recipe file or bundled name) with ``--set`` ``overrides`` and build its job on the
    meta device; ``world_size`` / ``seq_len`` override ``launch`` and ``data.max_length``. Problems are one-line
    ``RecipeError``s (or ``PlanModelError`` for a model that cannot be built)."""
    from zerotune.finetune.models import ModelLoadError, apply_method, resolve_model_path
    from zerotune.finetune.recipe import load_recipe, recipe_engine_config
    from zerotune.plan.meta_model import PlanModelError

    recipe = load_recipe(source, overrides)
    world = world_size if world_size is not None else recipe.launch.nproc_per_node * recipe.launch.nnodes
    if world < 1:
        raise RecipeError("--world-size", f"must be >= 1, got {world}")
    engine_config = recipe_engine_config(recipe, total_steps=recipe.train.max_steps, dp_world_size=world)
    objective = recipe.objective.type
    task = "sequence-classification" if objective == "reward" else recipe.task
    try:
        path = resolve_model_path(recipe.model.name_or_path)
    except ModelLoadError as error:
        raise PlanModelError(str(error)) from None
    model = _meta_base(path, task, _num_labels(recipe, objective), recipe.model.trust_remote_code)
    method = recipe.method
    quantized: dict[str, int] = {}
    if method.type == "qlora":
        quantized = _quantized_linears(model, task)
    try:
        with torch.device("meta"):
            model = apply_method(model, task, method)
    except (ModelLoadError, ValueError, TypeError) as error:
        raise RecipeError("method", f"{method.type}: {str(error).splitlines()[0]}") from None
    length = seq_len if seq_len is not None else recipe.data.max_length
    paired = objective in PAIRED_OBJECTIVES
    job = RecipeJob(model, task, engine_config, world, recipe.train.micro_batch_size * (2 if paired else 1), length)
    if quantized:
        _mark_quantized(job, quantized, method.bits)
    job.notes += _assumptions(recipe, job, objective, paired, seq_len is not None)
    return job


def _num_labels(recipe: Any, objective: str) -> int | None:
    if objective == "reward":
        return 1
    return recipe.model.num_labels if recipe.task == "sequence-classification" else None


def _meta_base(path: Path, task: str, num_labels: int | None, trust_remote_code: bool) -> torch.nn.Module:
    """The task's head on the body, on the meta device (``load_model``'s classes, no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    extra = {"num_labels": num_labels} if num_labels is not None else {}
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **extra)
    auto = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
    with torch.device("meta"):
        return auto.from_config(config, trust_remote_code=trust_remote_code)


def _quantized_linears(model: torch.nn.Module, task: str) -> dict[str, int]:
    """{module name: weight elements} of the linear layers bitsandbytes quantizes: every ``nn.Linear`` but the
    output head (transformers keeps the LM head / classification head in full precision)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if task == "causal-lm" and callable(get_head) else None
    skipped = {"lm_head", "score", "classifier"}
    return {name: module.weight.numel() for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module is not head and name.split(".")[-1] not in skipped}


def quantized_weight_bytes(numel: int, out_features: int, bits: int) -> int:
    """Bytes bitsandbytes stores for one quantized linear weight: 4-bit NF4 packs two per byte with one 8-bit
    absmax per 64-element block and, double-quantized, one fp32 absmax per 256 blocks; 8-bit (LLM.int8) stores a
    byte per element and an fp32 scale per output row."""
    if bits == 4:
        blocks = -(-numel // 64)
        return -(-numel // 2) + blocks + 4 * -(-blocks // 256)
    return numel + 4 * out_features


def _mark_quantized(job: RecipeJob, quantized: dict[str, int], bits: int) -> None:
    """Account QLoRA's frozen linear weights at their packed size, apart from the full-precision parameters."""
    for name, module in job.model.named_modules():
        base = name.removesuffix(".base_layer")
        key = next((k for k in quantized if base.endswith(k) and (base == k or base.endswith("." + k))), None)
        if key is not None and isinstance(module, torch.nn.Linear) and not name.split(".")[-1].startswith("lora_"):
            weight = module.weight
            job.quantized_params += weight.numel()
            job.quantized_bytes += quantized_weight_bytes(weight.numel(), weight.shape[0], bits)
            quantized.pop(key)


def _assumptions(recipe: Any, job: RecipeJob, objective: str, paired: bool, seq_given: bool) -> list[str]:
    method = recipe.method
    described = {"lora": f"LoRA r={method.r} on {method.target_modules or 'the default targets'}",
                 "qlora": f"QLoRA: {method.bits}-bit {'NF4' if method.bits == 4 else 'LLM.int8'} frozen base, LoRA "
                          f"r={method.r}",
                 "prefix": f"prefix tuning, {method.num_virtual_tokens} virtual tokens",
                 "freeze": f"freeze all but {method.trainable_layers or 0} last blocks"
                           + (f" and {method.trainable_modules}" if method.trainable_modules else ""),
                 "full": "full fine-tuning"}[method.type]
    notes = [f"method: {described}"]
    if job.quantized_params:
        notes.append(f"quantized frozen weights: {job.quantized_params:,} parameters in "
                     f"{job.quantized_bytes / 2**20:,.1f} MiB packed (not sharded, no gradients or optimizer state)")
    source = "--seq-len" if seq_given else "data.max_length"
    if recipe.data.packing:
        notes.append(f"sequence length {job.seq_len} ({source}); data.packing: every row is full length")
    else:
        notes.append(f"sequence length {job.seq_len} ({source}); no packing: batches pad to their longest "
                     "example, planned at the worst case (every row at full length)")
    rows = f"micro-batch {recipe.train.micro_batch_size}"
    if paired:
        rows += f" pairs = {job.micro_batch} sequences per forward (chosen + rejected)"
    notes.append(f"objective: {objective}; {rows}")
    adapter = method.type in ("lora", "qlora", "prefix")
    if objective == "kto" or (objective == "dpo" and not recipe.objective.reference_free):
        notes.append("reference: the same model with the adapter disabled (no extra weights; one extra no-grad "
                     "forward per step, its activations freed)" if adapter else
                     "reference: log-probs precomputed once before the first step by a no-grad pass (no extra "
                     "weights during training)")
    elif objective in ("dpo", "orpo", "simpo"):
        notes.append("reference: none (reference-free)")
    if objective == "reward":
        notes.append("reward model: sequence-classification head with 1 output")
    elif job.task == "sequence-classification":
        labels = getattr(getattr(job.model, "config", None), "num_labels", None)
        notes.append(f"classification head: {labels} outputs ("
                     + ("model.num_labels)" if recipe.model.num_labels else "the model config's; the job sizes it "
                        "to the data's labels, set model.num_labels to plan that)"))
    if objective == "kto":
        notes.append("kto: the mismatched-pair KL forwards run without gradients (no saved activations)")
    return notes


def plan_job(job: RecipeJob, zero_stage: int | None = None) -> tuple[Any, Any, Any]:
    """(RankPlan, ModelProfile, Layout) of one rank of ``job`` (its model is consumed by the trace); the layout
    is the recipe's engine config on the job's ranks, ``zero_stage`` overriding its stage. QLoRA's quantized
    weights are a row of their own at their packed size, outside the parameters row."""
    import dataclasses

    from zerotune.plan.memory import Row, check_composes, layout_from_config, plan_from_profile, profile_model

    layout = dataclasses.replace(layout_from_config(job.engine_config, job.world_size), micro_batch=job.micro_batch)
    if zero_stage is not None:
        layout = dataclasses.replace(layout, stage=zero_stage)
    check_composes(layout)
    profile = profile_model(job.model, job.seq_len, layout.precision, job.task)
    if job.quantized_params:
        profile = dataclasses.replace(profile, frozen=profile.frozen - job.quantized_params)
    plan = plan_from_profile(profile, layout)
    if job.quantized_params:
        plan.rows.insert(1, Row("quantized frozen weights", job.quantized_bytes,
                                note=f"{job.quantized_params:,} packed, not sharded"))
    return plan, profile, layout
