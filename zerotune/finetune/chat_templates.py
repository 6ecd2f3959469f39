"""Named chat formats (``data.template``) as Jinja chat templates set on the tokenizer.

Why Jinja strings on ``tokenizer.chat_template`` rather than a renderer of our own: tokenization,
the eval-time samples (``generation.encode_prompt``), ``zerotune generate`` and the saved tokenizer then
all go through one path, ``apply_chat_template``, so a model is asked at inference exactly as it was
trained. The templates are written from each format's public definition:

  chatml   ``<|im_start|>role\\n...<|im_end|>\\n``
  qwen     chatml, with a default system prompt when the conversation has none
  llama3   ``<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>``
  mistral  ``[INST] ... [/INST] answer</s>`` (a system prompt goes before the first user message)
  gemma    ``<start_of_turn>user\\n...<end_of_turn>\\n``, the assistant's role called ``model``, no system role
  alpaca   ``### Instruction:\\n...\\n\\n### Response:\\n...``

Every one takes ``add_generation_prompt`` (for mistral it adds nothing: ``[/INST]`` already asks for the
answer). ``auto`` keeps the tokenizer's own template; ``none`` removes it (prompt and answer concatenated as
plain text).
"""

from __future__ import annotations

from typing import Any

from zerotune.monitor.logging import log_rank0

_CHATML_TURNS = ("{%- for message in messages %}"
                 "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
                 "{%- endfor %}"
                 "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

QWEN_SYSTEM = "You are a helpful assistant."

TEMPLATES: dict[str, str] = {
    "chatml": _CHATML_TURNS,
    "qwen": ("{%- if not messages or messages[0]['role'] != 'system' %}"
             "{{- '<|im_start|>system\\n" + QWEN_SYSTEM + "<|im_end|>\\n' }}{%- endif %}" + _CHATML_TURNS),
    "llama3": ("{{- '<|begin_of_text|>' }}"
               "{%- for message in messages %}"
               "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] "
               "+ '<|eot_id|>' }}"
               "{%- endfor %}"
               "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
               "{%- endif %}"),
    "mistral": ("{{- bos_token or '' }}"
                "{%- set system = namespace(text='') %}"
                "{%- for message in messages %}"
                "{%- if message['role'] == 'system' %}{%- set system.text = message['content'] + '\\n\\n' %}"
                "{%- elif message['role'] == 'user' %}"
                "{{- '[INST] ' + system.text + message['content'] + ' [/INST]' }}{%- set system.text = '' %}"
                "{%- else %}{{- ' ' + message['content'] + (eos_token or '') }}"
                "{%- endif %}"
                "{%- endfor %}"),
    "gemma": ("{{- bos_token or '' }}"
              "{%- set system = namespace(text='') %}"
              "{%- for message in messages %}"
              "{%- if message['role'] == 'system' %}{%- set system.text = message['content'] + '\\n\\n' %}"
              "{%- else %}"
              "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\\n' "
              "+ system.text + message['content'] + '<end_of_turn>\\n' }}{%- set system.text = '' %}"
              "{%- endif %}"
              "{%- endfor %}"
              "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"),
    "alpaca": ("{%- for message in messages %}"
               "{%- if message['role'] == 'system' %}{{- message['content'] + '\\n\\n' }}"
               "{%- elif message['role'] == 'user' %}{{- '### Instruction:\\n' + message['content'] + '\\n\\n' }}"
               "{%- else %}{{- '### Response:\\n' + message['content'] + (eos_token or '') }}"
               "{%- if not loop.last %}{{- '\\n\\n' }}{%- endif %}"
               "{%- endif %}"
               "{%- endfor %}"
               "{%- if add_generation_prompt %}{{- '### Response:\\n' }}{%- endif %}"),
}
"""The named templates. A system turn in a format without one (mistral, gemma) is put before the next user
message, as those models' own templates do; alpaca separates answers from the next instruction after
the end-of-sequence token, so a conversation's rendering ends with the token the model must learn to stop at."""

SPECIAL_TOKENS: dict[str, tuple[str, ...]] = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "qwen": ("<|im_start|>", "<|im_end|>"),
    "llama3": ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "mistral": (),
    "gemma": ("<start_of_turn>", "<end_of_turn>"),
    "alpaca": (),
}
"""The marker strings each template writes that a matching tokenizer holds as single tokens (mistral and
alpaca use the tokenizer's own bos / eos tokens, and ``[INST]`` is plain text in the original format)."""

TEMPLATE_NAMES = ("auto", "none", *TEMPLATES)


def end_of_turn(name: str, tokenizer: Any) -> str:
    """The token a rendered answer of template ``name`` ends with: what a trained model learns to stop at."""
    return {"chatml": "<|im_end|>", "qwen": "<|im_end|>", "llama3": "<|eot_id|>",
            "gemma": "<end_of_turn>"}.get(name, tokenizer.eos_token or "")


def use_template(tokenizer: Any, name: str, *, rank: int = 0) -> bool:
    """Set ``data.template`` ``name`` on ``tokenizer``; True when rows are then rendered through a chat template.

    ``auto`` keeps the tokenizer's own template (False when it has none), ``none`` removes it so prompts,
    answers and eval-time questions are all plain text. A named template whose markers the tokenizer does
    not hold as single tokens still works -- they are tokenized as text -- and the log says so once.
    """
    if name == "auto":
        return getattr(tokenizer, "chat_template", None) is not None
    if name == "none":
        tokenizer.chat_template = None
        return False
    if name not in TEMPLATES:
        raise ValueError(f"data.template {name!r} is not one of {', '.join(TEMPLATE_NAMES)}")
    tokenizer.chat_template = TEMPLATES[name]
    split = [token for token in SPECIAL_TOKENS[name]
             if len(tokenizer(token, add_special_tokens=False)["input_ids"]) != 1]
    if split:
        log_rank0("data.template %s: the tokenizer has no single token for %s, so they are tokenized as plain "
                  "text (it works, but costs tokens; a model trained this way must be asked with this template)",
                  name, ", ".join(split), rank=rank)
    return True
