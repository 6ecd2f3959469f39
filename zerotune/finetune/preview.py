"""``zerotune finetune RECIPE --preview [N]``: the first N training examples as the model will see them.

Why: a wrong chat template or loss mask trains a model that looks fine in the loss curve and answers
badly. The preview renders each tokenized example token span by token span with the loss-bearing
spans marked -- in colour through ``rich`` on a terminal, between ``[[`` and ``]]`` otherwise -- with its
token and trained-token counts. It needs only the tokenizer and the data: it runs in the launching process,
starts no ranks and loads no model weights (a bundled GGUF model that was never converted gives its
tokenizer straight from the GGUF file, without dequantizing the weights).
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from zerotune.finetune.tokenization import IGNORE_INDEX, tokenize_causal_lm

PLAIN_MARKERS = ("[[", "]]")
TRAINED_STYLE = "bold green"
DEFAULT_COUNT = 3


def preview_tokenizer(recipe: Any) -> Any:
    """The recipe's tokenizer, loaded without touching the model's weights."""
    from zerotune.finetune import assets, gguf_models
    from zerotune.finetune.models import load_tokenizer, resolve_model_path

    name = recipe.model.name_or_path
    if gguf_models.is_gguf_asset(name):
        converted = assets.cache_dir() / f"{name}{gguf_models.DEQUANTIZED_SUFFIX}"
        if not converted.is_dir():  # resolve_model_path would dequantize the weights: read the GGUF's tokenizer
            from transformers import AutoTokenizer

            gguf_file = assets.asset_path(name)
            tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token
            return tokenizer
    return load_tokenizer(resolve_model_path(name), recipe.model.trust_remote_code)


def spans(ids: list[int], labels: list[int]) -> list[tuple[list[int], bool]]:
    """``ids`` cut into runs of tokens that are all trained (True) or all not (False)."""
    runs: list[tuple[list[int], bool]] = []
    for token, label in zip(ids, labels):
        trained = label != IGNORE_INDEX
        if runs and runs[-1][1] == trained:
            runs[-1][0].append(token)
        else:
            runs.append(([token], trained))
    return runs


def render_plain(tokenizer: Any, ids: list[int], labels: list[int]) -> str:
    """The example's text with every trained span between ``[[`` and ``]]``."""
    opening, closing = PLAIN_MARKERS
    return "".join(f"{opening}{text}{closing}" if trained else text
                   for text, trained in ((tokenizer.decode(run), trained) for run, trained in spans(ids, labels)))


def print_preview(rows: Any, tokenizer: Any, *, template: str, stream: TextIO | None = None,
                  color: bool | None = None) -> None:
    """Print the tokenized ``rows`` (``input_ids`` / ``labels``) with their counts; colour only on a terminal."""
    stream = stream or sys.stdout
    color = stream.isatty() if color is None else color
    how = f"trained tokens in {TRAINED_STYLE}" if color else "trained tokens between [[ and ]]"
    print(f"zerotune finetune --preview: {len(rows)} training example(s), data.template {template}; {how}",
          file=stream)
    console = None
    if color:
        from rich.console import Console

        console = Console(file=stream, highlight=False, soft_wrap=True, force_terminal=True)
    for number, row in enumerate(rows, 1):
        ids, labels = list(row["input_ids"]), list(row["labels"])
        trained = sum(label != IGNORE_INDEX for label in labels)
        print(f"\n--- example {number}: {len(ids)} tokens, {trained} trained", file=stream)
        if console is None:
            print(render_plain(tokenizer, ids, labels), file=stream)
            continue
        from rich.text import Text

        text = Text()
        for run, is_trained in spans(ids, labels):
            text.append(tokenizer.decode(run), style=TRAINED_STYLE if is_trained else None)
        console.print(text)


def run_preview(recipe: Any, count: int, stream: TextIO | None = None) -> None:
    """Tokenize the recipe's first ``count`` training examples as training would and print them."""
    from zerotune.finetune.recipe_checks import RecipeError
    from zerotune.finetune.task_data import load_causal_lm, loss_policy, prepare_causal_lm_tokenizer

    if recipe.task != "causal-lm":
        raise RecipeError("--preview", f"shows chat-formatted causal-LM examples; task is {recipe.task!r}")
    if count < 1:
        raise RecipeError("--preview", f"{count} examples; give a number >= 1 (default {DEFAULT_COUNT})")
    tokenizer = preview_tokenizer(recipe)
    train_set, _ = load_causal_lm(recipe)
    prepare_causal_lm_tokenizer(recipe, tokenizer, train_set)
    rows = tokenize_causal_lm(train_set.select(range(min(count, len(train_set)))), tokenizer,
                              recipe.data.max_length, loss_policy(recipe))
    print_preview(rows, tokenizer, template=recipe.data.template, stream=stream)
