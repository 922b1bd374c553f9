"""``bankml tokenize`` and ``bankml chat-template``: a GGUF's text layer from the command line.

Both read only the GGUF's metadata (no weights), so they answer in about a second.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from bankml.cli.parsing import Commands, add_command


def add_commands(commands: Commands) -> None:
    _add_tokenize(commands)
    _add_chat_template(commands)


def _add_tokenize(commands: Commands) -> None:
    parser = add_command(
        commands,
        "tokenize",
        tokenize_command,
        "tokenize stdin with a GGUF's vocabulary",
        "Tokenize the text on stdin with a GGUF's vocabulary, as llama-server's /tokenize "
        "(special-token texts are parsed unless --no-parse-special).",
    )
    parser.add_argument("file", help="the GGUF model file")
    parser.add_argument(
        "--add-special", action="store_true", help="add BOS/EOS as the model's flags say"
    )
    parser.add_argument(
        "--no-parse-special",
        action="store_true",
        help="treat control-token texts such as <|im_start|> as plain text",
    )
    parser.add_argument(
        "--jsonl",
        action="store_true",
        help='each stdin line is a JSON string; print one {"tokens": [...]} line for each',
    )


def _fail(command: str, message: str, status: int = 1) -> int:
    print(f"bankml {command}: {message}", file=sys.stderr)
    return status


def tokenize_command(args: argparse.Namespace) -> int:
    # the engine's modules (NumPy, Numba) only once the command runs: `bankml --help` stays quick
    from bankml.engine_cupy.tokenizer import Tokenizer, TokenizerError

    try:
        tokenizer = Tokenizer.from_gguf(args.file)
    except (OSError, TokenizerError) as err:
        return _fail("tokenize", str(err))
    parse_special = not args.no_parse_special
    if not args.jsonl:
        try:
            text = sys.stdin.buffer.read().decode("utf-8")
        except UnicodeDecodeError as err:
            return _fail("tokenize", f"stdin is not UTF-8: {err}")
        ids = tokenizer.tokenize(text, add_special=args.add_special, parse_special=parse_special)
        print(json.dumps({"tokens": ids}))
        return 0
    return _tokenize_lines(tokenizer, sys.stdin, sys.stdout, args.add_special, parse_special)


def _tokenize_lines(
    tokenizer: Any, lines: TextIO, out: TextIO, add_special: bool, parse_special: bool
) -> int:
    """One JSON string a line in, one {"tokens"} (or {"error"}) object a line out, in order."""
    status = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)
        except ValueError as err:
            text, problem = None, f"line {number} is not JSON: {err}"
        else:
            problem = "" if isinstance(text, str) else f"line {number} is not a JSON string"
        if problem:
            out.write(json.dumps({"error": problem}) + "\n")
            status = 1
            continue
        ids = tokenizer.tokenize(text, add_special=add_special, parse_special=parse_special)
        out.write(json.dumps({"tokens": ids}) + "\n")
        out.flush()
    return status


def _add_chat_template(commands: Commands) -> None:
    parser = add_command(
        commands,
        "chat-template",
        chat_template_command,
        "render a GGUF's chat template",
        "Render a GGUF's chat template as llama-server's /apply-template does.",
    )
    parser.add_argument("file", help="the GGUF model file")
    parser.add_argument("--messages", required=True, help="the messages, a JSON array")
    parser.add_argument("--tools", help="tools, a JSON array (OpenAI format)")
    parser.add_argument(
        "--kwargs", default="{}", help="chat_template_kwargs, a JSON object (e.g. enable_thinking)"
    )
    parser.add_argument(
        "--no-generation-prompt", action="store_true", help="do not open the assistant's turn"
    )


def chat_template_command(args: argparse.Namespace) -> int:
    from bankml.engine_cupy.chat_template import ChatTemplate, TemplateError
    from bankml.engine_cupy.tokenizer import TokenizerError

    try:
        messages = json.loads(args.messages)
        tools = json.loads(args.tools) if args.tools else None
        kwargs = json.loads(args.kwargs)
    except ValueError as err:
        return _fail("chat-template", f"invalid JSON argument: {err}", 2)
    if not isinstance(kwargs, dict):
        return _fail("chat-template", "--kwargs must be a JSON object", 2)
    try:
        template = ChatTemplate.from_gguf(args.file)
        prompt = template.render(
            messages, add_generation_prompt=not args.no_generation_prompt, tools=tools, **kwargs
        )
    except (OSError, TokenizerError, TemplateError) as err:
        return _fail("chat-template", str(err))
    sys.stdout.write(prompt)
    sys.stdout.flush()
    return 0
