"""The sections of a fine-tuning recipe as typed pydantic models.

They subclass the engine config's :class:`~zerotune.config.section.Section` (unknown keys
forbidden, a docstring under every field) so the engine config's loading machinery --
did-you-mean for unknown keys, one-line translation of pydantic errors -- works on recipes
unchanged. Field types come from ``zerotune.config.types``: strict, so ``lr: fast`` or
``epochs: "3"`` is an error instead of a silent coercion.

Checks that span several fields (exactly one of ``epochs``/``max_steps``, options of another
method than the chosen one) live in ``recipe_checks.py``, which raises them with the exact key
path; a pydantic model validator could only report the whole section.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BeforeValidator, Field, StrictBool

from zerotune.config.schema import ZeroTuneConfig
from zerotune.config.section import Section
from zerotune.config.types import Fraction, NonNegFloat, NonNegInt, PosFloat, PosInt, Stage, Str
from zerotune.finetune.chat_templates import TEMPLATE_NAMES
from zerotune.finetune.formats import CHAT_ROLES, FORMATS
from zerotune.finetune.recipe_objective import (  # the recipe's sections are all named here
    OBJECTIVE_OPTIONS,
    OBJECTIVES,
    PREFERENCE_OBJECTIVES,
    ObjectiveSection,
)

# Names the finetune asset layer (zerotune/finetune/assets.py) knows how to fetch offline.
BUNDLED_MODELS = ("all-MiniLM-L6-v2", "SmolLM2-135M-Instruct")
BUNDLED_DATA = ("rotten_tomatoes", "chatterbot_corpus_english")

TASKS = ("sequence-classification", "causal-lm")
METHODS = ("full", "lora", "qlora", "prefix", "freeze")
# Which method.* options belong to which method.type; "type" itself belongs to all.
_LORA_OPTIONS = ("r", "alpha", "dropout", "target_modules", "dora", "rslora")
METHOD_OPTIONS = {
    "lora": _LORA_OPTIONS,
    "qlora": (*_LORA_OPTIONS, "bits"),
    "prefix": ("num_virtual_tokens",),
    "freeze": ("trainable_layers", "trainable_modules"),
}
PRECISIONS = ("fp32", "bf16", "fp16")


def _one_path_as_list(value: Any) -> Any:
    """``train_files: a.csv`` (or ``--set data.train_files=a.csv``) means a list of one file."""
    return [value] if isinstance(value, str) else value


PathList = Annotated[list[Str], BeforeValidator(_one_path_as_list), Field(min_length=1)]


class ModelSection(Section):
    """``model``: which pretrained model to fine-tune and how to load it."""

    name_or_path: Str
    """A local Hugging Face model directory (relative paths resolve against the recipe's directory) or a bundled model
    name: all-MiniLM-L6-v2, SmolLM2-135M-Instruct."""
    num_labels: Optional[PosInt] = None
    """Number of classes for sequence classification; None infers it from the training labels."""
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """dtype the weights are loaded in; "auto" is fp32 (the engine casts per its precision and keeps fp32 masters made
    from the checkpoint's exact values). bf16 / fp16 halve the loading memory and need the same engine.precision."""
    trust_remote_code: StrictBool = False
    """Allow the model directory to run its own Python modelling code (only for directories you trust)."""


class DataSection(Section):
    """``data``: where the examples come from, which columns hold what, and how they are cut."""

    train_files: Optional[PathList] = None
    """Local CSV / JSON / JSONL / parquet / text files with the training examples (relative paths resolve against the
    recipe's directory). Exactly one of train_files and bundled."""
    eval_files: Optional[PathList] = None
    """Files with the held-out examples; None splits eval_fraction off the training data."""
    bundled: Optional[Literal[BUNDLED_DATA]] = None  # type: ignore[valid-type]
    """A bundled data set fetched offline: rotten_tomatoes (sentiment) or chatterbot_corpus_english (question/answer
    pairs). Exactly one of train_files and bundled."""
    dataset: Optional[Str] = None
    """A Hugging Face data set id (through the hub's cache: offline once cached) or a local data set directory
    (save_to_disk's, or a folder of data files); instead of train_files and bundled."""
    dataset_config: Optional[Str] = None
    """The data set's configuration (subset) name, for ids that have several."""
    train_split: Str = "train"
    """The data set's split to train on."""
    eval_split: Optional[Str] = None
    """The data set's split to evaluate on; None splits eval_fraction off the training split."""
    text_column: Str = "text"
    """Column with the input text (sequence classification, or plain-text causal LM)."""
    text_pair_column: Optional[Str] = None
    """Column with the second text of a sentence pair (sequence classification); None for single texts."""
    label_column: Str = "label"
    """Column with the class label (sequence classification); strings or integers."""
    prompt_column: Optional[Str] = None
    """Column with the prompt / question (causal LM, with response_column); the loss is not taken on these tokens. None
    (with response_column None) trains on text_column as plain text."""
    response_column: Optional[Str] = None
    """Column with the answer (causal LM, with prompt_column); the loss is taken on these tokens only."""
    format: Literal[FORMATS] = "auto"  # type: ignore[valid-type]
    """Causal LM: how the examples are laid out. auto detects it from the columns: messages (OpenAI / TRL chat: role +
    content turns, loss on the assistant turns through the tokenizer's chat template), conversations (ShareGPT: from +
    value), instruction + input + output (alpaca: loss on the output), prompt + response (or prompt_column +
    response_column: loss on the response), input_ids [+ labels] (tokens, pre-tokenized), else text_column (text: loss
    on every token)."""
    template: Literal[TEMPLATE_NAMES] = "auto"  # type: ignore[valid-type]
    """Causal LM: the chat format prompt/response and messages rows are rendered in. auto: the tokenizer's own chat
    template (plain text when it has none); chatml, llama3, mistral, qwen, gemma or alpaca: that format, set as the
    tokenizer's chat template (so the eval samples and the saved tokenizer use it too); none: no template, prompt
    and answer concatenated as plain text (not for messages data)."""
    train_on_prompt: StrictBool = False
    """Causal LM: take the loss on the prompt tokens too -- every token of every turn, template markers included
    (LLaMA-Factory's name); for prompt/response and messages data."""
    train_on: Literal["all_assistant", "last_assistant"] = "all_assistant"
    """Causal LM: which assistant turns carry the loss: all_assistant (every one) or last_assistant (only the final
    one). roles_to_train is the general form; set one of the two."""
    roles_to_train: Optional[Annotated[list[Literal[CHAT_ROLES]], Field(min_length=1)]] = None  # type: ignore[valid-type]
    """Causal LM: the roles whose every turn carries the loss, e.g. [assistant] or [user, assistant] (axolotl's name;
    for prompt/response data the prompt is the user's); None: as train_on says."""
    add_eos: StrictBool = True
    """Causal LM: end every text row with the tokenizer's EOS token, trained on, so a completion-trained model learns
    to stop (truncation keeps room for it); false leaves text rows as tokenized. Prompt/response rows always end with
    EOS (without a template) or the template's end-of-turn token."""
    eval_fraction: Fraction = 0.1
    """Fraction of the training data held out for evaluation when eval_files is not given."""
    max_train_samples: Optional[PosInt] = None
    """Use at most this many training examples (after the split); None uses all."""
    max_eval_samples: Optional[PosInt] = None
    """Evaluate on at most this many held-out examples; None uses all."""
    max_length: PosInt = 128
    """Truncate tokenized examples to this many tokens."""
    packing: StrictBool = False
    """Causal LM: pack short training examples into rows of up to max_length tokens (position ids restart per example,
    so no example attends to another; micro_batch_size then counts packed rows). Models whose forward takes
    position_ids; not with prefix tuning. Evaluation stays per example."""


class MethodSection(Section):
    """``method``: full fine-tuning, or a parameter-efficient method through peft.

    Options belong to one method type each; giving an option of another type than the
    chosen one is an error, because it would silently do nothing.
    """

    type: Literal[METHODS] = "full"  # type: ignore[valid-type]
    """full (train every weight), lora (low-rank adapters), qlora (LoRA on a 4- or 8-bit frozen base, through
    bitsandbytes; ZeRO 0-2), prefix (prefix tuning) or freeze (train the last trainable_layers blocks and/or the
    trainable_modules, the rest frozen)."""
    r: PosInt = 8
    """LoRA: rank of the adapter matrices."""
    alpha: PosFloat = 16
    """LoRA: scaling numerator; the adapter output is scaled by alpha / r."""
    dropout: Fraction = 0.05
    """LoRA: dropout on the adapter input."""
    target_modules: Optional[Union[list[Str], Str]] = None
    """LoRA: names (or one regex) of the modules to adapt; None uses the per-architecture default."""
    dora: StrictBool = False
    """LoRA / QLoRA: weight-decomposed adapters (DoRA: a trained magnitude per output on top of the low-rank direction).
    """
    rslora: StrictBool = False
    """LoRA / QLoRA: rank-stabilized scaling alpha / sqrt(r) instead of alpha / r."""
    bits: Literal[4, 8] = 4
    """QLoRA: the frozen base's precision, 4 (NF4, double-quantized) or 8 (LLM.int8)."""
    trainable_layers: Optional[PosInt] = None
    """Freeze tuning: train the last N transformer blocks (with the final norm, and a new classification head)."""
    trainable_modules: Optional[Union[list[Str], Str]] = None
    """Freeze tuning: names (or one regex) of the modules to train besides trainable_layers."""
    num_virtual_tokens: PosInt = 20
    """Prefix tuning: number of trainable virtual tokens prepended at every layer."""


class TrainSection(Section):
    """``train``: length of training, optimizer and schedule, and the evaluation/checkpoint cadence."""

    epochs: Optional[PosFloat] = None
    """Passes over the training data (fractions allowed); exactly one of epochs and max_steps, epochs 1 when neither is
    set."""
    max_steps: Optional[PosInt] = None
    """Optimizer steps to run; exactly one of epochs and max_steps."""
    lr: PosFloat = 5e-5
    """Peak learning rate (AdamW)."""
    warmup_steps: NonNegInt = 0
    """Optimizer steps of linear warmup from 0 to lr; at most one of warmup_steps and warmup_ratio."""
    warmup_ratio: Optional[Fraction] = None
    """Warmup as a fraction of the total optimizer steps; at most one of warmup_steps and warmup_ratio."""
    lr_scheduler: Literal["linear", "cosine", "constant"] = "linear"
    """The lr after the warmup (HF Trainer's lr_scheduler_type): linear decay toward 0, cosine decay toward
    min_lr_ratio x lr, or constant; the engine section's own scheduler replaces it. No step trains at lr 0."""
    min_lr_ratio: Fraction = 0.0
    """lr_scheduler cosine: the floor of the decay as a fraction of lr."""
    weight_decay: NonNegFloat = 0.0
    """AdamW decoupled weight decay."""
    micro_batch_size: PosInt = 16
    """Examples per rank per forward/backward pass (the global batch is this x accumulation x ranks)."""
    gradient_accumulation_steps: PosInt = 1
    """Micro batches accumulated before each optimizer step."""
    seed: NonNegInt = 42
    """Seed of the model head initialisation, dropout and data order."""
    eval_every: NonNegInt = 0
    """Evaluate every this many optimizer steps; 0 evaluates only at the end."""
    save_every: NonNegInt = 0
    """Save a checkpoint every this many optimizer steps; 0 never checkpoints during training."""
    save_total_limit: Optional[PosInt] = None
    """Keep only the newest N checkpoints (HF Trainer's name; the engine's checkpoint.keep_last)."""
    load_best_model_at_end: StrictBool = False
    """Keep the checkpoint of the best evaluation (by metric_for_best_model, in OUTPUT/best) and end the run with that
    model: the final evaluation and the saved model are the best's. Needs eval_every."""
    metric_for_best_model: Optional[Str] = None
    """The eval metric that picks the best evaluation and drives early stopping: loss or perplexity (causal LM),
    accuracy, macro_f1 or loss (sequence classification); None: loss (causal LM), accuracy (classification)."""
    greater_is_better: Optional[StrictBool] = None
    """Whether a larger metric_for_best_model is better; None infers it (accuracy, macro_f1: yes; loss, perplexity: no).
    """
    early_stopping_patience: Optional[PosInt] = None
    """Stop after this many evaluations in a row without an improvement larger than early_stopping_min_delta; None never
    stops early. Needs eval_every."""
    early_stopping_min_delta: NonNegFloat = 0.0
    """The smallest change of metric_for_best_model that counts as an improvement."""
    log_every: PosInt = 10
    """Log the training loss and lr every this many optimizer steps."""
    eval_samples: NonNegInt = 2
    """Causal LM: at each evaluation, answer this many prompts greedily (the first eval-set questions, or
    sample_prompts) and print them (also OUTPUT/samples.jsonl); 0 turns it off."""
    sample_prompts: Optional[list[Str]] = None
    """Causal LM: fixed prompts (user turns) to answer at each evaluation instead of eval-set questions."""
    sample_max_new_tokens: PosInt = 32
    """Causal LM: the longest generated answer at each evaluation, in tokens."""
    gradient_clipping: NonNegFloat = 1.0
    """Clip the global gradient L2 norm to this value; 0 disables clipping."""
    gradient_checkpointing: StrictBool = False
    """Recompute each transformer block's activations in the backward pass instead of keeping them (Hugging Face's
    gradient_checkpointing_enable, non-reentrant): less activation memory for about one more forward; the same loss.
    """
    neftune_noise_alpha: Optional[PosFloat] = None
    """Causal LM: NEFTune -- add uniform noise scaled by alpha / sqrt(sequence length x hidden size) to the input
    embeddings while training (not in evaluation); None turns it off. 5 is the paper's usual value."""


class EngineSection(Section):
    """``engine``: the zerotune/DeepSpeed engine config plus two shortcuts.

    In a recipe file the DeepSpeed keys sit directly under ``engine`` (``engine:
    {zero_optimization: {...}}``); the loader gathers them into ``config``. ``config_path``
    points at a config file instead. ``zero_stage`` and ``precision`` fill the engine config
    where it does not set them.
    """

    config: dict[str, Any] = Field(default_factory=dict)
    """The inline engine config (DeepSpeed JSON keys), validated by zerotune.config.load_config."""
    config_path: Optional[Str] = None
    """A JSON/YAML engine config file (relative paths resolve against the recipe's directory); instead of inline keys.
    """
    zero_stage: Optional[Stage] = None
    """ZeRO stage 0-3; sets zero_optimization.stage when the engine config does not."""
    precision: Optional[Literal[PRECISIONS]] = None  # type: ignore[valid-type]
    """Training precision fp32, bf16 or fp16; sets bf16/fp16.enabled when the engine config does not."""


ENGINE_SHORTCUTS = tuple(EngineSection.model_fields)


class EngineKeys(ZeroTuneConfig):
    """Every key allowed directly under ``engine``: the engine config's plus the shortcuts.

    Used only to check keys, so an unknown key gets a did-you-mean over both sets.
    """

    config: dict[str, Any] = Field(default_factory=dict)
    config_path: Optional[Str] = None
    zero_stage: Optional[Stage] = None
    precision: Optional[Str] = None


class LaunchSection(Section):
    """``launch``: how many processes to start, here and on other nodes."""

    nproc_per_node: PosInt = 2
    """Ranks started on this node (data-parallel workers)."""
    nnodes: PosInt = 1
    """Number of nodes; more than 1 needs rdzv_endpoint."""
    rdzv_endpoint: Optional[Str] = None
    """host:port of the rendezvous (the first node) for multi-node runs."""
    rdzv_backend: Literal["c10d", "static", "etcd", "etcd-v2"] = "c10d"
    """torchrun rendezvous backend."""
    rdzv_id: Optional[Str] = None
    """Job id shared by all nodes of a run; None uses a fixed default."""
    node_rank: Optional[NonNegInt] = None
    """This node's rank for the static rendezvous backend; None lets the rendezvous assign it."""
    max_restarts: NonNegInt = 0
    """Restart every rank this many times after one dies (torchrun's elastic agent); a restarted job resumes
    from the newest complete checkpoint in the output directory."""


class Recipe(Section):
    """A fine-tuning recipe: model, task, data, method, training, engine and launch settings.

    Build one with :func:`zerotune.finetune.recipe.load_recipe`, which also resolves relative
    paths, applies ``--set`` overrides and runs the cross-field checks.
    """

    ALIASES: ClassVar[dict[str, str]] = {}

    model: ModelSection
    """The pretrained model to fine-tune."""
    task: Literal[TASKS]  # type: ignore[valid-type]
    """sequence-classification or causal-lm."""
    data: DataSection
    """The training and evaluation data."""
    method: MethodSection = Field(default_factory=MethodSection)
    """Full fine-tuning, LoRA or prefix tuning."""
    objective: ObjectiveSection = Field(default_factory=ObjectiveSection)
    """Supervised fine-tuning, or a preference method (DPO, ORPO, SimPO, KTO) or reward-model training."""
    train: TrainSection = Field(default_factory=TrainSection)
    """Training length, optimizer, schedule and cadence."""
    engine: EngineSection = Field(default_factory=EngineSection)
    """The zerotune/DeepSpeed engine config (ZeRO stage, precision, offload, ...)."""
    launch: LaunchSection = Field(default_factory=LaunchSection)
    """Processes and nodes."""


def _teach_foreign_names() -> None:
    """Give every recipe section the other tools' names for recipe keys (``recipe_names.py``), so did-you-mean
    answers 'learning_rate' with 'lr' in ``train`` and with 'train.lr' anywhere else. Only keys that exist are
    suggested."""
    from zerotune.finetune.recipe_names import FOREIGN_KEY_NAMES

    sections = {name: field.annotation for name, field in Recipe.model_fields.items()
                if isinstance(field.annotation, type) and issubclass(field.annotation, Section)}
    known = {}
    for foreign, target in FOREIGN_KEY_NAMES.items():
        owner, key = target.split(".")
        if owner in sections and key in sections[owner].model_fields:
            known[foreign] = target
    Recipe.KNOWN_AS = dict(known)
    for name, section in sections.items():
        section.KNOWN_AS = {foreign: target.split(".", 1)[1] if target.startswith(name + ".") else target
                            for foreign, target in known.items()}
    # engine keys are checked against the engine config and its shortcuts together (recipe.py's _fold_engine)
    EngineKeys.KNOWN_AS = {foreign: target for foreign, target in sections["engine"].KNOWN_AS.items()
                           if foreign not in EngineKeys.model_fields and foreign not in EngineKeys.ALIASES}


_teach_foreign_names()

__all__ = [
    "BUNDLED_DATA",
    "BUNDLED_MODELS",
    "DataSection",
    "ENGINE_SHORTCUTS",
    "EngineKeys",
    "EngineSection",
    "LaunchSection",
    "METHODS",
    "METHOD_OPTIONS",
    "MethodSection",
    "OBJECTIVES",
    "OBJECTIVE_OPTIONS",
    "ObjectiveSection",
    "PREFERENCE_OBJECTIVES",
    "ModelSection",
    "PRECISIONS",
    "Recipe",
    "TASKS",
    "TrainSection",
]
