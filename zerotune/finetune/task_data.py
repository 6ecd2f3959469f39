"""The recipe's data, loaded and tokenized for its task and objective: what a rank trains and evaluates on.

Shared by the worker (``worker.py``), the launcher's early checks and ``--preview`` (``preview.py``), so a
preview shows exactly the tokens a run trains on.
"""

from __future__ import annotations

import os

from zerotune.finetune.chat_templates import TEMPLATES, use_template
from zerotune.finetune.data import (
    DataSpec,
    check_num_labels,
    load_causal_lm_data,
    load_classification_data,
    load_preference_data,
)
from zerotune.finetune.models import resolve_model_path
from zerotune.finetune.packing import causal_lm_class, check_packing_support
from zerotune.finetune.preference.batches import tokenize_pairs, tokenize_unpaired
from zerotune.finetune.recipe import RecipeError
from zerotune.finetune.tokenization import LossPolicy, tokenize_causal_lm, tokenize_classification


def data_spec(recipe) -> DataSpec:
    data = recipe.data
    return DataSpec(train_files=data.train_files, eval_files=data.eval_files, bundled=data.bundled,
                    text_column=data.text_column, text_pair_column=data.text_pair_column,
                    label_column=data.label_column, eval_fraction=data.eval_fraction, seed=recipe.train.seed,
                    max_train_samples=data.max_train_samples, max_eval_samples=data.max_eval_samples,
                    dataset=data.dataset, dataset_config=data.dataset_config, train_split=data.train_split,
                    eval_split=data.eval_split)


def check_recipe_inputs(recipe) -> list[str]:
    """Fail early, in one process, on what a user gets wrong: model path, data files and columns, labels.

    Returns the label names (sequence classification) or an empty list (causal LM). For a bundled
    GGUF model this also dequantizes it into the cache once, before any rank starts.
    """
    model_path = resolve_model_path(recipe.model.name_or_path)
    if recipe.objective.type != "sft":
        load_preference_data(data_spec(recipe), unpaired=recipe.objective.type == "kto")
        return []
    if recipe.task == "causal-lm":
        _check_template_fits(recipe, load_causal_lm(recipe)[0])
        model_class = causal_lm_class(model_path, recipe.model.trust_remote_code) if recipe.data.packing else None
        if model_class is not None:
            check_packing_support(model_class)
        return []
    _, _, label_names = load_classification_data(data_spec(recipe))
    check_num_labels(label_names, recipe.model.num_labels)
    return label_names


def load_causal_lm(recipe):
    """Train/eval rows in one of ``formats.py``'s shapes: text, prompt/response, chat messages or token ids."""
    return load_causal_lm_data(data_spec(recipe), prompt_column=recipe.data.prompt_column,
                               response_column=recipe.data.response_column, data_format=recipe.data.format)


def loss_policy(recipe) -> LossPolicy:
    """The recipe's data.train_on_prompt / train_on / roles_to_train / add_eos as one LossPolicy (the recipe
    checks have refused combinations that contradict each other)."""
    data = recipe.data
    return LossPolicy(train_on_prompt=data.train_on_prompt, roles=tuple(data.roles_to_train or ("assistant",)),
                      last_only=data.train_on == "last_assistant", add_eos=data.add_eos)


def _check_template_fits(recipe, rows) -> None:
    """``data.template: none`` cannot render chat messages (detected from the columns, so checked on the rows)."""
    if recipe.data.template == "none" and "messages" in rows.column_names:
        raise RecipeError("data.template", "none, but the data holds chat messages, which need a chat template; set "
                                           f"data.template to auto or one of {', '.join(TEMPLATES)}")


def prepare_causal_lm_tokenizer(recipe, tokenizer, rows) -> None:
    """Set data.template on ``tokenizer``, so training, the eval samples and the saved tokenizer share it."""
    _check_template_fits(recipe, rows)
    use_template(tokenizer, recipe.data.template, rank=int(os.environ.get("RANK", "0") or 0))


def load_task_data(recipe, tokenizer) -> tuple:
    """(tokenized train set, tokenized eval set, label names, eval rows before tokenization) for the recipe's
    task.

    Causal LM renders question/answer rows in data.template and puts the loss where the recipe's
    loss_policy says (by default the answers only); its label names are empty.
    """
    max_length = recipe.data.max_length
    if recipe.objective.type != "sft":
        unpaired = recipe.objective.type == "kto"
        tokenize = tokenize_unpaired if unpaired else tokenize_pairs
        train_rows, eval_rows = load_preference_data(data_spec(recipe), unpaired=unpaired)
        use_template(tokenizer, recipe.data.template, rank=int(os.environ.get("RANK", "0") or 0))
        return tokenize(train_rows, tokenizer, max_length), tokenize(eval_rows, tokenizer, max_length), [], eval_rows
    if recipe.task == "causal-lm":
        train_set, eval_set = load_causal_lm(recipe)
        prepare_causal_lm_tokenizer(recipe, tokenizer, train_set)
        policy = loss_policy(recipe)
        return (tokenize_causal_lm(train_set, tokenizer, max_length, policy),
                tokenize_causal_lm(eval_set, tokenizer, max_length, policy), [], eval_set)
    train_set, eval_set, label_names = load_classification_data(data_spec(recipe))
    return (tokenize_classification(train_set, tokenizer, max_length),
            tokenize_classification(eval_set, tokenizer, max_length), label_names, eval_set)
