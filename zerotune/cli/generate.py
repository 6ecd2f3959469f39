"""``zerotune generate RUN_DIR --prompt TEXT`` and ``zerotune chat RUN_DIR``: answers from a fine-tuned run.

``generate`` answers each ``--prompt`` (several allowed) on its own; ``chat`` reads one message per line
from standard input and keeps the conversation (an empty line or ``/exit`` ends it). Bad input is one
``zerotune generate: ...`` line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the --output-dir of a finished zerotune finetune run")
    parser.add_argument("--system", default=None, help="a system prompt before the conversation")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="longest answer, in tokens (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 (default): greedy")


def add_generate_parsers(subparsers: Any) -> None:
    generate = subparsers.add_parser("generate", help="answer prompts with a fine-tuned run's model",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _options(generate)
    generate.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    generate.set_defaults(func=run_generate)
    chat = subparsers.add_parser("chat", help="chat with a fine-tuned run's model (one message per input line)",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _options(chat)
    chat.set_defaults(func=run_chat)


def _load(args: argparse.Namespace, command: str) -> tuple[Any, Any] | None:
    from zerotune.finetune.console import quiet_libraries
    from zerotune.finetune.generation import GenerationError, load_trained
    from zerotune.finetune.models import ModelLoadError

    quiet_libraries(rank=0)
    if args.max_new_tokens < 1 or args.temperature < 0:
        print(f"zerotune {command}: --max-new-tokens must be >= 1 and --temperature >= 0", file=sys.stderr)
        return None
    try:
        return load_trained(args.run_dir)
    except (GenerationError, ModelLoadError) as error:
        print(f"zerotune {command}: {error}", file=sys.stderr)
        return None


def _start(args: argparse.Namespace) -> list[dict[str, str]]:
    return [{"role": "system", "content": args.system}] if args.system else []


def run_generate(args: argparse.Namespace) -> int:
    from zerotune.finetune.generation import reply

    loaded = _load(args, "generate")
    if loaded is None:
        return 2
    model, tokenizer = loaded
    for prompt in args.prompt:
        answer = reply(model, tokenizer, _start(args) + [{"role": "user", "content": prompt}],
                       max_new_tokens=args.max_new_tokens, temperature=args.temperature)
        print(f"> {prompt}\n{answer}" if len(args.prompt) > 1 else answer, flush=True)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    from zerotune.finetune.generation import reply

    loaded = _load(args, "chat")
    if loaded is None:
        return 2
    model, tokenizer = loaded
    messages = _start(args)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or not line.strip() or line.strip() == "/exit":
            return 0
        messages.append({"role": "user", "content": line.strip()})
        answer = reply(model, tokenizer, messages, max_new_tokens=args.max_new_tokens, temperature=args.temperature)
        messages.append({"role": "assistant", "content": answer})
        print(f"model> {answer}" if interactive else answer, flush=True)
